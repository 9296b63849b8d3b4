// Half a warp per 1 x 128 tile, 8 values per lane: one 16-byte bf16 load and one 8-byte e4m3 store
// per lane (a last tile of 64 leaves half the lanes idle), so each load of a warp reads two adjacent
// tiles, 512 bytes, coalesced; a half warp takes kSteps tiles, all loaded before the first is
// reduced. A tile's amax is reduced over its 16 lanes, then its scale and values. The numerics
// are the host's (numerics::block_scale; the amax, the division and the E4M3 conversion through
// device instructions that give numerics::amax_with's, IEEE division's and numerics::to_e4m3's
// bits), so the reference's bits.
#include "quant/row_tiles.hpp"

#include "quant/e4m3_vectors.cuh"

#include "numerics/block_scaling.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;                                                          // bf16 per 16-byte load
constexpr int kLanesPerTile = static_cast<int>(numerics::kScaleBlock) / kVector;  // 16
constexpr int kSteps = 2;                                                           // tiles per half warp
constexpr int kTilesPerCta = kThreads / kLanesPerTile * kSteps;                     // 32

// The tile a half warp quantizes at step s: the two half warps of a warp take adjacent tiles (512
// contiguous bytes within a row), and a warp takes kSteps such pairs, its loads all in flight before
// the first reduction waits on them.
template <typename Index>
__device__ Index tile_at(int s) {
  const int warp = threadIdx.x / 32, half = threadIdx.x / kLanesPerTile % 2;
  return Index(blockIdx.x) * kTilesPerCta + (warp * kSteps + s) * 2 + half;
}

// x, values: 16- and 8-byte aligned (cols is a multiple of 64, so every tile is too). Index: the
// type of tile numbers, uint32_t whenever they fit (a 64-bit division costs about as much as the
// quantization of a lane's 8 values).
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    row_tiles_kernel(const __nv_bfloat16* x, Index rows, int64_t cols, Index tiles_per_row, uint8_t* values,
                     float* scales, const int32_t* rows_end) {
  if (rows_end != nullptr) rows = min(rows, Index(max(*rows_end, 0)));
  const Index tiles = rows * tiles_per_row;
  const int lane = threadIdx.x % kLanesPerTile;
  int64_t at[kSteps];  // this lane's first element (and e4m3 byte) at each step; -1: none
  uint4 v[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const Index tile = tile_at<Index>(s), row = tile / tiles_per_row;
    const int64_t col = int64_t(tile % tiles_per_row) * numerics::kScaleBlock + lane * kVector;
    at[s] = tile < tiles && col < cols ? int64_t(row) * cols + col : -1;  // a lane holds all of its 8 or none
    v[s] = at[s] >= 0 ? __ldg(reinterpret_cast<const uint4*>(x + at[s])) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    // No early return above: every lane of the warp takes part in the shuffles.
    uint32_t amax_bits = amax_bits_of(v[s]);
    for (int offset = kLanesPerTile / 2; offset > 0; offset /= 2)  // within each half warp
      amax_bits = max(amax_bits, __shfl_xor_sync(~0u, amax_bits, offset));
    const float scale = numerics::block_scale(__uint_as_float(amax_bits << 16));  // bf16 -> fp32: exact
    if (lane == 0 && tile_at<Index>(s) < tiles) scales[tile_at<Index>(s)] = scale;
    if (at[s] >= 0) *reinterpret_cast<uint2*>(values + at[s]) = quantize_bf16x8(v[s], scale);
  }
}

