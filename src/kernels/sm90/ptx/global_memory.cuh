// Global-memory reductions from registers (sm_90).
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

// *p += (a, b), two adjacent fp32 (8-byte aligned), done by the memory system (relaxed, gpu scope).
__device__ __forceinline__ void red_add_v2_f32(float* p, float a, float b) {
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

}  // namespace poise::sm90::ptx
