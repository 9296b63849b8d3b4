// Host-side TMA descriptors (CUtensorMap) for row-major bf16 matrices, 128-byte swizzled boxes.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace poise::sm90 {

// A [rows, cols] row-major bf16 matrix at `base` (16-byte aligned, cols a multiple of 8),
// read in boxes of box_rows x 64 columns (64 bf16 = one 128-byte swizzle row).
// Boxes reaching past the matrix are zero-filled by the hardware.
CUtensorMap make_bf16_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                                 const char* argument_name);

// A [rows, cols] row-major e4m3 matrix (cols a multiple of 64) described as [rows, cols / 2] 16-bit
// elements, in boxes of box_rows x 64 of them: a box is 128 e4m3 of K, one 128-byte swizzle row,
// loaded at the coordinates of the BF16 kernels' 64-value boxes (TMA copies bytes; the pairing is
// invisible to the GEMM).
CUtensorMap make_fp8_tensor_map(const void* base, int64_t rows, int64_t cols, int box_rows, const char* argument_name);

// Epilogue store maps: 64-row boxes of 128 bytes (64 bf16 or 32 fp32 columns), same swizzle.
// A null `base` gives an all-zero map that must not be used (optional outputs).
CUtensorMap make_store_tensor_map(const void* base, bool fp32, int64_t rows, int64_t cols,
                                  const char* argument_name);

}  // namespace poise::sm90
