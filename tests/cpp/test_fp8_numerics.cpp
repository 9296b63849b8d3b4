// FP8 E4M3 conversion and block scaling (src/numerics), on the CPU: the conversion gives the bits of
// CUDA's own (cuda_fp8.h, the SATFINITE round-to-nearest-even of cvt.rn.satfinite.e4m3x2.f32) on
// every E4M3 value, every tie between neighbours and their surroundings, special values and a
// million random floats; the block scales follow the recipe's blocks, bound the error, and keep NaN.
#include <gtest/gtest.h>

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "numerics/block_scaling.hpp"
#include "numerics/fp8_e4m3.hpp"

namespace poise::numerics {
namespace {

uint8_t cuda_e4m3(float f) { return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)); }

float cuda_from_e4m3(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

bool same_bits_or_both_nan(uint8_t a, uint8_t b) {
  const bool nan_a = (a & 0x7F) == 0x7F, nan_b = (b & 0x7F) == 0x7F;
  return nan_a || nan_b ? nan_a == nan_b : a == b;
}

void expect_matches_cuda(float f) {
  EXPECT_TRUE(same_bits_or_both_nan(to_e4m3(f), cuda_e4m3(f)))
      << "f=" << f << " (bits 0x" << std::hex << float_bits(f) << "): ours 0x" << int(to_e4m3(f)) << ", CUDA 0x"
      << int(cuda_e4m3(f));
}

TEST(Fp8E4m3, DecodesEveryValueAsCudaDoes) {
  for (int b = 0; b < 256; ++b) {
    const float ours = from_e4m3(static_cast<uint8_t>(b)), cuda = cuda_from_e4m3(static_cast<uint8_t>(b));
    if (std::isnan(cuda)) {
      EXPECT_TRUE(std::isnan(ours)) << b;
    } else {
      EXPECT_EQ(ours, cuda) << b;
    }
  }
  EXPECT_EQ(from_e4m3(kE4m3MaxBits), 448.0f);
  EXPECT_EQ(from_e4m3(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8E4m3, EncodesValuesTiesAndNeighboursAsCudaDoes) {
  std::vector<float> values;
  for (int b = 0; b < 0x7F; ++b) values.push_back(from_e4m3(static_cast<uint8_t>(b)));
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    const float tie = 0.5f * (values[i] + values[i + 1]);  // exact: neighbours differ in a few low bits
    for (float f : {values[i], tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e9f)}) {
      expect_matches_cuda(f);
      expect_matches_cuda(-f);
    }
  }
  for (float f : {0.0f, -0.0f, 448.0f, 449.0f, 463.99f, 464.0f, 465.0f, 480.0f, 1e30f, 3.0e38f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
                  std::ldexp(1.0f, -10), std::ldexp(1.0f, -10) * 1.0001f, std::ldexp(3.0f, -11)})
    expect_matches_cuda(f);
}

TEST(Fp8E4m3, EncodesAMillionRandomFloatsAsCudaDoes) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-24, 12);
  for (int i = 0; i < 1000000; ++i) {
    const float f = std::ldexp(mantissa(rng), exponent(rng)) * (i % 2 ? -1.0f : 1.0f);
    if (to_e4m3(f) != cuda_e4m3(f)) {
      expect_matches_cuda(f);
      return;
    }
  }
}

