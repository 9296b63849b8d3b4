// FP8 E4M3 (OCP "E4M3FN": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN; largest finite 448, smallest subnormal 2^-9), as the SM90 tensor cores read it.
// Conversion from fp32 rounds to nearest even and saturates finite values to +-448 (the SATFINITE
// mode of cvt.rn.satfinite.e4m3x2.f32); NaN stays NaN. The same code runs on the host (the reference
// engine) and on the device, so both produce the same bits.
#pragma once

#include <math.h>
#include <cstdint>
#include <cstring>

#include "numerics/host_device.hpp"

namespace poise::numerics {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3MaxBits = 0x7E;  // 448
inline constexpr uint8_t kE4m3NanBits = 0x7F;

POISE_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// fp32 -> E4M3 bits: round to nearest even, finite values saturate to +-448, NaN -> NaN.
POISE_HD inline uint8_t to_e4m3(float f) {
  const uint32_t bits = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | kE4m3NanBits;    // NaN
  if (abs_bits >= 0x43E00000u) return sign | kE4m3MaxBits;   // |f| >= 448 (Inf too): saturate
  if (abs_bits < 0x3C800000u) {                               // |f| < 2^-6: a subnormal (or zero)
    // |f| * 2^9 is exact (a power-of-two scale) and below 8; rounded to an integer 0..8 it is the
    // E4M3 bits themselves (8 = exponent 1, mantissa 0 = 2^-6, the smallest normal).
    float magnitude;
    std::memcpy(&magnitude, &abs_bits, sizeof magnitude);
    return sign | static_cast<uint8_t>(nearbyintf(magnitude * 512.0f));
  }
  // Normal: round the 23-bit mantissa to 3 bits, ties to even; a carry moves into the exponent.
  const uint32_t rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
  const uint32_t e4m3 = (rounded >> 20) - ((127u - 7u) << 3);  // rebias the exponent 127 -> 7
  return sign | static_cast<uint8_t>(e4m3 > kE4m3MaxBits ? kE4m3MaxBits : e4m3);
}

// E4M3 bits -> fp32 (exact).
POISE_HD inline float from_e4m3(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exponent = (b >> 3) & 0xF;
  const int mantissa = b & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return NAN;
  if (exponent == 0) return sign * ldexpf(static_cast<float>(mantissa), -9);
  return sign * ldexpf(static_cast<float>(8 + mantissa), exponent - 10);
}

}  // namespace poise::numerics
