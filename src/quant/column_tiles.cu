// One CTA per 128-row block x 64 columns: the block's values land in shared memory column by
// column (fp32, exact for bf16 and for dequantized e4m3), each column's amax is reduced over the
// block's rows that belong to its group, then each thread quantizes 32 rows of one column and stores
// them as 32 contiguous bytes of that column's transposed row. The column-major tile has a stride of
// 129 floats, so a warp touching 32 columns at one row, or one row offset of 32 columns, hits 32
// banks.
#include "quant/column_tiles.hpp"

#include "numerics/block_scaling.hpp"
#include "poise/errors.hpp"
#include "quant/e4m3_vectors.cuh"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kBlockRows = static_cast<int>(numerics::kScaleBlock);  // 128
constexpr int kBlockCols = 64;
constexpr int kStride = kBlockRows + 1;
constexpr int kRowsPerThread = kBlockRows / (kThreads / kBlockCols);  // 32

struct Bf16Rows {
  const __nv_bfloat16* x;
  int64_t cols;
  __device__ float at(int64_t r, int64_t c) const { return __bfloat162float(x[r * cols + c]); }
};

struct Fp8Rows {
  const uint8_t* x;
  const float* scales;
  int64_t cols, tiles_per_row;
  __device__ float at(int64_t r, int64_t c) const {
    return numerics::dequantize(x[r * cols + c], scales[r * tiles_per_row + c / numerics::kScaleBlock]);
  }
};

// Rows of the block starting at row0 that belong to a group (the rest quantize as 0).
__device__ int valid_rows_of(const RowGroups& groups, int64_t row0) {
  __shared__ int valid;
  if (threadIdx.x == 0) valid = 0;
  __syncthreads();
  for (int g = threadIdx.x; g < groups.groups; g += kThreads) {
    const int64_t offset = groups.offsets[g], end = offset + groups.counts[g];
    if (offset <= row0 && row0 < end) valid = static_cast<int>(min(end - row0, int64_t(kBlockRows)));
  }
  __syncthreads();
  return valid;
}

template <class Rows>
__global__ void __launch_bounds__(kThreads)
    column_tiles_kernel(Rows x, int64_t rows, RowGroups groups, uint8_t* values_CR, float* scales_BC) {
  __shared__ float tile[kBlockCols * kStride];
  __shared__ float partial_amax[kThreads / kBlockCols][kBlockCols];
  const int64_t row0 = int64_t(blockIdx.y) * kBlockRows, col0 = int64_t(blockIdx.x) * kBlockCols;
  const int valid = valid_rows_of(groups, row0);
  const int c = threadIdx.x % kBlockCols, part = threadIdx.x / kBlockCols;
  float amax = 0.0f;
  for (int r = part; r < valid; r += kThreads / kBlockCols) {
    const float v = x.at(row0 + r, col0 + c);
    tile[c * kStride + r] = v;
    amax = numerics::amax_with(amax, v);
  }
  partial_amax[part][c] = amax;
  __syncthreads();
  for (int p = 0; p < kThreads / kBlockCols; ++p) amax = numerics::amax_with(amax, partial_amax[p][c]);
  const float scale = numerics::block_scale(amax);
  if (part == 0) scales_BC[blockIdx.y * x.cols + col0 + c] = scale;
  // Thread (c, part) stores rows [32 part, 32 part + 32) of column c: 32 bytes, 8 words.
  uint32_t words[kRowsPerThread / 4];
#pragma unroll
  for (int w = 0; w < kRowsPerThread / 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      // Rows past the group's count are 0 bytes whatever the scale (a NaN scale would make 0 / NaN).
      const int r = part * kRowsPerThread + 4 * w + 2 * pair;
      const uint32_t mask = (r < valid ? 0x00FFu : 0u) | (r + 1 < valid ? 0xFF00u : 0u);
      const float lo = r < valid ? tile[c * kStride + r] : 0.0f, hi = r + 1 < valid ? tile[c * kStride + r + 1] : 0.0f;
      const uint32_t q = to_e4m3x2(__fdiv_rn(lo, scale), __fdiv_rn(hi, scale));
      word |= (q & mask) << (16 * pair);
    }
    words[w] = word;
  }
  uint4* out = reinterpret_cast<uint4*>(values_CR + (col0 + c) * rows + row0 + part * kRowsPerThread);
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
}

template <class Rows>
void launch(const Rows& x, int64_t rows, const RowGroups& groups, uint8_t* values_CR, float* scales_BC,
            cudaStream_t stream) {
  if (rows % kBlockRows != 0) throw InvalidArgument("rows", "must be a multiple of 128 (whole row blocks)");
  if (x.cols % kBlockCols != 0) throw InvalidArgument("cols", "must be a multiple of 64");
  if (reinterpret_cast<uintptr_t>(values_CR) % 16 != 0) throw InvalidArgument("values_CR", "must be 16-byte aligned");
  if (rows == 0 || x.cols == 0) return;
  const dim3 grid(static_cast<unsigned>(x.cols / kBlockCols), static_cast<unsigned>(rows / kBlockRows));
  column_tiles_kernel<<<grid, kThreads, 0, stream>>>(x, rows, groups, values_CR, scales_BC);
  runtime::cuda_check_launch("column_tiles_kernel");
}

}  // namespace

void launch_column_tiles_transposed(const __nv_bfloat16* x_RC, int64_t rows, int64_t cols, const RowGroups& groups,
                                    uint8_t* values_CR, float* scales_BC, cudaStream_t stream) {
  launch(Bf16Rows{x_RC, cols}, rows, groups, values_CR, scales_BC, stream);
}

void launch_column_tiles_transposed(const uint8_t* x_RC, const float* x_scales_RT, int64_t rows, int64_t cols,
                                    const RowGroups& groups, uint8_t* values_CR, float* scales_BC,
                                    cudaStream_t stream) {
  launch(Fp8Rows{x_RC, x_scales_RT, cols, numerics::scale_blocks(cols)}, rows, groups, values_CR, scales_BC, stream);
}

}  // namespace poise::quant
