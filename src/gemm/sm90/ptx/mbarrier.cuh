// mbarrier helpers: thin names over cuda::ptx for the producer/consumer pipeline.
// A "full" barrier completes when the copy engine has landed a stage's bytes; an "empty" barrier
// completes when every consumer warp has finished reading that stage. Waits: fault.cuh (bounded).
#pragma once

#include <cuda/ptx>
#include <cstdint>

namespace poise::sm90::ptx {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  cuda::ptx::mbarrier_init(bar, arrivals);
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}

// Producer: announce `bytes` of TMA traffic for this phase and count as one arrival.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                             cuda::ptx::space_shared, bar, bytes);
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  (void)cuda::ptx::mbarrier_arrive(bar);
}

// Whether the phase with parity `parity` has completed (one bounded try).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  return cuda::ptx::mbarrier_try_wait_parity(bar, parity);
}

}  // namespace poise::sm90::ptx
