// What a caller may trust when an input is bad or odd, and when contexts share a device.
//
//  - Faults (context.hpp's contract): an expert id outside [0, E), a token picking one expert twice,
//    or a capacity overflow (balance=capacity) stops the call on every rank and fills its outputs
//    with NaN. The fault stays until reset(): a later call raises DeviceError at its entry, naming
//    the fault (kind, rank, value, token), once the faulted call has ended on the device (no sync
//    needed; after a cudaStreamSynchronize it must raise); check() raises; a call already queued
//    behind the faulted one returns NaN. With ContextOptions::sync_check the faulted call raises
//    itself. After reset() a good call matches the CPU reference again.
// Inputs are fresh random ones (the seed is in the trace; POISE_TEST_SEED replays it). Outputs are
// poisoned (NaN) before a call that must write them, and zeroed (finite) before a call that must
// fill them with NaN, so neither can pass by leaving the buffer alone.

#include "trust_checks.hpp"

namespace poise {
namespace {

using namespace trust_test;

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
    ids[t * K + k] = fc.fault == Fault::id_past_E ? int32_t(c.num_experts) + past : -2 - past;
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
// raise_if_faulted() and check() raise too; reset() then a good forward+backward matches the reference.
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
  expect_device_error([&] { context.raise_if_faulted(); }, entry, "raise_if_faulted() (a call's entry check alone)");
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

}  // namespace
}  // namespace poise
