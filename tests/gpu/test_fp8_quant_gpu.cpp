// FP8 quantization on the GPU against the reference's numerics, bit for bit up to a NaN's payload
// (the host's and the device's NaNs differ in their bits): the weights' 128 x 128 blocks (the public
// poise::quantize_fp8_weight_blocks, and quant::launch_weight_blocks_transposed against the
// reference's blocks transposed on the host) and the activations' 1 x 128 row tiles
// (quant::launch_row_tiles, and back: quant::launch_dequantize_row_tiles).
// Random bf16 values with an all-zero tile, a NaN (its whole tile NaN), a value far beyond 448, dims
// that are multiples of 64 but not of 128; outputs poisoned first. Buffers `misalign` values past an
// aligned address take the kernels' scalar path (the vector loads need 16-byte aligned bf16).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "gpu_test_support.hpp"
#include "numerics/block_scaling.hpp"
#include "poise/fp8.hpp"
#include "poise/reference.hpp"
#include "quant/column_tiles.hpp"
#include "quant/row_tiles.hpp"
#include "quant/weight_blocks.hpp"

namespace poise {
namespace {

struct Shape {
  int64_t matrices, rows, cols;
  int misalign = 0;  // values by which the input and output buffers start past an aligned address
};

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  return std::to_string(info.param.matrices) + "x" + std::to_string(info.param.rows) + "x" +
         std::to_string(info.param.cols) + (info.param.misalign ? "_misaligned" : "");
}

// Random bf16 values of `shape`, the first (up to) 128 x 128 zero, one value far beyond 448, the last NaN.
std::vector<float> test_values(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(s.matrices * s.rows * s.cols);
  for (float& v : w) v = reference::round_to_bf16(normal(rng) * 0.02f);
  for (int64_t r = 0; r < 128 && r < s.rows; ++r)
    for (int64_t c = 0; c < 128 && c < s.cols; ++c) w[r * s.cols + c] = 0.0f;
  w[w.size() / 2] = reference::round_to_bf16(3.0e4f);
  w.back() = NAN;
  return w;
}

// The bf16 bits of values that hold bf16 values.
std::vector<uint16_t> bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], sizeof u);
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  return bits;
}

