// Warpgroup-level primitives cuda::ptx does not provide: register reallocation and named barriers.
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

// setmaxnreg: move registers from the producer warpgroup to the consumer warpgroups.
// Takes effect only in a kernel with a register cap at entry (__launch_bounds__(threads, 1)).
template <uint32_t kRegisters>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <uint32_t kRegisters>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Barrier among `threads` threads (a multiple of 32) on hardware barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace poise::sm90::ptx
