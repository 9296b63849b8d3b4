// FP8 weight blocks on the host (reference::quantize_fp8_weight_blocks): the numerics' blocks, named
// errors; and the GPU entry point's host checks, which run before any CUDA call.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "numerics/block_scaling.hpp"
#include "poise/fp8.hpp"
#include "poise/reference.hpp"
#include "testing/rejected_name.hpp"

namespace poise {

using poise::testing::rejected_name;
namespace {

TEST(Fp8WeightBlocks, BlocksOf128By128WithTheLastOf64) {
  const int64_t rows = 192, cols = 320;  // 2 x 3 blocks, the last of each 64 wide
  std::vector<float> w(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = reference::round_to_bf16(std::sin(0.37f * float(r * cols + c)) * (1 + r / 128 + c / 128));
  const reference::Fp8WeightBlocks q = reference::quantize_fp8_weight_blocks(w, 1, rows, cols);
  ASSERT_EQ(q.scales.size(), 6u);
  for (int64_t rb = 0; rb < 2; ++rb)
    for (int64_t cb = 0; cb < 3; ++cb) {
      float amax = 0;
      for (int64_t r = rb * 128; r < std::min<int64_t>(rows, rb * 128 + 128); ++r)
        for (int64_t c = cb * 128; c < std::min<int64_t>(cols, cb * 128 + 128); ++c) amax = std::max(amax, std::abs(w[r * cols + c]));
      EXPECT_EQ(q.scales[rb * 3 + cb], amax / 448.0f) << rb << "," << cb;
    }
  double error2 = 0, norm2 = 0;  // e4m3 keeps 3 mantissa bits: within 2^-4 relative, per value
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float back = numerics::dequantize(q.values_MRC[i], q.scales[(i / cols / 128) * 3 + (i % cols) / 128]);
    error2 += double(back - w[i]) * (back - w[i]);
    norm2 += double(w[i]) * w[i];
  }
  EXPECT_LT(std::sqrt(error2 / norm2), 0.05);
}

TEST(Fp8WeightBlocks, ErrorsNameTheArgument) {
  std::vector<float> w(64 * 64, 0.5f);
  EXPECT_EQ(rejected_name([&] { reference::quantize_fp8_weight_blocks(w, 0, 64, 64); }), "matrices");
  EXPECT_EQ(rejected_name([&] { reference::quantize_fp8_weight_blocks(w, 1, 96, 64); }), "rows");
  EXPECT_EQ(rejected_name([&] { reference::quantize_fp8_weight_blocks(w, 1, 64, 32); }), "cols");
  EXPECT_EQ(rejected_name([&] { reference::quantize_fp8_weight_blocks(w, 2, 64, 64); }), "w");
  w[5] = 0.1f;  // not a bf16 value
  EXPECT_EQ(rejected_name([&] { reference::quantize_fp8_weight_blocks(w, 1, 64, 64); }), "w");
  // The GPU entry points (and the transposed one) check on the host first: no CUDA call is made for these.
  uint8_t values[1];
  float scales[1];
  for (auto quantize : {quantize_fp8_weight_blocks, quantize_fp8_weight_blocks_transposed}) {
    EXPECT_EQ(rejected_name([&] { quantize(nullptr, 1, 64, 64, values, scales, nullptr); }), "w");
    EXPECT_EQ(rejected_name([&] { quantize(w.data(), 1, 64, 64, nullptr, scales, nullptr); }), "values");
    EXPECT_EQ(rejected_name([&] { quantize(w.data(), 1, 64, 64, values, nullptr, nullptr); }), "scales");
    EXPECT_EQ(rejected_name([&] { quantize(w.data(), 1, 64, 100, values, scales, nullptr); }), "cols");
  }
}

}  // namespace
}  // namespace poise
