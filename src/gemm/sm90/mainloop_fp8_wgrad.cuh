// The FP8 WGRAD K loop of a consumer warpgroup: rows as K, both operands e4m3 column tiles written
// transposed (quant/column_tiles.hpp), A [M][rows] and B [N][rows], so K-major as FP8 wgmma needs.
//
// A stage is one 128-row block of the expert's rows (its groups start on such blocks, and the rows
// past a group's count were quantized as 0). Its scales are one per row block and column of each
// operand: the promotion multiplies a tile element by its A row's scale (two per thread, loaded as
// the forward loads its row scales) and its B column's. A thread's 64 B columns per half differ
// from its neighbours', so the warpgroup stages the block's kBlockN column scales in shared memory
// (two buffers, one per parity of the block: the buffer written at block kb + 2 was last read
// before the warpgroup's barrier of block kb + 1), each thread loading two of them one block ahead.
#pragma once

#include <cstdint>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/mainloop_fp8.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/warpgroup.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// acc[64 half + i] += part[i] * scale_a[row half] * scale_b[column]: part[4j + 2h + c] is row half
// h, column 8j + 2 quad + c of the half, whose scales are adjacent in `column_scales`.
// column_scales: the staged scales' shared-memory address.
template <int kHalf>
__device__ __forceinline__ void promote_fp8_columns(float (&acc)[kBlockN / 2], const float (&part)[kBlockN / 4],
                                                    const float (&sa)[2], uint32_t column_scales, int quad) {
#pragma unroll
  for (int j = 0; j < kBlockN / 16; ++j) {
    const float2 sb = ptx::ld_shared_v2_f32(column_scales + 4 * ((kBlockN / 2) * kHalf + 8 * j + 2 * quad));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc[(kBlockN / 4) * kHalf + 4 * j + 2 * h] += part[4 * j + 2 * h] * (sa[h] * sb.x);
      acc[(kBlockN / 4) * kHalf + 4 * j + 2 * h + 1] += part[4 * j + 2 * h + 1] * (sa[h] * sb.y);
    }
  }
}

// This warpgroup's scales of a tile: its two fragment rows' A scale rows and its two staged B columns,
// as 32-bit element offsets of row block kb from the parameters' base pointers (64-bit addresses per
// load left the K loop one register short: it reloaded one from local memory every block).
struct Fp8ColumnScaleRows {
  const ColumnScales& s;
  uint32_t a_first;   // row block 0's scale of the first fragment row, in a_BM
  uint32_t a_second;  // the second row's (8 rows further, clamped to M - 1) minus the first's
  uint32_t b_first;   // row block 0's scale of this thread's first column, in b_BN; the second is kBlockN / 2 further
  bool b_in[2];       // the columns lie below N (past N: scale 1)

  __device__ Fp8ColumnScaleRows(const GroupedGemmShape& shape, const TileInfo& tile, int consumer, int thread)
      : s(shape.column_scales) {
    const uint32_t block0 = uint32_t(tile.row_begin / 128);  // the expert's first 128-row block
    const int32_t m = tile.m_block * kTileM + 64 * consumer + Fragment(thread).row;
    // Rows past M (a last M block of 64) are zero-filled by TMA: any finite scale serves them.
    const int32_t first_row = min(m, s.M - 1);
    a_first = block0 * uint32_t(s.M) + uint32_t(first_row);
    a_second = uint32_t(min(m + 8, s.M - 1) - first_row);
    const int32_t b_col = tile.n_block * kBlockN + thread;
    b_first = block0 * uint32_t(s.N) + uint32_t(b_col);
    b_in[0] = b_col < s.N, b_in[1] = b_col + kBlockN / 2 < s.N;
  }
  __device__ __forceinline__ void load_a(int32_t kb, float (&sa)[2]) const {
    const uint32_t at = a_first + uint32_t(kb) * uint32_t(s.M);
    sa[0] = __ldg(s.a_BM + at), sa[1] = __ldg(s.a_BM + (at + a_second));
  }
  __device__ __forceinline__ void load_b(int32_t kb, float (&sb)[2]) const {
    const uint32_t at = b_first + uint32_t(kb) * uint32_t(s.N);
    sb[0] = b_in[0] ? __ldg(s.b_BN + at) : 1.0f;
    sb[1] = b_in[1] ? __ldg(s.b_BN + (at + kBlockN / 2)) : 1.0f;
  }
};

// column_scales: this warpgroup's 2 x kBlockN floats of shared memory.
template <class Ring, uint32_t kABytes>
__device__ __forceinline__ uint32_t mainloop_fp8_wgrad(const Ring& ring, uint32_t it, const TileInfo& tile,
                                                       int32_t k_blocks, int consumer, int thread,
                                                       const GroupedGemmShape& shape, float* column_scales,
                                                       float (&acc)[kBlockN / 2]) {
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
  if (k_blocks == 0) return it;  // an expert without rows: its gradient is 0
  const Fp8ColumnScaleRows scales(shape, tile, consumer, thread);
  const int quad = Fragment(thread).quad;
  float part[kBlockN / 4], next_b[2];
  scales.load_b(0, next_b);
  for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
    float sa[2];
    scales.load_a(kb, sa);
    const uint32_t staged = ptx::shared_address(column_scales + (kb & 1) * kBlockN);
    ptx::st_shared_b32(staged + 4 * thread, __float_as_uint(next_b[0]));
    ptx::st_shared_b32(staged + 4 * (thread + kBlockN / 2), __float_as_uint(next_b[1]));
    if (kb + 1 < k_blocks) scales.load_b(kb + 1, next_b);
    ptx::named_barrier_sync(2 + consumer, 128);  // the block's column scales are staged
    uint8_t* const a_smem = ring.wait(it);
    const uint64_t desc_a = ptx::make_k_major_desc(a_smem + consumer * 64 * 128);
    uint8_t* const b_smem = a_smem + kABytes;
    wgmma_fp8_half(part, desc_a, ptx::make_k_major_desc(b_smem));
    promote_fp8_columns<0>(acc, part, sa, staged, quad);
    wgmma_fp8_half(part, desc_a, ptx::make_k_major_desc(b_smem + (kBlockN / 2) * 128));
    ring.release(it);
    promote_fp8_columns<1>(acc, part, sa, staged, quad);
  }
  return it;
}

}  // namespace poise::sm90
