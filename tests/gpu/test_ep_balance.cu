// Exact balance in the staged EP pipeline (virtual ranks), against the float64 layer model and
// against the capacity-mode pipeline on the same inputs:
//  - the planner kernel's plan equals the shared planner run on the host from the same counts;
//  - every (t, k) lands in a group of its expert (own slot or the replica slot the plan says),
//    rows unique, every rank computes exactly T*K rows (at most (1+eps)*T*K with a tolerance);
//  - out, grad_x, grad_scores, grad_w13, grad_w2 match the float64 model (replica weight grads
//    reduced to the owners), and match capacity mode (rows bitwise, weight grads to fp32 order);
//  - routings: random, one hot expert, all K experts of a token on one rank, an idle rank,
//    every token on rank 0's experts (peak/mean = R); R in {1, 2, 4, 8};
//  - one captured graph replays correctly across routings (static memory and launches).
#include <gtest/gtest.h>

#include <set>

#include "balance/balance_cost.hpp"
#include "core/workspace_layout.hpp"
#include "runtime/device_info.hpp"
#include "poise/errors.hpp"
#include "test_ep_world.hpp"
#include "testing/rejected_name.hpp"

namespace poise::ep::testing {
namespace {

struct BalanceCase {
  LayerCase layer;
  bool all_on_rank0 = false;  // every token picks K experts of rank 0: peak/mean = R
  double tolerance = 0.0;
  DType replica_grads = DType::bf16;  // Config::replica_grad_dtype
};

std::string balance_case_name(const ::testing::TestParamInfo<BalanceCase>& info) {
  return case_name(info.param.layer) + (info.param.all_on_rank0 ? "_allOnRank0" : "") +
         (info.param.tolerance > 0 ? "_tol" + std::to_string(int(info.param.tolerance * 100)) : "") +
         (info.param.replica_grads == DType::fp32 ? "_fp32ReplicaGrads" : "");
}

std::unique_ptr<EpWorld> make_world(const BalanceCase& b, uint64_t seed, Balance mode) {
  LayerCase c = b.layer;
  if (mode == Balance::capacity) c.capacity_factor = c.R;  // room for any routing
  PipelineOptions o;
  o.timeout_ns = 2'000'000'000ull;
  auto world = std::make_unique<EpWorld>(c, seed, o.timeout_ns, [=](const Config& config) {
    Config x = config;
    x.balance = mode;
    x.balance_tolerance = b.tolerance;
    x.replica_grad_dtype = b.replica_grads;
    return StagedPipeline::create_virtual(x, c.R, o);
  });
  if (b.all_on_rank0) {
    const int EL = c.E / c.R;
    std::mt19937_64 rng(seed ^ 0x5eed);
    for (int r = 0; r < c.R; ++r) {
      auto& ids = world->host()[r].ids_TK;
      for (int t = 0; t < c.T; ++t) {
        std::vector<int32_t> pool(EL);
        for (int j = 0; j < EL; ++j) pool[j] = j;
        std::shuffle(pool.begin(), pool.end(), rng);
        for (int k = 0; k < c.K; ++k) ids[size_t(t) * c.K + k] = pool[k];
      }
      world->dev()[r].ids->upload(ids);
    }
  }
  return world;
}

// The plan the host computes from the routed counts with the same shared planner code.
struct HostPlan {
  std::vector<int32_t> kept;
  std::vector<plan::shared::ReplicaPiece> pieces;
};

HostPlan host_plan(const EpWorld& w, int row_limit, int B) {
  const LayerCase& c = w.c();
  const int E = c.E, R = c.R, L = E / R;
  std::vector<int32_t> counts(E, 0);
  for (int r = 0; r < R; ++r)
    for (int32_t e : w.host()[r].ids_TK) counts[e] += 1;
  std::vector<int32_t> position(E), sequence(E), start(R * (L + 1)), remaining(R), received(R), replicas(R),
      donors(R), takers(2 * R);
  std::vector<plan::shared::ReplicaPiece> pieces(std::max(1, R * B));
  plan::shared::BalanceProblem p{counts.data(), R, L, c.T * c.K, row_limit, B};
  plan::shared::BalanceScratch s{position.data(), sequence.data(), start.data(), remaining.data(), received.data(),
                                 replicas.data(), donors.data(), takers.data(), pieces.data()};
  int32_t n = 0;
  plan::shared::plan_balance_serial(p, s, &n);
  HostPlan h;
  for (int e = 0; e < E; ++e) h.kept.push_back(plan::shared::kept_rows(p, s, e));
  h.pieces.assign(pieces.begin(), pieces.begin() + n);
  std::sort(h.pieces.begin(), h.pieces.end(), [](const auto& a, const auto& b) {
    return a.expert != b.expert ? a.expert < b.expert : a.begin < b.begin;
  });
  return h;
}

// The device plan equals the host's with row limit U; each (t, k) sits in a group of its own
// expert; rows unique; every rank computes C rows (at most U when U > C).
void check_plan_with_limit(EpWorld& w, int U) {
  const LayerCase& c = w.c();
  const int R = c.R, L = c.E / R, C = c.T * c.K, B = L;
  const HostPlan want = host_plan(w, U, B);
  std::vector<LayoutSnapshot> snaps;
  for (int r = 0; r < R; ++r) {
    const PlanSnapshot got = w.pipeline().plan_snapshot(r);
    ASSERT_TRUE(got.exact) << "rank " << r;
    EXPECT_EQ(got.kept_E, want.kept) << "rank " << r;
    ASSERT_EQ(got.pieces.size(), want.pieces.size()) << "rank " << r;
    for (size_t i = 0; i < want.pieces.size(); ++i) {
      const auto &a = got.pieces[i], &b = want.pieces[i];
      EXPECT_TRUE(a.expert == b.expert && a.rank == b.rank && a.slot == b.slot && a.begin == b.begin && a.end == b.end)
          << "rank " << r << " piece " << i;
    }
    EXPECT_LE(got.max_rank_rows, U);
    EXPECT_EQ(got.row_limit, U) << "rank " << r;
    snaps.push_back(w.pipeline().snapshot(r));
  }
  const int G = L + B;
  // expert_of[d][g]: the expert rank d computes in group g (-1: unused slot).
  std::vector<std::vector<int>> expert_of(R, std::vector<int>(G, -1));
  for (int d = 0; d < R; ++d)
    for (int j = 0; j < L; ++j) expert_of[d][j] = d * L + j;
  for (const auto& p : want.pieces) expert_of[p.rank][p.slot] = p.expert;
  for (int d = 0; d < R; ++d) {
    int rows = 0;
    for (int g = 0; g < G; ++g) {
      EXPECT_EQ(snaps[d].group_offsets[g] % 128, 0);
      rows += snaps[d].group_counts[g];
    }
    if (U == C) EXPECT_EQ(rows, C) << "rank " << d << " must compute exactly T*K rows";
    EXPECT_LE(rows, U) << "rank " << d;
  }
  std::set<std::pair<int, int>> used;
  for (int src = 0; src < R; ++src) {
    const auto& ids = w.host()[src].ids_TK;
    for (size_t i = 0; i < ids.size(); ++i) {
      const int d = snaps[src].dest_rank_TK[i], row = snaps[src].dest_row_TK[i];
      ASSERT_TRUE(d >= 0 && d < R) << "src " << src << " entry " << i;
      const LayoutSnapshot& s = snaps[d];
      int g = 0;
      while (g + 1 < G && s.group_offsets[g + 1] <= row) ++g;
      ASSERT_EQ(expert_of[d][g], ids[i]) << "src " << src << " entry " << i << " rank " << d << " row " << row;
      ASSERT_LT(row, s.group_offsets[g] + s.group_counts[g]);
      ASSERT_TRUE(used.insert({d, row}).second) << "row " << row << " of rank " << d << " used twice";
      EXPECT_EQ(s.row_origin[row], src * c.T * c.K + int(i));
    }
  }
}

void check_plan_and_layout(EpWorld& w, double tolerance) {
  const int C = w.c().T * w.c().K;
  check_plan_with_limit(w, C + int(std::floor(tolerance * C)));
}

void check_against_model(EpWorld& w, const std::vector<ModelOut>& model) {
  const LayerCase& c = w.c();
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    RankDevice& d = w.dev()[r];
    check_rows(bf16_values(d.out->download<uint16_t>(size_t(c.T) * c.D)), model[r].out_TD, c.T, c.D, "out_TD");
    check_rows(bf16_values(d.grad_x->download<uint16_t>(size_t(c.T) * c.D)), model[r].grad_x_TD, c.T, c.D,
               "grad_x_TD", &model[r].grad_x_clamp_slack_T);
    EXPECT_LT(relative_error(w.scores_as_double(*d.grad_scores), model[r].grad_scores_TK), kTolerance);
    check_weight_grads(w, model, r);
    check_clip_counts(w, model, r);
  }
}

class EpBalance : public ::testing::TestWithParam<BalanceCase> {};

TEST_P(EpBalance, MatchesFloat64ModelAndCapacityMode) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const BalanceCase& b = GetParam();
  const LayerCase& c = b.layer;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  auto exact = make_world(b, seed, Balance::exact);
  const auto model = run_model(exact->shape(), exact->host());
  run_pass(*exact, stream);
  check_plan_and_layout(*exact, b.tolerance);
  check_against_model(*exact, model);

