// poise_demo: the main job in one command. One MoE layer (routed experts) forward + backward across
// R expert-parallel ranks: prints the memory plan, the routing balance, the time, and a check against
// float64. Exit code 0 = PASS (or nothing checked: --check none), 1 = FAIL, 2 = bad arguments or a
// layer that does not fit in memory.
//
// Where: with an SM90 GPU (and --device auto|gpu) the layer runs through the public entry points
// (Context + routed_experts) with R virtual ranks on that GPU; without one, on the CPU reference
// engine (R threads). Every argument, and whether the layer fits, is checked before anything is
// printed. The routing is drawn on the host and its balance computed from the ids alone. With a full
// check the inputs come from reference::random_inputs on the host; otherwise the GPU generates them,
// so a layer of any size that fits on the GPU starts within seconds.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "demo_check.hpp"
#include "demo_flags.hpp"
#include "demo_sizes.hpp"
#include "poise/context.hpp"
#include "poise/memory_plan.hpp"
#include "poise/reference.hpp"
#include "runtime/device_info.hpp"
#include "testing/device_layer.hpp"
#include "testing/synthetic_layer.hpp"

namespace {

using namespace poise::demo;
using poise::Balance;
using poise::Config;
using poise::DType;
namespace ref = poise::reference;

std::string str(int64_t v) { return std::to_string(v); }

void cuda_ok(cudaError_t status) {
  if (status != cudaSuccess) throw poise::DeviceError(cudaGetErrorString(status));
}

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// ---- setup: everything decided and checked before the first line is printed ---------------------

struct Setup {
  Flags flags;  // receive_capacity_factor and wgrad_dtype as chosen
  poise::MemoryPlan plan;
  bool gpu = false;
  std::string device_line, check_line, capacity_note, wgrad_note, memory_line;
  Check check = Check::full;
  ref::RandomRouting routing;
  ref::RoutingStats stats;
  std::vector<std::vector<int64_t>> sampled_tokens;  // per rank, for --check sampled

