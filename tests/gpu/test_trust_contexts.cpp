// Contexts of different shapes used in turn on one device each keep matching the reference (a
// kernel attribute set for one shape once broke another's launches: cudaErrorInvalidValue after
// A, B, A), and a fault on one leaves the others alone.

#include "trust_checks.hpp"

namespace poise {
namespace {

using namespace trust_test;

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
  return {{"A", layer_config(192, 192, 320, 32, 8, Balance::exact, 2.0), 2, 1.5},
          {"B", layer_config(192, 128, 192, 8, 2, Balance::capacity, 2.0), 1, 1.0},
          {"C", layer_config(160, 256, 448, 128, 6, Balance::exact, 2.0), 4, 2.0}};
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

}  // namespace
}  // namespace poise