// `quantize` run on the device over `w` (as bf16) into poisoned buffers, both `misalign` values past
// cudaMalloc's alignment: (values, scales).
using DeviceQuantize = std::function<void(const void* w, uint8_t* values, float* scales)>;
std::pair<std::vector<uint8_t>, std::vector<float>> on_device(const std::vector<float>& w, size_t num_scales,
                                                              int misalign, const DeviceQuantize& quantize) {
  const std::vector<uint16_t> bits = bf16_bits(w);
  void *w_dev = nullptr, *values_dev = nullptr, *scales_dev = nullptr;
  EXPECT_EQ(cudaMalloc(&w_dev, (w.size() + misalign) * 2), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&values_dev, w.size() + misalign), cudaSuccess);
  auto* const w_at = static_cast<uint16_t*>(w_dev) + misalign;
  auto* const values_at = static_cast<uint8_t*>(values_dev) + misalign;
  EXPECT_EQ(cudaMalloc(&scales_dev, num_scales * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(w_at, bits.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(values_dev, 0xA5, w.size() + misalign), cudaSuccess);
  EXPECT_EQ(cudaMemset(scales_dev, 0xFF, num_scales * sizeof(float)), cudaSuccess);
  quantize(w_at, values_at, static_cast<float*>(scales_dev));
  std::pair<std::vector<uint8_t>, std::vector<float>> out{std::vector<uint8_t>(w.size()), std::vector<float>(num_scales)};
  EXPECT_EQ(cudaMemcpy(out.first.data(), values_at, w.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.second.data(), scales_dev, num_scales * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(w_dev), cudaFree(values_dev), cudaFree(scales_dev);
  return out;
}

void expect_same_bits(const std::pair<std::vector<uint8_t>, std::vector<float>>& got,
                      const std::vector<uint8_t>& want_values, const std::vector<float>& want_scales) {
  ASSERT_EQ(got.second.size(), want_scales.size());
  int64_t differing_scales = 0;
  for (size_t i = 0; i < want_scales.size(); ++i)
    differing_scales += !(got.second[i] == want_scales[i] || (std::isnan(got.second[i]) && std::isnan(want_scales[i])));
  EXPECT_EQ(differing_scales, 0) << "scales differ from the reference";
  auto nan_byte = [](uint8_t q) { return (q & 0x7F) == 0x7F; };
  int64_t differing = 0;
  for (size_t i = 0; i < want_values.size(); ++i)
    differing += got.first[i] != want_values[i] && !(nan_byte(got.first[i]) && nan_byte(want_values[i]));
  EXPECT_EQ(differing, 0) << "e4m3 values differ from the reference";
  EXPECT_TRUE(std::isnan(got.second.back())) << "a NaN's scale is NaN";
  if (want_scales.size() > 1) EXPECT_EQ(got.second[0], 1.0f) << "an all-zero tile's scale is 1";
}

class Fp8WeightBlocksGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(Fp8WeightBlocksGpu, EqualTheReferenceBitForBit) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> w = test_values(s, seed);
  const reference::Fp8WeightBlocks want = reference::quantize_fp8_weight_blocks(w, s.matrices, s.rows, s.cols);
  expect_same_bits(on_device(w, want.scales.size(), s.misalign,
                             [&](const void* dev, uint8_t* values, float* scales) {
                               quantize_fp8_weight_blocks(dev, s.matrices, s.rows, s.cols, values, scales, nullptr);
                             }),
                   want.values_MRC, want.scales);
}

// The reference's blocks in launch_weight_blocks_transposed's layout: values_MRC holds [m][c][r],
// scales [m][ceil(cols/128)][ceil(rows/128)].
reference::Fp8WeightBlocks transposed(const reference::Fp8WeightBlocks& q, const Shape& s) {
  const int64_t row_blocks = numerics::scale_blocks(s.rows), col_blocks = numerics::scale_blocks(s.cols);
  reference::Fp8WeightBlocks t{std::vector<uint8_t>(q.values_MRC.size()), std::vector<float>(q.scales.size())};
  for (int64_t m = 0; m < s.matrices; ++m) {
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t c = 0; c < s.cols; ++c)
        t.values_MRC[(m * s.cols + c) * s.rows + r] = q.values_MRC[(m * s.rows + r) * s.cols + c];
    for (int64_t rb = 0; rb < row_blocks; ++rb)
      for (int64_t cb = 0; cb < col_blocks; ++cb)
        t.scales[(m * col_blocks + cb) * row_blocks + rb] = q.scales[(m * row_blocks + rb) * col_blocks + cb];
  }
  return t;
}

// The DGRAD GEMMs' K-major weights: the same bits as EqualTheReferenceBitForBit's, transposed.
TEST_P(Fp8WeightBlocksGpu, TransposedEqualsTheReferenceTransposed) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> w = test_values(s, seed);
  const reference::Fp8WeightBlocks want =
      transposed(reference::quantize_fp8_weight_blocks(w, s.matrices, s.rows, s.cols), s);
  expect_same_bits(on_device(w, want.scales.size(), s.misalign,
                             [&](const void* dev, uint8_t* values, float* scales) {
                               quant::launch_weight_blocks_transposed(static_cast<const __nv_bfloat16*>(dev),
                                                                      s.matrices, s.rows, s.cols, values, scales,
                                                                      nullptr);
                               ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                             }),
                   want.values_MRC, want.scales);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8WeightBlocksGpu,
                         ::testing::Values(Shape{3, 192, 320}, Shape{2, 256, 128}, Shape{1, 64, 64}, Shape{4, 1536, 2048},
                                           Shape{37, 320, 448}, Shape{3, 192, 320, 1}),
                         shape_name);

