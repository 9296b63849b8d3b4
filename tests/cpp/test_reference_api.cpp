// The reference engine's contract: argument checks that name the argument, W13 layouts that are
// the same weights in another order, wgrad dtype and accumulation, determinism, bf16 rounding,
// and a failing rank that ends the call instead of hanging it.
#include <cmath>
#include <stdexcept>

#include "reference/transport.hpp"
#include "test_reference_support.hpp"
#include "testing/rejected_name.hpp"

namespace poise::reference::testing {

using poise::testing::rejected_name;
namespace {

Config api_config() { return small_config(/*T=*/16, /*D=*/128, /*F=*/64, /*E=*/8, /*K=*/2); }

TEST(ReferenceApi, RejectsBadInputsNamingTheArgument) {
  const Config config = api_config();
  const auto good = random_inputs(config, 2, {}, {});
  Engine engine(config, 2, {});
  auto with = [&](auto&& edit) {
    auto inputs = good;
    edit(inputs);
    return rejected_name([&] { engine.forward(inputs); });
  };
  EXPECT_EQ(with([](auto& in) { in[1].ids_TK[5] = 8; }), "ids_TK");   // out of range
  EXPECT_EQ(with([](auto& in) { in[0].ids_TK[3] = -2; }), "ids_TK");
  EXPECT_EQ(with([](auto& in) { in[0].ids_TK[1] = in[0].ids_TK[0]; }), "ids_TK");  // twice in one token
  EXPECT_EQ(with([](auto& in) { in[0].x_TD.pop_back(); }), "x_TD");
  EXPECT_EQ(with([](auto& in) { in[1].x_TD[7] = 1.0f + 1.0f / 1024; }), "x_TD");  // not a bf16 value
  EXPECT_EQ(with([](auto& in) { in[0].scores_TK.resize(3); }), "scores_TK");
  EXPECT_EQ(with([](auto& in) { in[1].w13.resize(10); }), "w13");
  EXPECT_EQ(with([](auto& in) { in[1].w2[0] = 0.1f; }), "w2");
  EXPECT_EQ(with([](auto& in) { in.pop_back(); }), "inputs_per_rank");

  // bf16 scores must be bf16 values; fp32 scores need not be.
  Options bf16_scores;
  bf16_scores.scores_dtype = DType::bf16;
  Engine bf16_engine(config, 2, bf16_scores);
  auto inputs = good;
  inputs[0].scores_TK[0] = 0.1f;
  EXPECT_EQ(rejected_name([&] { bf16_engine.forward(inputs); }), "scores_TK");
  EXPECT_NO_THROW(engine.forward(inputs));

  // The message names the rank and what is wrong.
  auto bad = good;
  bad[1].ids_TK[5] = 8;
  try {
    engine.forward(bad);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
}

TEST(ReferenceApi, RejectsBadSetupAndBackwardMisuse) {
  Config config = api_config();
  EXPECT_EQ(rejected_name([&] { Engine(config, 3, {}); }), "num_experts");  // 8 % 3
  Options options;
  options.replica_slots = -2;
  EXPECT_EQ(rejected_name([&] { Engine(config, 2, options); }), "replica_slots");

  const auto inputs = random_inputs(config, 2, {}, {});
  const auto grad_out = random_grad_out(config, 2, 1);
  Engine engine(config, 2, {});
  std::vector<RankGradients> grads;
  EXPECT_THROW(engine.backward(inputs, grad_out, grads), std::logic_error);  // no forward yet
  engine.forward(inputs);
  auto short_grad = grad_out;
  short_grad[0].resize(5);
  EXPECT_EQ(rejected_name([&] { engine.backward(inputs, short_grad, grads); }), "grad_out_TD");
  auto other_routing = inputs;
  std::swap(other_routing[0].ids_TK[0], other_routing[0].ids_TK[2]);
  EXPECT_EQ(rejected_name([&] { engine.backward(other_routing, grad_out, grads); }), "ids_TK");
  std::vector<RankGradients> wrong_sizes(2);
  EXPECT_EQ(rejected_name([&] { engine.backward(inputs, grad_out, wrong_sizes, true); }), "grad_w13");

  config.inference = true;
  Engine inference(config, 2, {});
  inference.forward(inputs);
  EXPECT_EQ(rejected_name([&] { inference.backward(inputs, grad_out, grads); }), "inference");
}

TEST(ReferenceApi, InterleavedW13IsTheSameWeightsInAnotherOrder) {
  Config config = small_config(16, 192, 192, 8, 2);
  config.activation = Activation::swiglu_clamped;
  config.swiglu_limit = 1.0;
  const auto blocked = random_inputs(config, 2, {.seed = 4, .skew = 2.0}, {});
  const int64_t D = 192, F = 192, local = 4;
  // Row f of the gate block -> row 2f; row f of the up block -> row 2f+1.
  auto interleave = [&](const std::vector<float>& w) {
    std::vector<float> out(w.size());
    for (int64_t e = 0; e < local; ++e) {
      for (int64_t f = 0; f < F; ++f) {
        for (int64_t d = 0; d < D; ++d) {
          out[((e * 2 * F) + 2 * f) * D + d] = w[((e * 2 * F) + f) * D + d];
          out[((e * 2 * F) + 2 * f + 1) * D + d] = w[((e * 2 * F) + F + f) * D + d];
        }
      }
    }
    return out;
  };
  auto interleaved = blocked;
  for (RankInputs& in : interleaved) in.w13 = interleave(in.w13);
  Options options;
  const auto grad_out = random_grad_out(config, 2, 2);
  const RunResult a = run_engine(config, 2, options, blocked, grad_out);
  options.w13_layout = W13Layout::gate_up_interleaved;
  const RunResult b = run_engine(config, 2, options, interleaved, grad_out);
  for (int r = 0; r < 2; ++r) {
    expect_bitwise_equal(a.out_TD[r], b.out_TD[r], "out_TD");
    expect_bitwise_equal(a.grads[r].grad_x_TD, b.grads[r].grad_x_TD, "grad_x_TD");
    expect_bitwise_equal(a.grads[r].grad_scores_TK, b.grads[r].grad_scores_TK, "grad_scores_TK");
    expect_bitwise_equal(interleave(a.grads[r].grad_w13), b.grads[r].grad_w13, "grad_w13");
    expect_bitwise_equal(a.grads[r].grad_w2, b.grads[r].grad_w2, "grad_w2");
  }
}

TEST(ReferenceApi, WgradDtypeAndAccumulation) {
  Config config = api_config();
  const auto inputs = random_inputs(config, 2, {.seed = 6, .skew = 2.0}, {});
  const auto grad_out = random_grad_out(config, 2, 3);
  const RunResult fp32 = run_engine(config, 2, {}, inputs, grad_out);

  // bf16 weight grads are the fp32 sums rounded once.
  config.wgrad_dtype = DType::bf16;
  const RunResult bf16 = run_engine(config, 2, {}, inputs, grad_out);
  for (int r = 0; r < 2; ++r) {
    std::vector<float> rounded13 = fp32.grads[r].grad_w13, rounded2 = fp32.grads[r].grad_w2;
    for (float& v : rounded13) v = round_to_bf16(v);
    for (float& v : rounded2) v = round_to_bf16(v);
    expect_bitwise_equal(bf16.grads[r].grad_w13, rounded13, "bf16 grad_w13");
    expect_bitwise_equal(bf16.grads[r].grad_w2, rounded2, "bf16 grad_w2");
  }

  // Accumulation adds the fresh fp32 sums to what is there (then rounds to wgrad_dtype).
  for (DType wgrad : {DType::fp32, DType::bf16}) {
    config.wgrad_dtype = wgrad;
    Engine engine(config, 2, {});
    engine.forward(inputs);
    std::vector<RankGradients> grads(2);
    for (int r = 0; r < 2; ++r) {
      grads[r].grad_w13.assign(fp32.grads[r].grad_w13.size(), 0.0f);
      grads[r].grad_w2.assign(fp32.grads[r].grad_w2.size(), 0.0f);
      for (size_t i = 0; i < grads[r].grad_w13.size(); ++i) grads[r].grad_w13[i] = round_to_bf16(0.001f * (i % 7));
      for (size_t i = 0; i < grads[r].grad_w2.size(); ++i) grads[r].grad_w2[i] = round_to_bf16(-0.002f * (i % 5));
    }
    const std::vector<RankGradients> before = grads;
    engine.backward(inputs, grad_out, grads, /*accumulate_wgrad=*/true);
    for (int r = 0; r < 2; ++r) {
      std::vector<float> want13 = before[r].grad_w13, want2 = before[r].grad_w2;
      for (size_t i = 0; i < want13.size(); ++i) {
        want13[i] += fp32.grads[r].grad_w13[i];
        if (wgrad == DType::bf16) want13[i] = round_to_bf16(want13[i]);
      }
      for (size_t i = 0; i < want2.size(); ++i) {
        want2[i] += fp32.grads[r].grad_w2[i];
        if (wgrad == DType::bf16) want2[i] = round_to_bf16(want2[i]);
      }
      expect_bitwise_equal(grads[r].grad_w13, want13, "accumulated grad_w13");
      expect_bitwise_equal(grads[r].grad_w2, want2, "accumulated grad_w2");
      expect_bitwise_equal(grads[r].grad_x_TD, fp32.grads[r].grad_x_TD, "grad_x_TD is overwritten");
    }
  }
}

TEST(ReferenceApi, RunsAreDeterministic) {
  const Config config = small_config(32, 128, 128, 16, 4);
  const auto inputs = random_inputs(config, 4, {.seed = 9, .skew = 3.0, .padding_rows = 1}, {});
  const auto grad_out = random_grad_out(config, 4, 9);
  const RunResult a = run_engine(config, 4, {}, inputs, grad_out);
  const RunResult b = run_engine(config, 4, {}, inputs, grad_out);
  for (int r = 0; r < 4; ++r) {
    expect_bitwise_equal(a.out_TD[r], b.out_TD[r], "out_TD");
    expect_bitwise_equal(a.grads[r].grad_x_TD, b.grads[r].grad_x_TD, "grad_x_TD");
    expect_bitwise_equal(a.grads[r].grad_scores_TK, b.grads[r].grad_scores_TK, "grad_scores_TK");
    expect_bitwise_equal(a.grads[r].grad_w13, b.grads[r].grad_w13, "grad_w13");
    expect_bitwise_equal(a.grads[r].grad_w2, b.grads[r].grad_w2, "grad_w2");
  }
}

TEST(ReferenceApi, Bf16RoundsToNearestEven) {
  EXPECT_EQ(round_to_bf16(1.0f + 1.0f / 256), 1.0f);                      // tie -> even (down)
  EXPECT_EQ(round_to_bf16(1.0f + 3.0f / 256), 1.0f + 4.0f / 256);         // tie -> even (up)
  EXPECT_EQ(round_to_bf16(1.0f + 1.0f / 256 + 1.0f / 4096), 1.0f + 2.0f / 256);  // above the tie
  EXPECT_EQ(round_to_bf16(-2.5f), -2.5f);
  EXPECT_TRUE(std::isinf(round_to_bf16(3.4e38f)));
  EXPECT_TRUE(std::isnan(round_to_bf16(std::nanf(""))));
  EXPECT_TRUE(is_bf16_value(round_to_bf16(0.1f)));
  EXPECT_FALSE(is_bf16_value(0.1f));
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_from_bits(0xc020), -2.5f);
  const std::vector<float> values = {0.0f, -1.5f, round_to_bf16(3.14159f), 65280.0f};
  EXPECT_EQ(from_bf16_bits(to_bf16_bits(values)), values);
}

TEST(ReferenceApi, AFailingRankEndsTheCallWithItsError) {
  for (int failing = 0; failing < 4; ++failing) {
    try {
      run_ranks(4, [&](int rank, InProcessTransport& transport) {
        transport.barrier();
        if (rank == failing) throw std::runtime_error("rank " + std::to_string(rank) + " failed");
        transport.all_gather(rank, rank);
        transport.barrier();
      });
      FAIL() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(failing) + " failed");
    }
  }
}

}  // namespace
}  // namespace poise::reference::testing