// Pointers not aligned for the vector loads and stores (a view at an odd offset): one warp per
// tile, one value at a time, with the host's functions. Correct, not fast.
__global__ void __launch_bounds__(kThreads)
    row_tiles_unaligned_kernel(const __nv_bfloat16* x, int64_t rows, int64_t cols, int64_t tiles_per_row,
                               uint8_t* values, float* scales, const int32_t* rows_end) {
  if (rows_end != nullptr) rows = min(rows, int64_t(max(*rows_end, 0)));
  constexpr int kPerLane = static_cast<int>(numerics::kScaleBlock) / 32;
  const int64_t tile = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (tile >= rows * tiles_per_row) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const int64_t row = tile / tiles_per_row, col = tile % tiles_per_row * numerics::kScaleBlock + lane * kPerLane;
  const bool active = col < cols;
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

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One thread per 8 values (an 8-byte e4m3 load, a 16-byte bf16 store); each value's e4m3 -> fp32 is
// exact, the product by the tile's scale one IEEE multiply, then round to nearest even bf16.
__global__ void __launch_bounds__(kThreads)
    dequantize_row_tiles_kernel(const uint8_t* values, const float* scales, int64_t rows, int64_t cols,
                                int64_t tiles_per_row, __nv_bfloat16* out, const int32_t* rows_end) {
  if (rows_end != nullptr) rows = min(rows, int64_t(max(*rows_end, 0)));
  const int64_t at = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kVector;
  const int64_t row = at / cols, col = at % cols;
  if (row >= rows) return;
  const float scale = scales[row * tiles_per_row + col / numerics::kScaleBlock];
  const uint2 q = *reinterpret_cast<const uint2*>(values + at);
  uint32_t words[4];
  for (int i = 0; i < 4; ++i) {
    const float2 pair = e4m3x2_to_float2(uint16_t((i < 2 ? q.x : q.y) >> (16 * (i % 2))));
    const __nv_bfloat162 h = __floats2bfloat162_rn(__fmul_rn(pair.x, scale), __fmul_rn(pair.y, scale));
    words[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(out + at) = make_uint4(words[0], words[1], words[2], words[3]);
}

}  // namespace

void launch_row_tiles(const __nv_bfloat16* x_RC, int64_t rows, int64_t cols, uint8_t* values_RC, float* scales_RT,
                      cudaStream_t stream, const int32_t* rows_end) {
  const int64_t tiles_per_row = numerics::scale_blocks(cols), tiles = rows * tiles_per_row;
  if (tiles == 0) return;
  const int64_t ctas = (tiles + kTilesPerCta - 1) / kTilesPerCta;
  if (!aligned(x_RC, sizeof(uint4)) || !aligned(values_RC, sizeof(uint2))) {
    const int64_t warp_ctas = (tiles + kThreads / 32 - 1) / (kThreads / 32);
    row_tiles_unaligned_kernel<<<static_cast<unsigned>(warp_ctas), kThreads, 0, stream>>>(
        x_RC, rows, cols, tiles_per_row, values_RC, scales_RT, rows_end);
  } else if (ctas * kTilesPerCta <= UINT32_MAX) {  // every tile number the grid forms fits 32 bits
    row_tiles_kernel<uint32_t><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
        x_RC, static_cast<uint32_t>(rows), cols, static_cast<uint32_t>(tiles_per_row), values_RC, scales_RT,
        rows_end);
  } else {
    row_tiles_kernel<int64_t><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(x_RC, rows, cols, tiles_per_row,
                                                                                    values_RC, scales_RT, rows_end);
  }
  runtime::cuda_check_launch("row_tiles_kernel");
}

void launch_dequantize_row_tiles(const uint8_t* values_RC, const float* scales_RT, int64_t rows, int64_t cols,
                                 __nv_bfloat16* out_RC, cudaStream_t stream, const int32_t* rows_end) {
  const int64_t vectors = rows * cols / kVector;  // cols is a multiple of 64
  if (vectors == 0) return;
  const int64_t ctas = (vectors + kThreads - 1) / kThreads;
  dequantize_row_tiles_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      values_RC, scales_RT, rows, cols, numerics::scale_blocks(cols), out_RC, rows_end);
  runtime::cuda_check_launch("dequantize_row_tiles_kernel");
}

}  // namespace poise::quant
