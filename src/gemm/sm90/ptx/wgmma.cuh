// wgmma (warpgroup MMA, sm_90a) wrappers: bf16 operands from shared memory, fp32 accumulators.
//
// Accumulator layout of m64nN (per warpgroup thread t, warp w = t/32, lane l):
//   d[4j + 2h + c] holds row 16w + l/4 + 8h, column 8j + 2(l%4) + c.
// So a thread owning column c also owns c + 8q for every q: epilogues that pair columns
// (gate/up halves of a tile, or interleaved gate/up pairs) stay thread-local.
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

// Orders register writes of the accumulators before wgmma reads them (wgmma.fence).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator accesses across wgmma issue/wait points.
template <int kCount>
__device__ __forceinline__ void fence_accumulators(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#include "gemm/sm90/ptx/wgmma_ops.inc"

// Dispatch on tile width: one k16 step of a 64 x kN warpgroup tile.
template <int kN, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_k16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
  if constexpr (kN == 256) {
    wgmma_m64n256k16<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  } else if constexpr (kN == 128) {
    wgmma_m64n128k16<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  } else {
    static_assert(kN == 64, "tile width must be 64, 128 or 256");
    wgmma_m64n64k16<kTransA, kTransB>(d, desc_a, desc_b, scale_d);
  }
}

}  // namespace poise::sm90::ptx
