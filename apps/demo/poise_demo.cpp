// poise_demo: the main job in one command. One MoE layer (routed experts) forward + backward across
// R expert-parallel ranks: prints the memory plan, the routing balance, the time, and the check of
// every output against a float64 computation. Exit code 0 = PASS, 1 = FAIL, 2 = bad arguments.
//
// Where: with an SM90 GPU (and --device auto|gpu) the layer runs through the public entry points
// (Context + routed_experts) with R virtual ranks on that GPU; the CPU reference engine (R threads)
// always runs too, for the routing statistics and as a second opinion. Without a GPU, or when the GPU
// path lacks a feature (it says which), the CPU reference engine's results are the ones checked.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <optional>

#include "runtime/device_info.hpp"
#include "testing/device_layer.hpp"
#include "poise/context.hpp"
#include "poise/memory_plan.hpp"
#include "poise/reference.hpp"

namespace {

using poise::reference::RoutingStats;

struct Flags {
  poise::Config config;
  int64_t ranks = 4;
  double skew = 3.0;
  uint64_t seed = 1;
  int64_t padding_rows = 0;
  poise::DType scores_dtype = poise::DType::fp32;
  double tolerance = 1e-2;
  std::string device = "auto";
};

const char* kUsage =
    "usage: poise_demo [flags]   (every flag is optional)\n"
    "  --tokens T            tokens per rank (64)\n"
    "  --hidden D            hidden size, a multiple of 64 (256)\n"
    "  --intermediate F      expert intermediate size, a multiple of 64 (128)\n"
    "  --experts E           routed experts, divisible by R (16)\n"
    "  --topk K              experts per token (4)\n"
    "  --ranks R             expert-parallel ranks (4)\n"
    "  --skew S              target peak/mean of rows per rank before balancing, >= 1 (3; 1 = uniform)\n"
    "  --balance MODE        exact | capacity (exact)\n"
    "  --capacity-factor C   capacity mode: rows a rank may receive, x T*K (2)\n"
    "  --activation A        swiglu | swiglu_clamped (swiglu)\n"
    "  --scores-dtype DT     fp32 | bf16 (fp32)\n"
    "  --wgrad-dtype DT      fp32 | bf16 (fp32)\n"
    "  --padding-rows N      last N tokens of each rank are padding (zero scores) (0)\n"
    "  --seed N              random inputs (1)\n"
    "  --tolerance X         relative error bound of the float64 check (0.01)\n"
    "  --device WHERE        auto | gpu | cpu (auto: the GPU when an SM90 GPU is present)\n";

int64_t parse_int(const std::string& flag, const std::string& value) {
  size_t used = 0;
  const long long v = std::stoll(value, &used);
  if (used != value.size()) throw std::invalid_argument(flag + ": not an integer: " + value);
  return v;
}

double parse_double(const std::string& flag, const std::string& value) {
  size_t used = 0;
  const double v = std::stod(value, &used);
  if (used != value.size()) throw std::invalid_argument(flag + ": not a number: " + value);
  return v;
}

Flags parse(int argc, char** argv) {
  Flags f;
  poise::Config& c = f.config;
  c.num_local_input_tokens = 64;
  c.hidden_dim = 256;
  c.intermediate_dim = 128;
  c.num_experts = 16;
  c.top_k = 4;
  const std::map<std::string, std::function<void(const std::string&, const std::string&)>> setters = {
      {"--tokens", [&](auto& k, auto& v) { c.num_local_input_tokens = parse_int(k, v); }},
      {"--hidden", [&](auto& k, auto& v) { c.hidden_dim = parse_int(k, v); }},
      {"--intermediate", [&](auto& k, auto& v) { c.intermediate_dim = parse_int(k, v); }},
      {"--experts", [&](auto& k, auto& v) { c.num_experts = parse_int(k, v); }},
      {"--topk", [&](auto& k, auto& v) { c.top_k = parse_int(k, v); }},
      {"--ranks", [&](auto& k, auto& v) { f.ranks = parse_int(k, v); }},
      {"--skew", [&](auto& k, auto& v) { f.skew = parse_double(k, v); }},
      {"--balance", [&](auto&, auto& v) { c.balance = poise::balance_from_string(v); }},
      {"--capacity-factor", [&](auto& k, auto& v) { c.receive_capacity_factor = parse_double(k, v); }},
      {"--activation", [&](auto&, auto& v) { c.activation = poise::activation_from_string(v); }},
      {"--scores-dtype", [&](auto&, auto& v) { f.scores_dtype = poise::dtype_from_string(v, "scores_dtype"); }},
      {"--wgrad-dtype", [&](auto&, auto& v) { c.wgrad_dtype = poise::dtype_from_string(v, "wgrad_dtype"); }},
      {"--padding-rows", [&](auto& k, auto& v) { f.padding_rows = parse_int(k, v); }},
      {"--seed", [&](auto& k, auto& v) { f.seed = static_cast<uint64_t>(parse_int(k, v)); }},
      {"--device", [&](auto& k, auto& v) {
         if (v != "auto" && v != "gpu" && v != "cpu") throw std::invalid_argument(k + " must be auto, gpu or cpu");
         f.device = v;
       }},
      {"--tolerance", [&](auto& k, auto& v) { f.tolerance = parse_double(k, v); }},
  };
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw std::invalid_argument(flag + ": missing value");
    }
    const auto setter = setters.find(flag);
    if (setter == setters.end()) throw std::invalid_argument("unknown flag " + flag);
    setter->second(flag, value);
  }
  return f;
}

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

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void print_balance(const RoutingStats& s, int64_t rows_per_rank, poise::Balance balance) {
  std::printf("Routing balance (rows = (token, k) pairs; T*K = %lld per rank):\n", static_cast<long long>(rows_per_rank));
  std::printf("  rows per rank before balancing  %s  peak/mean %.2f\n", list(s.owner_rows).c_str(),
              s.owner_peak_over_mean());
  std::printf("  rows per rank computed          %s  peak/mean %.2f\n", list(s.computed_rows).c_str(),
              s.computed_peak_over_mean());
  std::printf("  grouped rows (padded to %lld)    %s\n", static_cast<long long>(poise::kExpertRowAlignment),
              list(s.grouped_rows).c_str());
  std::printf("  token rows received per rank    %s  (a token crosses to a rank once)\n",
              list(s.received_token_rows).c_str());
  if (balance == poise::Balance::exact) {
    std::printf("  replica experts per rank        %s\n", list(s.replicas).c_str());
    std::printf("  rows moved off their owner      %lld (surplus %lld)\n", static_cast<long long>(s.moved_rows),
                static_cast<long long>(s.surplus_rows));
    if (s.unplaced_surplus_rows > 0) {
      std::printf("  NOT EXACT: %lld surplus rows found no replica slot and stay on their owner\n",
                  static_cast<long long>(s.unplaced_surplus_rows));
    }
  }
}

