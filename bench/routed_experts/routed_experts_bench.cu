// routed_experts_bench: the product path through the public C++ API only (poise/poise.hpp), one rank.
//
// Four cases: the DeepSeek-V3 EP8 rank shape and Qwen3-30B-A3B, each with balanced routing and
// routing of peak/mean ~3 rows per expert. Per case, forward and forward+backward on one stream,
// each call timed with CUDA events from an idle GPU, medians of --repeats calls after a warm-up.
// Only the public API is used so that the same file builds against an older libpoise and the two
// libraries can be timed side by side in one device call.
//
//   routed_experts_bench OUT.json [--label NAME] [--repeats N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <poise/poise.hpp>

namespace {

#define CUDA_CHECK(expr)                                                                                     \
  do {                                                                                                       \
    const cudaError_t status_ = (expr);                                                                      \
    if (status_ != cudaSuccess) {                                                                            \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(status_) + " (" + __FILE__ + \
                               ":" + std::to_string(__LINE__) + ")");                                        \
    }                                                                                                        \
  } while (0)

struct Shape {
  const char* name;
  int64_t T, D, F, E, K;
};

constexpr Shape kShapes[] = {
    {"deepseek_v3_ep8_rank", 4096, 7168, 2048, 32, 8},
    {"qwen3_30b_a3b", 8192, 2048, 768, 128, 8},
};
constexpr double kSkews[] = {1.0, 3.0};  // target peak/mean rows per expert; <= 1: balanced
constexpr int kWarmupCalls = 5;

// ---------------------------------------------------------------- device inputs

__device__ uint64_t mix(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ float uniform01(uint64_t i, uint64_t seed) {  // (0, 1]
  return (float((mix((i + 1) * 0x9E3779B97F4A7C15ull ^ seed) >> 40)) + 1.0f) / float(1ull << 24);
}

__device__ float normal(uint64_t i, uint64_t seed) {  // Box-Muller on two hashed uniforms
  const float r = sqrtf(-2.0f * logf(uniform01(2 * i, seed)));
  return r * cospif(2.0f * uniform01(2 * i + 1, seed));
}

__global__ void fill_normal_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16(scale * normal(i, seed));
  }
}

// A router's top-k probabilities: a softmax over K normal logits per token (positive, sum 1).
__global__ void fill_scores(float* scores_TK, int64_t T, int64_t K, uint64_t seed) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < T; t += int64_t(gridDim.x) * blockDim.x) {
    float* row = scores_TK + t * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; ++k) sum += row[k] = expf(normal(uint64_t(t * K + k), seed));
    for (int64_t k = 0; k < K; ++k) row[k] /= sum;
  }
}