namespace poise::reference::testing {
namespace {

// Clip statistics: per local expert, gate inputs above the limit and up inputs outside
// [-limit, limit], counted on bf16 h13 over every row of the expert. Recounted here token by token
// with the engine's own dot order (so exactly equal), for both balance modes and both layouts.
TEST(ReferenceApi, ClipCountsCountEveryRowOfEachExpert) {
  for (Balance balance : {Balance::exact, Balance::capacity}) {
    for (W13Layout layout : {W13Layout::gate_up_blocked, W13Layout::gate_up_interleaved}) {
      Config config = small_config(/*T=*/24, /*D=*/64, /*F=*/64, /*E=*/8, /*K=*/2, balance);
      config.activation = Activation::swiglu_clamped;
      config.swiglu_limit = 0.6;
      const int64_t R = 4, EL = 2, D = 64, F = 64;
      Options options;
      options.w13_layout = layout;
      RandomInputsSpec spec;
      spec.skew = 3.0;  // replicas in exact mode
      const auto inputs = random_inputs(config, R, spec, options);
      Engine engine(config, R, options);
      engine.forward(inputs);
      const auto got = engine.clip_counts();
      ASSERT_EQ(got.size(), size_t(R));
      std::vector<std::vector<int64_t>> want(R, std::vector<int64_t>(2 * EL, 0));
      for (int64_t src = 0; src < R; ++src) {
        for (size_t i = 0; i < inputs[src].ids_TK.size(); ++i) {
          const int64_t e = inputs[src].ids_TK[i], owner = e / EL, j = e % EL, t = i / 2;
          const float* x = inputs[src].x_TD.data() + t * D;
          for (int64_t f = 0; f < F; ++f) {
            const int64_t g = layout == W13Layout::gate_up_blocked ? f : 2 * f;
            const int64_t u = layout == W13Layout::gate_up_blocked ? F + f : 2 * f + 1;
            auto h = [&](int64_t row) {
              const float* w = inputs[owner].w13.data() + (j * 2 * F + row) * D;
              float sum = 0.0f;
              for (int64_t d = 0; d < D; ++d) sum += x[d] * w[d];
              return round_to_bf16(sum);
            };
            want[owner][2 * j] += h(g) > 0.6f;
            want[owner][2 * j + 1] += std::abs(h(u)) > 0.6f;
          }
        }
      }
      EXPECT_EQ(got, want) << "balance " << to_string(balance) << " layout " << (layout == W13Layout::gate_up_blocked ? "blocked" : "interleaved");
      int64_t total = 0;
      for (const auto& r : got) for (int64_t c : r) total += c;
      EXPECT_GT(total, 0) << "the limit should clip something";
    }
  }
  Config plain = small_config(16, 64, 64, 8, 2);
  Engine engine(plain, 2, {});
  engine.forward(random_inputs(plain, 2, {}, {}));
  for (const auto& r : engine.clip_counts()) EXPECT_EQ(r, std::vector<int64_t>(8, 0)) << "plain SwiGLU clips nothing";
}

}  // namespace
}  // namespace poise::reference::testing
