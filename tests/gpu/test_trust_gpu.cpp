// What a caller may trust when an input is bad or odd, and when contexts share a device.
//
//  - Faults (context.hpp's contract): an expert id outside [0, E), a token picking one expert twice,
//    or a capacity overflow (balance=capacity) stops the call on every rank and fills its outputs
//    with NaN. The fault stays until reset(): a later call raises DeviceError at its entry, naming
//    the fault (kind, rank, value, token), once the faulted call has ended on the device (no sync
//    needed; after a cudaStreamSynchronize it must raise); check() raises; a call already queued
//    behind the faulted one returns NaN. With ContextOptions::sync_check the faulted call raises
//    itself. After reset() a good call matches the CPU reference again.
//  - Contexts of different shapes used in turn on one device each keep matching the reference (a
//    kernel attribute set for one shape once broke another's launches: cudaErrorInvalidValue after
//    A, B, A), and a fault on one leaves the others alone.
//  - NaN semantics: see NanPropagation below.
// Inputs are fresh random ones (the seed is in the trace; POISE_TEST_SEED replays it). Outputs are
// poisoned (NaN) before a call that must write them, and zeroed (finite) before a call that must
// fill them with NaN, so neither can pass by leaving the buffer alone.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/poise.hpp"
#include "poise/reference.hpp"
#include "testing/device_layer.hpp"

namespace poise {
namespace {

using testing::expect_all_nan;
using testing::ReferenceLayer;
using testing::TestStream;
using testing::zero_outputs;

constexpr double kTolerance = 1e-2;

// ---- small tools ---------------------------------------------------------------------------------

void synchronize(cudaStream_t stream) { ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess); }

// Per rank: every element 0, what zero_outputs left (the call that should have written nothing).
void expect_all_zero(const std::vector<std::vector<float>>& per_rank, const std::string& what) {
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const auto nonzero = std::count_if(per_rank[r].begin(), per_rank[r].end(), [](float x) { return x != 0.0f; });
    EXPECT_EQ(nonzero, 0) << what << ", rank " << r << ": written by a call that should have launched nothing";
  }
}

// `call` must raise DeviceError whose message holds every piece (pieces[0], the root cause, before
// any peer's "stopped", and no timeout: a fault stops the peers at once). Returns whether it raised.
bool expect_device_error(const std::function<void()>& call, const std::vector<std::string>& pieces,
                         const std::string& what) {
  try {
    call();
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    for (const std::string& piece : pieces) EXPECT_NE(msg.find(piece), std::string::npos) << what << ": " << msg;
    EXPECT_EQ(msg.find("timed out"), std::string::npos) << what << ": " << msg;
    if (msg.find("stopped:") != std::string::npos)  // root causes first, their echoes after
      EXPECT_LT(msg.find(pieces[0]), msg.find("stopped:")) << what << ": " << msg;
    return true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": raised a non-DeviceError: " << e.what();
    return true;
  }
  ADD_FAILURE() << what << ": did not raise";
  return false;
}

// Like expect_device_error, but a call that does not raise is fine too (it was enqueued before the
// fault was visible). Returns whether it ran.
bool runs_or_raises(const std::function<void()>& call, const std::vector<std::string>& pieces,
                    const std::string& what) {
  try {
    call();
    return true;
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    for (const std::string& piece : pieces) EXPECT_NE(msg.find(piece), std::string::npos) << what << ": " << msg;
    return false;
  }
}

Config layer_config(int64_t T, int64_t D, int64_t F, int64_t E, int64_t K, Balance balance, double factor = 2.0) {
  Config c;
  c.num_local_input_tokens = T;
  c.hidden_dim = D;
  c.intermediate_dim = F;
  c.num_experts = E;
  c.top_k = K;
  c.balance = balance;
  c.receive_capacity_factor = factor;
  return c;
}

// ---- faults ----------------------------------------------------------------------------------------

enum class Fault { id_past_E, id_negative, duplicate_id, capacity_overflow };

