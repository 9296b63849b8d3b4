#include "demo_host.hpp"

#include <chrono>
#include <cstdio>
#include <utility>

namespace poise::demo {

HostInputs make_host_inputs(const Setup& s) {
  const auto start = std::chrono::steady_clock::now();
  HostInputs h{ref::random_inputs(s.config(), s.ranks(), inputs_spec(s.flags), s.options()),
               ref::random_grad_out(s.config(), s.ranks(), s.flags.seed + 1)};
  for (int64_t r = 0; r < s.ranks(); ++r) {
    h.inputs[r].ids_TK = s.routing.ids_TK[r];
    h.inputs[r].scores_TK = s.routing.scores_TK[r];
  }
  std::printf("\nInputs: drawn on the host (reference::random_inputs), %.1f ms\n", milliseconds_since(start));
  return h;
}

HostResults run_engine(const Setup& s, const HostInputs& h) {
  ref::Engine engine(s.config(), s.ranks(), s.options());
  auto start = std::chrono::steady_clock::now();
  HostResults r;
  r.out = engine.forward(h.inputs);
  const double forward_ms = milliseconds_since(start);
  start = std::chrono::steady_clock::now();
  std::vector<ref::RankGradients> grads;
  engine.backward(h.inputs, h.grad_out, grads);
  const double backward_ms = milliseconds_since(start);
  std::printf("\nTime (CPU reference, %lld threads): forward %.1f ms, backward %.1f ms\n",
              static_cast<long long>(s.ranks()), forward_ms, backward_ms);
  for (ref::RankGradients& g : grads) {
    r.grad_x.push_back(std::move(g.grad_x_TD));
    r.grad_scores.push_back(std::move(g.grad_scores_TK));
    r.grad_w13.push_back(std::move(g.grad_w13));
    r.grad_w2.push_back(std::move(g.grad_w2));
  }
  return r;
}

}  // namespace poise::demo
