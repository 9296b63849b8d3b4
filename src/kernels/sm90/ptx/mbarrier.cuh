// mbarrier helpers: thin names over cuda::ptx for the producer/consumer pipeline.
// A "full" barrier completes when the copy engine has landed a stage's bytes; an "empty" barrier
// completes when every consumer warp has finished reading that stage.
#pragma once

#include <cuda/ptx>
#include <cstdint>
#include <cstdio>

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

// Debugging builds only (-DPOISE_MBARRIER_WATCHDOG=1): a wait that spins ~2^32 cycles prints the
// barrier's shared-memory offset, the parity and the thread, then traps.
#ifndef POISE_MBARRIER_WATCHDOG
#define POISE_MBARRIER_WATCHDOG 0
#endif

// Spin until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if POISE_MBARRIER_WATCHDOG
  const long long start = clock64();
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
    if (clock64() - start > (1ll << 32)) {
      printf("mbarrier watchdog: block %d thread %d barrier at smem %u parity %u\n", blockIdx.x, threadIdx.x,
             static_cast<unsigned>(__cvta_generic_to_shared(bar)), parity);
      __trap();
    }
  }
#else
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

}  // namespace poise::sm90::ptx