const char* to_string(Fault f) {
  switch (f) {
    case Fault::id_past_E: return "id_past_E";
    case Fault::id_negative: return "id_negative";
    case Fault::duplicate_id: return "duplicate_id";
    case Fault::capacity_overflow: return "capacity_overflow";
  }
  return "?";
}

struct FaultCase {
  Fault fault;
  int64_t ranks;
  Balance balance;
};

std::string name_of(const FaultCase& fc) {
  return std::string(to_string(fc.fault)) + "_R" + std::to_string(fc.ranks) + "_" + poise::to_string(fc.balance);
}
std::string fault_case_name(const ::testing::TestParamInfo<FaultCase>& info) { return name_of(info.param); }
void PrintTo(const FaultCase& fc, std::ostream* os) { *os << name_of(fc); }

// T*K = 1024 rows a rank. Capacity factor 1.25: random routing (about T*K rows a rank, sigma ~28)
// fits with room on the reference's unpadded count; 4 ranks where rank 0 sends every row to rank 1
// do not (see overflow_rank_1). D and F are 64 x odd.
Config fault_config(Balance balance) { return layer_config(256, 192, 320, 16, 4, balance, 1.25); }

// The rank holding the bad input: not rank 0, so a rank mix-up shows.
int64_t bad_rank(int64_t ranks) { return ranks > 2 ? 2 : ranks - 1; }

// Rows rank `dst` receives in capacity mode, counted as the device does: each local expert's rows
// padded to kExpertRowAlignment.
int64_t padded_receive_rows(const Config& c, int64_t R, const std::vector<reference::RankInputs>& in, int64_t dst) {
  const int64_t local = c.num_local_experts(R);
  std::vector<int64_t> rows(local, 0);
  for (const auto& rank : in)
    for (int32_t e : rank.ids_TK)
      if (e / local == dst) ++rows[e % local];
  int64_t total = 0;
  for (int64_t n : rows) total += (n + kExpertRowAlignment - 1) / kExpertRowAlignment * kExpertRowAlignment;
  return total;
}

struct BadInputs {
  std::vector<reference::RankInputs> inputs;
  std::vector<std::string> message;  // what every DeviceError about it must say
};

std::string rank_prefix(int64_t rank, const char* phase) { return "rank " + std::to_string(rank) + ", " + phase + ": "; }

// Peers of a rank whose ids were bad stop at the counts exchange, each naming a rank that failed:
// the first to stop names the bad rank, a later one may name an earlier stopper.
void add_peer_stops(BadInputs& bad, int64_t ranks, int64_t failed) {
  if (ranks == 1) return;
  bad.message.push_back("stopped: rank " + std::to_string(failed) + " failed");
  for (int64_t r = 0; r < ranks; ++r)
    if (r != failed) bad.message.push_back(rank_prefix(r, "route (counts exchange)") + "stopped: rank ");
}

// One bad ids entry (out of range or a repeat within its token) on bad_rank, at a random token.
BadInputs bad_id(const FaultCase& fc, const Config& c, std::vector<reference::RankInputs> inputs, std::mt19937_64& rng) {
  const int64_t r = bad_rank(fc.ranks), K = c.top_k;
  const int64_t t = std::uniform_int_distribution<int64_t>(0, c.num_local_input_tokens - 1)(rng);
  std::vector<int32_t>& ids = inputs[r].ids_TK;
  const std::string where = rank_prefix(r, "route (count)");
  BadInputs bad;
  if (fc.fault == Fault::duplicate_id) {
    const int64_t k2 = std::uniform_int_distribution<int64_t>(1, K - 1)(rng);
    const int64_t k1 = std::uniform_int_distribution<int64_t>(0, k2 - 1)(rng);
    ids[t * K + k2] = ids[t * K + k1];
    bad.message.push_back(where + "ids_TK picks expert " + std::to_string(ids[t * K + k1]) + " more than once at token " +
                          std::to_string(t));
  } else {
    const int64_t k = std::uniform_int_distribution<int64_t>(0, K - 1)(rng);
    const int32_t past = std::uniform_int_distribution<int32_t>(0, 20)(rng);
    ids[t * K + k] = fc.fault == Fault::id_past_E ? int32_t(c.num_experts) + past : -1 - past;
    bad.message.push_back(where + "ids_TK holds expert id " + std::to_string(ids[t * K + k]) + " at token " +
                          std::to_string(t) + ", outside [0, E)");
  }
  add_peer_stops(bad, fc.ranks, r);
  bad.inputs = std::move(inputs);
  return bad;
}