// The pipeline's per-call quantization skips the experts no row reads (rows_M[m] == 0): their
// values and scales stay as they were (here the poison); the others are the reference's bits, in
// either orientation (a matrix keeps its place in both layouts).
TEST_P(Fp8WeightBlocksGpu, SkipTheMatricesNoRowReads) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();
  if (s.matrices < 2) GTEST_SKIP() << "needs a matrix to skip and one to quantize";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> w = test_values(s, seed);
  const reference::Fp8WeightBlocks blocks = reference::quantize_fp8_weight_blocks(w, s.matrices, s.rows, s.cols);
  std::vector<int32_t> rows_M(s.matrices);
  for (int64_t m = 0; m < s.matrices; ++m) rows_M[m] = m % 2 == 0 ? 0 : static_cast<int32_t>(m);  // even: no rows
  int32_t* rows_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&rows_dev, rows_M.size() * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(rows_dev, rows_M.data(), rows_M.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
  for (const bool transpose : {false, true}) {
    SCOPED_TRACE(transpose ? "launch_weight_blocks_transposed" : "launch_weight_blocks");
    const reference::Fp8WeightBlocks want = transpose ? transposed(blocks, s) : blocks;
    const auto launch = transpose ? quant::launch_weight_blocks_transposed : quant::launch_weight_blocks;
    const auto got = on_device(w, want.scales.size(), s.misalign, [&](const void* dev, uint8_t* values, float* scales) {
      launch(static_cast<const __nv_bfloat16*>(dev), s.matrices, s.rows, s.cols, values, scales, nullptr, rows_dev);
    });
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const int64_t per_matrix = s.rows * s.cols, scales_per_matrix = static_cast<int64_t>(want.scales.size()) / s.matrices;
    auto nan_byte = [](uint8_t q) { return (q & 0x7F) == 0x7F; };
    int64_t wrong = 0;
    for (int64_t m = 0; m < s.matrices; ++m) {
      for (int64_t i = m * per_matrix; i < (m + 1) * per_matrix; ++i) {
        const uint8_t q = got.first[i], want_q = want.values_MRC[i];
        wrong += rows_M[m] == 0 ? q != 0xA5 : (q != want_q && !(nan_byte(q) && nan_byte(want_q)));
      }
      for (int64_t i = m * scales_per_matrix; i < (m + 1) * scales_per_matrix; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &got.second[i], sizeof bits);
        wrong += rows_M[m] == 0 ? bits != 0xFFFFFFFFu
                                : !(got.second[i] == want.scales[i] ||
                                    (std::isnan(got.second[i]) && std::isnan(want.scales[i])));
      }
    }
    EXPECT_EQ(wrong, 0) << "skipped matrices written, or quantized ones differing from the reference";
  }
  cudaFree(rows_dev);
}

class Fp8RowTilesGpu : public ::testing::TestWithParam<Shape> {};

TEST_P(Fp8RowTilesGpu, EqualTheReferenceBitForBit) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();  // matrices: 1 (rows x cols activations)
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = test_values(s, seed);
  const numerics::BlockScaled want = numerics::quantize_row_tiles(x.data(), s.rows, s.cols);
  expect_same_bits(on_device(x, want.scales.size(), s.misalign,
                             [&](const void* dev, uint8_t* values, float* scales) {
                               quant::launch_row_tiles(static_cast<const __nv_bfloat16*>(dev), s.rows, s.cols, values,
                                                       scales, nullptr);
                               ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                             }),
                   want.values, want.scales);
}

