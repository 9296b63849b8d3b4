// Reductions into global memory, performed by the L2 (no read back into the SM).
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

// *p += v as 8 bf16 lanes (16 bytes, 16-byte aligned), each sum rounded to nearest bf16
// (REDG.E.ADD.BF16x8.RN): relaxed, GPU scope, so concurrent additions to one address all land but
// in no fixed order.
__device__ __forceinline__ void red_add_bf16x8(void* p, uint4 v) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

}  // namespace poise::sm90::ptx