// Capacity mode, 4 ranks: rank 0 sends every token to rank 1's experts, so rank 1 gets about
// 1.75 T*K rows (padded: 2 T*K) where its capacity is 1.25 T*K + padding. Every rank sees the same
// counts and stops itself, naming rank 1 and its padded row count.
BadInputs overflow_rank_1(const Config& c, std::vector<reference::RankInputs> inputs, std::mt19937_64& rng) {
  const int64_t local = c.num_local_experts(4), K = c.top_k;
  std::vector<int32_t> experts(local);
  for (int64_t j = 0; j < local; ++j) experts[j] = int32_t(local + j);
  for (int64_t t = 0; t < c.num_local_input_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy_n(experts.begin(), K, inputs[0].ids_TK.begin() + t * K);
  }
  BadInputs bad;
  const int64_t rows = padded_receive_rows(c, 4, inputs, 1);
  for (int64_t r = 0; r < 4; ++r)
    bad.message.push_back(rank_prefix(r, "route (assign rows)") + "capacity overflow: rank 1 would receive " +
                          std::to_string(rows) + " rows");
  bad.inputs = std::move(inputs);
  return bad;
}

BadInputs bad_inputs(const FaultCase& fc, const ReferenceLayer& good, uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (fc.fault == Fault::capacity_overflow) return overflow_rank_1(good.config, good.inputs, rng);
  return bad_id(fc, good.config, good.inputs, rng);
}

// The capacity numbers the overflow case relies on: the good routing fits, the bad one does not,
// first at rank 1 (the device names the lowest rank that overflows).
void check_capacity_preconditions(const FaultCase& fc, const ReferenceLayer& good, const BadInputs& bad) {
  if (fc.fault != Fault::capacity_overflow) return;
  const int64_t capacity = plan_memory(good.config, fc.ranks).device_rows;
  for (int64_t d = 0; d < fc.ranks; ++d)
    ASSERT_LE(padded_receive_rows(good.config, fc.ranks, good.inputs, d), capacity) << "good routing, rank " << d;
  ASSERT_LE(padded_receive_rows(good.config, fc.ranks, bad.inputs, 0), capacity) << "bad routing, rank 0";
  ASSERT_GT(padded_receive_rows(good.config, fc.ranks, bad.inputs, 1), capacity) << "bad routing, rank 1";
}

// After the faulted call: the next call raises at its entry naming the fault and launches nothing;
// check() raises too; reset() then a good forward+backward matches the reference.
void expect_sticky_fault_then_recovery(Context& context, const ReferenceLayer& good, const BadInputs& bad,
                                       cudaStream_t stream) {
  DeviceLayer next = testing::device_layer(good);
  zero_outputs(next, good.config);
  std::vector<std::string> entry = bad.message;
  entry.push_back("every call fails until reset()");
  expect_device_error([&] { routed_experts_forward(context, next.forward_args(), stream); }, entry,
                      "the forward after the faulted one");
  expect_device_error([&] { routed_experts_backward(context, next.backward_args(), stream); }, entry,
                      "a backward after the faulted forward");
  expect_all_zero(next.out_TD(), "out_TD of the raising forward");
  expect_all_zero(next.grad_x_TD(), "grad_x_TD of the raising backward");
  expect_device_error([&] { context.check(stream); }, bad.message, "check()");
  context.reset();
  ASSERT_NO_THROW(testing::run_forward_backward(context, next, stream));
  testing::expect_matches_reference(next, good, kTolerance);
}

class TrustFaults : public ::testing::TestWithParam<FaultCase> {};

