// Exact-balance benchmark over R virtual ranks on one GPU (SM90 expert kernels).
//
//   balance_bench [out.json] [replica_slots] [iterations]
// R=8 T=4096 D=7168 F=2048 E=256 K=8. For routings whose peak/mean rows per rank is 1, 1.3, 3
// and 8 (the hot rank is rank 0; its experts share its rows evenly; other ranks uniform), times
// the layer forward+backward with exact balance (tolerance 0 and 0.1) next to balancing off
// (capacity mode with receive_capacity_factor = peak/mean, skipped when it does not fit in HBM),
// the planner kernel alone, and the replica traffic the plan implies. One pipeline alive at a time;
// within a pipeline the skews take turns pass by pass (median of `iterations` passes each).
//
// Memory: all virtual ranks share one copy of the layer weights (read-only) so that B replica
// slots of weights and fp32 gradients per rank fit: 8 ranks x B x (88 MB bf16 + 176 MB fp32).
// Default B = 16 (training would use E_local = 32; the plan needs at most 4 here).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "ep/data_path.hpp"
#include "pipeline/staged_pipeline.hpp"

using namespace poise;
using namespace poise::ep;
using namespace poise::bench;

namespace {

constexpr int R = 8, T = 4096, D = 7168, F = 2048, E = 256, K = 8, EL = E / R;

// ids for every rank: each token puts m of its K experts on rank 0 (m = K*pm/R on average, the
// fraction by a coin), the rest on other ranks, all distinct and uniform within their ranks.
std::vector<std::vector<int32_t>> make_routing(double peak_mean, std::mt19937_64& rng) {
  std::vector<std::vector<int32_t>> ids(R, std::vector<int32_t>(size_t(T) * K));
  const double hot = K * peak_mean / R;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<int32_t> hot_pool(EL), cold_pool(E - EL);
  for (int e = 0; e < EL; ++e) hot_pool[e] = e;
  for (int e = EL; e < E; ++e) cold_pool[e - EL] = e;
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      int m = static_cast<int>(std::floor(hot));
      if (coin(rng) < hot - m) ++m;
      m = std::min(m, K);
      std::shuffle(hot_pool.begin(), hot_pool.end(), rng);
      std::shuffle(cold_pool.begin(), cold_pool.end(), rng);
      for (int k = 0; k < K; ++k) ids[r][size_t(t) * K + k] = k < m ? hot_pool[k] : cold_pool[k - m];
    }
  }
  return ids;
}

struct Buffers {  // per-rank call buffers; weights shared by every rank
  void *w13 = nullptr, *w2 = nullptr;
  std::vector<void*> x, scores, out, grad_out, grad_x, grad_scores, grad_w13, grad_w2;
  std::vector<std::vector<void*>> ids;  // [skew][rank]: every routing stays on the device
};

