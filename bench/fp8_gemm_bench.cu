// FP8 block-scaled vs BF16 expert GEMMs on one GPU (one rank's experts, docs/fp8.md). The forward:
//   BF16: expert_mlp_fprop_w13 (h13 saved) + expert_mlp_fprop_w2 (scores)
//   FP8:  quant::launch_row_tiles(x) + expert_mlp_fprop_w13_fp8 (h13 saved)
//         + quant::launch_row_tiles(a) + expert_mlp_fprop_w2_fp8 (scores)
// and the weight gradients (run_wgrad): expert_mlp_wgrad_w2 / _w13 against column tiles + _fp8;
// each step also timed alone. Weights quantized once (quant::launch_weight_blocks), outside the timing.
// Rows spread evenly over the local experts (no padding rows), dynamic tile order (tile_counters, as
// a Context runs the GEMMs), random inputs from a hash fill (no zeros to speak of).
//
//   fp8_gemm_bench [--out results.json] [--shapes deepseek,qwen] [--warmup 3] [--iters 10]
// Shapes: deepseek = DeepSeek-V3 at one rank of EP 8 (T 4096, K 8, 32 local experts: 1024 rows each,
//         D 7168, F 2048); qwen = Qwen3-30B-A3B on one GPU (T 8192, K 8, 128 experts: 512 rows each,
//         D 2048, F 768).
// Times with CUDA events, median of --iters after --warmup, the ops round-robin (each round times
// every op once, so all see the same clocks). FLOPs: 2 R D 2F (W13) and 2 R F D (W2);
// the FP8 totals count the quantization passes' time but no FLOPs of theirs. Also a sanity check,
// so a wrong kernel shows: relative L2 of the FP8 path's h13, a and y against the BF16 path's
// (expected a few percent: E4M3 keeps 3 mantissa bits). JSON to --out (default stdout); a table to stderr.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "quant/column_tiles.hpp"
#include "quant/row_tiles.hpp"
#include "quant/weight_blocks.hpp"
#include "bench_support.hpp"  // CHECK


namespace {

using namespace poise;

// Uniform in [-scale, scale) from a hash of (index, seed).
__global__ void fill_random_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (float(z >> 40) + 0.5f) / float(1ull << 24);  // (0, 1)
    p[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

__global__ void fill_random_f32(float* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = lo + (hi - lo) * float(z >> 40) / float(1ull << 24);
  }
}

// acc[0] += sum (got - want)^2, acc[1] += sum want^2, acc[2] += non-finite elements of got.
__device__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ float as_float(float v) { return v; }
template <class T>
__global__ void diff_norms(const T* got, const T* want, size_t n, double* acc) {
  double d2 = 0, w2 = 0, bad = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = as_float(got[i]), w = as_float(want[i]);
    if (!isfinite(g)) {
      bad += 1;
      continue;
    }
    d2 += double(g - w) * double(g - w);
    w2 += double(w) * double(w);
  }
  for (int o = 16; o > 0; o /= 2) {
    d2 += __shfl_down_sync(0xffffffffu, d2, o);
    w2 += __shfl_down_sync(0xffffffffu, w2, o);
    bad += __shfl_down_sync(0xffffffffu, bad, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(acc + 0, d2);
    atomicAdd(acc + 1, w2);
    atomicAdd(acc + 2, bad);
  }
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return p;
}

void fill_bf16(void* p, size_t n, uint64_t seed, float scale, cudaStream_t s) {
  fill_random_bf16<<<2048, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CHECK(cudaGetLastError());
}

struct RelL2 {
  double rel = NAN;
  double non_finite = 0;
};
// got and want: n values of T (bf16 by default, or float).
template <class T = __nv_bfloat16>
RelL2 rel_l2(const void* got, const void* want, size_t n, cudaStream_t s) {
  double* acc = static_cast<double*>(device_alloc(3 * sizeof(double)));
  CHECK(cudaMemsetAsync(acc, 0, 3 * sizeof(double), s));
  diff_norms<T><<<1024, 256, 0, s>>>(static_cast<const T*>(got), static_cast<const T*>(want), n, acc);
  CHECK(cudaGetLastError());
  double h[3];
  CHECK(cudaMemcpyAsync(h, acc, sizeof h, cudaMemcpyDeviceToHost, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaFree(acc));
  return {h[1] > 0 ? std::sqrt(h[0] / h[1]) : std::sqrt(h[0]), h[2]};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median (and least) milliseconds of each op enqueued on `s`, each run between its own pair of events.
// Round-robin: every round runs each op once, in turn, so that all of them see the same clocks (long
// runs of one large GEMM otherwise throttle and skew whichever op is timed next).
struct Timed {
  double median_ms = 0, min_ms = 0;
};
std::vector<Timed> time_round_robin(const std::vector<std::function<void()>>& ops, cudaStream_t s, int warmup,
                                    int iters) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& op : ops) op();
  CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<std::vector<double>> ms(ops.size());
  for (int i = 0; i < iters; ++i)
    for (size_t j = 0; j < ops.size(); ++j) {
      CHECK(cudaEventRecord(a, s));
      ops[j]();
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventSynchronize(b));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms[j].push_back(t);
    }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::vector<Timed> out;
  for (const auto& v : ms) out.push_back({median(v), *std::min_element(v.begin(), v.end())});
  return out;
}

