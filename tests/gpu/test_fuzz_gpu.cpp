// GPU fuzz: random layers through the public entry points, forward and backward, against the CPU
// reference engine. Each case draws its shape (T from 1 to 300, odd and even; D and F multiples of
// 64, 64 x odd included; E in [4, 64] divisible by R; K in [1, min(8, E)]), R in {1, 2, 4, 8}
// virtual ranks, the balance mode (capacity with a factor the routing fits, tight or not; exact
// with a random tolerance), the activation, dtypes and W13 layout, and a routing: random (skewed)
// or adversarial (every token on one expert, every token on the same K experts, one rank receiving
// nothing, each token's experts on one rank, every token on one rank). One case in ten first runs a
// forward with a bad expert id on the same context: check() must name it, every rank's out_TD is
// NaN, and after reset() the good case must match. One case in four runs FP8 GEMMs
// (gemm_precision fp8_block_scaled, WGRAD in BF16 or FP8; blocked W13, clamp limits 3 and 7) against
// the FP8 reference, within kFp8Tolerance: the H200's FP8 MMA sums with fewer bits than the
// reference's fp32, and in small tensors one e4m3 value rounding the other way weighs more (the
// worst FP8 error of the run is printed). BF16 score gradients that cancel: scores_within_their_terms.
//
// POISE_FUZZ_CASES cases (default 200) from POISE_FUZZ_SEED (default fixed). A case is built from its
// own seed alone (case 0's is the base seed), printed on failure: POISE_FUZZ_SEED=<seed>
// POISE_FUZZ_CASES=1 replays it. The CPU reference is the slow part: cases are kept small
// (R*T*K*D*F bounded) and their references computed ahead on every host core (up to 16).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "testing/device_layer.hpp"