// Elements of a bf16 buffer that are not finite (outputs are poisoned with NaN before the last call).
__global__ void count_nonfinite(const __nv_bfloat16* p, size_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    mine += !isfinite(__bfloat162float(p[i]));
  }
  if (mine) atomicAdd(count, mine);
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, count * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void normal_bf16(DeviceBuffer<__nv_bfloat16>& b, uint64_t seed, float scale) {
  fill_normal_bf16<<<1024, 256>>>(b.ptr, b.n, seed, scale);
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- routing (host)

// ids [T, K], distinct experts per token, drawn without replacement with weights (rank+1)^-s over a
// random order of the experts (s = 0: uniform); returns the peak/mean rows per expert.
double sample_routing(int64_t T, int64_t E, int64_t K, double s, std::mt19937_64& rng, std::vector<int32_t>& ids) {
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> weight(E);
  for (int64_t r = 0; r < E; ++r) weight[order[r]] = std::pow(double(r + 1), -s);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::pair<double, int32_t>> keys(E);
  std::vector<int64_t> counts(E, 0);
  ids.assign(T * K, 0);
  for (int64_t t = 0; t < T; ++t) {
    // Efraimidis-Spirakis: the K largest u^(1/w) are a weighted sample without replacement.
    for (int32_t e = 0; e < E; ++e) keys[e] = {std::log(1.0 - u(rng)) / weight[e], e};
    std::partial_sort(keys.begin(), keys.begin() + K, keys.end(), std::greater<>());
    for (int64_t k = 0; k < K; ++k) {
      ids[t * K + k] = keys[k].second;
      ++counts[keys[k].second];
    }
  }
  const double peak = double(*std::max_element(counts.begin(), counts.end()));
  return peak / (double(T * K) / double(E));
}

// The bench's routing: balanced (uniform) for target <= 1, else the exponent bisected so that
// peak/mean comes closest to the target (as bench.py's make_routing).
double make_routing(int64_t T, int64_t E, int64_t K, double target, std::vector<int32_t>& ids) {
  std::mt19937_64 rng(1234);
  double best = sample_routing(T, E, K, 0.0, rng, ids);
  if (target <= 1.0) return best;
  std::vector<int32_t> trial;
  double lo = 0.0, hi = 4.0;
  for (int i = 0; i < 14; ++i) {
    const double mid = 0.5 * (lo + hi);
    const double skew = sample_routing(T, E, K, mid, rng, trial);
    if (std::abs(skew - target) < std::abs(best - target)) {
      best = skew;
      ids.swap(trial);
    }
    (skew < target ? lo : hi) = mid;
  }
  return best;
}

// ---------------------------------------------------------------- one case

struct CaseResult {
  std::string shape, routing;
  Shape dims;
  double skew = 0;
  std::vector<float> fwd_ms, fwdbwd_ms;
};

// As bench.py names them: "balanced", "peak/mean~3".
std::string routing_name(double target_skew) {
  if (target_skew <= 1.0) return "balanced";
  char text[32];
  std::snprintf(text, sizeof text, "peak/mean~%g", target_skew);
  return text;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (double(v[n / 2 - 1]) + double(v[n / 2]));
}

// One rank, capacity balance with factor 1: a single rank receives exactly its own T*K rows
// whatever the skew, so this fits every routing without the exact-balance planner's work.
poise::Config config_of(const Shape& s) {
  poise::Config c;
  c.num_local_input_tokens = s.T;
  c.hidden_dim = s.D;
  c.intermediate_dim = s.F;
  c.num_experts = s.E;
  c.top_k = s.K;
  c.balance = poise::Balance::capacity;
  c.receive_capacity_factor = 1.0;
  return c;
}

class Layer {
 public:
  Layer(const Shape& s, const std::vector<int32_t>& ids)
      : x_(s.T * s.D), w13_(s.E * 2 * s.F * s.D), w2_(s.E * s.D * s.F), out_(s.T * s.D), grad_out_(s.T * s.D),
        grad_x_(s.T * s.D), grad_w13_(w13_.n), grad_w2_(w2_.n), ids_(s.T * s.K), scores_(s.T * s.K),
        grad_scores_(s.T * s.K) {
    normal_bf16(x_, 1, 1.0f);
    normal_bf16(w13_, 2, 1.0f / std::sqrt(float(s.D)));
    normal_bf16(w2_, 3, 1.0f / std::sqrt(float(s.F)));
    normal_bf16(grad_out_, 4, 1.0f);
    fill_scores<<<256, 256>>>(scores_.ptr, s.T, s.K, 5);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemcpy(ids_.ptr, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  poise::ForwardArgs forward_args() const {
    poise::ForwardArgs a;
    a.x_TD = x_.ptr;
    a.ids_TK = ids_.ptr;
    a.scores_TK = scores_.ptr;
    a.scores_dtype = poise::DType::fp32;
    a.w13 = w13_.ptr;
    a.w2 = w2_.ptr;
    a.out_TD = out_.ptr;
    return a;
  }

  // Weight grads in the weights' bf16, as PyTorch autograd asks for them (bench.py's path).
  poise::BackwardArgs backward_args() const {
    poise::BackwardArgs a;
    a.forward = forward_args();
    a.grad_out_TD = grad_out_.ptr;
    a.grad_x_TD = grad_x_.ptr;
    a.grad_scores_TK = grad_scores_.ptr;
    a.grad_w13 = grad_w13_.ptr;
    a.grad_w2 = grad_w2_.ptr;
    a.wgrad_dtype = poise::DType::bf16;
    return a;
  }

  void poison_outputs(cudaStream_t stream) {
    for (auto* b : {&out_, &grad_x_}) {
      CUDA_CHECK(cudaMemsetAsync(b->ptr, 0xFF, b->n * sizeof(__nv_bfloat16), stream));  // bf16 NaN
    }
  }

  unsigned long long nonfinite_outputs(cudaStream_t stream) {
    DeviceBuffer<unsigned long long> count(1);
    CUDA_CHECK(cudaMemsetAsync(count.ptr, 0, sizeof(unsigned long long), stream));
    for (auto* b : {&out_, &grad_x_}) count_nonfinite<<<1024, 256, 0, stream>>>(b->ptr, b->n, count.ptr);
    CUDA_CHECK(cudaGetLastError());
    unsigned long long host = 0;
    CUDA_CHECK(cudaMemcpyAsync(&host, count.ptr, sizeof host, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return host;
  }

 private:
  DeviceBuffer<__nv_bfloat16> x_, w13_, w2_, out_, grad_out_, grad_x_, grad_w13_, grad_w2_;
  DeviceBuffer<int32_t> ids_;
  DeviceBuffer<float> scores_, grad_scores_;
};

class EventTimer {
 public:
  EventTimer() {
    CUDA_CHECK(cudaEventCreate(&start_));
    CUDA_CHECK(cudaEventCreate(&end_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(end_);
  }
  // ms of one call of fn on stream, started on an idle GPU.
  template <typename Fn>
  float time(cudaStream_t stream, Fn&& fn) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaEventRecord(start_, stream));
    fn();
    CUDA_CHECK(cudaEventRecord(end_, stream));
    CUDA_CHECK(cudaEventSynchronize(end_));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_, end_));
    return ms;
  }

 private:
  cudaEvent_t start_, end_;
};

CaseResult run_case(const Shape& s, double target_skew, int repeats, cudaStream_t stream) {
  CaseResult r;
  r.shape = s.name;
  r.dims = s;
  r.routing = routing_name(target_skew);
  std::vector<int32_t> ids;
  r.skew = make_routing(s.T, s.E, s.K, target_skew, ids);

  Layer layer(s, ids);
  const std::unique_ptr<poise::Context> context = poise::Context::create(config_of(s), 1, 0);
  const poise::ForwardArgs fwd = layer.forward_args();
  const poise::BackwardArgs bwd = layer.backward_args();
  auto forward = [&] { poise::routed_experts_forward(*context, fwd, stream); };
  auto forward_backward = [&] {
    poise::routed_experts_forward(*context, fwd, stream);
    poise::routed_experts_backward(*context, bwd, stream);
  };
  for (int i = 0; i < kWarmupCalls; ++i) forward_backward();  // the first call allocates
  context->check(stream);

  EventTimer timer;
  for (int i = 0; i < repeats; ++i) {  // interleaved, so drift of the card hits both alike
    r.fwd_ms.push_back(timer.time(stream, forward));
    r.fwdbwd_ms.push_back(timer.time(stream, forward_backward));
  }
  context->check(stream);

  // An output the calls stopped writing would keep its NaN poison.
  layer.poison_outputs(stream);
  forward_backward();
  context->check(stream);
  if (const unsigned long long bad = layer.nonfinite_outputs(stream)) {
    throw std::runtime_error(std::string(s.name) + " " + r.routing + ": " + std::to_string(bad) +
                             " non-finite elements in out_TD / grad_x_TD");
  }
  return r;
}

// ---------------------------------------------------------------- output

double fwd_flops(const Shape& s) { return 6.0 * double(s.T * s.K) * double(s.D) * double(s.F); }

std::string json_string(const std::string& text) {
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') quoted += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) quoted += c;
  }
  return quoted + "\"";
}

void write_list(FILE* f, const std::vector<float>& v) {
  std::fputc('[', f);
  for (size_t i = 0; i < v.size(); ++i) std::fprintf(f, "%s%.5f", i ? ", " : "", v[i]);
  std::fputc(']', f);
}

void write_json(const std::string& path, const std::string& label, const std::string& device, int repeats,
                const std::vector<CaseResult>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot open " + path + " for writing");
  std::fprintf(f, "{\n \"benchmark\": \"routed_experts_bench\",\n \"label\": %s,\n \"device\": %s,\n",
               json_string(label).c_str(), json_string(device).c_str());
  std::fprintf(f,
               " \"repeats\": %d,\n \"timing\": \"each call from an idle GPU (CUDA events), fwd and fwdbwd "
               "interleaved, medians after %d warm-up calls; one rank, balance capacity, factor 1; bf16 weight "
               "grads\",\n \"cases\": [",
               repeats, kWarmupCalls);
  for (size_t i = 0; i < results.size(); ++i) {
    const CaseResult& r = results[i];
    const Shape& s = r.dims;
    const double fwd = median(r.fwd_ms), fwdbwd = median(r.fwdbwd_ms);
    std::fprintf(f, "%s\n  {\"shape\": \"%s\", \"routing\": \"%s\", \"skew\": %.3f, \"T\": %lld, \"D\": %lld, "
                 "\"F\": %lld, \"E\": %lld, \"K\": %lld,\n   \"fwd_ms\": %.5f, \"fwdbwd_ms\": %.5f, "
                 "\"fwd_tflops\": %.2f, \"fwdbwd_tflops\": %.2f,\n   \"fwd_ms_repeats\": ",
                 i ? "," : "", r.shape.c_str(), r.routing.c_str(), r.skew, (long long)s.T, (long long)s.D,
                 (long long)s.F, (long long)s.E, (long long)s.K, fwd, fwdbwd, fwd_flops(s) / fwd / 1e9,
                 3 * fwd_flops(s) / fwdbwd / 1e9);
    write_list(f, r.fwd_ms);
    std::fprintf(f, ",\n   \"fwdbwd_ms_repeats\": ");
    write_list(f, r.fwdbwd_ms);
    std::fputc('}', f);
  }
  std::fprintf(f, "\n ]\n}\n");
  if (std::fclose(f) != 0) throw std::runtime_error("writing " + path + " failed");
}

void print_table(const std::string& label, const std::vector<CaseResult>& results) {
  std::printf("\n[%s]\n%-22s %-14s %5s %9s %11s %9s %11s\n", label.c_str(), "shape", "routing", "skew", "fwd ms",
              "fwd TF/s", "fwdbwd ms", "fwdbwd TF/s");
  for (const CaseResult& r : results) {
    const double fwd = median(r.fwd_ms), fwdbwd = median(r.fwdbwd_ms);
    std::printf("%-22s %-14s %5.2f %9.3f %11.0f %9.3f %11.0f\n", r.shape.c_str(), r.routing.c_str(), r.skew, fwd,
                fwd_flops(r.dims) / fwd / 1e9, fwdbwd, 3 * fwd_flops(r.dims) / fwdbwd / 1e9);
  }
}

struct Args {
  std::string out, label;
  int repeats = 20;
};

Args parse_args(int argc, char** argv) {
  Args a;
  const std::string usage = "usage: routed_experts_bench OUT.json [--label NAME] [--repeats N]";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--label" || arg == "--repeats") && i + 1 >= argc) {
      throw std::invalid_argument(arg + ": missing value\n" + usage);
    }
    if (arg == "--label") {
      a.label = argv[++i];
    } else if (arg == "--repeats") {
      a.repeats = std::atoi(argv[++i]);
      if (a.repeats < 1) throw std::invalid_argument("--repeats must be at least 1\n" + usage);
    } else if (arg.rfind("--", 0) == 0 || !a.out.empty()) {
      throw std::invalid_argument("unexpected argument " + arg + "\n" + usage);
    } else {
      a.out = arg;
    }
  }
  if (a.out.empty()) throw std::invalid_argument(usage);
  if (a.label.empty()) {
    const std::string self = argv[0];
    a.label = self.substr(self.find_last_of('/') + 1);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("[%s] %s, %d repeats\n", args.label.c_str(), prop.name, args.repeats);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<CaseResult> results;
    for (const Shape& s : kShapes) {
      for (const double skew : kSkews) {
        results.push_back(run_case(s, skew, args.repeats, stream));
        const CaseResult& r = results.back();
        std::printf("%s %s (skew %.2f): fwd %.3f ms, fwdbwd %.3f ms\n", r.shape.c_str(), r.routing.c_str(), r.skew,
                    median(r.fwd_ms), median(r.fwdbwd_ms));
        std::fflush(stdout);
      }
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    write_json(args.out, args.label, prop.name, args.repeats, results);
    print_table(args.label, results);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "routed_experts_bench [%s]: %s\n", args.label.c_str(), e.what());
    return 1;
  }
}