  const Config& config() const { return flags.config; }
  int64_t ranks() const { return flags.ranks; }
  ref::Options options() const {
    ref::Options o;
    o.scores_dtype = flags.scores_dtype;
    o.replica_slots = plan.num_replica_slots;
    return o;
  }
};

void choose_device(Setup& s) {
  const int devices = poise::cuda_device_count();
  const bool sm90 = devices > 0 && poise::is_sm90_device(0);
  if (s.flags.where == Where::gpu && !sm90) {
    throw FlagError(std::string("--device gpu: ") + (devices > 0 ? "device 0 is not an SM90 GPU" : "no CUDA device"));
  }
  s.gpu = s.flags.where == Where::gpu || (s.flags.where == Where::automatic && sm90);
  const std::string R = str(s.ranks());
  if (s.gpu) {
    s.device_line = "SM90 GPU; the layer runs through Context + routed_experts with " + R + " virtual ranks on it.";
  } else {
    s.device_line = std::string(s.flags.where == Where::cpu ? "--device cpu"
                                : devices > 0             ? "a CUDA device that is not SM90"
                                                          : "no CUDA device") +
                    "; running the CPU reference engine with " + R + " virtual ranks (threads).";
  }
}

void choose_check(Setup& s) {
  const double macs = expert_macs(s.config(), s.ranks());
  const bool by_default = s.flags.check == Check::automatic;
  s.check = by_default ? default_check(s.config(), s.ranks()) : s.flags.check;
  char why[160];
  std::snprintf(why, sizeof why, " (%s: the layer has %.1e expert multiply-adds, full up to %.0e)",
                by_default ? "default" : "--check", macs, kFullCheckMacs);
  if (s.check == Check::full) {
    s.check_line = "full: every output and weight gradient against a dense float64 computation on the host" +
                   std::string(why);
  } else if (s.check == Check::sampled) {
    s.sampled_tokens = pick_sampled_tokens(s.config(), s.ranks(), s.flags.seed);
    s.check_line = "sampled: out, grad_x and grad_scores of " + str(int64_t(s.sampled_tokens[0].size())) +
                   " token(s) per rank against float64; weight gradients are not checked" + why;
  } else {
    s.check_line = "none (--check none): nothing is compared with float64";
  }
}

ref::RandomInputsSpec inputs_spec(const Flags& f) {
  return {.seed = f.seed, .skew = f.skew, .padding_rows = f.padding_rows};
}

std::string sizes_hint(const Flags& f) {
  return "lower --tokens (" + str(f.config.num_local_input_tokens) + ") or the layer (--hidden " +
         str(f.config.hidden_dim) + ", --intermediate " + str(f.config.intermediate_dim) + ", --experts " +
         str(f.config.num_experts) + ", --ranks " + str(f.ranks) + ")";
}

// Refuses a layer whose buffers do not fit (FlagError). On the GPU without --wgrad-dtype, takes
// bf16 weight gradients when only they fit (the DeepSeek-V3 EP8 layer on one H200).
void fit_memory(Setup& s) {
  Flags& f = s.flags;
  s.memory_line.clear();
  if (s.gpu) {
    size_t free = 0, total = 0;
    cuda_ok(cudaMemGetInfo(&free, &total));
    double need = device_bytes(f, s.plan);
    if (need > double(free) && !f.wgrad_dtype_given && f.config.wgrad_dtype == DType::fp32) {
      Flags bf16 = f;
      bf16.config.wgrad_dtype = DType::bf16;
      if (device_bytes(bf16, s.plan) <= double(free)) {
        s.wgrad_note = " (chosen: with fp32 weight gradients the GPU would need " + gib(need) + ", " + gib(double(free)) +
                       " free; --wgrad-dtype sets it)";
        f.config.wgrad_dtype = DType::bf16;
        need = device_bytes(f, s.plan);
      }
    }
    const std::string breakdown = str(f.ranks) + " virtual ranks x (" + gib(double(s.plan.total_device_bytes)) +
                                  " plan + " + gib(layer_tensor_bytes(f, s.plan)) + " layer tensors) + " +
                                  gib(kDeviceReserveBytes) + " reserve";
    if (need > double(free)) {
      throw FlagError("the layer does not fit on the GPU: it needs " + gib(need) + " (" + breakdown + "), " +
                      gib(double(free)) + " are free; " + sizes_hint(f) +
                      (f.config.wgrad_dtype == DType::fp32 ? ", or pass --wgrad-dtype bf16" : ""));
    }
    s.memory_line = "GPU " + gib(need) + " of " + gib(double(free)) + " free (" + breakdown + "); ";
  }
  const HostWork work{.inputs = !s.gpu || s.check == Check::full,
                      .engine = !s.gpu,
                      .gpu_results = s.gpu && s.check == Check::full,
                      .dense = s.check == Check::full,
                      .sampled = s.check == Check::sampled};
  const double need = host_bytes(f, s.plan, work), physical = physical_memory_bytes();
  if (need > physical) {
    std::string what = work.engine ? "the CPU reference engine (the whole layer in fp32 on the host)" : "the inputs";
    if (work.dense) what += " and the full float64 check";
    throw FlagError("the layer does not fit in host memory: about " + gib(need) + " for " + what + ", the machine has " +
                    gib(physical) + "; " + sizes_hint(f) + (work.dense ? ", or use --check sampled" : "") +
                    (work.engine ? " (an SM90 GPU runs large layers)" : ""));
  }
  s.memory_line += "host about " + gib(need) + " of " + gib(physical);
}

// Capacity mode without --capacity-factor: the smallest factor (in hundredths) this routing fits.
void size_capacity_from_routing(Setup& s) {
  Config& c = s.flags.config;
  if (c.balance != Balance::capacity || s.flags.capacity_factor_given) return;
  const int64_t rows_per_rank = c.num_local_input_tokens * c.top_k;
  const int64_t peak = *std::max_element(s.stats.computed_rows.begin(), s.stats.computed_rows.end());
  double factor = std::max(1.0, std::ceil(100.0 * double(peak) / double(rows_per_rank)) / 100.0);
  while (std::floor(factor * double(rows_per_rank)) < double(peak)) factor += 0.01;  // a rank takes floor(factor*T*K)
  c.receive_capacity_factor = factor;
  char note[200];
  std::snprintf(note, sizeof note,
                " (set from this routing: the busiest rank receives %lld rows = %.3f x T*K; --capacity-factor sets it)",
                static_cast<long long>(peak), double(peak) / double(rows_per_rank));
  s.capacity_note = note;
  s.plan = poise::plan_memory(c, s.ranks());
}

Setup prepare(const Flags& flags) {
  Setup s;
  s.flags = flags;
  s.plan = check_flags(s.flags);
  choose_device(s);
  choose_check(s);
  fit_memory(s);  // before the routing is drawn: its arrays grow with T too
  s.routing = ref::random_routing(s.config(), s.ranks(), inputs_spec(s.flags), s.options());
  s.stats = ref::routing_stats(s.config(), s.ranks(), s.routing.ids_TK, s.options());
  size_capacity_from_routing(s);
  fit_memory(s);  // the plan's receive rows may have grown
  return s;
}

// ---- printing --------------------------------------------------------------------------------------

std::string list(const std::vector<int64_t>& values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 16 && values.size() > 20) {
      s += " ... " + std::to_string(values.size() - 16) + " more";
      break;
    }
    if (i > 0) s += ' ';
    s += std::to_string(values[i]);
  }
  return s + "]";
}