  // Capacity mode on the same inputs: every row is the same computation on another rank, so the
  // layer outputs agree bitwise; weight gradients differ only in fp32 summation order, and by the
  // bf16 rounding of the replicas' shares when they travel in bf16 (Config::replica_grad_dtype).
  auto capacity = make_world(b, seed, Balance::capacity);
  ASSERT_EQ(capacity->host()[0].x_TD, exact->host()[0].x_TD);
  run_pass(*capacity, stream);
  const size_t TD = size_t(c.T) * c.D;
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    RankDevice &e = exact->dev()[r], &k = capacity->dev()[r];
    EXPECT_EQ(e.out->download<uint16_t>(TD), k.out->download<uint16_t>(TD)) << "out_TD";
    EXPECT_EQ(e.grad_x->download<uint16_t>(TD), k.grad_x->download<uint16_t>(TD)) << "grad_x_TD";
    // bf16 gradients: exact balance rounds a replicated expert's gradient twice (own part, then
    // with the replicas' fp32 sum), capacity mode once.
    const double tolerance = c.wgrad == DType::bf16 ? 1e-2 : b.replica_grads == DType::bf16 ? 4e-3 : 1e-5;
    auto to_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    EXPECT_LT(relative_error(exact->grad_w13(r), to_double(capacity->grad_w13(r))), tolerance) << "grad_w13";
    EXPECT_LT(relative_error(exact->grad_w2(r), to_double(capacity->grad_w2(r))), tolerance) << "grad_w2";
  }
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Routings, EpBalance,
    ::testing::Values(BalanceCase{LayerCase{1, 100, 192, 128, 8, 4}},
                      BalanceCase{LayerCase{2, 77, 128, 192, 8, 3}},
                      BalanceCase{LayerCase{2, 77, 128, 192, 8, 3}, false, 0.0, DType::fp32},
                      BalanceCase{LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert}, false, 0.0, DType::fp32},
                      BalanceCase{LayerCase{8, 40, 128, 128, 32, 4}, true, 0.0, DType::fp32},
                      BalanceCase{LayerCase{4, 64, 192, 128, 16, 4}},
                      BalanceCase{LayerCase{8, 48, 192, 128, 32, 4}},
                      BalanceCase{LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert}},
                      BalanceCase{LayerCase{4, 64, 192, 128, 16, 4, Routing::hot_expert}},
                      BalanceCase{LayerCase{8, 40, 128, 128, 16, 2, Routing::hot_expert}},
                      BalanceCase{LayerCase{8, 40, 128, 128, 32, 4, Routing::same_rank}},
                      BalanceCase{LayerCase{4, 64, 192, 192, 16, 4, Routing::skip_last}},
                      BalanceCase{LayerCase{8, 40, 128, 128, 32, 4}, true},
                      BalanceCase{LayerCase{8, 40, 128, 128, 32, 4, Routing::random, 2.0, Activation::swiglu,
                                            DType::fp32, true},
                                  true},
                      BalanceCase{LayerCase{2, 64, 128, 128, 8, 2, Routing::hot_expert, 2.0, Activation::swiglu_clamped,
                                            DType::bf16, false, 0.75}},
                      BalanceCase{LayerCase{8, 48, 128, 128, 16, 2, Routing::hot_expert, 2.0, Activation::swiglu,
                                            DType::fp32, true}},
                      BalanceCase{LayerCase{4, 64, 192, 128, 16, 4, Routing::hot_expert, 2.0, Activation::swiglu_clamped,
                                            DType::fp32, false, 0.75, W13Layout::gate_up_interleaved, DType::bf16}},
                      BalanceCase{LayerCase{8, 40, 128, 192, 32, 4, Routing::random, 2.0, Activation::swiglu,
                                            DType::bf16, true, 7.0, W13Layout::gate_up_blocked, DType::bf16},
                                  true},
                      BalanceCase{LayerCase{8, 40, 128, 128, 32, 4}, true, 0.25},
                      BalanceCase{LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert}, false, 0.1}),
    balance_case_name);