namespace poise {
namespace {

using testing::ReferenceLayer;

constexpr double kTolerance = 1e-2;
constexpr double kFp8Tolerance = 5e-2;
constexpr uint64_t kDefaultSeed = 20250601;
constexpr int64_t kWorkBudget = 120'000'000;        // R*T*K*D*F: ~1 GMAC of reference per case at most
constexpr int64_t kWeightBudget = 4'000'000;        // E*D*F: the weights (and their grads) stay small
constexpr int kMaxFailingCases = 10;                // then stop: one bug tends to fail every case

enum class Routing { random, one_expert, same_experts, rank_empty, token_one_rank, hot_rank };

const char* to_string(Routing r) {
  switch (r) {
    case Routing::random: return "random";
    case Routing::one_expert: return "one_expert";      // every token picks expert e0 (K=1: all rows)
    case Routing::same_experts: return "same_experts";  // every token picks the same K experts
    case Routing::rank_empty: return "rank_empty";      // no token picks rank q's experts
    case Routing::token_one_rank: return "token_one_rank";  // each token's K experts on one rank
    case Routing::hot_rank: return "hot_rank";          // every token's K experts on rank q
  }
  return "?";
}

struct FuzzCase {
  uint64_t seed = 0;
  Config config;
  int64_t ranks = 1;
  Routing routing = Routing::random;
  double skew = 1.0;          // random routing: rank 0's experts drawn more often
  bool tight_capacity = true;  // capacity factor exactly the busiest rank's rows, else up to 1.5x that
  int64_t padding_rows = 0;
  double free_fraction = 0.0;  // each entry kNoExpert with this probability (after the routing)
  reference::Options options;  // scores dtype, W13 layout
  bool inject_fault = false;
};

std::string describe(const FuzzCase& fc) {
  const Config& c = fc.config;
  std::string s = "seed " + std::to_string(fc.seed) + ": R=" + std::to_string(fc.ranks) +
                  " T=" + std::to_string(c.num_local_input_tokens) + " D=" + std::to_string(c.hidden_dim) +
                  " F=" + std::to_string(c.intermediate_dim) + " E=" + std::to_string(c.num_experts) +
                  " K=" + std::to_string(c.top_k) + " " + to_string(c.balance) + " " + to_string(fc.routing);
  if (fc.routing == Routing::random) s += " skew=" + std::to_string(fc.skew);
  if (c.balance == Balance::exact) s += " tolerance=" + std::to_string(c.balance_tolerance);
  else s += fc.tight_capacity ? " tight" : " roomy";
  s += std::string(" ") + to_string(c.activation) + " scores=" + to_string(fc.options.scores_dtype) +
       " wgrad=" + to_string(c.wgrad_dtype) +
       (fc.options.w13_layout == W13Layout::gate_up_interleaved ? " interleaved" : " blocked") +
       " padding=" + std::to_string(fc.padding_rows) + " free=" + std::to_string(fc.free_fraction) +
       (fc.inject_fault ? " +fault" : "") +
       (c.gemm_precision == GemmPrecision::fp8_block_scaled ? (c.fp8_wgrad ? " fp8+fp8_wgrad" : " fp8") : "");
  return s;
}

// Case 0 is the base seed itself, so a printed case seed replays as a base seed with one case.
uint64_t case_seed(uint64_t base, uint64_t i) {
  if (i == 0) return base;
  uint64_t z = base + i * 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int64_t in(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool one_in(int64_t n) { return in(1, n) == 1; }
  template <class T>
  T of(const std::vector<T>& v) { return v[size_t(in(0, int64_t(v.size()) - 1))]; }

 private:
  std::mt19937_64 rng_;
};

bool routing_fits(Routing r, const Config& c, int64_t R) {
  const int64_t local = c.num_local_experts(R), K = c.top_k;
  switch (r) {
    case Routing::rank_empty: return R > 1 && c.num_experts - local >= K;
    case Routing::token_one_rank:
    case Routing::hot_rank: return K <= local;
    default: return true;
  }
}

// The shape: T small or medium (odd and even), then cut until the reference work fits the budget.
void draw_shape(Draw& d, Config& c, int64_t R) {
  c.num_experts = R * d.in((4 + R - 1) / R, 64 / R);
  c.top_k = d.in(1, std::min<int64_t>(8, c.num_experts));
  do {
    c.hidden_dim = 64 * d.in(1, 7);
    c.intermediate_dim = 64 * d.in(1, 7);
  } while (c.num_experts * c.hidden_dim * c.intermediate_dim > kWeightBudget);
  int64_t T = d.one_in(4) ? d.in(1, 16) : d.in(17, 300);
  const int64_t per_token = R * c.top_k * c.hidden_dim * c.intermediate_dim;
  if (T * per_token > kWorkBudget) T = std::max<int64_t>(1, kWorkBudget / per_token - d.in(0, 1));
  c.num_local_input_tokens = T;
}

FuzzCase draw_case(uint64_t seed) {
  Draw d(seed);
  FuzzCase fc;
  fc.seed = seed;
  fc.ranks = d.of<int64_t>({1, 2, 4, 8});
  Config& c = fc.config;
  draw_shape(d, c, fc.ranks);
  c.balance = d.one_in(2) ? Balance::exact : Balance::capacity;
  c.balance_tolerance = d.of<double>({0.0, 0.0, 0.25, 1.0});
  fc.tight_capacity = d.one_in(2);
  if (d.one_in(3)) {
    c.activation = Activation::swiglu_clamped;
    c.swiglu_limit = d.of<double>({1.5, 3.0, 7.0});
  }
  c.wgrad_dtype = d.one_in(4) ? DType::bf16 : DType::fp32;
  fc.options.scores_dtype = d.one_in(4) ? DType::bf16 : DType::fp32;
  fc.options.w13_layout = d.one_in(4) ? W13Layout::gate_up_interleaved : W13Layout::gate_up_blocked;
  std::vector<Routing> routings;
  for (Routing r : {Routing::random, Routing::one_expert, Routing::same_experts, Routing::rank_empty,
                    Routing::token_one_rank, Routing::hot_rank})
    if (routing_fits(r, c, fc.ranks)) routings.push_back(r);
  fc.routing = d.of(routings);
  fc.skew = d.real(1.0, double(fc.ranks));
  fc.padding_rows = d.one_in(4) ? d.in(1, std::max<int64_t>(1, c.num_local_input_tokens / 4)) : 0;
  fc.free_fraction = d.one_in(4) ? d.of<double>({0.2, 0.6, 1.0}) : 0.0;
  fc.inject_fault = d.one_in(10);
  if (d.one_in(4)) {  // FP8 GEMMs, as far as they are built (blocked W13); the clamp at 1.5 has its own test
    c.gemm_precision = GemmPrecision::fp8_block_scaled;
    c.fp8_wgrad = d.one_in(2);
    fc.options.w13_layout = W13Layout::gate_up_blocked;
    c.swiglu_limit = std::max(c.swiglu_limit, 3.0);
  }
  return fc;
}

// ---- routings --------------------------------------------------------------------------------------

// K distinct experts of `pool` (at least K of them) in random order.
void pick_from(std::vector<int32_t> pool, int64_t K, int32_t* ids_K, std::mt19937_64& rng) {
  std::shuffle(pool.begin(), pool.end(), rng);
  std::copy_n(pool.begin(), K, ids_K);
}

std::vector<int32_t> experts_where(const Config& c, const std::function<bool(int32_t)>& keep) {
  std::vector<int32_t> pool;
  for (int32_t e = 0; e < int32_t(c.num_experts); ++e)
    if (keep(e)) pool.push_back(e);
  return pool;
}

// Overwrites every token's ids (random keeps random_inputs' skewed draw); scores stay a softmax.
void route(Routing routing, const Config& c, int64_t R, std::vector<reference::RankInputs>& inputs,
           std::mt19937_64& rng) {
  if (routing == Routing::random) return;
  const int64_t K = c.top_k, local = c.num_local_experts(R);
  auto any = [&](int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); };
  const int32_t e0 = int32_t(any(c.num_experts));
  const int64_t q = any(R);
  std::vector<int32_t> same = experts_where(c, [](int32_t) { return true; });
  std::shuffle(same.begin(), same.end(), rng);
  same.resize(K);
  const auto others = experts_where(c, [&](int32_t e) { return e != e0; });
  const auto off_q = experts_where(c, [&](int32_t e) { return e / local != q; });
  const auto on_q = experts_where(c, [&](int32_t e) { return e / local == q; });
  for (auto& in : inputs) {
    for (int64_t t = 0; t < c.num_local_input_tokens; ++t) {
      int32_t* ids = in.ids_TK.data() + t * K;
      switch (routing) {
        case Routing::one_expert:
          pick_from(others, K - 1, ids, rng);
          ids[K - 1] = e0;
          std::swap(ids[K - 1], ids[any(K)]);
          break;
        case Routing::same_experts: pick_from(same, K, ids, rng); break;
        case Routing::rank_empty: pick_from(off_q, K, ids, rng); break;
        case Routing::hot_rank: pick_from(on_q, K, ids, rng); break;
        case Routing::token_one_rank: {
          const int64_t p = any(R);
          pick_from(experts_where(c, [&](int32_t e) { return e / local == p; }), K, ids, rng);
          break;
        }
        case Routing::random: break;
      }
    }
  }
}

// Capacity mode: the factor that fits the busiest rank's rows (the reference's unpadded count,
// which the device's padded capacity always holds), tight or with up to 50% room.
double capacity_factor(const Config& c, int64_t R, const std::vector<reference::RankInputs>& inputs, bool tight,
                       std::mt19937_64& rng) {
  std::vector<int64_t> rows(R, 0);
  for (const auto& in : inputs)
    for (int32_t e : in.ids_TK)
      if (e != kNoExpert) ++rows[e / c.num_local_experts(R)];
  const double TK = double(c.num_local_input_tokens * c.top_k);
  const double fit = std::max(1.0, (double(*std::max_element(rows.begin(), rows.end())) + 0.5) / TK);
  return tight ? fit : fit * std::uniform_real_distribution<double>(1.0, 1.5)(rng);
}

// The case's inputs (from its seed alone) and the reference engine's answer; the Config it returns
// carries the capacity factor.
ReferenceLayer build_reference(const FuzzCase& fc) {
  Config c = fc.config;
  auto inputs = reference::random_inputs(
      c, fc.ranks, {.seed = fc.seed, .skew = fc.skew, .padding_rows = fc.padding_rows}, fc.options);
  std::mt19937_64 rng(fc.seed ^ 0x5DEECE66Dull);
  route(fc.routing, c, fc.ranks, inputs, rng);
  std::bernoulli_distribution free_entry(fc.free_fraction);
  for (auto& in : inputs)
    for (int32_t& e : in.ids_TK)
      if (free_entry(rng)) e = kNoExpert;
  if (c.balance == Balance::capacity) c.receive_capacity_factor = capacity_factor(c, fc.ranks, inputs, fc.tight_capacity, rng);
  return testing::reference_layer(c, fc.ranks, std::move(inputs), reference::random_grad_out(c, fc.ranks, fc.seed + 1),
                                  fc.options);
}

// ---- one case on the GPU -----------------------------------------------------------------------------

// A forward with one bad id (past E, negative, or a token's repeat) on a random rank: check() names
// it (with sync_check on, the call itself already raised), every rank's out_TD is NaN; then reset().
void fault_then_reset(Context& context, const ReferenceLayer& good, uint64_t seed, cudaStream_t stream) {
  std::mt19937_64 rng(seed ^ 0xFA017ull);
  auto any = [&](int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); };
  const Config& c = good.config;
  const int64_t r = any(good.ranks), t = any(c.num_local_input_tokens), K = c.top_k;
  std::vector<reference::RankInputs> inputs = good.inputs;
  int32_t* ids = inputs[r].ids_TK.data() + t * K;
  std::string want = "rank " + std::to_string(r) + ", route (count): ids_TK ";
  const int64_t kind = any(K > 1 ? 3 : 2);
  if (kind == 2) {
    if (ids[0] == kNoExpert) {  // a repeated -1 is no fault: make the first pick an expert of its own
      int32_t e = 0;
      while (std::find(ids, ids + K, e) != ids + K) ++e;
      ids[0] = e;
    }
    ids[K - 1] = ids[0];
    want += "picks expert " + std::to_string(ids[0]) + " more than once at token " + std::to_string(t);
  } else {
    const int64_t k = any(K);
    ids[k] = kind == 0 ? int32_t(c.num_experts + any(5)) : int32_t(-2 - any(5));
    want += "holds expert id " + std::to_string(ids[k]) + " at token " + std::to_string(t);
  }
  SCOPED_TRACE("injected fault: " + want);
  DeviceLayer bad(c, good.ranks, inputs, good.grad_out, good.options.scores_dtype);
  testing::zero_outputs(bad, c);
  try {
    routed_experts_forward(context, bad.forward_args(), stream);
  } catch (const DeviceError&) {
    EXPECT_TRUE(context.options().sync_check) << "raised without sync_check, before the fault could be seen";
  }
  try {
    context.check(stream);
    ADD_FAILURE() << "check() did not raise after a forward with a bad id";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  testing::expect_all_nan(bad.out_TD(), "out_TD of the faulted forward");
  context.reset();
}

// The largest relative L2 of any output of any rank against the reference (a NaN: infinity).
double worst_error(const DeviceLayer& got, const ReferenceLayer& want) {
  double worst = 0;
  for (const testing::OutputError& e : testing::reference_errors(got, want))
    worst = std::isnan(e.error) ? std::numeric_limits<double>::infinity() : std::max(worst, e.error);
  return worst;
}

// grad_scores_TK are dot products over D that may cancel: there the BF16 reference's own rounding
// (its y rows are bf16) is a large part of the result (seen: 1.26e-2 from float64 over a rank's two
// scores at T = 2). A rank of a BF16 case beyond the tolerance in relative L2 still passes when every
// score lies within kTolerance x sum_d |grad_out_d y_d| of float64 (dense_float64, computed once per
// case when needed): the scale a dot product's rounding errors are relative to.
bool scores_within_their_terms(const DeviceLayer& got, const ReferenceLayer& want, int64_t rank,
                               std::optional<reference::DenseFloat64Result>& exact) {
  if (want.config.gemm_precision != GemmPrecision::bf16) return false;  // FP8: float64 is not the oracle
  if (!exact) exact = reference::dense_float64(want.config, want.ranks, want.inputs, want.grad_out, want.options);
  const std::vector<float> scores = got.grad_scores_TK()[rank];
  const std::vector<double>& value = exact->grad_scores_TK[rank];
  const std::vector<double>& terms = exact->grad_score_terms_TK[rank];
  for (size_t i = 0; i < scores.size(); ++i)
    if (!(std::abs(double(scores[i]) - value[i]) <= kTolerance * terms[i])) return false;  // a NaN fails
  return true;
}

// Returns the case's worst error (0 when it raised).
double run_case(const FuzzCase& fc, const ReferenceLayer& want, cudaStream_t stream) {
  auto context = testing::make_context(want.config, want.ranks);
  if (fc.inject_fault) fault_then_reset(*context, want, fc.seed, stream);
  DeviceLayer layer = testing::device_layer(want);
  try {
    testing::run_forward_backward(*context, layer, stream, want.options.w13_layout);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "raised: " << e.what();
    return 0;
  }
  const bool fp8 = want.config.gemm_precision == GemmPrecision::fp8_block_scaled;
  const double tolerance = fp8 ? kFp8Tolerance : kTolerance;
  std::optional<reference::DenseFloat64Result> exact;
  for (const testing::OutputError& e : testing::reference_errors(layer, want)) {
    if (e.error < tolerance) continue;
    if (std::string(e.output) == "grad_scores_TK" && scores_within_their_terms(layer, want, e.rank, exact)) {
      std::printf("fuzz: grad_scores_TK of rank %lld %.2e from the reference, within its terms of float64\n",
                  static_cast<long long>(e.rank), e.error);
      continue;
    }
    ADD_FAILURE() << e.output << " of rank " << e.rank << ": " << e.error << " relative L2, bound " << tolerance;
  }
  return worst_error(layer, want);
}

// ---- the run -------------------------------------------------------------------------------------------

// References computed ahead, at most `window` at once, handed out in case order.
class ReferenceQueue {
 public:
  ReferenceQueue(const std::vector<FuzzCase>& cases, size_t window) : cases_(cases), window_(window) { fill(); }
  ReferenceLayer next() {
    std::future<ReferenceLayer> f = std::move(pending_.front());
    pending_.pop_front();
    fill();
    return f.get();  // rethrows the reference's exception
  }