// The layer's results as the checks read them, wherever it ran.
struct LayerResults {
  std::vector<std::vector<float>> out, grad_x, grad_scores, grad_w13, grad_w2;
  double forward_ms = 0, backward_ms = 0;
};

void cuda_ok(cudaError_t status) {
  if (status != cudaSuccess) throw poise::DeviceError(cudaGetErrorString(status));
}

// Runs forward + backward through the public entry points on the GPU: one warm-up call, outputs
// poisoned, then the timed call (CUDA events). nullopt when the GPU path lacks a needed feature.
std::optional<LayerResults> run_on_gpu(const Flags& f, const std::vector<poise::reference::RankInputs>& inputs,
                                       const std::vector<std::vector<float>>& grad_out) {
  const poise::Config& c = f.config;
  try {
    auto context = f.ranks == 1 ? poise::Context::create(c, 1, 0) : poise::Context::create_virtual_ranks(c, f.ranks);
    poise::DeviceLayer layer(c, f.ranks, inputs, grad_out, f.scores_dtype);
    cudaStream_t stream;
    cuda_ok(cudaStreamCreate(&stream));
    poise::routed_experts_forward(*context, layer.forward_args(), stream);  // warm-up (allocates, loads modules)
    poise::routed_experts_backward(*context, layer.backward_args(), stream);
    context->check(stream);
    layer.poison_outputs();
    cudaEvent_t events[3];
    for (cudaEvent_t& e : events) cuda_ok(cudaEventCreate(&e));
    cuda_ok(cudaEventRecord(events[0], stream));
    poise::routed_experts_forward(*context, layer.forward_args(), stream);
    cuda_ok(cudaEventRecord(events[1], stream));
    poise::routed_experts_backward(*context, layer.backward_args(), stream);
    cuda_ok(cudaEventRecord(events[2], stream));
    context->check(stream);
    LayerResults r;
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, events[0], events[1]));
    r.forward_ms = ms;
    cuda_ok(cudaEventElapsedTime(&ms, events[1], events[2]));
    r.backward_ms = ms;
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    cudaStreamDestroy(stream);
    r.out = layer.out_TD();
    r.grad_x = layer.grad_x_TD();
    r.grad_scores = layer.grad_scores_TK();
    r.grad_w13 = layer.grad_w13();
    r.grad_w2 = layer.grad_w2();
    return r;
  } catch (const poise::NotAvailable& e) {
    std::printf("GPU path: not available for this configuration: %s\n", e.what());
    return std::nullopt;
  }
}

