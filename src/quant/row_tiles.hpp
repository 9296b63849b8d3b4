// FP8 row tiles on the device: rows of bf16 activations quantized to E4M3 in 1 x 128 tiles along the
// row (the FPROP / DGRAD activation operand: x before dispatch, a after SwiGLU), with the numerics of
// src/numerics/block_scaling.hpp (so the reference's bits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace poise::quant {

// x_RC: rows x cols row-major bf16 (cols a multiple of 64). values_RC: e4m3 bits, same layout;
// scales_RT: fp32 [rows][ceil(cols/128)]. Enqueued on `stream`. rows_end (device int32, nullable):
// only rows [0, *rows_end) are quantized, the others left as they are (the rows a call's expert
// groups end at, known on the device only).
void launch_row_tiles(const __nv_bfloat16* x_RC, int64_t rows, int64_t cols, uint8_t* values_RC, float* scales_RT,
                      cudaStream_t stream, const int32_t* rows_end = nullptr);

// The way back: out_RC = bf16(e4m3(values_RC) * scale of its tile), the product in fp32 rounded to
// nearest (numerics::dequantize, then round to bf16: the reference's bits). values_RC 8-byte and
// out_RC 16-byte aligned; cols a multiple of 64; rows_end as above.
void launch_dequantize_row_tiles(const uint8_t* values_RC, const float* scales_RT, int64_t rows, int64_t cols,
                                 __nv_bfloat16* out_RC, cudaStream_t stream, const int32_t* rows_end = nullptr);

}  // namespace poise::quant
