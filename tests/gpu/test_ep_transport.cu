// Virtual-rank transport: puts through peer pointers, the arrive-then-barrier of a launch split
// by rank, epochs across many rounds, and a peer that never arrives ending in a bounded timeout.
#include <gtest/gtest.h>

#include <chrono>

#include "testing/barrier_probe.hpp"
#include "comm/virtual_transport.hpp"
#include "runtime/device_info.hpp"
#include "poise/errors.hpp"

namespace poise::comm {
namespace {

bool have_gpu() { return cuda_device_count() > 0 && is_sm90_device(0); }

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class VirtualBarrier : public ::testing::TestWithParam<int> {};

TEST_P(VirtualBarrier, PutsArriveBeforeTheBarrierReleases) {
  if (!have_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const int world = GetParam();
  const int blocks_per_rank = 24;
  auto t = VirtualTransport::create(world, barrier_probe_workspace_bytes(world, blocks_per_rank), 2'000'000'000ull);
  int* mismatches = nullptr;
  CUDA_OK(cudaMalloc(&mismatches, sizeof(int)));
  CUDA_OK(cudaMemset(mismatches, 0, sizeof(int)));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (int round = 0; round < 50; ++round) {
    launch_barrier_probe_round(*t, blocks_per_rank, round, -1, stream);
    launch_barrier_probe_check(*t, blocks_per_rank, round, mismatches, stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  int host_mismatches = -1;
  CUDA_OK(cudaMemcpy(&host_mismatches, mismatches, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host_mismatches, 0);
  for (const ErrorWord& e : t->read_errors()) EXPECT_EQ(e.code, 0) << describe(e, t->timeout_ns());
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(mismatches));
}

INSTANTIATE_TEST_SUITE_P(Ranks, VirtualBarrier, ::testing::Values(1, 2, 4, 8));

TEST(VirtualBarrierTimeout, AbsentPeerEndsInReportedTimeoutNotHang) {
  if (!have_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const int world = 4, absent = 2, blocks_per_rank = 8;
  const uint64_t timeout_ns = 100'000'000ull;  // 100 ms
  auto t = VirtualTransport::create(world, barrier_probe_workspace_bytes(world, blocks_per_rank), timeout_ns);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const auto start = std::chrono::steady_clock::now();
  launch_barrier_probe_round(*t, blocks_per_rank, 0, absent, stream);
  launch_barrier_probe_round(*t, blocks_per_rank, 1, absent, stream);  // failed ranks skip at once
  CUDA_OK(cudaStreamSynchronize(stream));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0) << "the second round must not wait again";
  EXPECT_GE(seconds, 0.09) << "the wait ended before its bound";
  const auto errors = t->read_errors();
  for (int r = 0; r < world; ++r) {
    if (r == absent) {
      EXPECT_EQ(errors[r].code, 0);
      continue;
    }
    EXPECT_EQ(errors[r].code, int(ErrorCode::timeout)) << "rank " << r;
    EXPECT_EQ(errors[r].rank, r);
    EXPECT_EQ(errors[r].peer, absent);
    EXPECT_EQ(errors[r].phase, int(Phase::barrier_probe));
    const std::string msg = describe(errors[r], timeout_ns);
    EXPECT_NE(msg.find("waiting for rank 2"), std::string::npos) << msg;
  }
  // reset() makes the group usable again.
  t->reset();
  int* mismatches = nullptr;
  CUDA_OK(cudaMalloc(&mismatches, sizeof(int)));
  CUDA_OK(cudaMemset(mismatches, 0, sizeof(int)));
  launch_barrier_probe_round(*t, blocks_per_rank, 7, -1, stream);
  launch_barrier_probe_check(*t, blocks_per_rank, 7, mismatches, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  int host_mismatches = -1;
  CUDA_OK(cudaMemcpy(&host_mismatches, mismatches, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host_mismatches, 0);
  for (const ErrorWord& e : t->read_errors()) EXPECT_EQ(e.code, 0) << describe(e, timeout_ns);
  CUDA_OK(cudaFree(mismatches));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(VirtualTransportArgs, RejectsRankCountsItCannotLaunch) {
  EXPECT_THROW(VirtualTransport::create(0, 4096, 1), InvalidArgument);
  EXPECT_THROW(VirtualTransport::create(kMaxLaunchRanks + 1, 4096, 1), InvalidArgument);
}

}  // namespace
}  // namespace poise::comm
