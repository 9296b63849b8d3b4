// One CTA per 128 x 128 block (a last block along a dimension of 64 mod 128 holds 64 of it): the
// block's amax (NaN-sticky, so the order of the reduction does not matter), its scale, then every
// value quantized, all with the host's functions (numerics::amax_with, block_scale, quantize).
#include "quant/weight_blocks.hpp"

#include "numerics/block_scaling.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ float block_amax(float amax) {
  __shared__ float warp_amax[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) amax = numerics::amax_with(amax, __shfl_xor_sync(~0u, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < kWarps; ++w) amax = numerics::amax_with(amax, warp_amax[w]);
  return amax;
}

__global__ void __launch_bounds__(kThreads) weight_blocks_kernel(const __nv_bfloat16* w, int64_t rows, int64_t cols,
                                                                  int64_t row_blocks, int64_t col_blocks,
                                                                  uint8_t* values, float* scales) {
  const int64_t block = blockIdx.x;  // (matrix * row_blocks + row block) * col_blocks + col block
  const int64_t cb = block % col_blocks, rb = block / col_blocks % row_blocks, m = block / (col_blocks * row_blocks);
  const int64_t r0 = rb * numerics::kScaleBlock, c0 = cb * numerics::kScaleBlock;
  const int64_t height = min(numerics::kScaleBlock, rows - r0), width = min(numerics::kScaleBlock, cols - c0);
  const int64_t first = m * rows * cols + r0 * cols + c0;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads)
    amax = numerics::amax_with(amax, __bfloat162float(w[first + i / width * cols + i % width]));
  const float scale = numerics::block_scale(block_amax(amax));
  if (threadIdx.x == 0) scales[block] = scale;
  for (int64_t i = threadIdx.x; i < height * width; i += kThreads) {
    const int64_t at = first + i / width * cols + i % width;
    values[at] = numerics::quantize(__bfloat162float(w[at]), scale);
  }
}

}  // namespace

void launch_weight_blocks(const __nv_bfloat16* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                          uint8_t* values_MRC, float* scales, cudaStream_t stream) {
  const int64_t row_blocks = numerics::scale_blocks(rows), col_blocks = numerics::scale_blocks(cols);
  const int64_t blocks = matrices * row_blocks * col_blocks;
  if (blocks == 0) return;
  weight_blocks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w_MRC, rows, cols, row_blocks,
                                                                               col_blocks, values_MRC, scales);
  runtime::cuda_check_launch("weight_blocks_kernel");
}

}  // namespace poise::quant