int run(const Flags& f) {
  namespace ref = poise::reference;
  const poise::Config& c = f.config;
  const poise::MemoryPlan plan = poise::plan_memory(c, f.ranks);  // validates the Config

  std::printf("Poise demo: one MoE layer, forward + backward, EP=%lld\n", static_cast<long long>(f.ranks));
  const int devices = poise::cuda_device_count();
  const bool sm90 = devices > 0 && poise::is_sm90_device(0);
  const bool use_gpu = f.device == "gpu" || (f.device == "auto" && sm90);
  if (f.device == "gpu" && !sm90) throw poise::DeviceError("--device gpu: no SM90 GPU present");
  if (use_gpu) {
    std::printf("Device: SM90 GPU; the layer runs through Context + routed_experts with %lld virtual ranks on it, "
                "and on the CPU reference engine (%lld threads).\n",
                static_cast<long long>(f.ranks), static_cast<long long>(f.ranks));
  } else {
    std::printf("Device: %s; running the CPU reference engine with %lld virtual ranks (threads).\n",
                devices > 0 ? "a CUDA device that is not SM90, or --device cpu" : "no CUDA device",
                static_cast<long long>(f.ranks));
  }
  std::printf("Layer: activation=%s, scores %s, wgrad %s, routing skew %.2f, padding rows %lld, seed %llu\n\n",
              poise::to_string(c.activation), poise::to_string(f.scores_dtype), poise::to_string(c.wgrad_dtype),
              f.skew, static_cast<long long>(f.padding_rows), static_cast<unsigned long long>(f.seed));
  std::fputs(plan.explain().c_str(), stdout);
  std::printf("\n");

  ref::Options options;
  options.scores_dtype = f.scores_dtype;
  options.replica_slots = plan.num_replica_slots;
  const auto inputs = ref::random_inputs(c, f.ranks, {.seed = f.seed, .skew = f.skew, .padding_rows = f.padding_rows},
                                         options);
  const auto grad_out = ref::random_grad_out(c, f.ranks, f.seed + 1);

  ref::Engine engine(c, f.ranks, options);
  auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<float>> out;
  try {
    out = engine.forward(inputs);
  } catch (const ref::CapacityExceeded& e) {
    std::printf("Forward: %s\nresult: FAIL (raise --capacity-factor or use --balance exact)\n", e.what());
    return 1;
  }
  const double forward_ms = milliseconds_since(start);
  start = std::chrono::steady_clock::now();
  std::vector<ref::RankGradients> grads;
  engine.backward(inputs, grad_out, grads);
  const double backward_ms = milliseconds_since(start);

  print_balance(engine.routing_stats(), c.num_local_input_tokens * c.top_k, c.balance);
  std::printf("\nTime (CPU reference, %lld threads): forward %.1f ms, backward %.1f ms\n",
              static_cast<long long>(f.ranks), forward_ms, backward_ms);
  LayerResults results{out, {}, {}, {}, {}, forward_ms, backward_ms};
  for (const ref::RankGradients& g : grads) {
    results.grad_x.push_back(g.grad_x_TD);
    results.grad_scores.push_back(g.grad_scores_TK);
    results.grad_w13.push_back(g.grad_w13);
    results.grad_w2.push_back(g.grad_w2);
  }
  const char* checked = "CPU reference";
  if (use_gpu) {
    if (std::optional<LayerResults> gpu = run_on_gpu(f, inputs, grad_out)) {
      std::printf("Time (GPU, %lld virtual ranks on one GPU, CUDA events): forward %.3f ms, backward %.3f ms\n",
                  static_cast<long long>(f.ranks), gpu->forward_ms, gpu->backward_ms);
      results = std::move(*gpu);
      checked = "GPU";
    }
  }

  start = std::chrono::steady_clock::now();
  const ref::DenseFloat64Result want = ref::dense_float64(c, f.ranks, inputs, grad_out, options);
  std::printf("\nCheck of the %s results against float64 (dense formulation, %.1f ms): relative L2 error, "
              "bound %.0e\n", checked, milliseconds_since(start), f.tolerance);
  const struct {
    const char* name;
    double error;
  } checks[] = {
      {"out", ref::relative_error(results.out, want.out_TD)},
      {"grad_x", ref::relative_error(results.grad_x, want.grad_x_TD)},
      {"grad_scores", ref::relative_error(results.grad_scores, want.grad_scores_TK)},
      {"grad_w13", ref::relative_error(results.grad_w13, want.grad_w13)},
      {"grad_w2", ref::relative_error(results.grad_w2, want.grad_w2)},
  };
  bool pass = true;
  for (const auto& check : checks) {
    const bool ok = check.error < f.tolerance;  // false for NaN
    pass = pass && ok;
    std::printf("  %-12s %.3e  %s\n", check.name, check.error, ok ? "PASS" : "FAIL");
  }
  std::printf("result: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  try {
    flags = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "poise_demo: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    return run(flags);
  } catch (const poise::InvalidArgument& e) {
    std::fprintf(stderr, "poise_demo: invalid argument: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "poise_demo: error: %s\n", e.what());
    return 1;
  }
}