// The cost-aware plan (Config::balance_cost_*): the planner kernel picks the row limit the host
// picks from the same counts (plan::choose_row_limit over layout::row_limit, the same rates), its
// plan is the host's at that limit, and the layer still matches the float64 model. A fast link makes
// replicas cheap (exact balance, U = T*K); a slow one makes them dear (a larger U, fewer moved rows).
struct CostCase {
  LayerCase layer;
  double link_gb_per_s = 0.0;
  bool expect_exact_balance = false;
};

class EpBalanceCostAware : public ::testing::TestWithParam<CostCase> {};

TEST_P(EpBalanceCostAware, KernelChoosesTheHostsRowLimitAndPlan) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const CostCase& k = GetParam();
  const LayerCase& c = k.layer;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Config chosen_config;
  PipelineOptions o;
  o.timeout_ns = 2'000'000'000ull;
  EpWorld w(c, seed, o.timeout_ns, [&](const Config& config) {
    Config x = config;
    x.balance = Balance::exact;
    x.receive_capacity_factor = 2.0;
    x.balance_cost_ns_per_row = 400.0;
    x.balance_cost_ns_per_group = 0.0;  // rows alone: a free link then makes U = T*K the only best
    x.balance_link_gb_per_s = k.link_gb_per_s;
    chosen_config = x;
    return StagedPipeline::create_virtual(x, c.R, o);
  });
  const auto model = run_model(w.shape(), w.host());
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  run_pass(w, stream);
  std::vector<int64_t> counts(c.E, 0);
  for (int r = 0; r < c.R; ++r)
    for (int32_t e : w.host()[r].ids_TK) counts[e] += 1;
  const int C = c.T * c.K;
  const plan::CostAwareChoice want = plan::choose_row_limit(counts, c.R, C, c.E / c.R, layout::row_limit(chosen_config),
                                                            plan::balance_cost_rates(chosen_config));
  if (k.expect_exact_balance) EXPECT_EQ(want.row_limit, C);
  else EXPECT_GT(want.row_limit, C);
  check_plan_with_limit(w, int(want.row_limit));
  check_against_model(w, model);
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Links, EpBalanceCostAware,
    ::testing::Values(CostCase{LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert}, 1e6, true},
                      CostCase{LayerCase{4, 64, 128, 128, 16, 4, Routing::hot_expert}, 0.001, false},
                      CostCase{LayerCase{8, 40, 128, 192, 32, 4, Routing::hot_expert}, 0.001, false},
                      CostCase{LayerCase{2, 77, 128, 192, 8, 3}, 1e6, true}),
    [](const ::testing::TestParamInfo<CostCase>& info) {
      return case_name(info.param.layer) + (info.param.expect_exact_balance ? "_fastLink" : "_slowLink");
    });