 private:
  void fill() {
    while (pending_.size() < window_ && launched_ < cases_.size()) {
      const FuzzCase& fc = cases_[launched_++];
      pending_.push_back(std::async(std::launch::async, [&fc] { return build_reference(fc); }));
    }
  }
  const std::vector<FuzzCase>& cases_;
  size_t window_, launched_ = 0;
  std::deque<std::future<ReferenceLayer>> pending_;
};

struct Coverage {
  std::map<std::string, int> counts;
  int64_t min_T = 1 << 30, max_T = 0;
  void add(const FuzzCase& fc) {
    ++counts["R=" + std::to_string(fc.ranks)];
    ++counts[to_string(fc.config.balance)];
    ++counts[to_string(fc.routing)];
    if (fc.config.activation == Activation::swiglu_clamped) ++counts["clamped"];
    if (fc.config.wgrad_dtype == DType::bf16) ++counts["bf16_wgrad"];
    if (fc.options.scores_dtype == DType::bf16) ++counts["bf16_scores"];
    if (fc.options.w13_layout == W13Layout::gate_up_interleaved) ++counts["interleaved"];
    if (fc.padding_rows > 0) ++counts["padding"];
    if (fc.free_fraction > 0) ++counts["free_entries"];
    if (fc.inject_fault) ++counts["faults"];
    if (fc.config.gemm_precision == GemmPrecision::fp8_block_scaled) ++counts[fc.config.fp8_wgrad ? "fp8_wgrad" : "fp8"];
    min_T = std::min(min_T, fc.config.num_local_input_tokens);
    max_T = std::max(max_T, fc.config.num_local_input_tokens);
  }
  std::string line() const {
    std::string s;
    for (const auto& [name, n] : counts) s += " " + name + ":" + std::to_string(n);
    return s + " T=" + std::to_string(min_T) + ".." + std::to_string(max_T);
  }
};

int failed_parts() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

TEST(GpuFuzz, RandomLayersMatchTheCpuReference) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t base = testing::env_u64("POISE_FUZZ_SEED", kDefaultSeed);
  const uint64_t count = testing::env_u64("POISE_FUZZ_CASES", 200);
  std::vector<FuzzCase> cases;
  for (uint64_t i = 0; i < count; ++i) cases.push_back(draw_case(case_seed(base, i)));
  const size_t cores = std::clamp<size_t>(std::thread::hardware_concurrency(), 2, 16);
  ReferenceQueue references(cases, cores);
  testing::TestStream stream;
  Coverage coverage;
  double worst_bf16 = 0, worst_fp8 = 0;  // relative L2 against the reference, over every case
  int failing = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const FuzzCase& fc : cases) {
    SCOPED_TRACE(describe(fc) + "; replay: POISE_FUZZ_SEED=" + std::to_string(fc.seed) + " POISE_FUZZ_CASES=1");
    const int parts = failed_parts();
    try {
      const double worst = run_case(fc, references.next(), stream);
      double& kind = fc.config.gemm_precision == GemmPrecision::fp8_block_scaled ? worst_fp8 : worst_bf16;
      kind = std::max(kind, worst);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the reference or the context raised: " << e.what();
    }
    coverage.add(fc);
    if (failed_parts() == parts) continue;
    std::printf("FAILED fuzz case %s\n", describe(fc).c_str());
    if (++failing == kMaxFailingCases) {
      ADD_FAILURE() << "stopping after " << failing << " failing cases";
      break;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz: %zu cases from POISE_FUZZ_SEED=%llu, %d failing, %.1f s:%s; worst relative L2 %.2e (bf16), "
              "%.2e (fp8)\n", cases.size(), static_cast<unsigned long long>(base), failing, seconds,
              coverage.line().c_str(), worst_bf16, worst_fp8);
}

}  // namespace
}  // namespace poise
