// SwiGLU forward and backward in fp32 (the semantics of src/reference/swiglu.hpp).
//   plain:   a = silu(g) * u
//   clamped: g' = min(g, limit), u' = clamp(u, -limit, limit), a = g' * sigmoid(alpha g') * (u' + 1)
// The clamps pass gradient where the input lies inside them, bounds included.
#pragma once

namespace poise::ep {

struct SwigluParams {
  bool clamped = false;
  float alpha = 1.702f;
  float limit = 7.0f;
};

__device__ __forceinline__ float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ float swiglu_forward(float g, float u, const SwigluParams& p) {
  if (!p.clamped) return g * sigmoidf(g) * u;
  const float gc = fminf(g, p.limit);
  const float uc = fminf(fmaxf(u, -p.limit), p.limit);
  return gc * sigmoidf(p.alpha * gc) * (uc + 1.0f);
}

__device__ __forceinline__ void swiglu_backward(float g, float u, float grad_a, const SwigluParams& p,
                                                float& grad_g, float& grad_u) {
  if (!p.clamped) {
    const float s = sigmoidf(g);
    grad_g = grad_a * u * s * (1.0f + g * (1.0f - s));
    grad_u = grad_a * g * s;
    return;
  }
  const float gc = fminf(g, p.limit);
  const float uc = fminf(fmaxf(u, -p.limit), p.limit);
  const float s = sigmoidf(p.alpha * gc);
  grad_g = g <= p.limit ? grad_a * (uc + 1.0f) * s * (1.0f + p.alpha * gc * (1.0f - s)) : 0.0f;
  grad_u = (u >= -p.limit && u <= p.limit) ? grad_a * gc * s : 0.0f;
}

}  // namespace poise::ep
