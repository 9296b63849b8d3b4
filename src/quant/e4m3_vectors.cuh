// Vectorized E4M3 quantization pieces the quantization kernels share: 8 bf16 (one 16-byte load) at
// a time, with the bits of the host's numerics (src/numerics/block_scaling.hpp).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace poise::quant {

// The unsigned max of the |bf16| bits of 8 values, as one 16-bit value. With the sign cleared a
// bf16 orders like its bits, and NaNs (above 0x7F80) come above Inf: the max is numerics::amax_with's
// result (a NaN once any value is NaN), whatever the order.
__device__ __forceinline__ uint32_t amax_bits_of(uint4 bf16x8) {
  uint32_t amax_bits = 0;
  for (uint32_t word : {bf16x8.x, bf16x8.y, bf16x8.z, bf16x8.w}) amax_bits = __vmaxu2(amax_bits, word & 0x7FFF7FFFu);
  return max(amax_bits & 0xFFFFu, amax_bits >> 16);
}

// Two values to E4M3 bits (`lo` in the low byte), rounded to nearest even, finite values saturated:
// the instruction numerics::to_e4m3 matches bit for bit (tests/cpp/test_fp8_numerics.cpp).
__device__ __forceinline__ uint32_t to_e4m3x2(float lo, float hi) {
  uint16_t bits;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(bits) : "f"(hi), "f"(lo));
  return bits;
}

// Two E4M3 values (`lo` in the low byte) to fp32, exactly (numerics::from_e4m3's values), through
// one conversion to f16x2.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t bits) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(bits));
  return __half22float2(*reinterpret_cast<const __half2*>(&halves));
}

// numerics::quantize of two bf16 (one 32-bit word): e4m3(v / scale), the division IEEE's.
__device__ __forceinline__ uint32_t quantize_bf16x2(uint32_t word, float scale) {
  const float lo = __uint_as_float(word << 16), hi = __uint_as_float(word & 0xFFFF0000u);
  return to_e4m3x2(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale));
}

// 8 bf16 (one 16-byte load) to their 8 e4m3 bytes, in order (one 8-byte store).
__device__ __forceinline__ uint2 quantize_bf16x8(uint4 bf16x8, float scale) {
  return make_uint2(quantize_bf16x2(bf16x8.x, scale) | quantize_bf16x2(bf16x8.y, scale) << 16,
                    quantize_bf16x2(bf16x8.z, scale) | quantize_bf16x2(bf16x8.w, scale) << 16);
}

}  // namespace poise::quant