TEST_P(TrustFaults, FaultedCallIsNaNNextCallRaisesResetRecovers) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const FaultCase fc = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ReferenceLayer good = testing::random_reference_layer(fault_config(fc.balance), fc.ranks, seed);
  const BadInputs bad = bad_inputs(fc, good, seed + 7);
  ASSERT_NO_FATAL_FAILURE(check_capacity_preconditions(fc, good, bad));
  auto context = testing::make_context(good.config, fc.ranks);
  if (context->options().sync_check) GTEST_SKIP() << "POISE_SYNC_CHECK=1: the faulted call itself raises";
  TestStream stream;
  DeviceLayer faulted(good.config, fc.ranks, bad.inputs, good.grad_out, DType::fp32);
  zero_outputs(faulted, good.config);
  ASSERT_NO_THROW(routed_experts_forward(*context, faulted.forward_args(), stream)) << "no sync_check: no raise yet";
  synchronize(stream);
  expect_all_nan(faulted.out_TD(), "out_TD of the faulted forward");
  expect_sticky_fault_then_recovery(*context, good, bad, stream);
}

// Capacity overflow needs more than one rank: one rank's padded rows never exceed T*K plus its
// experts' padding, which the capacity always holds.
INSTANTIATE_TEST_SUITE_P(
    KindsRanksBalances, TrustFaults,
    ::testing::Values(FaultCase{Fault::id_past_E, 1, Balance::capacity}, FaultCase{Fault::id_negative, 1, Balance::capacity},
                      FaultCase{Fault::duplicate_id, 1, Balance::capacity}, FaultCase{Fault::id_past_E, 1, Balance::exact},
                      FaultCase{Fault::id_past_E, 4, Balance::capacity}, FaultCase{Fault::id_negative, 4, Balance::capacity},
                      FaultCase{Fault::duplicate_id, 4, Balance::capacity}, FaultCase{Fault::id_past_E, 4, Balance::exact},
                      FaultCase{Fault::id_negative, 4, Balance::exact}, FaultCase{Fault::duplicate_id, 4, Balance::exact},
                      FaultCase{Fault::capacity_overflow, 4, Balance::capacity}),
    fault_case_name);

// A backward differentiating a faulted forward (by its record or as the latest) raises at its entry
// and leaves the gradients alone.
TEST(TrustFaultsBackward, BackwardOfAFaultedForwardRaisesAtEntry) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const FaultCase fc{Fault::duplicate_id, 4, Balance::exact};
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ReferenceLayer good = testing::random_reference_layer(fault_config(fc.balance), fc.ranks, seed, 2.0);
  const BadInputs bad = bad_inputs(fc, good, seed + 7);
  auto context = testing::make_context(good.config, fc.ranks);
  if (context->options().sync_check) GTEST_SKIP() << "POISE_SYNC_CHECK=1: the faulted call itself raises";
  TestStream stream;
  DeviceLayer faulted(good.config, fc.ranks, bad.inputs, good.grad_out, DType::fp32);
  zero_outputs(faulted, good.config);
  const ActivationRecord record = routed_experts_forward(*context, faulted.forward_args(), stream);
  synchronize(stream);
  expect_device_error([&] { routed_experts_backward(*context, faulted.backward_args(), stream, &record); },
                      bad.message, "backward given the faulted forward's record");
  expect_device_error([&] { routed_experts_backward(*context, faulted.backward_args(), stream); }, bad.message,
                      "backward of the latest forward");
  for (const auto& grads : {faulted.grad_x_TD(), faulted.grad_scores_TK(), faulted.grad_w13(), faulted.grad_w2()})
    expect_all_zero(grads, "a gradient of the raising backward");
  expect_all_nan(faulted.out_TD(), "out_TD of the faulted forward");
  expect_sticky_fault_then_recovery(*context, good, bad, stream);
}

