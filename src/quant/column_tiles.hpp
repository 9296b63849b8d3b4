// FP8 column tiles on the device: WGRAD's operands (docs/fp8.md), whose reduction runs along the
// rows. Expert-grouped rows [rows][cols] quantized to E4M3 in 128 x 1 tiles counted from each
// group's first row, written transposed, [cols][rows]: FP8 wgmma reads no transposed operand, so
// WGRAD needs the rows K-major. The numerics of src/numerics/block_scaling.hpp (the reference's
// bits, numerics::quantize_column_tiles).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace poise::quant {

// The expert groups of grouped rows, on the device: group g is rows [offsets[g], offsets[g] +
// counts[g]), every offset a multiple of 128 (ep::kGroupAlignment), so no 128-row block spans two.
struct RowGroups {
  const int32_t* offsets = nullptr;
  const int32_t* counts = nullptr;
  int32_t groups = 0;
};

// x_RC: bf16 [rows][cols], rows a multiple of 128, cols of 64. values_CR: e4m3 [cols][rows];
// scales_BC: fp32 [rows / 128][cols], row block b's scale of each column. The rows of a group's last
// block past its count quantize as 0, so do blocks in no group (scale 1). Enqueued on `stream`.
void launch_column_tiles_transposed(const __nv_bfloat16* x_RC, int64_t rows, int64_t cols, const RowGroups& groups,
                                    uint8_t* values_CR, float* scales_BC, cudaStream_t stream);

// The same of rows held in FP8 1 x 128 row tiles (values_RC e4m3, scales_RT fp32 [rows][ceil(cols /
// 128)]): each value dequantized in fp32 first, as WGRAD W13 reads the x rows that crossed in FP8.
void launch_column_tiles_transposed(const uint8_t* x_RC, const float* x_scales_RT, int64_t rows, int64_t cols,
                                    const RowGroups& groups, uint8_t* values_CR, float* scales_BC,
                                    cudaStream_t stream);

}  // namespace poise::quant
