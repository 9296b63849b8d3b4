// Direct epilogue stores: a consumer warpgroup's accumulators leave as bf16 rows from registers,
// without a TMA store. In the cooperative 128 x 256 mainloop the TMA fill and the two warpgroups'
// wgmma reads already take about the whole shared-memory bandwidth (~125 of 128 bytes per cycle),
// so staging a whole tile through shared memory for a TMA store adds its bytes to the tile's time.
//
// Warp-staged: the wgmma fragment (ptx/wgmma.cuh: lane l holds, for rows l / 4 and + 8 of its
// warp's 16, columns 8j + 2 (l % 4), + 1 of every 8-column group j) is stmatrix's layout. A warp
// writes its 16 rows x 64 columns (one chunk) as bf16 with four stmatrix into a 2 KiB warp-private
// buffer and reads them back as whole 128-byte row pieces: lane L gets 16-byte unit L % 8 of the
// warp's rows 4p + L / 8, p = 0..3, and each warp store writes 4 whole 128-byte lines. Per 16 bytes
// that is a quarter stmatrix, one load and one store; the quad shuffle transposes it replaced took
// ~40 instructions (3 shuffles, ~16 selects, predicate shuffling). Only __syncwarp orders the
// buffer. Rows are 128 bytes apart with unit u of row r at u ^ (r % 8): conflict-free for both
// sides. (Storing the fragment as is writes 4 bytes per lane: half sectors.)
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <utility>

#include "gemm/sm90/epilogue_staging.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"

namespace poise::sm90 {

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

inline constexpr int kWarpStagingBytes = 16 * 128;

// Row (of the warp's 16) of this lane's piece p of a warp-staged chunk, and the piece's 16-byte unit.
__device__ __forceinline__ int warp_staged_row(int p, int lane) { return 4 * p + lane / 8; }
__device__ __forceinline__ int warp_staged_unit(int lane) { return lane % 8; }

// Chunk `chunk` (columns 64 chunk .. + 63) of d, scaled per fragment row half by scale[h], through the
// warp's buffer at shared address `buf`: seg[p] = 16 bytes of row warp_staged_row(p), unit
// warp_staged_unit. The whole warp calls it (stmatrix and __syncwarp are warp-collective).
template <int kN>
__device__ __forceinline__ void warp_stage_chunk(const float (&d)[kN], int chunk, const float (&scale)[2], uint32_t buf,
                                                 int lane, uint4 (&seg)[4]) {
  // stmatrix q writes matrices k = 0..3: group 8 chunk + 2q + k / 2, fragment row half k % 2; this
  // lane addresses row lane % 8 of matrix lane / 8 (buffer row 8 (k % 2) + lane % 8).
  const int i = lane % 8, k = lane / 8;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t w[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int a = 4 * (8 * chunk + 2 * q + m / 2) + 2 * (m % 2);
      w[m] = bf16x2_bits(d[a] * scale[m % 2], d[a + 1] * scale[m % 2]);
    }
    const int row = 8 * (k % 2) + i, unit = 2 * q + k / 2;
    ptx::stmatrix_x4(buf + swizzled_unit_offset(row, unit), w[0], w[1], w[2], w[3]);
  }
  __syncwarp();
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int row = warp_staged_row(p, lane), unit = warp_staged_unit(lane);
    seg[p] = ptx::ld_shared_v4_b32(buf + swizzled_unit_offset(row, unit));
  }
  __syncwarp();  // every lane has read the chunk before the next one is written
}

// The warp's 2 KiB of a consumer warpgroup's staging buffer (kStagingBytes = 4 warps x 2 KiB).
__device__ __forceinline__ uint32_t warp_staging(uint8_t* warpgroup_buf, int thread) {
  return ptx::shared_address(warpgroup_buf) + (thread / 32) * kWarpStagingBytes;
}

