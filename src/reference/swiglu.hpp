// SwiGLU activations in fp32, as the GPU's W13 epilogue computes them from the fp32 accumulator.
//   swiglu:          a = silu(g) * u
//   swiglu_clamped:  g' = min(g, limit), u' = clamp(u, -limit, limit),
//                    a = g' * sigmoid(alpha * g') * (u' + 1)            (gpt-oss)
// The clamps pass gradient where the input lies inside them, bounds included (like torch.clamp).
#pragma once

#include <algorithm>
#include <cmath>

#include "poise/config.hpp"

namespace poise::reference {

struct SwigluParams {
  Activation kind = Activation::swiglu;
  float alpha = 1.702f;
  float limit = 7.0f;
};

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

inline float swiglu_forward(float gate, float up, const SwigluParams& p) {
  if (p.kind == Activation::swiglu) return gate * sigmoid(gate) * up;
  const float g = std::min(gate, p.limit);
  const float u = std::clamp(up, -p.limit, p.limit);
  return g * sigmoid(p.alpha * g) * (u + 1.0f);
}

// d a / d gate and d a / d up, times grad_a.
inline void swiglu_backward(float gate, float up, float grad_a, const SwigluParams& p, float& grad_gate,
                            float& grad_up) {
  if (p.kind == Activation::swiglu) {
    const float s = sigmoid(gate);
    grad_gate = grad_a * up * s * (1.0f + gate * (1.0f - s));
    grad_up = grad_a * gate * s;
    return;
  }
  const float g = std::min(gate, p.limit);
  const float u = std::clamp(up, -p.limit, p.limit);
  const float s = sigmoid(p.alpha * g);
  grad_gate = gate <= p.limit ? grad_a * (u + 1.0f) * s * (1.0f + p.alpha * g * (1.0f - s)) : 0.0f;
  grad_up = (up >= -p.limit && up <= p.limit) ? grad_a * g * s : 0.0f;
}

}  // namespace poise::reference