// Calls enqueued right behind the faulted one, without a sync: each raises at its entry (the fault
// was already visible) or runs and returns NaN in every output. Either way check() then raises.
TEST(TrustFaultsQueued, CallsQueuedBehindAFaultReturnNaNOrRaise) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const FaultCase fc{Fault::id_past_E, 4, Balance::capacity};
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ReferenceLayer good = testing::random_reference_layer(fault_config(fc.balance), fc.ranks, seed);
  const BadInputs bad = bad_inputs(fc, good, seed + 7);
  auto context = testing::make_context(good.config, fc.ranks);
  if (context->options().sync_check) GTEST_SKIP() << "POISE_SYNC_CHECK=1: the faulted call itself raises";
  TestStream stream;
  DeviceLayer faulted(good.config, fc.ranks, bad.inputs, good.grad_out, DType::fp32);
  DeviceLayer queued = testing::device_layer(good);
  zero_outputs(faulted, good.config);
  zero_outputs(queued, good.config);
  routed_experts_forward(*context, faulted.forward_args(), stream);
  // Unsynchronized, a raise may see only some ranks' faults yet (the call-end kernel is writing
  // them): it must say that an earlier call faulted, not yet which.
  const std::vector<std::string> early = {"an earlier call faulted on the device", "every call fails until reset()"};
  const bool forward_ran = runs_or_raises([&] { routed_experts_forward(*context, queued.forward_args(), stream); },
                                          early, "queued forward");
  const bool backward_ran = runs_or_raises([&] { routed_experts_backward(*context, queued.backward_args(), stream); },
                                           early, "queued backward");
  synchronize(stream);
  std::printf("queued behind the fault: forward %s, backward %s\n", forward_ran ? "ran" : "raised",
              backward_ran ? "ran" : "raised");
  expect_all_nan(faulted.out_TD(), "out_TD of the faulted forward");
  if (forward_ran) expect_all_nan(queued.out_TD(), "out_TD of the queued forward");
  if (backward_ran) {
    expect_all_nan(queued.grad_x_TD(), "grad_x_TD of the queued backward");
    expect_all_nan(queued.grad_scores_TK(), "grad_scores_TK of the queued backward");
    expect_all_nan(queued.grad_w13(), "grad_w13 of the queued backward");
    expect_all_nan(queued.grad_w2(), "grad_w2 of the queued backward");
  }
  expect_device_error([&] { context->check(stream); }, bad.message, "check()");
  context->reset();
  ASSERT_NO_THROW(testing::run_forward_backward(*context, queued, stream));
  testing::expect_matches_reference(queued, good, kTolerance);
}

// ContextOptions::sync_check: the faulted call raises itself, naming the fault; reset() recovers
// and good calls (which sync too) do not raise.
class TrustSyncCheck : public ::testing::TestWithParam<FaultCase> {};

TEST_P(TrustSyncCheck, FaultedCallRaisesItself) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const FaultCase fc = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ReferenceLayer good = testing::random_reference_layer(fault_config(fc.balance), fc.ranks, seed);
  const BadInputs bad = bad_inputs(fc, good, seed + 7);
  ASSERT_NO_FATAL_FAILURE(check_capacity_preconditions(fc, good, bad));
  auto context = testing::make_context(good.config, fc.ranks, {.sync_check = true});
  TestStream stream;
  DeviceLayer faulted(good.config, fc.ranks, bad.inputs, good.grad_out, DType::fp32);
  zero_outputs(faulted, good.config);
  expect_device_error([&] { routed_experts_forward(*context, faulted.forward_args(), stream); }, bad.message,
                      "the faulted forward itself");
  expect_all_nan(faulted.out_TD(), "out_TD of the faulted forward");
  expect_sticky_fault_then_recovery(*context, good, bad, stream);
}

INSTANTIATE_TEST_SUITE_P(SomeKinds, TrustSyncCheck,
                         ::testing::Values(FaultCase{Fault::id_past_E, 1, Balance::capacity},
                                           FaultCase{Fault::duplicate_id, 4, Balance::exact},
                                           FaultCase{Fault::capacity_overflow, 4, Balance::capacity}),
                         fault_case_name);

// ---- contexts side by side -----------------------------------------------------------------------