struct Shape {
  std::string name, model;
  int64_t T, K, experts, D, F;
  int64_t rows_per_expert() const { return T * K / experts; }
  int64_t R() const { return T * K; }
};

const Shape kShapes[] = {
    {"deepseek", "DeepSeek-V3, one rank of EP 8", 4096, 8, 32, 7168, 2048},
    {"qwen", "Qwen3-30B-A3B, one GPU", 8192, 8, 128, 2048, 768},
};

struct Entry {
  std::string name;
  double flops = 0;  // 0: not a GEMM (quantization)
  double ms = 0, min_ms = 0;
  double tflops() const { return flops > 0 && ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; }
};

std::string json_entry(const Entry& e) {
  std::ostringstream o;
  o << "{\"ms\": " << e.ms << ", \"min_ms\": " << e.min_ms;
  if (e.flops > 0) o << ", \"tflops\": " << e.tflops();
  o << "}";
  return o.str();
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream o;
  o << v;
  return o.str();
}

// The weight gradients at one shape: BF16 expert_mlp_wgrad_w2 / _w13 against FP8 (column tiles of
// grad_y, a, grad_h13 and x, then expert_mlp_wgrad_w2_fp8 / _w13_fp8), fp32 gradients overwritten.
// The rows are the forward's (x, a, h13 standing in for grad_h13) and a random grad_y. Each step
// timed alone and the chains whole; returns the shape's "wgrad" JSON member.
std::string run_wgrad(const Shape& sh, const sm90::GroupedRows& rows, const sm90::ExpertMlpShape& shape, const void* x,
                      const void* a, const void* h13, int warmup, int iters, cudaStream_t s, bool& suspicious) {
  const int64_t E = sh.experts, D = sh.D, F = sh.F, R = sh.R();
  using bf16 = __nv_bfloat16;
  void* gy = device_alloc(size_t(R) * D * 2);
  fill_bf16(gy, size_t(R) * D, 5, 1.0f, s);
  float *gw2 = static_cast<float*>(device_alloc(size_t(E) * D * F * 4)),
        *gw13 = static_cast<float*>(device_alloc(size_t(E) * 2 * F * D * 4));
  float *gw2_8 = static_cast<float*>(device_alloc(size_t(E) * D * F * 4)),
        *gw13_8 = static_cast<float*>(device_alloc(size_t(E) * 2 * F * D * 4));
  struct Tiles {
    uint8_t* values;
    float* scales;
  };
  auto tiles = [&](int64_t C) {
    return Tiles{static_cast<uint8_t*>(device_alloc(size_t(C) * R)), static_cast<float*>(device_alloc(size_t(R) / 128 * C * 4))};
  };
  const Tiles tgy = tiles(D), ta = tiles(F), tgh = tiles(2 * F), tx = tiles(D);
  const quant::RowGroups groups{rows.row_offsets_E, rows.row_counts_E, static_cast<int32_t>(rows.num_experts)};
  auto quant = [&](const void* rows_RC, int64_t C, const Tiles& t) {
    quant::launch_column_tiles_transposed(static_cast<const bf16*>(rows_RC), R, C, groups, t.values, t.scales, s);
  };
  sm90::WgradOutput o2, o13, o2_8, o13_8;
  o2.grad_w = gw2, o13.grad_w = gw13, o2_8.grad_w = gw2_8, o13_8.grad_w = gw13_8;
  auto bf16_w2 = [&] { sm90::expert_mlp_wgrad_w2(rows, shape, gy, a, o2, s); };
  auto bf16_w13 = [&] { sm90::expert_mlp_wgrad_w13(rows, shape, h13, x, o13, s); };
  auto quant_all = [&] { quant(gy, D, tgy), quant(a, F, ta), quant(h13, 2 * F, tgh), quant(x, D, tx); };
  auto fp8_w2 = [&] { sm90::expert_mlp_wgrad_w2_fp8(rows, shape, {tgy.values, tgy.scales}, {ta.values, ta.scales}, o2_8, s); };
  auto fp8_w13 = [&] {
    sm90::expert_mlp_wgrad_w13_fp8(rows, shape, {tgh.values, tgh.scales}, {tx.values, tx.scales}, o13_8, s);
  };
  const std::vector<std::function<void()>> ops = {bf16_w2, bf16_w13, [&] { bf16_w2(), bf16_w13(); },
                                                  quant_all, fp8_w2, fp8_w13, [&] { quant_all(), fp8_w2(), fp8_w13(); }};
  const std::vector<Timed> t = time_round_robin(ops, s, warmup, iters);
  const RelL2 d2 = rel_l2<float>(gw2_8, gw2, size_t(E) * D * F, s), d13 = rel_l2<float>(gw13_8, gw13, size_t(E) * 2 * F * D, s);
  const double flops = 2.0 * R * D * F, flops13 = 2.0 * R * 2 * F * D;
  const std::vector<Entry> e = {{"bf16_w2", flops, t[0].median_ms, t[0].min_ms},
                                {"bf16_w13", flops13, t[1].median_ms, t[1].min_ms},
                                {"bf16_total", flops + flops13, t[2].median_ms, t[2].min_ms},
                                {"fp8_quant", 0, t[3].median_ms, t[3].min_ms},
                                {"fp8_w2", flops, t[4].median_ms, t[4].min_ms},
                                {"fp8_w13", flops13, t[5].median_ms, t[5].min_ms},
                                {"fp8_total", flops + flops13, t[6].median_ms, t[6].min_ms}};
  for (const Entry& x : e)
    std::fprintf(stderr, "  wgrad %-10s %9.3f ms (min %.3f) %7.1f TFLOP/s\n", x.name.c_str(), x.ms, x.min_ms, x.tflops());
  const bool bad = !(d2.rel < 0.15) || !(d13.rel < 0.15) || d2.non_finite + d13.non_finite > 0;
  std::fprintf(stderr, "  wgrad bf16 / fp8 time: gemms %.2fx  total (with quantization) %.2fx; check rel L2 w2 %.4f w13 %.4f%s\n",
               (e[0].ms + e[1].ms) / (e[4].ms + e[5].ms), e[2].ms / e[6].ms, d2.rel, d13.rel, bad ? "  <-- SUSPICIOUS" : "");
  suspicious = suspicious || bad;
  std::ostringstream js;
  js << "\"wgrad\": {";
  for (size_t i = 0; i < e.size(); ++i) js << (i ? ", " : "") << "\"" << e[i].name << "\": " << json_entry(e[i]);
  js << ", \"check_rel_l2_fp8_vs_bf16\": {\"w2\": " << json_number(d2.rel) << ", \"w13\": " << json_number(d13.rel)
     << ", \"suspicious\": " << (bad ? "true" : "false") << "}}";
  for (void* p : {gy, (void*)gw2, (void*)gw13, (void*)gw2_8, (void*)gw13_8, (void*)tgy.values, (void*)tgy.scales,
                  (void*)ta.values, (void*)ta.scales, (void*)tgh.values, (void*)tgh.scales, (void*)tx.values,
                  (void*)tx.scales})
    CHECK(cudaFree(p));
  return js.str();
}