// rows_end (device int32): only rows [0, *rows_end) are quantized, as the FP8 forward quantizes the
// rows up to its last expert group's end; the rows past it keep their poison.
TEST_P(Fp8RowTilesGpu, StopAtTheRowsEnd) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = test_values(s, seed);
  const numerics::BlockScaled want = numerics::quantize_row_tiles(x.data(), s.rows, s.cols);
  const int32_t end = static_cast<int32_t>(s.rows / 2);  // 0 for one row: nothing quantized
  int32_t* end_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&end_dev, sizeof end), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(end_dev, &end, sizeof end, cudaMemcpyHostToDevice), cudaSuccess);
  const auto got = on_device(x, want.scales.size(), s.misalign, [&](const void* dev, uint8_t* values, float* scales) {
    quant::launch_row_tiles(static_cast<const __nv_bfloat16*>(dev), s.rows, s.cols, values, scales, nullptr, end_dev);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  });
  cudaFree(end_dev);
  const int64_t tiles_per_row = numerics::scale_blocks(s.cols);
  auto nan_byte = [](uint8_t q) { return (q & 0x7F) == 0x7F; };
  int64_t wrong = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const uint8_t q = got.first[r * s.cols + c], want_q = want.values[r * s.cols + c];
      wrong += r >= end ? q != 0xA5 : (q != want_q && !(nan_byte(q) && nan_byte(want_q)));
    }
    for (int64_t t = 0; t < tiles_per_row; ++t) {
      const float v = got.second[r * tiles_per_row + t], w = want.scales[r * tiles_per_row + t];
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      wrong += r >= end ? bits != 0xFFFFFFFFu : !(v == w || (std::isnan(v) && std::isnan(w)));
    }
  }
  EXPECT_EQ(wrong, 0) << "rows past the end written, or rows before it differing from the reference";
}

// The way back (the FP8 backward's x rows for a BF16 WGRAD): quant::launch_dequantize_row_tiles of
// the reference's tiles gives bf16(dequantize(q, scale)) bit for bit (a NaN for a NaN) for rows
// [0, rows_end), and leaves the rows past it poisoned. Aligned buffers (the kernel's contract).
TEST_P(Fp8RowTilesGpu, DequantizeToTheReferenceBf16) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const Shape s = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = test_values(s, seed);
  const numerics::BlockScaled tiles = numerics::quantize_row_tiles(x.data(), s.rows, s.cols);
  const int32_t end = static_cast<int32_t>(s.rows - s.rows / 3);
  const size_t n = size_t(s.rows * s.cols);
  uint8_t* values = nullptr;
  float* scales = nullptr;
  uint16_t* out = nullptr;
  int32_t* end_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&values, n), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&scales, tiles.scales.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&end_dev, sizeof end), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(values, tiles.values.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(scales, tiles.scales.data(), tiles.scales.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(end_dev, &end, sizeof end, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(out, 0xFF, n * 2), cudaSuccess);  // bf16 NaN with every payload bit set
  quant::launch_dequantize_row_tiles(values, scales, s.rows, s.cols, reinterpret_cast<__nv_bfloat16*>(out), nullptr,
                                     end_dev);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), out, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(values), cudaFree(scales), cudaFree(out), cudaFree(end_dev);
  const int64_t tiles_per_row = numerics::scale_blocks(s.cols);
  auto is_nan = [](uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0; };
  int64_t wrong = 0, nonzero = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const uint16_t g = got[r * s.cols + c];
      if (r >= end) {
        wrong += g != 0xFFFF;
        continue;
      }
      const float v = numerics::dequantize(tiles.values[r * s.cols + c],
                                           tiles.scales[r * tiles_per_row + c / numerics::kScaleBlock]);
      const uint16_t want = reference::bf16_bits(v);
      wrong += g != want && !(is_nan(g) && is_nan(want));
      nonzero += v != 0.0f;
    }
  }
  EXPECT_EQ(wrong, 0) << "dequantized values differ from the reference, or rows past the end written";
  if (end > 0) EXPECT_GT(nonzero, 0) << "the inputs dequantize to zeros only";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8RowTilesGpu,
                         ::testing::Values(Shape{1, 77, 192}, Shape{1, 64, 128}, Shape{1, 1, 64}, Shape{1, 4096, 7168},
                                           Shape{1, 5, 64}, Shape{1, 77, 192, 3}),
                         shape_name);

