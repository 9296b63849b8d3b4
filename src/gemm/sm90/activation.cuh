// SwiGLU forward and backward on one (gate, up) pair, shared by the fprop and dgrad epilogues.
//   swiglu:          a = silu(g) * u
//   swiglu_clamped:  g' = min(g, limit), u' = clamp(u, -limit, limit), a = g' * sigmoid(alpha g') * (u' + 1)
// The clamps pass gradient where the input lies inside the closed interval (torch.clamp's rule).
#pragma once

#include <cstdint>

#include "gemm/sm90/kernel_params.hpp"

namespace poise::sm90 {


// 2^x flushing subnormals: one MUFU.EX2. __expf's non-flushing ex2 adds a range test and two
// predicated multiplies per element (3 of the SwiGLU-backward epilogue's ~30 instructions); a
// subnormal exp(-x) only arises for x > 87, where 1 / (1 + 0) is the sigmoid in fp32 anyway.
__device__ __forceinline__ float exp2_flush(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// __fdividef: one MUFU.RCP, no IEEE-division slow path (whose branches and calls, inlined per
// element, made the SwiGLU-backward epilogue 13k instructions long and i-cache bound).
// exp(-x) = inf gives 0, the right limit.
__device__ __forceinline__ float fast_sigmoid(float x) {
  return __fdividef(1.0f, 1.0f + exp2_flush(x * -1.4426950408889634f));
}

// The clamps with std::min / std::clamp's NaN rule (the reference's): a NaN input stays NaN, where
// fminf / fmaxf would return the bound and hide it.
__device__ __forceinline__ float min_keep_nan(float v, float hi) { return hi < v ? hi : v; }
__device__ __forceinline__ float clamp_keep_nan(float v, float lo, float hi) { return v < lo ? lo : (hi < v ? hi : v); }

// kClamped selects the activation at compile time; epilogues branch once, outside their loops.
template <bool kClamped>
__device__ __forceinline__ float swiglu_forward(float g, float u, const ActivationParams& p) {
  if constexpr (kClamped) {
    const float gc = min_keep_nan(g, p.limit);
    const float uc = clamp_keep_nan(u, -p.limit, p.limit);
    return gc * fast_sigmoid(p.alpha * gc) * (uc + 1.0f);
  }
  return g * fast_sigmoid(g) * u;
}

// Given grad_a, returns the activation a and the gradients of gate and up.
template <bool kClamped>
__device__ __forceinline__ void swiglu_backward(float g, float u, float grad_a,
                                                const ActivationParams& p, float& a, float& grad_g,
                                                float& grad_u) {
  if constexpr (kClamped) {
    const float gc = min_keep_nan(g, p.limit);
    const float uc = clamp_keep_nan(u, -p.limit, p.limit);
    const float s = fast_sigmoid(p.alpha * gc);
    const float glu = gc * s;  // d(glu)/d(gc) = s + alpha*gc*s*(1-s)
    a = glu * (uc + 1.0f);
    grad_g = (g <= p.limit) ? grad_a * (uc + 1.0f) * (s + p.alpha * gc * s * (1.0f - s)) : 0.0f;
    grad_u = (u >= -p.limit && u <= p.limit) ? grad_a * glu : 0.0f;
    return;
  }
  const float s = fast_sigmoid(g);
  const float silu = g * s;
  a = silu * u;
  grad_g = grad_a * u * (s + g * s * (1.0f - s));
  grad_u = grad_a * silu;
}

}  // namespace poise::sm90
