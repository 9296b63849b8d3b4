// One warp per 1 x 128 tile, 4 values per lane (a last tile of 64 leaves half the lanes idle): the
// tile's amax over the warp (NaN-sticky, order-free), its scale, its values, with the host's
// functions (numerics::amax_with, block_scale, quantize).
#include "quant/row_tiles.hpp"

#include "numerics/block_scaling.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kPerLane = numerics::kScaleBlock / 32;

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    row_tiles_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t tiles_per_row, uint8_t* values,
                     float* scales) {
  const int64_t tile = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (tile >= rows * tiles_per_row) return;
  const int lane = threadIdx.x % 32;
  const int64_t row = tile / tiles_per_row, first_col = tile % tiles_per_row * numerics::kScaleBlock;
  const int64_t col = first_col + lane * kPerLane;
  const bool active = col < cols;  // cols is a multiple of 64: a lane holds all of its 4 or none
  float v[kPerLane];
  float amax = 0.0f;
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = active ? __bfloat162float(x[row * cols + col + i]) : 0.0f;
    amax = numerics::amax_with(amax, v[i]);
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = numerics::amax_with(amax, __shfl_xor_sync(~0u, amax, offset));
  const float scale = numerics::block_scale(amax);
  if (lane == 0) scales[tile] = scale;
  if (!active) return;
  for (int i = 0; i < kPerLane; ++i) values[row * cols + col + i] = numerics::quantize(v[i], scale);
}

}  // namespace

void launch_row_tiles(const __nv_bfloat16* x_RC, int64_t rows, int64_t cols, uint8_t* values_RC, float* scales_RT,
                      cudaStream_t stream) {
  const int64_t tiles = rows * numerics::scale_blocks(cols);
  if (tiles == 0) return;
  const int64_t blocks = (tiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  row_tiles_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      x_RC, rows, cols, numerics::scale_blocks(cols), values_RC, scales_RT);
  runtime::cuda_check_launch("row_tiles_kernel");
}

}  // namespace poise::quant
