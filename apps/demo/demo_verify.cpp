#include "demo_verify.hpp"

#include <chrono>
#include <cstdio>

#include "demo_check.hpp"

namespace poise::demo {
namespace {

int finish(bool pass) {
  std::printf("result: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int check_full(const Setup& s, const char* what, const HostResults& got, const HostInputs& h) {
  const auto start = std::chrono::steady_clock::now();
  const ref::DenseFloat64Result want = ref::dense_float64(s.config(), s.ranks(), h.inputs, h.grad_out, s.options());
  std::printf("\nCheck of the %s results against float64 (full: dense formulation, every output, %.1f ms): "
              "relative L2 error, bound %.0e\n",
              what, milliseconds_since(start), s.flags.tolerance);
  return finish(print_check_lines({{"out", ref::relative_error(got.out, want.out_TD)},
                                   {"grad_x", ref::relative_error(got.grad_x, want.grad_x_TD)},
                                   {"grad_scores", ref::relative_error(got.grad_scores, want.grad_scores_TK)},
                                   {"grad_w13", ref::relative_error(got.grad_w13, want.grad_w13)},
                                   {"grad_w2", ref::relative_error(got.grad_w2, want.grad_w2)}},
                                  s.flags.tolerance));
}

RowFn rows_of(const std::vector<std::vector<float>>& per_rank, int64_t width) {
  return [&per_rank, width](int64_t r, int64_t t) {
    return std::vector<float>(per_rank[r].begin() + t * width, per_rank[r].begin() + (t + 1) * width);
  };
}

}  // namespace

int report_unchecked() {
  std::printf("\nCheck: none (--check none)\nresult: not checked\n");
  return 0;
}

int check_sampled(const Setup& s, const char* what, const std::vector<ref::SampledToken>& tokens,
                  const ref::ExpertWeightsFn& weights, const SampledGot& got) {
  const auto start = std::chrono::steady_clock::now();
  int64_t experts_read = 0;
  const ref::SampledFloat64Result want = ref::sampled_float64(
      s.config(), s.ranks(), tokens,
      [&](int64_t e, std::vector<float>& w13, std::vector<float>& w2) {
        ++experts_read;  // calls never overlap
        weights(e, w13, w2);
      },
      s.options(), sampled_check_threads(s.config()));
  std::vector<float> out, grad_x, grad_scores;
  std::vector<double> want_out, want_grad_x, want_grad_scores;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto append = [](std::vector<float>& to, const std::vector<float>& row) {
      to.insert(to.end(), row.begin(), row.end());
    };
    append(out, got.out(tokens[i].rank, tokens[i].token));
    append(grad_x, got.grad_x(tokens[i].rank, tokens[i].token));
    append(grad_scores, got.grad_scores(tokens[i].rank, tokens[i].token));
    want_out.insert(want_out.end(), want.out_D[i].begin(), want.out_D[i].end());
    want_grad_x.insert(want_grad_x.end(), want.grad_x_D[i].begin(), want.grad_x_D[i].end());
    want_grad_scores.insert(want_grad_scores.end(), want.grad_scores_K[i].begin(), want.grad_scores_K[i].end());
  }
  std::printf("\nCheck of the %s results against float64 (sampled: %zu tokens, %zu per rank fixed by the seed, "
              "%lld experts' weights read, %.1f ms): relative L2 error, bound %.0e\n",
              what, tokens.size(), s.sampled_tokens[0].size(), static_cast<long long>(experts_read),
              milliseconds_since(start), s.flags.tolerance);
  const bool pass = print_check_lines({{"out", ref::relative_error(out, want_out)},
                                       {"grad_x", ref::relative_error(grad_x, want_grad_x)},
                                       {"grad_scores", ref::relative_error(grad_scores, want_grad_scores)}},
                                      s.flags.tolerance);
  std::printf("  grad_w13, grad_w2: not checked (they sum over every token; --check full checks them)\n");
  return finish(pass);
}

int check_host_results(const Setup& s, const char* what, const HostResults& got, const HostInputs& h) {
  if (s.check == Check::none) return report_unchecked();
  if (s.check == Check::full) return check_full(s, what, got, h);
  const int64_t D = s.config().hidden_dim, K = s.config().top_k;
  return check_sampled(s, what, ref::sample_tokens(s.config(), s.ranks(), h.inputs, h.grad_out, s.sampled_tokens),
                       ref::expert_weights_from(s.config(), s.ranks(), h.inputs),
                       {rows_of(got.out, D), rows_of(got.grad_x, D), rows_of(got.grad_scores, K)});
}

}  // namespace poise::demo
