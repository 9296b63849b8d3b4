// EP data-path benchmark over virtual ranks on one GPU (all ranks share the GPU's HBM, so the
// "link" is local memory: the figures bound the kernels' own cost, not NVLink's).
//
//   ep_bench [out.json] [R T D F E K] [iterations]
// defaults: R=8 T=4096 D=7168 F=2048 E=256 K=8, 3 timed iterations after 1 warm-up.
// Times every stage of the staged forward and backward with CUDA events (median over iterations),
// counts bytes as rows received (every (t, k) row) and bytes actually written to other ranks
// (one row per token and destination rank, + 12 bytes of metadata per entry).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "pipeline/staged_pipeline.hpp"

using namespace poise;
using namespace poise::ep;
using namespace poise::bench;

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/ep_h200.json";
  int R = 8, T = 4096, D = 7168, F = 2048, E = 256, K = 8, iterations = 3;
  if (argc > 7) {
    R = std::atoi(argv[2]); T = std::atoi(argv[3]); D = std::atoi(argv[4]);
    F = std::atoi(argv[5]); E = std::atoi(argv[6]); K = std::atoi(argv[7]);
  }
  if (argc > 8) iterations = std::atoi(argv[8]);
  const Config cfg = layer_config(T, D, F, E, K, Balance::capacity, 1.25);
  const int EL = E / R;

  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));

  // Weights shared by all virtual ranks (the values do not change the timing; saves ~40 GB).
  const size_t w13n = size_t(EL) * 2 * F * D, w2n = size_t(EL) * D * F, TD = size_t(T) * D, TK = size_t(T) * K;
  void* w13 = device_alloc(w13n * 2);
  void* w2 = device_alloc(w2n * 2);
  void* gw13 = device_alloc(w13n * 4);
  void* gw2 = device_alloc(w2n * 4);
  random_fill(w13, w13n, 1, 3.0f / std::sqrt(float(D)));
  random_fill(w2, w2n, 2, 3.0f / std::sqrt(float(F)));

  std::mt19937_64 rng(12345);
  std::vector<ForwardArgs> fwd(R);
  std::vector<BackwardArgs> bwd(R);
  int64_t entries_remote = 0, rows_crossing = 0;
  for (int r = 0; r < R; ++r) {
    std::vector<int32_t> ids(TK);
    std::vector<float> scores(TK);
    std::vector<int> pool(E);
    for (int e = 0; e < E; ++e) pool[e] = e;
    std::uniform_real_distribution<float> sd(0.1f, 1.0f);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {  // partial Fisher-Yates: K distinct experts
        std::uniform_int_distribution<int> pick(k, E - 1);
        std::swap(pool[k], pool[pick(rng)]);
        ids[size_t(t) * K + k] = pool[k];
        scores[size_t(t) * K + k] = sd(rng);
      }
      std::vector<bool> seen(R, false);
      for (int k = 0; k < K; ++k) {
        const int d = ids[size_t(t) * K + k] / EL;
        if (d != r) ++entries_remote;
        if (d != r && !seen[d]) ++rows_crossing;
        seen[d] = true;
      }
    }
    void* x = device_alloc(TD * 2);
    void* ids_d = device_alloc(TK * 4);
    void* scores_d = device_alloc(TK * 4);
    void* out = device_alloc(TD * 2);
    void* grad_out = device_alloc(TD * 2);
    void* grad_x = device_alloc(TD * 2);
    void* grad_scores = device_alloc(TK * 4);
    random_fill(x, TD, 100 + r, 1.0f);
    random_fill(grad_out, TD, 200 + r, 1.0f);
    CHECK(cudaMemcpy(ids_d, ids.data(), TK * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(scores_d, scores.data(), TK * 4, cudaMemcpyHostToDevice));
    fwd[r] = ForwardArgs{x, static_cast<int32_t*>(ids_d), scores_d, DType::fp32, w13, W13Layout::gate_up_blocked, w2, out};
    bwd[r].forward = fwd[r];
    bwd[r].grad_out_TD = grad_out;
    bwd[r].grad_x_TD = grad_x;
    bwd[r].grad_scores_TK = grad_scores;
    bwd[r].grad_w13 = gw13;
    bwd[r].grad_w2 = gw2;
  }
  CHECK(cudaDeviceSynchronize());

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::ofstream js(out_path);
  js << "{\n  \"device\": \"" << prop.name << "\",\n  \"mode\": \"virtual ranks, one GPU\",\n";
  js << "  \"shape\": {\"R\": " << R << ", \"T\": " << T << ", \"D\": " << D << ", \"F\": " << F << ", \"E\": " << E
     << ", \"K\": " << K << ", \"receive_capacity_factor\": 1.25},\n";
  js << "  \"iterations\": " << iterations << ",\n";
  const double row_bytes = double(D) * 2;
  const double rows_received = double(R) * TK;
  const double bytes_received = rows_received * row_bytes;
  const double bytes_written_remote = double(rows_crossing) * row_bytes + double(R) * TK * 12.0;
  const double combine_bytes_remote = double(entries_remote) * row_bytes;
  const double flops_fwd = 6.0 * rows_received * D * F;
  js << "  \"rows_received\": " << int64_t(rows_received) << ",\n";
  js << "  \"bytes_received_as_rows\": " << int64_t(bytes_received) << ",\n";
  js << "  \"dispatch_bytes_written_to_other_ranks\": " << int64_t(bytes_written_remote) << ",\n";
  js << "  \"combine_bytes_written_to_other_ranks\": " << int64_t(combine_bytes_remote) << ",\n";
  js << "  \"expert_flops_forward\": " << flops_fwd << ",\n";
  // One whole, one light and one partial activation record besides the working one, to time a
  // backward that finds its forward kept (record 1), one that re-sends its x rows (light record 2),
  // one that also recomputes h13 past the first half of the receive rows (partial record 3), and
  // one that rebuilds its forward (activation slots without room).
  PipelineOptions options;
  options.activation_records = 1;
  options.light_activation_records = 1;
  const int64_t capacity = StagedPipeline::capacity_rows(cfg, R, options);
  options.partial_activation_records = 1;
  options.partial_record_rows = capacity / 2 / 128 * 128;
  const int kept = 1, light = 2, partial = 3;
  auto pipeline = StagedPipeline::create_virtual(cfg, R, options);
  StageClock clock;
  pipeline->set_stage_hook([&](Stage s, cudaStream_t st) { clock.hook(s, st); });
  // A forward into `record`, then its backward (from `from`, rebuilding the forward first when
  // recompute): the backward's stage times.
  auto pass = [&](int record, int from, bool recompute, std::map<std::string, double>* forward_ms) {
    pipeline->forward(fwd, stream, record);
    pipeline->check(stream);
    const auto f = clock.read();
    if (forward_ms) *forward_ms = f;
    pipeline->backward(bwd, stream, from, recompute);
    pipeline->check(stream);
    return clock.read();
  };
  std::map<std::string, std::vector<double>> fwd_ms, bwd_ms;
  std::map<std::string, std::vector<double>> recompute_ms;  // backward that rebuilds its forward
  std::map<std::string, std::vector<double>> light_ms;      // backward from a light record
  std::map<std::string, std::vector<double>> partial_ms;    // backward from a partial record
  for (int it = 0; it < iterations + 1; ++it) {
    std::map<std::string, double> f;
    const auto bw = pass(kept, kept, false, &f);
    const auto rc = pass(kept, 0, true, nullptr);
    const auto lt = pass(light, light, false, nullptr);
    const auto pt = pass(partial, partial, false, nullptr);
    if (it == 0) continue;  // warm-up
    for (auto& [k, v] : f) fwd_ms[k].push_back(v);
    for (auto& [k, v] : bw) bwd_ms[k].push_back(v);
    for (auto& [k, v] : rc) recompute_ms[k].push_back(v);
    for (auto& [k, v] : lt) light_ms[k].push_back(v);
    for (auto& [k, v] : pt) partial_ms[k].push_back(v);
  }
  // Median of a stage's times; 0 for a stage the pass does not have (never inserts a key).
  auto m = [&](const std::map<std::string, std::vector<double>>& s, const char* k) {
    const auto it = s.find(k);
    return it == s.end() ? 0.0 : median(it->second);
  };
  const double dispatch_ms = m(fwd_ms, "dispatch"), fanout_ms = m(fwd_ms, "fanout");
  const double push_ms = m(fwd_ms, "combine_push"), reduce_ms = m(fwd_ms, "combine_reduce");
  const double fwd_total = m(fwd_ms, "total"), bwd_total = m(bwd_ms, "total");
  std::printf("\nEP staged pipeline, %d virtual ranks on one %s, T=%d D=%d F=%d E=%d K=%d, median of %d\n", R,
              prop.name, T, D, F, E, K, iterations);
  std::printf("%-22s %10s %10s\n", "stage", "fwd ms", "bwd ms");
  for (const char* s : {"route", "dispatch", "fanout", "experts", "combine_push", "combine_reduce", "total"}) {
    std::printf("%-22s %10.3f %10.3f\n", s, m(fwd_ms, s), m(bwd_ms, s));
  }
  std::printf("dispatch: %.2f GB received as rows, %.2f GB written to other ranks (%.2f of received), %.0f GB/s of rows received\n",
              bytes_received / 1e9, bytes_written_remote / 1e9, bytes_written_remote / bytes_received,
              bytes_received / 1e9 / ((dispatch_ms + fanout_ms) / 1e3));
  std::printf("combine: %.2f GB stored to other ranks by the experts, push+reduce %.3f ms\n",
              combine_bytes_remote / 1e9, push_ms + reduce_ms);
  std::printf("layer forward %.3f ms, forward+backward %.3f ms (experts fwd %.1f TFLOP/s, bwd %.1f TFLOP/s)\n", fwd_total,
              fwd_total + bwd_total, flops_fwd / (m(fwd_ms, "experts") / 1e3) / 1e12,
              2 * flops_fwd / (m(bwd_ms, "experts") / 1e3) / 1e12);
  std::printf("backward from a kept record %.3f ms; from a light record %.3f ms (redispatch stage %.3f ms); "
              "from a partial record keeping %lld of %lld rows %.3f ms (redispatch %.3f, recompute_rows %.3f ms); "
              "rebuilding the forward first %.3f ms (recompute stage %.3f ms; the whole forward %.3f ms)\n",
              bwd_total, m(light_ms, "total"), m(light_ms, "redispatch"), (long long)options.partial_record_rows,
              (long long)capacity, m(partial_ms, "total"), m(partial_ms, "redispatch"), m(partial_ms, "recompute_rows"),
              m(recompute_ms, "total"), m(recompute_ms, "recompute"), fwd_total);
  auto dump = [&](const char* name, std::map<std::string, std::vector<double>>& s) {
    js << "  \"" << name << "_ms\": {";
    bool first = true;
    for (auto& [k, v] : s) {
      js << (first ? "" : ", ") << "\"" << k << "\": " << median(v);
      first = false;
    }
    js << "},\n";
  };
  dump("forward", fwd_ms);
  dump("backward", bwd_ms);
  dump("backward_recomputing_forward", recompute_ms);
  dump("backward_from_light_record", light_ms);
  dump("backward_from_partial_record", partial_ms);
  js << "  \"layer_forward_ms\": " << fwd_total << ", \"layer_forward_backward_ms\": " << fwd_total + bwd_total
     << "\n}\n";
  pipeline.reset();
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