// One shape: every buffer, the timings, the check; returns its JSON object.
std::string run_shape(const Shape& sh, int warmup, int iters, cudaStream_t s, bool& suspicious) {
  const int64_t E = sh.experts, D = sh.D, F = sh.F, R = sh.R(), rpe = sh.rows_per_expert();
  if (rpe % 128 != 0 || rpe * E != R) {
    std::fprintf(stderr, "%s: rows per expert (%lld) must be a multiple of 128\n", sh.name.c_str(), (long long)rpe);
    std::exit(1);
  }
  std::fprintf(stderr, "== %s (%s): R=%lld (%lld rows x %lld experts) D=%lld F=%lld\n", sh.name.c_str(),
               sh.model.c_str(), (long long)R, (long long)rpe, (long long)E, (long long)D, (long long)F);

  // Grouped rows: expert e owns rows [e * rpe, (e + 1) * rpe).
  std::vector<int32_t> offsets(E), counts(E, static_cast<int32_t>(rpe));
  for (int64_t e = 0; e < E; ++e) offsets[e] = static_cast<int32_t>(e * rpe);
  auto* d_offsets = static_cast<int32_t*>(device_alloc(E * 4));
  auto* d_counts = static_cast<int32_t*>(device_alloc(E * 4));
  auto* d_tiles = static_cast<int32_t*>(device_alloc(2 * 4));
  auto* d_fault = static_cast<unsigned long long*>(device_alloc(8));
  CHECK(cudaMemcpy(d_offsets, offsets.data(), E * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_counts, counts.data(), E * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_tiles, 0, 2 * 4));
  CHECK(cudaMemset(d_fault, 0, 8));
  sm90::GroupedRows rows;
  rows.row_offsets_E = d_offsets;
  rows.row_counts_E = d_counts;
  rows.num_experts = E;
  rows.max_rows = R;
  rows.tile_counters = d_tiles;
  rows.faults.word = d_fault;
  sm90::ExpertMlpShape shape;
  shape.hidden_dim = D;
  shape.intermediate_dim = F;

  const size_t nx = size_t(R) * D, nw13 = size_t(E) * 2 * F * D, nw2 = size_t(E) * D * F, nh = size_t(R) * 2 * F,
               na = size_t(R) * F;
  const auto kb = [](int64_t n) { return (n + 127) / 128; };
  // BF16 operands and outputs.
  void *x = device_alloc(nx * 2), *w13 = device_alloc(nw13 * 2), *w2 = device_alloc(nw2 * 2);
  void *h13 = device_alloc(nh * 2), *a = device_alloc(na * 2), *y = device_alloc(nx * 2);
  auto* scores = static_cast<float*>(device_alloc(R * 4));
  // FP8 operands and outputs.
  auto* xq = static_cast<uint8_t*>(device_alloc(nx));
  auto* xs = static_cast<float*>(device_alloc(size_t(R) * kb(D) * 4));
  auto* w13q = static_cast<uint8_t*>(device_alloc(nw13));
  auto* w13s = static_cast<float*>(device_alloc(size_t(E) * kb(2 * F) * kb(D) * 4));
  auto* w2q = static_cast<uint8_t*>(device_alloc(nw2));
  auto* w2s = static_cast<float*>(device_alloc(size_t(E) * kb(D) * kb(F) * 4));
  auto* aq = static_cast<uint8_t*>(device_alloc(na));
  auto* as = static_cast<float*>(device_alloc(size_t(R) * kb(F) * 4));
  void *h13_8 = device_alloc(nh * 2), *a_8 = device_alloc(na * 2), *y_8 = device_alloc(nx * 2);

  // x ~ U(-1, 1); weights U(-sqrt(3 / K), sqrt(3 / K)) (unit variance through each GEMM).
  fill_bf16(x, nx, 1, 1.0f, s);
  fill_bf16(w13, nw13, 2, std::sqrt(3.0f / float(D)), s);
  fill_bf16(w2, nw2, 3, std::sqrt(3.0f / float(F)), s);
  fill_random_f32<<<256, 256, 0, s>>>(scores, R, 4, 0.1f, 1.0f);
  CHECK(cudaGetLastError());
  quant::launch_weight_blocks(static_cast<const __nv_bfloat16*>(w13), E, 2 * F, D, w13q, w13s, s);
  quant::launch_weight_blocks(static_cast<const __nv_bfloat16*>(w2), E, D, F, w2q, w2s, s);
  CHECK(cudaStreamSynchronize(s));

  sm90::FpropW13Args b13{x, w13, a, h13};
  sm90::FpropW2Args b2{a, w2, scores, y};
  sm90::FpropW13Fp8Args f13;
  f13.x = {xq, xs};
  f13.w13 = {w13q, w13s};
  f13.a_RF = a_8;
  f13.h13_R2F = h13_8;
  sm90::FpropW2Fp8Args f2;
  f2.a = {aq, as};
  f2.w2 = {w2q, w2s};
  f2.scores_R = scores;
  f2.y_RD = y_8;

  auto bf16_w13 = [&] { sm90::expert_mlp_fprop_w13(rows, shape, b13, s); };
  auto bf16_w2 = [&] { sm90::expert_mlp_fprop_w2(rows, shape, b2, s); };
  auto quant_x = [&] { quant::launch_row_tiles(static_cast<const __nv_bfloat16*>(x), R, D, xq, xs, s); };
  auto fp8_w13 = [&] { sm90::expert_mlp_fprop_w13_fp8(rows, shape, f13, s); };
  auto quant_a = [&] { quant::launch_row_tiles(static_cast<const __nv_bfloat16*>(a_8), R, F, aq, as, s); };
  auto fp8_w2 = [&] { sm90::expert_mlp_fprop_w2_fp8(rows, shape, f2, s); };

  // One pass of each path first (the FP8 GEMMs' inputs come from it), then the check.
  bf16_w13();
  bf16_w2();
  quant_x();
  fp8_w13();
  quant_a();
  fp8_w2();
  CHECK(cudaStreamSynchronize(s));
  const RelL2 dh = rel_l2(h13_8, h13, nh, s), da = rel_l2(a_8, a, na, s), dy = rel_l2(y_8, y, nx, s);

  const double flops13 = 2.0 * R * D * 2 * F, flops2 = 2.0 * R * F * D;
  std::vector<Entry> bf16 = {{"w13", flops13}, {"w2", flops2}, {"total", flops13 + flops2}};
  std::vector<Entry> fp8 = {{"quant_x", 0}, {"w13", flops13}, {"quant_a", 0}, {"w2", flops2}, {"total", flops13 + flops2}};
  const std::vector<std::function<void()>> ops = {
      bf16_w13, bf16_w2, [&] { bf16_w13(); bf16_w2(); },
      quant_x, fp8_w13, quant_a, fp8_w2, [&] { quant_x(); fp8_w13(); quant_a(); fp8_w2(); }};
  const std::vector<Timed> t = time_round_robin(ops, s, warmup, iters);
  for (size_t i = 0; i < ops.size(); ++i) {
    Entry& e = i < bf16.size() ? bf16[i] : fp8[i - bf16.size()];
    e.ms = t[i].median_ms;
    e.min_ms = t[i].min_ms;
  }
  const sm90::PipelineFault fault = sm90::take_pipeline_fault(rows.faults, s);
  if (fault.occurred) {
    std::fprintf(stderr, "%s: DEVICE FAULT: %s\n", sh.name.c_str(), sm90::describe(fault).c_str());
    suspicious = true;
  }
  const double speed13 = bf16[0].ms / fp8[1].ms, speed2 = bf16[1].ms / fp8[3].ms, speed_all = bf16[2].ms / fp8[4].ms;
  const double speed_gemms = (bf16[0].ms + bf16[1].ms) / (fp8[1].ms + fp8[3].ms);

  for (const Entry& e : bf16)
    std::fprintf(stderr, "  bf16 %-8s %9.3f ms (min %.3f) %7.1f TFLOP/s\n", e.name.c_str(), e.ms, e.min_ms, e.tflops());
  for (const Entry& e : fp8)
    std::fprintf(stderr, "  fp8  %-8s %9.3f ms (min %.3f) %7.1f TFLOP/s\n", e.name.c_str(), e.ms, e.min_ms, e.tflops());
  std::fprintf(stderr, "  bf16 / fp8 time: w13 %.2fx  w2 %.2fx  gemms %.2fx  total (with quantization) %.2fx\n", speed13,
               speed2, speed_gemms, speed_all);
  // E4M3 on both operands: a few percent from BF16; far beyond, or a NaN, means a broken kernel.
  const bool bad = !(dy.rel < 0.15) || !(dh.rel < 0.15) || !(da.rel < 0.3) || dy.non_finite + dh.non_finite + da.non_finite > 0;
  std::fprintf(stderr, "  check, fp8 vs bf16 rel L2: h13 %.4f  a %.4f  y %.4f  (non-finite %g / %g / %g)%s\n", dh.rel,
               da.rel, dy.rel, dh.non_finite, da.non_finite, dy.non_finite, bad ? "  <-- SUSPICIOUS" : "");
  suspicious = suspicious || bad;

  std::ostringstream js;
  js << "    {\"name\": \"" << sh.name << "\", \"model\": \"" << sh.model << "\", \"T\": " << sh.T << ", \"K\": " << sh.K
     << ", \"local_experts\": " << E << ", \"rows_per_expert\": " << rpe << ", \"R\": " << R << ", \"D\": " << D
     << ", \"F\": " << F << ",\n     \"flops\": {\"w13\": " << flops13 << ", \"w2\": " << flops2 << "},\n     \"bf16\": {";
  for (size_t i = 0; i < bf16.size(); ++i) js << (i ? ", " : "") << "\"" << bf16[i].name << "\": " << json_entry(bf16[i]);
  js << "},\n     \"fp8\": {";
  for (size_t i = 0; i < fp8.size(); ++i) js << (i ? ", " : "") << "\"" << fp8[i].name << "\": " << json_entry(fp8[i]);
  js << "},\n     \"speedup_bf16_ms_over_fp8_ms\": {\"w13\": " << json_number(speed13) << ", \"w2\": " << json_number(speed2)
     << ", \"gemms\": " << json_number(speed_gemms) << ", \"total_with_quantization\": " << json_number(speed_all)
     << "},\n     \"check_rel_l2_fp8_vs_bf16\": {\"h13\": " << json_number(dh.rel) << ", \"a\": " << json_number(da.rel)
     << ", \"y\": " << json_number(dy.rel) << ", \"non_finite\": " << dh.non_finite + da.non_finite + dy.non_finite
     << ", \"suspicious\": " << (bad ? "true" : "false") << "},\n     \"device_fault\": "
     << (fault.occurred ? "\"" + sm90::describe(fault) + "\"" : std::string("null")) << ",\n     "
     << run_wgrad(sh, rows, shape, x, a, h13, warmup, iters, s, suspicious) << "}";

  for (void* p : {(void*)d_offsets, (void*)d_counts, (void*)d_tiles, (void*)d_fault, x, w13, w2, h13, a, y,
                  (void*)scores, (void*)xq, (void*)xs, (void*)w13q, (void*)w13s, (void*)w2q, (void*)w2s, (void*)aq,
                  (void*)as, h13_8, a_8, y_8})
    CHECK(cudaFree(p));
  return js.str();
}

