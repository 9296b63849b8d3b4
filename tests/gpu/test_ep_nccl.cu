// NcclTransport with one rank (one process, one GPU): the window registration, LSA pointers,
// barrier probe and the whole staged layer over it, against the float64 model. Multi-GPU runs
// need the same binary launched once per GPU (not available on the test machine).
#include <gtest/gtest.h>

#include "testing/barrier_probe.hpp"
#include "comm/nccl_transport.hpp"
#include "runtime/device_info.hpp"
#include "test_ep_world.hpp"

namespace poise::ep::testing {
namespace {

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
    int version = 0;
    ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
    if (version < 22800) GTEST_SKIP() << "NCCL " << version << " has no LSA window device API (needs 2.28)";
    int devices[1] = {0};
    ASSERT_EQ(ncclCommInitAll(&comm_, 1, devices), ncclSuccess);
  }
  void TearDown() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  ncclComm_t comm_ = nullptr;
};

TEST_F(NcclOneRank, BarrierProbeOverWindow) {
  const int blocks_per_rank = 16;
  auto t = comm::NcclTransport::create(comm_, comm::barrier_probe_workspace_bytes(1, blocks_per_rank), 1'000'000'000ull);
  int* mismatches = nullptr;
  EP_CUDA_OK(cudaMalloc(&mismatches, sizeof(int)));
  EP_CUDA_OK(cudaMemset(mismatches, 0, sizeof(int)));
  for (int round = 0; round < 10; ++round) {
    comm::launch_barrier_probe_round(*t, blocks_per_rank, round, -1, nullptr);
    comm::launch_barrier_probe_check(*t, blocks_per_rank, round, mismatches, nullptr);
  }
  EP_CUDA_OK(cudaDeviceSynchronize());
  int host = -1;
  EP_CUDA_OK(cudaMemcpy(&host, mismatches, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host, 0);
  EXPECT_EQ(t->read_errors()[0].code, 0) << comm::describe(t->read_errors()[0], t->timeout_ns());
  EP_CUDA_OK(cudaFree(mismatches));
}

TEST_F(NcclOneRank, LayerForwardBackwardMatchesModel) {
  const LayerCase c{1, 96, 192, 128, 8, 4};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ncclComm_t comm = comm_;
  EpWorld w(c, seed, 2'000'000'000ull, [comm](const Config& cfg) {
    return StagedPipeline::create(cfg, comm::NcclTransport::create(comm, StagedPipeline::workspace_bytes(cfg, 1),
                                                                   2'000'000'000ull));
  });
  const auto model = run_model(w.shape(), w.host());
  cudaStream_t stream;
  EP_CUDA_OK(cudaStreamCreate(&stream));
  ASSERT_NO_FATAL_FAILURE(run_pass(w, stream));
  RankDevice& d = w.dev()[0];
  EXPECT_LT(relative_error(bf16_values(d.out->download<uint16_t>(size_t(c.T) * c.D)), model[0].out_TD), 1e-2);
  EXPECT_LT(relative_error(bf16_values(d.grad_x->download<uint16_t>(size_t(c.T) * c.D)), model[0].grad_x_TD), 1e-2);
  EXPECT_LT(relative_error(w.scores_as_double(*d.grad_scores), model[0].grad_scores_TK), 1e-2);
  const size_t w13n = size_t(c.E) * 2 * c.F * c.D, w2n = size_t(c.E) * c.D * c.F;
  EXPECT_LT(relative_error(d.grad_w13->download<float>(w13n), model[0].grad_w13_E2FD), 1e-2);
  EXPECT_LT(relative_error(d.grad_w2->download<float>(w2n), model[0].grad_w2_EDF), 1e-2);
  EP_CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace poise::ep::testing
