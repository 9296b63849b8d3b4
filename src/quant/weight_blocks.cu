// One CTA of 256 threads per 128 x 128 block (a last block along a dimension of 64 mod 128 holds 64
// of it), reading global memory once: each thread loads 8 rows x 8 bf16 (16-byte loads, kept in
// registers), the block's amax is reduced over the CTA, then each thread writes its values as
// 8-byte e4m3 stores. A warp covers two 256-byte block rows per load, so every access is
// coalesced. The numerics are the host's (numerics::block_scale; the amax, the division and the
// E4M3 conversion through device instructions that give numerics::amax_with's, IEEE division's and
// numerics::to_e4m3's bits), so the reference's bits.
#include "quant/weight_blocks.hpp"

#include "quant/e4m3_vectors.cuh"

#include "numerics/block_scaling.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlock = static_cast<int>(numerics::kScaleBlock);
constexpr int kVector = 8;                                  // bf16 per 16-byte load
constexpr int kThreadsPerRow = kBlock / kVector;            // 16 threads span a block row
constexpr int kRowsPerStep = kThreads / kThreadsPerRow;     // 16 block rows per CTA-wide load
constexpr int kSteps = kBlock / kRowsPerStep;               // 8 loads (64 values) per thread

// The CTA's amax as a float: one max per warp, then across the warps through shared memory.
__device__ float block_amax(uint32_t amax_bits) {
  __shared__ uint32_t warp_amax[kWarps];
  amax_bits = __reduce_max_sync(~0u, amax_bits);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax_bits;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) amax_bits = max(amax_bits, warp_amax[w]);
  return __uint_as_float(amax_bits << 16);  // bf16 -> fp32 is exact: the top half of the bits
}

// w, values: 16- and 8-byte aligned (cols is a multiple of 64, so every row of a block is too).
__global__ void __launch_bounds__(kThreads) weight_blocks_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols,
                                                                  uint32_t row_blocks, uint32_t col_blocks,
                                                                  uint8_t* values, float* scales,
                                                                  const int32_t* rows_M) {
  // (matrix * row_blocks + row block) * col_blocks + col block, split in 32 bits (the grid's limit)
  const uint32_t block = blockIdx.x;
  const uint32_t cb = block % col_blocks, rb = block / col_blocks % row_blocks, m = block / col_blocks / row_blocks;
  if (rows_M != nullptr && rows_M[m] == 0) return;
  const int64_t r0 = int64_t(rb) * kBlock, c0 = int64_t(cb) * kBlock;
  const int64_t height = min(numerics::kScaleBlock, rows - r0), width = min(numerics::kScaleBlock, cols - c0);
  // This thread's 8 columns, and its rows: row0, row0 + 16, ..., row0 + 112 of the block.
  const int col = threadIdx.x % kThreadsPerRow * kVector, row0 = threadIdx.x / kThreadsPerRow;
  const int64_t first = (m * rows + r0 + row0) * cols + c0 + col;  // its first element
  const int64_t step = kRowsPerStep * cols;
  auto holds = [&](int s) { return col < width && row0 + s * kRowsPerStep < height; };  // 64-wide/high blocks

  uint4 v[kSteps];  // all loads issued before the reduction waits on any of them
  uint32_t amax_bits = 0;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    v[s] = holds(s) ? __ldg(reinterpret_cast<const uint4*>(w + first + s * step)) : make_uint4(0, 0, 0, 0);
    amax_bits = max(amax_bits, amax_bits_of(v[s]));
  }
  const float scale = numerics::block_scale(block_amax(amax_bits));
  if (threadIdx.x == 0) scales[block] = scale;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (holds(s)) *reinterpret_cast<uint2*>(values + first + s * step) = quantize_bf16x8(v[s], scale);
  }
}

// Pointers not aligned for the vector loads and stores (a view at an odd offset): one value at a
// time, with the host's functions. Correct, not fast.
__global__ void __launch_bounds__(kThreads) weight_blocks_unaligned_kernel(const __nv_bfloat16* w, int64_t rows,
                                                                            int64_t cols, uint32_t row_blocks,
                                                                            uint32_t col_blocks, uint8_t* values,
                                                                            float* scales, const int32_t* rows_M) {
  const uint32_t block = blockIdx.x;
  const uint32_t cb = block % col_blocks, rb = block / col_blocks % row_blocks, m = block / col_blocks / row_blocks;
  if (rows_M != nullptr && rows_M[m] == 0) return;
  const int64_t r0 = int64_t(rb) * kBlock, c0 = int64_t(cb) * kBlock;
  const int64_t height = min(numerics::kScaleBlock, rows - r0), width = min(numerics::kScaleBlock, cols - c0);
  const int64_t first = m * rows * cols + r0 * cols + c0;
  __shared__ float warp_amax[kWarps];
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads)
    amax = numerics::amax_with(amax, __bfloat162float(w[first + i / width * cols + i % width]));
  for (int offset = 16; offset > 0; offset /= 2) amax = numerics::amax_with(amax, __shfl_xor_sync(~0u, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  for (int i = 0; i < kWarps; ++i) amax = numerics::amax_with(amax, warp_amax[i]);
  const float scale = numerics::block_scale(amax);
  if (threadIdx.x == 0) scales[block] = scale;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads) {
    const int64_t at = first + i / width * cols + i % width;
    values[at] = numerics::quantize(__bfloat162float(w[at]), scale);
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void launch_weight_blocks(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                          uint8_t* values_MRC, float* scales, cudaStream_t stream, const int32_t* rows_M) {
  const int64_t row_blocks = numerics::scale_blocks(rows), col_blocks = numerics::scale_blocks(cols);
  const int64_t blocks = matrices * row_blocks * col_blocks;
  if (blocks == 0) return;
  const auto kernel = aligned(w_MRC, sizeof(uint4)) && aligned(values_MRC, sizeof(uint2))
                          ? weight_blocks_kernel
                          : weight_blocks_unaligned_kernel;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w_MRC, rows, cols, static_cast<uint32_t>(row_blocks),
                                                                 static_cast<uint32_t>(col_blocks), values_MRC, scales,
                                                                 rows_M);
  runtime::cuda_check_launch("weight_blocks_kernel");
}

}  // namespace poise::quant