TEST(EpBalanceGraph, ReplayFollowsNewRoutingWithStaticMemory) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const BalanceCase b{LayerCase{4, 64, 128, 128, 16, 4}};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto w = make_world(b, seed, Balance::exact);
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  w->forward(stream);
  w->backward(stream);
  ASSERT_NO_THROW(w->pipeline().check(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  EP_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  w->forward(stream);
  w->backward(stream);
  EP_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  EP_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  EP_CUDA_OK(cudaGraphLaunch(exec, stream));
  ASSERT_NO_THROW(w->pipeline().check(stream));
  size_t free_before = 0, total = 0;
  EP_CUDA_OK(cudaMemGetInfo(&free_before, &total));
  for (Routing routing : {Routing::hot_expert, Routing::random, Routing::skip_last, Routing::same_rank}) {
    SCOPED_TRACE(to_string(routing));
    w->new_routing(routing);
    w->poison_outputs();
    const auto model = run_model(w->shape(), w->host());
    EP_CUDA_OK(cudaGraphLaunch(exec, stream));
    ASSERT_NO_THROW(w->pipeline().check(stream));
    check_against_model(*w, model);
    check_plan_and_layout(*w, 0.0);
  }
  size_t free_after = 0;
  EP_CUDA_OK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(free_after, free_before) << "replays must not allocate";
  EP_CUDA_OK(cudaGraphExecDestroy(exec));
  EP_CUDA_OK(cudaGraphDestroy(graph));
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

TEST(EpBalanceErrors, FewReplicaSlotsOverflowIsReported) {
  if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  // B = 0: no replicas, so every token on rank 0's experts cannot fit T*K rows: reported, no hang.
  const LayerCase c{4, 64, 128, 128, 16, 4};
  PipelineOptions o;
  o.timeout_ns = 200'000'000ull;
  o.replica_slots = 0;
  EpWorld w(c, fresh_seed(), o.timeout_ns, [=](const Config& config) {
    Config x = config;
    x.balance = Balance::exact;
    return StagedPipeline::create_virtual(x, c.R, o);
  });
  for (int r = 0; r < c.R; ++r) {
    auto& ids = w.host()[r].ids_TK;
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i % c.K);
    w.dev()[r].ids->upload(ids);
  }
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  w.forward(stream);
  try {
    w.pipeline().check(stream);
    ADD_FAILURE() << "expected a capacity overflow";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
  w.pipeline().reset();
  w.new_routing(Routing::random);
  w.forward(stream);
  EXPECT_NO_THROW(w.pipeline().check(stream));
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

// The layer the host-validation tests size pipelines for (exact balance, 4 ranks: E_local = 4).
Config host_check_config() {
  Config cfg;
  cfg.num_local_input_tokens = 64;
  cfg.hidden_dim = 128;
  cfg.intermediate_dim = 128;
  cfg.top_k = 4;
  cfg.num_experts = 16;
  cfg.balance = Balance::exact;
  return cfg;
}

TEST(EpBalanceErrors, HostRejectsBadOptions) {
  Config cfg = host_check_config();
  PipelineOptions o;
  o.replica_slots = 5;  // E_local = 4 at R = 4
  EXPECT_THROW(StagedPipeline::workspace_bytes(cfg, 4, o), InvalidArgument);
  o.replica_slots = -1;
  cfg.balance_tolerance = 16.5;  // past what the pipeline supports
  EXPECT_THROW(StagedPipeline::workspace_bytes(cfg, 4, o), InvalidArgument);
  cfg.balance_tolerance = 0.0;
  // Memory depends only on the configuration: B = E_local slots of weights and fp32 gradients.
  const size_t with_slots = StagedPipeline::workspace_bytes(cfg, 4, o);
  o.replica_slots = 0;
  EXPECT_GT(with_slots, StagedPipeline::workspace_bytes(cfg, 4, o));
}

// Activation records (Context sizes them from the plan): bad counts and partial rows are named.
TEST(EpRecordErrors, HostRejectsBadRecordOptions) {
  Config cfg = host_check_config();  // made an inference config below
  auto name_of = [&](const PipelineOptions& o) {
    return poise::testing::rejected_name([&] { StagedPipeline::workspace_bytes(cfg, 4, o); });
  };
  PipelineOptions o;
  o.activation_records = -1;
  EXPECT_EQ(name_of(o), "activation_records");
  o.activation_records = 0;
  o.light_activation_records = -1;
  EXPECT_EQ(name_of(o), "light_activation_records");
  o.light_activation_records = 0;
  o.partial_activation_records = 1;
  o.partial_record_rows = 100;  // not a multiple of 128
  EXPECT_EQ(name_of(o), "partial_record_rows");
  o.partial_record_rows = 1 << 20;  // past the receive rows
  EXPECT_EQ(name_of(o), "partial_record_rows");
  o.partial_record_rows = 128;
  EXPECT_EQ(name_of(o), "(accepted)");
  // More records, more window: each whole record's x rows and metadata live there.
  o.activation_records = 1;
  const size_t one = StagedPipeline::workspace_bytes(cfg, 4, o);
  o.activation_records = 2;
  EXPECT_GT(StagedPipeline::workspace_bytes(cfg, 4, o), one);
  cfg.inference = true;
  o.partial_activation_records = 0;
  EXPECT_EQ(name_of(o), "activation_records");
}

}  // namespace
}  // namespace poise::ep::testing