size_t used_bytes() {
  size_t free = 0, total = 0;
  CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

struct RunResult {
  bool ran = false;
  std::string why;
  double fwd_ms = 0, fwd_bwd_ms = 0, planner_us = 0;
  double fwd_bwd_min_ms = 0, fwd_bwd_max_ms = 0;
  PlanSnapshot plan;
  size_t used = 0;
  std::map<std::string, double> fwd_stages_ms, bwd_stages_ms;  // one extra pass with stage events
};

struct Call {  // one routing's argument sets, one per virtual rank
  std::vector<ForwardArgs> fwd = std::vector<ForwardArgs>(R);
  std::vector<BackwardArgs> bwd = std::vector<BackwardArgs>(R);
};

Call make_call(const Buffers& b, size_t skew) {
  Call c;
  for (int r = 0; r < R; ++r) {
    c.fwd[r] = ForwardArgs{b.x[r], static_cast<int32_t*>(b.ids[skew][r]), b.scores[r], DType::fp32, b.w13,
                           W13Layout::gate_up_blocked, b.w2, b.out[r]};
    c.bwd[r].forward = c.fwd[r];
    c.bwd[r].grad_out_TD = b.grad_out[r];
    c.bwd[r].grad_x_TD = b.grad_x[r];
    c.bwd[r].grad_scores_TK = b.grad_scores[r];
    c.bwd[r].grad_w13 = b.grad_w13[r];
    c.bwd[r].grad_w2 = b.grad_w2[r];
  }
  return c;
}

// Times forward and forward+backward of every skew on one pipeline, the skews interleaved: pass i
// runs each skew once, in turn, so clock and power drift over the run (this card's sustained
// tensor load varies ~5-10%) falls on every skew alike instead of on the ones measured last.
std::vector<RunResult> run_interleaved(StagedPipeline& p, const Buffers& b, const std::vector<size_t>& skews,
                                       int iterations, cudaStream_t stream) {
  std::vector<RunResult> res(skews.size());
  std::vector<Call> calls;
  for (size_t i : skews) calls.push_back(make_call(b, i));
  cudaEvent_t e0, e1, e2;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventCreate(&e2));
  std::vector<std::vector<double>> f(skews.size()), fb(skews.size());
  std::vector<bool> failed(skews.size(), false);
  for (int pass = 0; pass <= iterations; ++pass) {  // pass 0: warm-up
    for (size_t i = 0; i < skews.size(); ++i) {
      if (failed[i]) continue;
      CHECK(cudaEventRecord(e0, stream));
      p.forward(calls[i].fwd, stream);
      CHECK(cudaEventRecord(e1, stream));
      p.backward(calls[i].bwd, stream);
      CHECK(cudaEventRecord(e2, stream));
      try {
        p.check(stream);
      } catch (const std::exception& ex) {
        res[i].why = ex.what();
        failed[i] = true;
        p.reset();
        continue;
      }
      float a = 0, c = 0;
      CHECK(cudaEventElapsedTime(&a, e0, e1));
      CHECK(cudaEventElapsedTime(&c, e0, e2));
      if (pass > 0) f[i].push_back(a), fb[i].push_back(c);
    }
  }
  for (size_t i = 0; i < skews.size(); ++i) {
    if (failed[i]) continue;
    RunResult& r = res[i];
    r.ran = true;
    r.fwd_ms = median(f[i]);
    r.fwd_bwd_ms = median(fb[i]);
    r.fwd_bwd_min_ms = *std::min_element(fb[i].begin(), fb[i].end());
    r.fwd_bwd_max_ms = *std::max_element(fb[i].begin(), fb[i].end());
    r.used = used_bytes();
    {  // where the time goes: one more pass with an event at every stage boundary
      StageClock clock;
      p.set_stage_hook([&](Stage s, cudaStream_t st) { clock.hook(s, st); });
      p.forward(calls[i].fwd, stream);
      p.check(stream);
      r.fwd_stages_ms = clock.read();
      p.backward(calls[i].bwd, stream);
      p.check(stream);
      r.bwd_stages_ms = clock.read();
      p.set_stage_hook(nullptr);
    }
    if (p.dims().balanced) {
      r.plan = p.plan_snapshot(0);
      // The planner kernel alone, on the counts of the last forward (re-planning is idempotent).
      constexpr int kReps = 200;
      launch_balance_plan(p.launch_params(), stream);
      CHECK(cudaEventRecord(e0, stream));
      for (int k = 0; k < kReps; ++k) launch_balance_plan(p.launch_params(), stream);
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaStreamSynchronize(stream));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      r.planner_us = 1e3 * ms / kReps;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaEventDestroy(e2);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/balance_h200.json";
  const int B = argc > 2 ? std::atoi(argv[2]) : 16;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 3;
  const std::vector<double> skews = {1.0, 1.3, 3.0, 8.0};
  const size_t TD = size_t(T) * D, TK = size_t(T) * K;
  const size_t w13n = size_t(EL) * 2 * F * D, w2n = size_t(EL) * D * F;
  const size_t expert_bf16 = (size_t(2) * F * D + size_t(D) * F) * 2;

  Buffers b;
  b.w13 = device_alloc(w13n * 2);
  b.w2 = device_alloc(w2n * 2);
  random_fill(b.w13, w13n, 1, 3.0f / std::sqrt(float(D)));
  random_fill(b.w2, w2n, 2, 3.0f / std::sqrt(float(F)));
  std::vector<float> scores(TK, 0.125f);
  for (int r = 0; r < R; ++r) {
    b.x.push_back(device_alloc(TD * 2));
    b.grad_out.push_back(device_alloc(TD * 2));
    random_fill(b.x[r], TD, 10 + r, 1.0f);
    random_fill(b.grad_out[r], TD, 20 + r, 1.0f);
    b.scores.push_back(device_alloc(TK * 4));
    CHECK(cudaMemcpy(b.scores[r], scores.data(), TK * 4, cudaMemcpyHostToDevice));
    b.out.push_back(device_alloc(TD * 2));
    b.grad_x.push_back(device_alloc(TD * 2));
    b.grad_scores.push_back(device_alloc(TK * 4));
    b.grad_w13.push_back(device_alloc(w13n * 4));
    b.grad_w2.push_back(device_alloc(w2n * 4));
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::mt19937_64 rng(42);
  std::vector<size_t> all_skews;
  for (size_t i = 0; i < skews.size(); ++i) {
    const std::vector<std::vector<int32_t>> ids = make_routing(skews[i], rng);
    b.ids.emplace_back();
    for (int r = 0; r < R; ++r) {
      b.ids[i].push_back(device_alloc(TK * 4));
      CHECK(cudaMemcpy(b.ids[i][r], ids[r].data(), TK * 4, cudaMemcpyHostToDevice));
    }
    all_skews.push_back(i);
  }

  // results[mode][skew]: mode 0 exact, 1 exact with tolerance 0.1, 2 capacity (balancing off)
  std::vector<std::vector<RunResult>> results(3, std::vector<RunResult>(skews.size()));
  std::vector<size_t> workspace(3, 0);
  for (int mode = 0; mode < 2; ++mode) {
    PipelineOptions o;
    o.replica_slots = B;
    Config c = layer_config(T, D, F, E, K, Balance::exact, 1.0);
    c.balance_tolerance = mode == 0 ? 0.0 : 0.1;
    workspace[mode] = StagedPipeline::workspace_bytes(c, R, o);
    auto p = StagedPipeline::create_virtual(c, R, o);
    results[mode] = run_interleaved(*p, b, all_skews, iterations, stream);
    for (size_t i = 0; i < skews.size(); ++i) {
      std::printf("exact tol %.1f  peak/mean %.1f: %s fwd %.3f ms fwd+bwd %.3f ms planner %.2f us moved %lld rows "
                  "pieces %zu used %.2f GB\n",
                  c.balance_tolerance, skews[i], results[mode][i].ran ? "" : results[mode][i].why.c_str(),
                  results[mode][i].fwd_ms, results[mode][i].fwd_bwd_ms, results[mode][i].planner_us,
                  (long long)results[mode][i].plan.moved_rows, results[mode][i].plan.pieces.size(),
                  results[mode][i].used / 1e9);
    }
  }
  for (size_t i = 0; i < skews.size(); ++i) {
    const double factor = std::max(1.0, skews[i]) * 1.02;  // a little room over the exact peak
    const Config c = layer_config(T, D, F, E, K, Balance::capacity, factor);
    PipelineOptions o;
    const size_t need = R * StagedPipeline::bytes_per_rank(c, R, o);
    size_t free = 0, total = 0;
    CHECK(cudaMemGetInfo(&free, &total));
    if (need + (size_t(2) << 30) > free) {
      results[2][i].why = "capacity factor " + std::to_string(factor) + " needs " + std::to_string(need >> 30) +
                          " GiB, " + std::to_string(free >> 30) + " GiB free";
      std::printf("off  peak/mean %.1f: skipped (%s)\n", skews[i], results[2][i].why.c_str());
      continue;
    }
    auto p = StagedPipeline::create_virtual(c, R, o);
    results[2][i] = run_interleaved(*p, b, {i}, iterations, stream)[0];
    std::printf("off  peak/mean %.1f: %s fwd %.3f ms fwd+bwd %.3f ms\n", skews[i],
                results[2][i].ran ? "" : results[2][i].why.c_str(), results[2][i].fwd_ms, results[2][i].fwd_bwd_ms);
  }

  std::ostringstream js;
  js << "{\n  \"bench\": \"balance_bench\", \"device\": \"";
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  js << prop.name << "\",\n  \"R\": " << R << ", \"T\": " << T << ", \"D\": " << D << ", \"F\": " << F
     << ", \"E\": " << E << ", \"K\": " << K << ", \"replica_slots\": " << B << ", \"expert_kernels\": \"sm90\""
     << ", \"iterations\": " << iterations << ",\n  \"workspace_bytes_per_rank\": {\"exact\": " << workspace[0]
     << ", \"exact_tol0.1\": " << workspace[1] << "},\n  \"runs\": [\n";
  const char* names[3] = {"exact", "exact_tol0.1", "off"};
  for (size_t i = 0; i < skews.size(); ++i) {
    js << "    {\"peak_mean\": " << skews[i];
    for (int mode = 0; mode < 3; ++mode) {
      const RunResult& r = results[mode][i];
      js << ",\n     \"" << names[mode] << "\": ";
      if (!r.ran) {
        js << "{\"ran\": false, \"why\": \"" << r.why << "\"}";
        continue;
      }
      js << "{\"ran\": true, \"forward_ms\": " << r.fwd_ms << ", \"forward_backward_ms\": " << r.fwd_bwd_ms
         << ", \"forward_backward_min_ms\": " << r.fwd_bwd_min_ms << ", \"forward_backward_max_ms\": " << r.fwd_bwd_max_ms
         << ", \"device_bytes_in_use\": " << r.used;
      if (mode < 2) {
        const size_t pieces = r.plan.pieces.size();
        js << ", \"planner_us\": " << r.planner_us << ", \"plan_exact\": " << (r.plan.exact ? "true" : "false")
           << ", \"max_rank_rows\": " << r.plan.max_rank_rows << ", \"moved_rows\": " << r.plan.moved_rows
           << ", \"replica_pieces\": " << pieces << ", \"replica_weight_bytes\": " << pieces * expert_bf16
           << ", \"replica_grad_bytes\": " << pieces * expert_bf16 * 2
           << ", \"moved_row_bytes\": " << size_t(r.plan.moved_rows) * D * 2;
      }
      for (const auto& [key, stages] : {std::pair{"forward_stages_ms", &r.fwd_stages_ms},
                                        std::pair{"backward_stages_ms", &r.bwd_stages_ms}}) {
        js << ", \"" << key << "\": {";
        const char* sep = "";
        for (const auto& [stage, ms] : *stages) js << sep << "\"" << stage << "\": " << ms, sep = ", ";
        js << "}";
      }
      js << "}";
    }
    js << "}" << (i + 1 < skews.size() ? "," : "") << "\n";
  }
  js << "  ]\n}\n";
  std::ofstream(out_path) << js.str();
  std::printf("%s", js.str().c_str());
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