struct Shape {
  std::string name;
  Config config;
  int64_t ranks;
  double skew;  // > 1: exact balance moves rows to replicas
};

// Different E, K, D, F, balance and rank counts (each planner and GEMM shape sets its own launch
// attributes); D and F multiples of 64 including 64 x odd.
std::vector<Shape> three_shapes() {
  return {{"A", layer_config(192, 192, 320, 32, 8, Balance::exact), 2, 1.5},
          {"B", layer_config(192, 128, 192, 8, 2, Balance::capacity), 1, 1.0},
          {"C", layer_config(160, 256, 448, 128, 6, Balance::exact), 4, 2.0}};
}

// The reference answers for a sequence of uses (fresh inputs each), computed in parallel.
std::vector<std::future<ReferenceLayer>> references_for(const std::vector<Shape>& shapes, const std::vector<int>& order,
                                                        uint64_t seed) {
  std::vector<std::future<ReferenceLayer>> want;
  for (size_t i = 0; i < order.size(); ++i) {
    const Shape& s = shapes[order[i]];
    want.push_back(std::async(std::launch::async, [s, i, seed] {
      return testing::random_reference_layer(s.config, s.ranks, seed + 1000 * i, s.skew);
    }));
  }
  return want;
}

void expect_use_matches(Context& context, const ReferenceLayer& want, cudaStream_t stream) {
  DeviceLayer layer = testing::device_layer(want);
  ASSERT_NO_THROW(testing::run_forward_backward(context, layer, stream));
  testing::expect_matches_reference(layer, want, kTolerance);
}

TEST(TrustContexts, ThreeShapesInTurnOnOneDevice) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = three_shapes();
  const std::vector<int> order = {0, 1, 0, 2, 1, 0};  // A, B, A, C, B, A
  auto want = references_for(shapes, order, seed);
  std::vector<std::unique_ptr<Context>> contexts;
  for (const Shape& s : shapes) contexts.push_back(testing::make_context(s.config, s.ranks));
  TestStream stream;
  for (size_t i = 0; i < order.size(); ++i) {
    SCOPED_TRACE("use " + std::to_string(i) + ": context " + shapes[order[i]].name);
    expect_use_matches(*contexts[order[i]], want[i].get(), stream);
  }
}

// A is faulted (a bad id on rank 1) while B keeps working; A's check raises, B's calls match the
// reference; A's reset recovers A, and B is still fine after it.
TEST(TrustContexts, FaultOnOneContextLeavesTheOthersAlone) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = three_shapes();
  const std::vector<int> order = {0, 1, 1, 1, 0, 1};  // A good, [A faulted], B, B, [A reset], A, B
  auto want = references_for(shapes, order, seed);
  auto a = testing::make_context(shapes[0].config, shapes[0].ranks);
  auto b = testing::make_context(shapes[1].config, shapes[1].ranks);
  if (a->options().sync_check) GTEST_SKIP() << "POISE_SYNC_CHECK=1: the faulted call itself raises";
  TestStream stream;
  const ReferenceLayer first_a = want[0].get();
  expect_use_matches(*a, first_a, stream);

  std::vector<reference::RankInputs> bad = first_a.inputs;
  bad[1].ids_TK[5] = int32_t(first_a.config.num_experts);  // token 5 / K = 0
  DeviceLayer faulted(first_a.config, first_a.ranks, bad, first_a.grad_out, DType::fp32);
  zero_outputs(faulted, first_a.config);
  routed_experts_forward(*a, faulted.forward_args(), stream);
  synchronize(stream);
  expect_all_nan(faulted.out_TD(), "A's faulted out_TD");
  const std::vector<std::string> message = {"rank 1, route (count): ids_TK holds expert id 32 at token 0"};
  expect_use_matches(*b, want[1].get(), stream);
  expect_device_error([&] { routed_experts_forward(*a, faulted.forward_args(), stream); }, message, "A's next call");
  expect_use_matches(*b, want[2].get(), stream);
  expect_device_error([&] { a->check(stream); }, message, "A's check()");
  expect_use_matches(*b, want[3].get(), stream);
  a->reset();
  expect_use_matches(*a, want[4].get(), stream);
  expect_use_matches(*b, want[5].get(), stream);
}

