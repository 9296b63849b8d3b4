// runtime::HostBackedRange (src/runtime/host_backed_range.hpp): one address range, device memory
// then host memory mapped for the device. On the GPU: a kernel writes and reads every word across
// the boundary, the host part takes no device memory, a CUDA graph captured on the range replays
// on it. The layout arithmetic needs no GPU (HostBackedLayout.*, label cpu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/errors.hpp"
#include "runtime/host_backed_range.hpp"

namespace poise::runtime {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(HostBackedLayout, EachPartRoundsToItsGranularityAndTheBoundaryToBoth) {
  const HostBackedLayout a = host_backed_layout(3 * kMiB, 5 * kMiB, 2 * kMiB, 4096);
  EXPECT_EQ(a.device_part_bytes, 4 * kMiB);
  EXPECT_EQ(a.host_part_bytes, 5 * kMiB);
  EXPECT_EQ(a.alignment, 2 * kMiB);
  const HostBackedLayout b = host_backed_layout(1, 1, 2 * kMiB, 4 * kMiB);  // a host granularity above the device's
  EXPECT_EQ(b.device_part_bytes, 4 * kMiB);
  EXPECT_EQ(b.host_part_bytes, 4 * kMiB);
  EXPECT_EQ(b.alignment, 4 * kMiB);
  const HostBackedLayout c = host_backed_layout(0, 0, 2 * kMiB, 4096);  // no host part; never an empty device part
  EXPECT_EQ(c.device_part_bytes, 2 * kMiB);
  EXPECT_EQ(c.host_part_bytes, 0u);
}

__global__ void write_words(uint32_t* words, size_t count, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    words[i] = uint32_t(i) * 2654435761u + salt;
}

// words[i] += words[count - 1 - i] for the first half: every read of the device part meets the host
// part's mirror and the other way round.
__global__ void add_mirror(uint32_t* words, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count / 2; i += size_t(gridDim.x) * blockDim.x)
    words[i] += words[count - 1 - i];
}

uint32_t word(size_t i, uint32_t salt) { return uint32_t(i) * 2654435761u + salt; }

void expect_words(const uint32_t* words, size_t count, uint32_t salt, bool mirrored) {
  std::vector<uint32_t> host(count, 0xdeadbeef);
  ASSERT_EQ(cudaMemcpy(host.data(), words, count * sizeof(uint32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  size_t wrong = 0, first = count;
  for (size_t i = 0; i < count; ++i) {
    uint32_t want = word(i, salt);
    if (mirrored && i < count / 2) want += word(count - 1 - i, salt);
    if (host[i] != want && wrong++ == 0) first = i;
  }
  EXPECT_EQ(wrong, 0u) << "first wrong word " << first << " of " << count;
}

class HostBackedRangeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
    if (host_location_of(0) == HostLocation::none) {
      GTEST_SKIP() << "this driver maps no host memory through VMM (reported as a skip, not a pass)";
    }
  }
};

TEST_F(HostBackedRangeGpu, KernelsReadAndWriteAcrossTheBoundary) {
  HostBackedRange range(0, 3 * kMiB, 5 * kMiB);
  ASSERT_GE(range.device_part_bytes(), 3 * kMiB);
  ASSERT_GE(range.host_part_bytes(), 5 * kMiB);
  EXPECT_NE(range.host_location(), HostLocation::none);
  auto* words = static_cast<uint32_t*>(range.data());
  const size_t count = (range.device_part_bytes() + range.host_part_bytes()) / sizeof(uint32_t);
  const uint32_t salt = static_cast<uint32_t>(testing::fresh_seed());
  SCOPED_TRACE("salt " + std::to_string(salt));
  ASSERT_EQ(cudaMemset(words, 0xff, count * sizeof(uint32_t)), cudaSuccess);  // poisoned
  write_words<<<264, 256>>>(words, count, salt);
  add_mirror<<<264, 256>>>(words, count);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_words(words, count, salt, /*mirrored=*/true);
}

TEST_F(HostBackedRangeGpu, TheHostPartTakesNoDeviceMemory) {
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  HostBackedRange range(0, 64 * kMiB, 2048 * kMiB);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  const size_t taken = free_before > free_after ? free_before - free_after : 0;
  EXPECT_GE(taken, range.device_part_bytes());
  EXPECT_LT(taken, range.device_part_bytes() + 256 * kMiB) << "the 2 GiB host part should not take device memory";
}

TEST_F(HostBackedRangeGpu, AGraphCapturedOnTheRangeReplaysOnIt) {
  HostBackedRange range(0, 2 * kMiB, 2 * kMiB);
  auto* words = static_cast<uint32_t*>(range.data());
  const size_t count = (range.device_part_bytes() + range.host_part_bytes()) / sizeof(uint32_t);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  write_words<<<132, 256, 0, stream>>>(words, count, 7);
  add_mirror<<<132, 256, 0, stream>>>(words, count);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaMemset(words, 0, count * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_words(words, count, 7, /*mirrored=*/true);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(HostBackedRangeGpu, RangesComeAndGoWithoutLeaking) {
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int i = 0; i < 8; ++i) HostBackedRange range(0, 256 * kMiB, 64 * kMiB);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_LT(free_before > free_after ? free_before - free_after : 0, 64 * kMiB);
}

}  // namespace
}  // namespace poise::runtime
