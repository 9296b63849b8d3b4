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

// One scale block of a row-major matrix with `cols` columns, rows [r0, r1) x columns [c0, c1):
// quantized with the block's own scale into the same places of `values`; returns the scale. The
// amax is order-free (amax_with), so every block shape below shares this one loop.
inline float quantize_block(const float* x, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                            uint8_t* values) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = amax_with(amax, x[r * cols + c]);
  const float scale = block_scale(amax);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) values[r * cols + c] = quantize(x[r * cols + c], scale);
  return scale;
}

// The end of the scale block that starts at `begin` along a dimension of `size`.
inline int64_t block_end(int64_t begin, int64_t size) { return begin + kScaleBlock < size ? begin + kScaleBlock : size; }

// rows x cols, row-major, 1 x 128 tiles along the row: scales [rows][scale_blocks(cols)].
inline BlockScaled quantize_row_tiles(const float* x, int64_t rows, int64_t cols) {
  const int64_t tiles = scale_blocks(cols);
  BlockScaled out{std::vector<uint8_t>(rows * cols), std::vector<float>(rows * tiles)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c0 = t * kScaleBlock;
      out.scales[r * tiles + t] = quantize_block(x, cols, r, r + 1, c0, block_end(c0, cols), out.values.data());
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
        const int64_t r0 = rb * kScaleBlock, c0 = cb * kScaleBlock;
        out.scales[(m * row_blocks + rb) * col_blocks + cb] =
            quantize_block(w + m * rows * cols, cols, r0, block_end(r0, rows), c0, block_end(c0, cols),
                           out.values.data() + m * rows * cols);
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
      const int64_t r0 = group_offsets[g] + t0, r1 = group_offsets[g] + block_end(t0, group_rows[g]);
      for (int64_t c = 0; c < cols; ++c)
        out.scales[tile * cols + c] = quantize_block(x, cols, r0, r1, c, c + 1, out.values.data());
    }
  return out;
}

}  // namespace poise::numerics