// ---- NaN propagation -------------------------------------------------------------------------------
//
// The semantics (the reference engine's, checked here to hold there too, and the GPU's):
//  - A NaN in token t's x row makes h13 of each of its K expert rows all NaN, hence a and y, hence
//    out[t] (every column), grad_x[t] and grad_scores[t, :] (every k: d out / d score_k = y_k), and
//    every element of grad_w13 and grad_w2 of each expert t visited (their sums over rows include
//    t's row; after exact balance, a replica's partial sums reach the owner's). Nothing else: every
//    other token's rows and every other expert's weight gradients are finite and match the
//    reference.
//  - A NaN in score[t, k] reaches out[t] (score * y summed over k), grad_x[t] (grad_a of that row is
//    score * grad_out . W2) and every element of expert ids[t, k]'s grad_w13 and grad_w2 (the rows'
//    sums include s * a and grad_h13 of that row). Not grad_scores: d out / d score_k = y_k does not
//    involve any score, so grad_scores[t, :] stays finite; nor the other experts t visited (their
//    rows carry finite scores).
// Capacity balance, so each expert's rows are computed by its owner. Plain SwiGLU: with the clamped
// one a NaN h13 meets min/max, where the GPU (fminf/fmaxf return the other operand) and the
// reference (std::min/std::clamp return the NaN) part ways.

enum class NanIn { x, score };

struct NanSite {
  int64_t rank, token, k;
  NanIn where;
};

using Masks = std::vector<std::vector<char>>;  // per rank, 1 where the element must be NaN

struct NanMasks {
  Masks out, grad_x, grad_scores, grad_w13, grad_w2;
};

NanMasks nan_masks(const Config& c, int64_t R, const std::vector<reference::RankInputs>& in, const NanSite& s) {
  const int64_t T = c.num_local_input_tokens, D = c.hidden_dim, F = c.intermediate_dim, K = c.top_k;
  const int64_t local = c.num_local_experts(R);
  NanMasks m{Masks(R, std::vector<char>(T * D, 0)), Masks(R, std::vector<char>(T * D, 0)),
             Masks(R, std::vector<char>(T * K, 0)), Masks(R, std::vector<char>(local * 2 * F * D, 0)),
             Masks(R, std::vector<char>(local * D * F, 0))};
  std::fill_n(m.out[s.rank].begin() + s.token * D, D, 1);
  std::fill_n(m.grad_x[s.rank].begin() + s.token * D, D, 1);
  if (s.where == NanIn::x) std::fill_n(m.grad_scores[s.rank].begin() + s.token * K, K, 1);
  for (int64_t k = 0; k < K; ++k) {
    if (s.where == NanIn::score && k != s.k) continue;
    const int32_t e = in[s.rank].ids_TK[s.token * K + k];
    std::fill_n(m.grad_w13[e / local].begin() + (e % local) * 2 * F * D, 2 * F * D, 1);
    std::fill_n(m.grad_w2[e / local].begin() + (e % local) * D * F, D * F, 1);
  }
  return m;
}

// NaN exactly where the mask says; the other elements within tolerance of `want` (which must be
// finite there too).
void expect_nan_exactly(const std::vector<std::vector<float>>& got, const Masks& mask,
                        const std::vector<std::vector<float>>& want, const std::string& what) {
  for (size_t r = 0; r < got.size(); ++r) {
    int64_t wrong = 0, first = -1;
    std::vector<float> got_finite, want_finite;
    for (size_t i = 0; i < got[r].size(); ++i) {
      if (std::isnan(got[r][i]) != bool(mask[r][i])) {
        if (wrong++ == 0) first = int64_t(i);
      } else if (!mask[r][i]) {
        got_finite.push_back(got[r][i]);
        want_finite.push_back(want[r][i]);
      }
    }
    EXPECT_EQ(wrong, 0) << what << ", rank " << r << ": elements NaN where they must not be or the reverse, first at "
                        << first;
    EXPECT_LT(testing::relative_error_to(got_finite, want_finite), kTolerance) << what << ", rank " << r;
  }
}