TEST(BlockScaling, RowTilesScaleEachTileToItsAmax) {
  const int64_t rows = 3, cols = 192;  // a full tile and a 64-wide last tile per row
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = normal(rng);
  x[1 * cols + 5] = 0.0f;
  for (int64_t c = 128; c < 192; ++c) x[2 * cols + c] = 0.0f;  // an all-zero tile: scale 1, zeros
  const BlockScaled q = quantize_row_tiles(x.data(), rows, cols);
  ASSERT_EQ(q.scales.size(), size_t(rows * 2));
  EXPECT_EQ(q.scales[2 * 2 + 1], 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < 2; ++t) {
      float amax = 0.0f;
      for (int64_t c = t * 128; c < std::min<int64_t>(cols, t * 128 + 128); ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const float scale = q.scales[r * 2 + t];
      EXPECT_EQ(scale, amax == 0.0f ? 1.0f : amax / 448.0f);
      for (int64_t c = t * 128; c < std::min<int64_t>(cols, t * 128 + 128); ++c) {
        const float v = x[r * cols + c], back = dequantize(q.values[r * cols + c], scale);
        // E4M3 keeps 4 significant bits: half an ulp is 2^-4 relative; below 2^-6 * scale, subnormal steps.
        EXPECT_LE(std::fabs(back - v), std::max(std::fabs(v) * 0.0625f, scale * std::ldexp(1.0f, -10)) * 1.0001f)
            << r << "," << c;
        if (std::fabs(v) == amax && amax > 0.0f) EXPECT_EQ(q.values[r * cols + c] & 0x7F, kE4m3MaxBits);
      }
    }
}

TEST(BlockScaling, ANanReachesItsBlockOnly) {
  std::vector<float> x(2 * 256, 1.5f);
  x[0 * 256 + 130] = NAN;
  const BlockScaled q = quantize_row_tiles(x.data(), 2, 256);
  EXPECT_TRUE(std::isnan(q.scales[0 * 2 + 1]));
  for (int64_t c = 128; c < 256; ++c) EXPECT_TRUE(std::isnan(dequantize(q.values[c], q.scales[1]))) << c;
  for (int64_t c = 0; c < 128; ++c) EXPECT_EQ(dequantize(q.values[c], q.scales[0]), 1.5f) << c;
  for (int64_t c = 0; c < 256; ++c) EXPECT_EQ(dequantize(q.values[256 + c], q.scales[2 + c / 128]), 1.5f) << c;
}

TEST(BlockScaling, WeightBlocksAre128By128PerMatrix) {
  const int64_t matrices = 2, rows = 192, cols = 320;  // 2 x 3 blocks, the last ones 64 wide / tall
  std::vector<float> w(matrices * rows * cols);
  for (int64_t i = 0; i < int64_t(w.size()); ++i) w[i] = std::sin(0.37f * float(i)) * float(1 + i % 5);
  w[1 * rows * cols + 130 * cols + 300] = 1000.0f;  // matrix 1, block (1, 2): its amax
  const BlockScaled q = quantize_weight_blocks(w.data(), matrices, rows, cols);
  ASSERT_EQ(q.scales.size(), size_t(matrices * 2 * 3));
  EXPECT_EQ(q.scales[(1 * 2 + 1) * 3 + 2], 1000.0f / 448.0f);
  EXPECT_EQ(q.values[1 * rows * cols + 130 * cols + 300], kE4m3MaxBits);
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = m * rows * cols + r * cols + c;
        const float scale = q.scales[(m * 2 + r / 128) * 3 + c / 128];
        EXPECT_LE(std::fabs(dequantize(q.values[i], scale) - w[i]),
                  std::max(std::fabs(w[i]) * 0.0625f, scale * std::ldexp(1.0f, -10)) * 1.0001f);
      }
}

TEST(BlockScaling, ColumnTilesStartAtEachGroupAndNeverCrossOne) {
  // Groups of 0, 130 and 64 rows at offsets 0, 0 and 256 (rows 130..255 belong to no group).
  const int64_t rows = 320, cols = 3;
  std::vector<float> x(rows * cols, 0.25f);
  x[129 * cols + 1] = 8.0f;    // group 1, its second tile (rows 128..129), column 1
  x[256 * cols + 2] = -64.0f;  // group 2, its only tile, column 2
  const BlockScaled q = quantize_column_tiles(x.data(), rows, cols, {0, 0, 256}, {0, 130, 64});
  ASSERT_EQ(q.scales.size(), size_t((2 + 1) * cols));  // 2 tiles for 130 rows, 1 for 64
  EXPECT_EQ(q.scales[0 * cols + 1], 0.25f / 448.0f);   // rows 0..127: the 8 is not in this tile
  EXPECT_EQ(q.scales[1 * cols + 1], 8.0f / 448.0f);
  EXPECT_EQ(q.scales[2 * cols + 2], 64.0f / 448.0f);
  EXPECT_EQ(q.values[129 * cols + 1], kE4m3MaxBits);
  EXPECT_EQ(q.values[256 * cols + 2], 0x80 | kE4m3MaxBits);
  EXPECT_EQ(q.values[200 * cols + 0], 0) << "rows outside every group stay 0";
  for (int64_t r = 0; r < 128; ++r) EXPECT_EQ(dequantize(q.values[r * cols + 1], q.scales[1]), 0.25f);
}

}  // namespace
}  // namespace poise::numerics