void print_header(const Setup& s) {
  const Config& c = s.config();
  std::printf("Poise demo: one MoE layer, forward + backward, EP=%lld\n", static_cast<long long>(s.ranks()));
  std::printf("Device: %s\n", s.device_line.c_str());
  std::printf("Layer: activation=%s, scores %s, wgrad %s%s, routing skew %.2f, padding rows %lld, seed %llu\n",
              poise::to_string(c.activation), poise::to_string(s.flags.scores_dtype), poise::to_string(c.wgrad_dtype),
              s.wgrad_note.c_str(), s.flags.skew, static_cast<long long>(s.flags.padding_rows),
              static_cast<unsigned long long>(s.flags.seed));
  if (c.balance == Balance::capacity) {
    std::printf("Balance: capacity, receive capacity factor %.2f%s\n", c.receive_capacity_factor,
                s.capacity_note.c_str());
  }
  std::printf("Check: %s\n", s.check_line.c_str());
  std::printf("Memory: %s\n\n", s.memory_line.c_str());
  std::fputs(s.plan.explain().c_str(), stdout);
  std::printf("\n");
}

void print_balance(const Setup& s) {
  const ref::RoutingStats& st = s.stats;
  const Config& c = s.config();
  std::printf("Routing balance (rows = (token, k) pairs; T*K = %lld per rank):\n",
              static_cast<long long>(c.num_local_input_tokens * c.top_k));
  std::printf("  rows per rank before balancing  %s  peak/mean %.2f\n", list(st.owner_rows).c_str(),
              st.owner_peak_over_mean());
  std::printf("  rows per rank computed          %s  peak/mean %.2f\n", list(st.computed_rows).c_str(),
              st.computed_peak_over_mean());
  std::printf("  grouped rows (padded to %lld)    %s\n", static_cast<long long>(poise::kExpertRowAlignment),
              list(st.grouped_rows).c_str());
  std::printf("  token rows received per rank    %s  (a token crosses to a rank once)\n",
              list(st.received_token_rows).c_str());
  if (c.balance == Balance::exact) {
    std::printf("  replica experts per rank        %s\n", list(st.replicas).c_str());
    std::printf("  rows moved off their owner      %lld (surplus %lld)\n", static_cast<long long>(st.moved_rows),
                static_cast<long long>(st.surplus_rows));
    if (st.unplaced_surplus_rows > 0) {
      std::printf("  NOT EXACT: %lld surplus rows found no replica slot and stay on their owner\n",
                  static_cast<long long>(st.unplaced_surplus_rows));
    }
  }
}

// Capacity mode: a rank routed more rows than it may receive fails the run, before it starts.
bool capacity_overflows(const Setup& s) {
  const Config& c = s.config();
  if (c.balance != Balance::capacity) return false;
  const auto capacity =
      static_cast<int64_t>(std::floor(c.receive_capacity_factor * double(c.num_local_input_tokens * c.top_k)));
  for (int64_t r = 0; r < s.ranks(); ++r) {
    if (s.stats.computed_rows[r] > capacity) {
      std::printf("\nCapacity: %s\nresult: FAIL (raise --capacity-factor, leave it out to size it from the routing, or "
                  "use --balance exact)\n",
                  ref::CapacityExceeded(r, s.stats.computed_rows[r], capacity).what());
      return true;
    }
  }
  return false;
}

