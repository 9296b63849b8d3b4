// FP8 block-scaled expert weights (docs/fp8.md "Weights"): what the FP8 GEMMs read, prepared by the
// caller once per optimizer step (or once, for inference).
#pragma once

#include <cstdint>

#include "poise/context.hpp"  // Stream

namespace poise {

// Quantizes `matrices` row-major bf16 [rows, cols] matrices (every local expert's W13 [2F, D], or
// W2 [D, F]) to E4M3 in 128 x 128 blocks, DeepSeek-V3's recipe: values_MRC e4m3 bits in the same
// layout, scales fp32 [matrices][ceil(rows/128)][ceil(cols/128)] (value = e4m3 * scale). Enqueued
// on `stream` (no host sync; CUDA-graph safe; the buffers are the caller's, refilled in place).
// rows and cols: positive multiples of 64. Bits equal reference::quantize_fp8_weight_blocks's.
// Throws InvalidArgument naming the argument before any kernel runs.
void quantize_fp8_weight_blocks(const void* w_MRC, int64_t matrices, int64_t rows, int64_t cols, uint8_t* values_MRC,
                                float* scales, Stream stream);

// The same blocks transposed, the K-major weights the FP8 DGRAD GEMMs read (BackwardArgs::w13_fp8_t
// ...): values_MCR e4m3 [matrices][cols][rows], scales fp32 [matrices][ceil(cols/128)][ceil(rows/128)]:
// quantize_fp8_weight_blocks' bits transposed (a block's scale does not depend on its orientation).
void quantize_fp8_weight_blocks_transposed(const void* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                                           uint8_t* values_MCR, float* scales, Stream stream);

}  // namespace poise