[[noreturn]] void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--out results.json] [--shapes deepseek,qwen] [--warmup 3] [--iters 10]\n", argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, shapes = "deepseek,qwen";
  int warmup = 3, iters = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage(argv[0]);
    if (arg == "--out") out_path = argv[++i];
    else if (arg == "--shapes") shapes = argv[++i];
    else if (arg == "--warmup") warmup = std::atoi(argv[++i]);
    else if (arg == "--iters") iters = std::atoi(argv[++i]);
    else usage(argv[0]);
  }
  if (iters < 1 || warmup < 0) usage(argv[0]);

  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  std::fprintf(stderr, "fp8_gemm_bench on %s (sm_%d%d), warmup %d, median of %d\n", prop.name, prop.major, prop.minor,
               warmup, iters);

  std::vector<std::string> results;
  bool suspicious = false;
  try {
    for (const Shape& sh : kShapes)
      if (("," + shapes + ",").find("," + sh.name + ",") != std::string::npos)
        results.push_back(run_shape(sh, warmup, iters, s, suspicious));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8_gemm_bench: %s\n", e.what());
    return 1;
  }
  if (results.empty()) usage(argv[0]);

  std::ostringstream js;
  js << "{\n  \"bench\": \"fp8_gemm_bench\",\n  \"device\": \"" << prop.name << "\",\n  \"warmup\": " << warmup
     << ",\n  \"iterations\": " << iters
     << ",\n  \"statistic\": \"median ms (cudaEvent; ops timed round-robin), min_ms the least\",\n  \"notes\": \"BF16: fprop_w13 (h13 saved) + fprop_w2 (scores); "
        "FP8: row tiles of x, fprop_w13_fp8 (h13 saved), row tiles of a, fprop_w2_fp8 (scores); weights quantized "
        "once, untimed; dynamic tile order; TFLOP/s from 2 R D 2F and 2 R F D\",\n  \"shapes\": [\n";
  for (size_t i = 0; i < results.size(); ++i) js << results[i] << (i + 1 < results.size() ? ",\n" : "\n");
  js << "  ]\n}\n";
  if (out_path.empty()) {
    std::cout << js.str();
  } else {
    std::ofstream f(out_path);
    f << js.str();
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
      return 1;
    }
    std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  }
  CHECK(cudaStreamDestroy(s));
  return suspicious ? 3 : 0;
}