// ---- running ----------------------------------------------------------------------------------------

struct HostInputs {
  std::vector<ref::RankInputs> inputs;
  std::vector<std::vector<float>> grad_out;
};

// x and the weights from random_inputs, the routing the statistics were computed from.
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

// Results per rank as floats, wherever the layer ran.
struct HostResults {
  std::vector<std::vector<float>> out, grad_x, grad_scores, grad_w13, grad_w2;
};

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

inline constexpr int kTimedCalls = 5;

struct Events {
  cudaEvent_t e[3] = {};
  Events() {
    for (cudaEvent_t& event : e) cuda_ok(cudaEventCreate(&event));
  }
  ~Events() {
    for (cudaEvent_t event : e) cudaEventDestroy(event);
  }
  float ms(int from, int to) const {
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, e[from], e[to]));
    return ms;
  }
};

// Forward + backward through the public entry points: a warm-up call (allocates, loads modules),
// outputs poisoned, then kTimedCalls timed calls (CUDA events; the median is printed). The outputs
// are the last call's. Throws NotAvailable when the GPU path lacks a feature.
template <class Layer>
void time_on_gpu(const Setup& s, Layer& layer) {
  const Config& c = s.config();
  auto context = s.ranks() == 1 ? poise::Context::create(c, 1, 0) : poise::Context::create_virtual_ranks(c, s.ranks());
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream));
  const std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> stream_owner(stream, cudaStreamDestroy);
  const auto start = std::chrono::steady_clock::now();
  poise::routed_experts_forward(*context, layer.forward_args(), stream);
  poise::routed_experts_backward(*context, layer.backward_args(), stream);
  context->check(stream);
  const double warm_up_ms = milliseconds_since(start);
  layer.poison_outputs();
  std::vector<float> forward_ms, backward_ms;
  const Events events;
  for (int i = 0; i < kTimedCalls; ++i) {
    cuda_ok(cudaEventRecord(events.e[0], stream));
    poise::routed_experts_forward(*context, layer.forward_args(), stream);
    cuda_ok(cudaEventRecord(events.e[1], stream));
    poise::routed_experts_backward(*context, layer.backward_args(), stream);
    cuda_ok(cudaEventRecord(events.e[2], stream));
    context->check(stream);
    forward_ms.push_back(events.ms(0, 1));
    backward_ms.push_back(events.ms(1, 2));
  }
  std::sort(forward_ms.begin(), forward_ms.end());
  std::sort(backward_ms.begin(), backward_ms.end());
  std::printf("\nTime (GPU, %lld virtual ranks on one GPU, CUDA events, median of %d calls after a warm-up of "
              "%.0f ms): forward %.3f ms, backward %.3f ms\n",
              static_cast<long long>(s.ranks()), kTimedCalls, warm_up_ms, forward_ms[kTimedCalls / 2],
              backward_ms[kTimedCalls / 2]);
}

// ---- checks -----------------------------------------------------------------------------------------