// WGRAD's operands: grouped rows in 128 x 1 column tiles counted from each group's first row,
// written transposed. Groups start at multiples of 128; counts leave partial last blocks, an empty
// group leaves a block in no group, dims 64 mod 128.
struct ColumnTilesCase {
  const char* name;
  int64_t rows, cols;
  std::vector<int64_t> offsets, counts;
};

class Fp8ColumnTilesGpu : public ::testing::TestWithParam<ColumnTilesCase> {};

// GPU values [cols][rows] and scales [rows / 128][cols] from `launch` into poisoned buffers.
using ColumnTilesLaunch = std::function<void(const quant::RowGroups&, uint8_t* values_CR, float* scales_BC)>;
std::pair<std::vector<uint8_t>, std::vector<float>> column_tiles_on_device(const ColumnTilesCase& k,
                                                                           const ColumnTilesLaunch& launch) {
  std::vector<int32_t> offsets(k.offsets.begin(), k.offsets.end()), counts(k.counts.begin(), k.counts.end());
  int32_t *offsets_dev = nullptr, *counts_dev = nullptr;
  uint8_t* values_dev = nullptr;
  float* scales_dev = nullptr;
  const int64_t blocks = k.rows / 128;
  EXPECT_EQ(cudaMalloc(&offsets_dev, offsets.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&counts_dev, counts.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(offsets_dev, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(counts_dev, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&values_dev, k.rows * k.cols), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&scales_dev, blocks * k.cols * 4), cudaSuccess);
  EXPECT_EQ(cudaMemset(values_dev, 0xA5, k.rows * k.cols), cudaSuccess);
  EXPECT_EQ(cudaMemset(scales_dev, 0xFF, blocks * k.cols * 4), cudaSuccess);
  launch({offsets_dev, counts_dev, static_cast<int32_t>(offsets.size())}, values_dev, scales_dev);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::pair<std::vector<uint8_t>, std::vector<float>> out{std::vector<uint8_t>(k.rows * k.cols),
                                                          std::vector<float>(blocks * k.cols)};
  EXPECT_EQ(cudaMemcpy(out.first.data(), values_dev, out.first.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.second.data(), scales_dev, out.second.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(offsets_dev), cudaFree(counts_dev), cudaFree(values_dev), cudaFree(scales_dev);
  return out;
}

// The reference's column tiles (compact tile numbers, [rows][cols] values) against the device's
// (row-block numbers, transposed values); blocks in no group: values 0, scale 1.
void expect_column_tiles(const ColumnTilesCase& k, const std::vector<float>& x,
                         const std::pair<std::vector<uint8_t>, std::vector<float>>& got) {
  const numerics::BlockScaled want = numerics::quantize_column_tiles(x.data(), k.rows, k.cols, k.offsets, k.counts);
  auto same_byte = [](uint8_t a, uint8_t b) { return a == b || ((a & 0x7F) == 0x7F && (b & 0x7F) == 0x7F); };
  auto same_scale = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  int64_t wrong_values = 0, wrong_scales = 0;
  for (int64_t r = 0; r < k.rows; ++r)
    for (int64_t c = 0; c < k.cols; ++c) wrong_values += !same_byte(got.first[c * k.rows + r], want.values[r * k.cols + c]);
  std::vector<float> want_scales(got.second.size(), 1.0f);
  int64_t tile = 0;
  for (size_t g = 0; g < k.counts.size(); ++g)
    for (int64_t t0 = 0; t0 < k.counts[g]; t0 += 128, ++tile)
      for (int64_t c = 0; c < k.cols; ++c)
        want_scales[(k.offsets[g] + t0) / 128 * k.cols + c] = want.scales[tile * k.cols + c];
  for (size_t i = 0; i < want_scales.size(); ++i) wrong_scales += !same_scale(got.second[i], want_scales[i]);
  EXPECT_EQ(wrong_values, 0) << "e4m3 values differ from the reference's (transposed)";
  EXPECT_EQ(wrong_scales, 0) << "scales differ from the reference's";
}

// Random bf16 values with a NaN inside the first group and one value far beyond 448.
std::vector<float> column_tile_values(const ColumnTilesCase& k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(k.rows * k.cols);
  for (float& v : x) v = reference::round_to_bf16(normal(rng));
  x[k.cols + 1] = reference::round_to_bf16(3.0e4f);
  if (k.counts[0] > 3) x[3 * k.cols + k.cols - 1] = NAN;
  return x;
}

TEST_P(Fp8ColumnTilesGpu, EqualTheReferenceTransposed) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const ColumnTilesCase k = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<float> x = column_tile_values(k, seed);
  const std::vector<uint16_t> bits = bf16_bits(x);
  void* x_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&x_dev, bits.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x_dev, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  const auto got = column_tiles_on_device(k, [&](const quant::RowGroups& g, uint8_t* values, float* scales) {
    quant::launch_column_tiles_transposed(static_cast<const __nv_bfloat16*>(x_dev), k.rows, k.cols, g, values, scales,
                                          nullptr);
  });
  cudaFree(x_dev);
  expect_column_tiles(k, x, got);
}

// x as it crossed the wire: FP8 row tiles, dequantized in fp32 before its column tiles.
TEST_P(Fp8ColumnTilesGpu, OfFp8RowsEqualTheReferenceOfTheirDequantizedValues) {
  if (!testing::have_sm90_gpu()) GTEST_SKIP() << "needs an SM90 GPU";
  const ColumnTilesCase k = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const numerics::BlockScaled rows = numerics::quantize_row_tiles(column_tile_values(k, seed).data(), k.rows, k.cols);
  const int64_t tiles_per_row = numerics::scale_blocks(k.cols);
  std::vector<float> x_deq(k.rows * k.cols);
  for (int64_t i = 0; i < k.rows * k.cols; ++i)
    x_deq[i] = numerics::dequantize(rows.values[i], rows.scales[i / k.cols * tiles_per_row + i % k.cols / 128]);
  uint8_t* values_dev = nullptr;
  float* scales_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&values_dev, rows.values.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&scales_dev, rows.scales.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(values_dev, rows.values.data(), rows.values.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(scales_dev, rows.scales.data(), rows.scales.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const auto got = column_tiles_on_device(k, [&](const quant::RowGroups& g, uint8_t* values, float* scales) {
    quant::launch_column_tiles_transposed(values_dev, scales_dev, k.rows, k.cols, g, values, scales, nullptr);
  });
  cudaFree(values_dev), cudaFree(scales_dev);
  expect_column_tiles(k, x_deq, got);
}

TEST(Fp8ColumnTiles, RefuseRowsNotInWholeBlocks) {
  const quant::RowGroups none{};
  uint8_t* values = reinterpret_cast<uint8_t*>(uintptr_t{256});
  float* scales = reinterpret_cast<float*>(uintptr_t{256});
  EXPECT_THROW(quant::launch_column_tiles_transposed(static_cast<const __nv_bfloat16*>(nullptr), 100, 64, none, values,
                                                     scales, nullptr),
               InvalidArgument);
  EXPECT_THROW(quant::launch_column_tiles_transposed(static_cast<const __nv_bfloat16*>(nullptr), 128, 96, none, values,
                                                     scales, nullptr),
               InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Fp8ColumnTilesGpu,
    ::testing::Values(ColumnTilesCase{"partial_empty_and_gap", 768, 192, {0, 128, 256, 384, 640}, {100, 0, 128, 200, 5}},
                      ColumnTilesCase{"one_group_all_rows", 384, 64, {0}, {384}},
                      ColumnTilesCase{"one_row", 128, 128, {0}, {1}},
                      ColumnTilesCase{"deepseek_w13_slice", 4096, 2048, {0, 1024, 2048, 3072}, {1000, 1024, 0, 777}}),
    [](const ::testing::TestParamInfo<ColumnTilesCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace poise