template <class Get>
std::vector<std::vector<float>> each_rank(const std::vector<reference::RankGradients>& grads, Get get) {
  std::vector<std::vector<float>> v;
  for (const auto& g : grads) v.push_back(get(g));
  return v;
}

struct Results {
  std::vector<std::vector<float>> out, grad_x, grad_scores, grad_w13, grad_w2;
};

Results results_of(const ReferenceLayer& l) {
  return {l.out, each_rank(l.grads, [](const auto& g) { return g.grad_x_TD; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_scores_TK; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_w13; }),
          each_rank(l.grads, [](const auto& g) { return g.grad_w2; })};
}

Results results_of(const DeviceLayer& l) {
  return {l.out_TD(), l.grad_x_TD(), l.grad_scores_TK(), l.grad_w13(), l.grad_w2()};
}

void expect_nan_pattern(const Results& got, const NanMasks& m, const Results& want, const std::string& who) {
  expect_nan_exactly(got.out, m.out, want.out, who + " out_TD");
  expect_nan_exactly(got.grad_x, m.grad_x, want.grad_x, who + " grad_x_TD");
  expect_nan_exactly(got.grad_scores, m.grad_scores, want.grad_scores, who + " grad_scores_TK");
  expect_nan_exactly(got.grad_w13, m.grad_w13, want.grad_w13, who + " grad_w13");
  expect_nan_exactly(got.grad_w2, m.grad_w2, want.grad_w2, who + " grad_w2");
}

class NanPropagation : public ::testing::TestWithParam<NanIn> {};

TEST_P(NanPropagation, ReachesItsTokenAndItsExpertsOnly) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c = layer_config(96, 192, 320, 8, 4, Balance::capacity, 2.0);
  const int64_t R = 2;
  std::mt19937_64 rng(seed);
  const NanSite site{1, std::uniform_int_distribution<int64_t>(0, c.num_local_input_tokens - 1)(rng),
                     std::uniform_int_distribution<int64_t>(0, c.top_k - 1)(rng), GetParam()};
  SCOPED_TRACE("NaN at rank 1, token " + std::to_string(site.token) +
               (site.where == NanIn::x ? ", x column 5" : ", score k=" + std::to_string(site.k)));
  auto inputs = reference::random_inputs(c, R, {.seed = seed}, {});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (site.where == NanIn::x) inputs[1].x_TD[site.token * c.hidden_dim + 5] = nan;
  else inputs[1].scores_TK[site.token * c.top_k + site.k] = nan;
  const ReferenceLayer want = testing::reference_layer(c, R, inputs, reference::random_grad_out(c, R, seed + 1));
  const NanMasks masks = nan_masks(c, R, inputs, site);
  const Results reference_results = results_of(want);
  expect_nan_pattern(reference_results, masks, reference_results, "reference");

  auto context = testing::make_context(c, R);
  TestStream stream;
  DeviceLayer layer = testing::device_layer(want);
  ASSERT_NO_THROW(testing::run_forward_backward(*context, layer, stream)) << "a NaN value is no fault";
  expect_nan_pattern(results_of(layer), masks, reference_results, "GPU");

  // Nothing of the NaN outlives its call: the next call on the context, its rows over the buffers
  // the NaN rows used, matches the reference.
  const ReferenceLayer next = testing::random_reference_layer(c, R, seed + 2);
  DeviceLayer next_layer = testing::device_layer(next);
  ASSERT_NO_THROW(testing::run_forward_backward(*context, next_layer, stream));
  testing::expect_matches_reference(next_layer, next, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(XAndScore, NanPropagation, ::testing::Values(NanIn::x, NanIn::score),
                         [](const ::testing::TestParamInfo<NanIn>& info) {
                           return std::string(info.param == NanIn::x ? "nan_in_x" : "nan_in_score");
                         });

}  // namespace
}  // namespace poise