int finish(bool pass) {
  std::printf("result: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int report_unchecked() {
  std::printf("\nCheck: none (--check none)\nresult: not checked\n");
  return 0;
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

// Row t of rank r of one output, wherever the layer ran.
using RowFn = std::function<std::vector<float>(int64_t rank, int64_t t)>;
struct SampledGot {
  RowFn out, grad_x, grad_scores;
};

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

RowFn rows_of(const std::vector<std::vector<float>>& per_rank, int64_t width) {
  return [&per_rank, width](int64_t r, int64_t t) {
    return std::vector<float>(per_rank[r].begin() + t * width, per_rank[r].begin() + (t + 1) * width);
  };
}

int check_host_results(const Setup& s, const char* what, const HostResults& got, const HostInputs& h) {
  if (s.check == Check::none) return report_unchecked();
  if (s.check == Check::full) return check_full(s, what, got, h);
  const int64_t D = s.config().hidden_dim, K = s.config().top_k;
  return check_sampled(s, what, ref::sample_tokens(s.config(), s.ranks(), h.inputs, h.grad_out, s.sampled_tokens),
                       ref::expert_weights_from(s.config(), s.ranks(), h.inputs),
                       {rows_of(got.out, D), rows_of(got.grad_x, D), rows_of(got.grad_scores, K)});
}

int run_cpu(const Setup& s) {
  const HostInputs h = make_host_inputs(s);
  return check_host_results(s, "CPU reference", run_engine(s, h), h);
}

// Full check: the host's inputs uploaded; when the GPU path lacks a feature, the CPU engine's results.
int run_gpu_full(const Setup& s) {
  const HostInputs h = make_host_inputs(s);
  poise::DeviceLayer layer(s.config(), s.ranks(), h.inputs, h.grad_out, s.flags.scores_dtype);
  try {
    time_on_gpu(s, layer);
  } catch (const poise::NotAvailable& e) {
    std::printf("GPU path: not available for this configuration: %s\n", e.what());
    return check_host_results(s, "CPU reference", run_engine(s, h), h);
  }
  return check_host_results(s, "GPU",
                            {layer.out_TD(), layer.grad_x_TD(), layer.grad_scores_TK(), layer.grad_w13(),
                             layer.grad_w2()},
                            h);
}

std::vector<ref::SampledToken> sampled_tokens_of(const Setup& s, const poise::SyntheticLayer& layer) {
  const int64_t K = s.config().top_k;
  std::vector<ref::SampledToken> tokens;
  for (int64_t r = 0; r < s.ranks(); ++r) {
    const std::vector<int32_t>& ids = s.routing.ids_TK[r];
    const std::vector<float>& scores = s.routing.scores_TK[r];
    for (int64_t t : s.sampled_tokens[r]) {
      tokens.push_back({r, t, layer.x_row(r, t), std::vector<int32_t>(ids.begin() + t * K, ids.begin() + (t + 1) * K),
                        std::vector<float>(scores.begin() + t * K, scores.begin() + (t + 1) * K),
                        layer.grad_out_row(r, t)});
    }
  }
  return tokens;
}

// Sampled or no check: x, the weights and grad_out generated on the GPU, nothing large on the host.
int run_gpu_generated(const Setup& s) {
  const auto start = std::chrono::steady_clock::now();
  poise::SyntheticLayer layer(s.config(), s.ranks(), s.routing.ids_TK, s.routing.scores_TK, s.flags.scores_dtype,
                              s.flags.seed);
  std::printf("\nInputs: x, weights and grad_out generated on the GPU from the seed, routing drawn on the host, "
              "%.1f ms\n",
              milliseconds_since(start));
  try {
    time_on_gpu(s, layer);
  } catch (const poise::NotAvailable& e) {
    std::printf("GPU path: not available for this configuration: %s\nresult: FAIL (--device cpu runs the CPU "
                "reference engine)\n",
                e.what());
    return 1;
  }
  if (s.check == Check::none) return report_unchecked();
  const auto row = [&layer](auto method) {
    return [&layer, method](int64_t r, int64_t t) { return (layer.*method)(r, t); };
  };
  return check_sampled(
      s, "GPU", sampled_tokens_of(s, layer),
      [&layer](int64_t e, std::vector<float>& w13, std::vector<float>& w2) { layer.expert_weights(e, w13, w2); },
      {row(&poise::SyntheticLayer::out_row), row(&poise::SyntheticLayer::grad_x_row),
       row(&poise::SyntheticLayer::grad_scores_row)});
}

int run(const Setup& s) {
  print_header(s);
  print_balance(s);
  if (capacity_overflows(s)) return 1;
  if (!s.gpu) return run_cpu(s);
  return s.check == Check::full ? run_gpu_full(s) : run_gpu_generated(s);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is printed, also into a pipe
  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const FlagError& e) {
    std::fprintf(stderr, "poise_demo: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (flags.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  Setup setup;
  try {
    setup = prepare(flags);
  } catch (const FlagError& e) {
    std::fprintf(stderr, "poise_demo: %s\n", e.what());
    return 2;
  } catch (const poise::InvalidArgument& e) {
    std::fprintf(stderr, "poise_demo: invalid argument: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "poise_demo: error: %s\n", e.what());
    return 1;
  }
  try {
    return run(setup);
  } catch (const poise::InvalidArgument& e) {
    std::fprintf(stderr, "poise_demo: invalid argument: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "poise_demo: error: %s\n", e.what());
    return 1;
  }
}