// Stores d (a 64 x kBlockN fragment) as bf16, scaled per fragment row half by scale[h], through the
// warp's part of the warpgroup's staging buffer `buf`; row(r): column 0 of the tile in slab row r
// (nullptr: the row is not written); only the first `columns` columns are stored (a multiple of 64).
template <int kBlockN, class RowPtr>
__device__ __forceinline__ void store_bf16_rows_direct(const float (&d)[kBlockN / 2], int thread, uint8_t* buf,
                                                       RowPtr&& row, const float (&scale)[2], int columns) {
  const int lane = thread % 32, warp_row = 16 * (thread / 32);
  const uint32_t wbuf = warp_staging(buf, thread);
  __nv_bfloat16* row_ptr[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) row_ptr[p] = row(warp_row + warp_staged_row(p, lane));
#pragma unroll
  for (int c = 0; c < kBlockN / 64; ++c) {
    if (64 * c >= columns) break;  // uniform across the warp
    uint4 seg[4];
    warp_stage_chunk(d, c, scale, wbuf, lane, seg);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (!row_ptr[p]) continue;
      *reinterpret_cast<uint4*>(row_ptr[p] + 64 * c + 8 * warp_staged_unit(lane)) = seg[p];
    }
  }
}

// A warpgroup's tile packed as bf16 rows, held in registers while the next tile's mainloop starts:
// v[c][p] is this lane's piece p of chunk c. Epilogues with kDeferredParts > 0 pack into it instead
// of storing; the kernel stores part q (pieces i with i % kParts == q) right after issuing the wgmmas
// of the next tile's K block q, so the stores drain while the tensor cores work (consumer.cuh).
template <int kBlockN>
struct PendingRows {
  static constexpr int kChunks = kBlockN / 64;
  uint4 v[kChunks][4];
  // Few registers, held through the next tile's K loop (four row pointers cost the wgrad GEMMs
  // 1.4-2%): the lane's rows are 4 apart in the output, so one pointer, the row stride, and which of
  // the four are written.
  __nv_bfloat16* first_row_ptr;  // column 0 of the tile in warp row warp_staged_row(0)
  int32_t row_elems;             // output row stride (elements)
  int32_t rows_mask;             // bit p: row warp_staged_row(p) is written
  int columns = 0;               // columns pending (a multiple of 64); 0: none

  template <int kPiece>
  __device__ __forceinline__ void store_piece(int lane) const {
    constexpr int c = kPiece / 4, p = kPiece % 4;
    if (64 * c >= columns) return;
    if (rows_mask & (1 << p))
      *reinterpret_cast<uint4*>(first_row_ptr + int64_t(4 * p) * row_elems + 64 * c + 8 * warp_staged_unit(lane)) = v[c][p];
  }
  // Stores the pieces of part `part` (of kParts).
  template <int kParts>
  __device__ __forceinline__ void flush_part(int part, int lane) const {
    flush_if<kParts>(lane, [&](int q) { return q == part; });
  }
  // Stores the pieces of parts [first_part, kParts); then nothing is pending.
  template <int kParts>
  __device__ __forceinline__ void flush_from(int first_part, int lane) {
    flush_if<kParts>(lane, [&](int q) { return q >= first_part; });
    columns = 0;
  }
  // Piece i (chunk i / 4, row i % 4) belongs to part i % kParts.
  template <int kParts, class Pick>
  __device__ __forceinline__ void flush_if(int lane, Pick&& pick) const {
    [&]<int... kPiece>(std::integer_sequence<int, kPiece...>) {
      ((pick(kPiece % kParts) ? store_piece<kPiece>(lane) : void()), ...);
    }(std::make_integer_sequence<int, 4 * kChunks>{});
  }

  // Packs d's first `cols` columns through the warp's staging buffer; row(r): column 0 of the tile
  // in slab row r (nullptr: not written), affine in r with stride `stride` elements wherever it is
  // not null (weight rows).
  template <class RowPtr>
  __device__ __forceinline__ void pack(const float (&d)[kBlockN / 2], int thread, uint8_t* buf, RowPtr&& row, int cols,
                                       int32_t stride) {
    const int lane = thread % 32, warp_row = 16 * (thread / 32);
    const uint32_t wbuf = warp_staging(buf, thread);
    const float scale[2] = {1.0f, 1.0f};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (64 * c >= cols) break;  // uniform across the warp
      warp_stage_chunk(d, c, scale, wbuf, lane, v[c]);
    }
    first_row_ptr = row(warp_row + warp_staged_row(0, lane));
    row_elems = stride;
    rows_mask = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) rows_mask |= row(warp_row + warp_staged_row(p, lane)) ? 1 << p : 0;
    columns = cols;
  }
};

}  // namespace poise::sm90
