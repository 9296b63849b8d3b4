// poise::quantize_fp8_weight_blocks on the GPU against reference::quantize_fp8_weight_blocks, bit for
// bit: random bf16 weights with an all-zero block, a NaN (its whole block NaN), values far beyond
// 448 (scaled into range), dims that are multiples of 64 but not of 128; outputs poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_support.hpp"
#include "poise/fp8.hpp"
#include "poise/reference.hpp"

namespace poise {
namespace {

struct Shape {
  int64_t matrices, rows, cols;
};

class Fp8WeightsGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(Fp8WeightsGpu, EqualTheReferenceBitForBit) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const auto [matrices, rows, cols] = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = matrices * rows * cols;
  std::vector<float> w(n);
  for (float& v : w) v = reference::round_to_bf16(normal(rng) * 0.02f);
  for (int64_t r = 0; r < 64; ++r)  // matrix 0's first block: its top half zero (the rest random)
    for (int64_t c = 0; c < 128 && c < cols; ++c) w[r * cols + c] = 0.0f;
  w[n - 1] = NAN;                                              // the last block: NaN everywhere
  w[n / 2] = reference::round_to_bf16(3.0e4f);                 // a value far beyond 448
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &w[i], sizeof u);
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  const reference::Fp8WeightBlocks want = reference::quantize_fp8_weight_blocks(w, matrices, rows, cols);

  void *w_dev = nullptr, *values_dev = nullptr, *scales_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&w_dev, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&values_dev, n), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&scales_dev, want.scales.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(w_dev, bits.data(), n * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(values_dev, 0xA5, n), cudaSuccess);  // poison
  ASSERT_EQ(cudaMemset(scales_dev, 0xFF, want.scales.size() * sizeof(float)), cudaSuccess);
  quantize_fp8_weight_blocks(w_dev, matrices, rows, cols, static_cast<uint8_t*>(values_dev),
                             static_cast<float*>(scales_dev), nullptr);
  std::vector<uint8_t> values(n);
  std::vector<float> scales(want.scales.size());
  ASSERT_EQ(cudaMemcpy(values.data(), values_dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(scales.data(), scales_dev, scales.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(w_dev), cudaFree(values_dev), cudaFree(scales_dev);

  // Bit for bit, a NaN's payload aside (the host's and the device's NaNs differ in their bits).
  int64_t differing_scales = 0;
  for (size_t i = 0; i < scales.size(); ++i)
    differing_scales += !(scales[i] == want.scales[i] || (std::isnan(scales[i]) && std::isnan(want.scales[i])));
  EXPECT_EQ(differing_scales, 0) << "scales differ from the reference";
  auto nan_byte = [](uint8_t q) { return (q & 0x7F) == 0x7F; };
  int64_t differing = 0;
  for (int64_t i = 0; i < n; ++i) differing += values[i] != want.values_MRC[i] && !(nan_byte(values[i]) && nan_byte(want.values_MRC[i]));
  EXPECT_EQ(differing, 0) << "e4m3 values differ from the reference";
  EXPECT_TRUE(std::isnan(scales.back())) << "a NaN's block scale is NaN";
  EXPECT_EQ(values[0], 0) << "a zero stays zero";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8WeightsGpu,
                         ::testing::Values(Shape{3, 192, 320}, Shape{2, 256, 128}, Shape{1, 64, 64}, Shape{4, 1536, 2048}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::to_string(info.param.matrices) + "x" + std::to_string(info.param.rows) + "x" +
                                  std::to_string(info.param.cols);
                         });

}  // namespace
}  // namespace poise
