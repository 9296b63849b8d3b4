// Block scaling of FP8 GEMM operands, the DeepSeek-V3 recipe: one fp32 scale per block of values,
// value = e4m3 * scale, scale = amax(block) / 448 (1 for an all-zero block; NaN when the block
// holds a NaN, so a NaN reaches its whole block, as a NaN row reaches its whole output row in BF16).
// A value is quantized as e4m3(v / scale): an IEEE division, which the kernels compute too.
//
// The blocks, per GEMM operand (K is the GEMM's reduction dimension):
//  - activations and activation gradients, K along the row (FPROP, DGRAD): 1 x 128 row tiles;
//  - weights: 128 x 128 blocks (one scale serves both orientations, FPROP and DGRAD);
//  - WGRAD's operands, K along the tokens: 128 x 1 column tiles, counted from the start of each
//    expert's row group (groups never share a tile).
// A last block along a dimension that is a multiple of 64 but not of 128 holds 64.
#pragma once

#include <cstdint>
#include <vector>

#include "numerics/fp8_e4m3.hpp"
#include "numerics/host_device.hpp"

namespace poise::numerics {

inline constexpr int64_t kScaleBlock = 128;

POISE_HD inline int64_t scale_blocks(int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; }

// The running |v| maximum of a block; once a NaN is seen it stays NaN.
POISE_HD inline float amax_with(float amax, float v) {
  const float a = fabsf(v);
  return (a > amax || a != a) ? a : amax;
}

POISE_HD inline float block_scale(float amax) { return amax == 0.0f ? 1.0f : amax / kE4m3Max; }

POISE_HD inline uint8_t quantize(float v, float scale) { return to_e4m3(v / scale); }

POISE_HD inline float dequantize(uint8_t q, float scale) { return from_e4m3(q) * scale; }

// An FP8 operand on the host: e4m3 bits in the source's layout, and its block scales.
struct BlockScaled {
  std::vector<uint8_t> values;
  std::vector<float> scales;
};

// rows x cols, row-major, 1 x 128 tiles along the row: scales [rows][scale_blocks(cols)].
inline BlockScaled quantize_row_tiles(const float* x, int64_t rows, int64_t cols) {
  const int64_t tiles = scale_blocks(cols);
  BlockScaled out{std::vector<uint8_t>(rows * cols), std::vector<float>(rows * tiles)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t begin = t * kScaleBlock, end = begin + kScaleBlock < cols ? begin + kScaleBlock : cols;
      float amax = 0.0f;
      for (int64_t c = begin; c < end; ++c) amax = amax_with(amax, x[r * cols + c]);
      const float scale = block_scale(amax);
      out.scales[r * tiles + t] = scale;
      for (int64_t c = begin; c < end; ++c) out.values[r * cols + c] = quantize(x[r * cols + c], scale);
    }
  return out;
}

// matrices x rows x cols (one per expert), 128 x 128 blocks: scales [matrices][blocks(rows)][blocks(cols)].
inline BlockScaled quantize_weight_blocks(const float* w, int64_t matrices, int64_t rows, int64_t cols) {
  const int64_t row_blocks = scale_blocks(rows), col_blocks = scale_blocks(cols);
  BlockScaled out{std::vector<uint8_t>(matrices * rows * cols), std::vector<float>(matrices * row_blocks * col_blocks)};
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t rb = 0; rb < row_blocks; ++rb)
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t r0 = rb * kScaleBlock, r1 = r0 + kScaleBlock < rows ? r0 + kScaleBlock : rows;
        const int64_t c0 = cb * kScaleBlock, c1 = c0 + kScaleBlock < cols ? c0 + kScaleBlock : cols;
        const float* block = w + m * rows * cols;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = amax_with(amax, block[r * cols + c]);
        const float scale = block_scale(amax);
        out.scales[(m * row_blocks + rb) * col_blocks + cb] = scale;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) out.values[m * rows * cols + r * cols + c] = quantize(block[r * cols + c], scale);
      }
  return out;
}

// Column tiles over row groups: rows [group_offsets[g], + group_rows[g]) of a rows x cols matrix
// form group g; each group is cut into 128-row tiles from its first row. Scales: [tiles][cols],
// tiles numbered group by group. Rows outside every group are left 0.
inline BlockScaled quantize_column_tiles(const float* x, int64_t rows, int64_t cols,
                                         const std::vector<int64_t>& group_offsets,
                                         const std::vector<int64_t>& group_rows) {
  int64_t tiles = 0;
  for (int64_t n : group_rows) tiles += scale_blocks(n);
  BlockScaled out{std::vector<uint8_t>(rows * cols, 0), std::vector<float>(tiles * cols)};
  int64_t tile = 0;
  for (size_t g = 0; g < group_rows.size(); ++g)
    for (int64_t t0 = 0; t0 < group_rows[g]; t0 += kScaleBlock, ++tile) {
      const int64_t r0 = group_offsets[g] + t0;
      const int64_t r1 = r0 + (group_rows[g] - t0 < kScaleBlock ? group_rows[g] - t0 : kScaleBlock);
      for (int64_t c = 0; c < cols; ++c) {
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) amax = amax_with(amax, x[r * cols + c]);
        const float scale = block_scale(amax);
        out.scales[tile * cols + c] = scale;
        for (int64_t r = r0; r < r1; ++r) out.values[r * cols + c] = quantize(x[r * cols + c], scale);
      }
    }
  return out;
}

}  // namespace poise::numerics
