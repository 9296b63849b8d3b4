// Direct epilogue stores: a consumer warpgroup's accumulators leave as bf16 rows straight from
// registers, without shared-memory staging. In the cooperative 128 x 256 mainloop the TMA fill and
// the two warpgroups' wgmma reads already take about the whole shared-memory bandwidth (~125 of 128
// bytes per cycle), so staging an epilogue through shared memory (write, then TMA read) adds its
// bytes to the tile's time instead of overlapping the next tile (performance.md, v13 / v14).
//
// Fragment (ptx/wgmma.cuh): lane quad q of a warp holds, for each of its two rows, columns
// 8j + 2q, 8j + 2q + 1 of every 8-column group j. Four groups (64 bytes of a row) are transposed
// among the quad's lanes so that lane q holds group 4m + q whole; each lane then stores 16 bytes
// and one warp instruction writes 8 rows x 64 contiguous bytes (whole 32-byte sectors; storing
// the fragment as is wrote 4 bytes per lane, half sectors: v1).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <utility>

namespace poise::sm90 {

// w[i & 3] with selects (a dynamic register index would go through local memory).
__device__ __forceinline__ uint32_t select_word(const uint32_t (&w)[4], int i) {
  const uint32_t lo = (i & 1) ? w[1] : w[0];
  const uint32_t hi = (i & 1) ? w[3] : w[2];
  return (i & 2) ? hi : lo;
}

// In: w[k] = this lane's word of group k (of four). Out: the four words of group `quad`, in lane
// order (lane k's word is word k). Round r: every lane sends its word for the group of lane
// quad + r and receives, from lane quad - r, that lane's word for this lane's group.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&w)[4], int lane) {
  const int quad = lane & 3;
  uint32_t got[4];  // got[r]: word of lane (quad - r) & 3
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t sent = select_word(w, quad + r);
    got[r] = r == 0 ? sent : __shfl_sync(0xffffffffu, sent, (lane & ~3) | ((quad - r) & 3));
  }
  // out[k] = got[(quad - k) & 3]: rotate by quad.
  uint32_t out[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = select_word(got, quad - k);
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// This lane's 16 bytes of columns 8 (4m + quad) .. + 7 in fragment row `row + 8h` of d (a
// 64 x kBlockN fragment, ptx/wgmma.cuh) as bf16, scaled by `scale`.
template <int kN>
__device__ __forceinline__ uint4 pack_row_segment(const float (&d)[kN], int m, int h, float scale, int lane) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int a = 4 * (4 * m + k) + 2 * h;
    w[k] = bf16x2_bits(d[a] * scale, d[a + 1] * scale);
  }
  return quad_transpose(w, lane);
}

// Stores d as bf16, scaled per row half by scale[h]: row_ptr[h] points at column 0 of the tile in
// fragment row `row + 8h` (nullptr: the row is not written); only the first `columns` columns are
// stored (a multiple of 32).
template <int kBlockN>
__device__ __forceinline__ void store_bf16_rows_direct(const float (&d)[kBlockN / 2], int lane,
                                                       __nv_bfloat16* const (&row_ptr)[2], const float (&scale)[2],
                                                       int columns) {
#pragma unroll
  for (int m = 0; m < kBlockN / 32; ++m) {
    if (32 * m >= columns) break;  // uniform across the warp: shuffles stay converged
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = pack_row_segment(d, m, h, scale[h], lane);
      if (row_ptr[h]) *reinterpret_cast<uint4*>(row_ptr[h] + 8 * (4 * m + (lane & 3))) = v;
    }
  }
}

// A warpgroup's tile packed as bf16 rows for direct stores, held in registers while the next
// tile's mainloop starts: v[m][h] is this lane's 16 bytes of columns 8 (4m + quad) .. + 7 in
// fragment row `row + 8h`. Epilogues with kDeferredParts > 0 pack into it instead of storing;
// the kernel stores part p (every m with m % kParts == p) right after issuing the wgmmas of the
// next tile's K block p, so the stores drain while the tensor cores work (grouped_gemm.cuh).
template <int kBlockN>
struct PendingRows {
  static constexpr int kBlocks = kBlockN / 32;
  uint4 v[kBlocks][2];
  __nv_bfloat16* row_ptr[2];  // column 0 of the tile in rows row, row + 8 (nullptr: not written)
  int columns = 0;            // columns pending (a multiple of 32); 0: none

  template <int kBlock>
  __device__ __forceinline__ void store_block(int lane) const {
    if (32 * kBlock >= columns) return;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (row_ptr[h]) *reinterpret_cast<uint4*>(row_ptr[h] + 8 * (4 * kBlock + (lane & 3))) = v[kBlock][h];
  }
  // Stores the blocks of part `part` (of kParts).
  template <int kParts>
  __device__ __forceinline__ void flush_part(int part, int lane) const {
    flush_if<kParts>(lane, [&](int p) { return p == part; });
  }
  // Stores the blocks of parts [first_part, kParts); then nothing is pending.
  template <int kParts>
  __device__ __forceinline__ void flush_from(int first_part, int lane) {
    flush_if<kParts>(lane, [&](int p) { return p >= first_part; });
    columns = 0;
  }
  template <int kParts, class Pick>
  __device__ __forceinline__ void flush_if(int lane, Pick&& pick) const {
    [&]<int... kBlock>(std::integer_sequence<int, kBlock...>) {
      ((pick(kBlock % kParts) ? store_block<kBlock>(lane) : void()), ...);
    }(std::make_integer_sequence<int, kBlocks>{});
  }

  // Packs d (a 64 x kBlockN fragment) for rows row0, row8 and its first `cols` columns.
  __device__ __forceinline__ void pack(const float (&d)[kBlockN / 2], int lane, __nv_bfloat16* row0,
                                       __nv_bfloat16* row8, int cols) {
#pragma unroll
    for (int m = 0; m < kBlocks; ++m) {
      if (32 * m >= cols) break;  // uniform across the warp: shuffles stay converged
#pragma unroll
      for (int h = 0; h < 2; ++h) v[m][h] = pack_row_segment(d, m, h, 1.0f, lane);
    }
    row_ptr[0] = row0;
    row_ptr[1] = row8;
    columns = cols;
  }
};

}  // namespace poise::sm90
