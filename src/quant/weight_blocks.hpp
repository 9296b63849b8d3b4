// FP8 weight blocks on the device: matrices of bf16 values quantized to E4M3 in 128 x 128 blocks,
// with the numerics of src/numerics/block_scaling.hpp (so the reference's bits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace poise::quant {

// w_MRC: `matrices` row-major [rows, cols] bf16 matrices. values_MRC: e4m3 bits, same layout;
// scales: fp32 [matrices][ceil(rows/128)][ceil(cols/128)]. Enqueued on `stream`; arguments checked
// by the caller (src/api/fp8_weights.cpp). rows_M (device int32 [matrices], nullable): matrix m is
// skipped, its values and scales left as they are, when rows_M[m] == 0 (an expert no row reads).
void launch_weight_blocks(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                          uint8_t* values_MRC, float* scales, cudaStream_t stream, const int32_t* rows_M = nullptr);

// The same blocks written transposed: values_MCR e4m3 [matrices][cols][rows] (value [m][c][r] is
// the e4m3 of w [m][r][c], quantized with its block's scale), scales_T fp32
// [matrices][ceil(cols/128)][ceil(rows/128)]. The bits of launch_weight_blocks' output transposed
// (a block's scale does not depend on its orientation): the K-major weights of the FP8 DGRAD GEMMs.
// rows_M as in launch_weight_blocks.
void launch_weight_blocks_transposed(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                                     uint8_t* values_MCR, float* scales_T, cudaStream_t stream,
                                     const int32_t* rows_M = nullptr);

}  // namespace poise::quant
