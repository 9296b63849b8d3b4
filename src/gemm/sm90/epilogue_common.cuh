// What every epilogue shares, and the interface the kernel calls (consumer.cuh).
//
// An epilogue is what happens to a consumer warpgroup's 64 x kBlockN fp32 accumulators (layout in
// ptx/wgmma.cuh). It declares
//   kStagingBuffers   shared-memory staging buffers per consumer warpgroup (0 or 1),
//   kRingStages       ring stages it stages in after the tile's K blocks (0: its own buffers);
//                     then load_ring_stage<kBlockN>(j, tile, stage, full_bar) runs on the producer
//                     and store<kBlockN>(acc, tile, consumer, thread, ring, it) on the consumers,
//   kDeferredParts    > 0: store<kBlockN>(acc, tile, consumer, thread, buf, pending) packs the tile
//                     and the kernel stores it in that many parts during the next tile's K blocks,
//                     else store<kBlockN>(acc, tile, consumer, thread, buf) stores it now,
//   kPairedTiles      runs on 2-CTA clusters that share an operand by multicast,
//   kSkipsEmptySlabs  a warpgroup whose 64 rows are all padding skips the tile's wgmmas.
// Rows past the expert's count and column chunks past N are never written (they may be padding
// rows or a neighbouring expert's weights). D and F are multiples of 64, so a 64-column chunk is
// either entirely inside N or entirely outside.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// Where one thread's accumulators sit in its warpgroup's 64-row slab:
// d[4j + 2h + c] is slab row `row + 8h`, column 8j + 2*quad + c.
struct Fragment {
  int row;
  int quad;
  __device__ explicit Fragment(int thread) : row(16 * (thread / 32) + (thread % 32) / 4), quad(thread % 4) {}
};

// Moves accumulators [kFrom, kFrom + kCount) down to [kTo, kTo + kCount). The SwiGLU epilogues
// walk their column chunks in a loop that is not unrolled, reading each chunk at fixed register
// indices and shifting the next chunk into place: unrolling over chunks multiplied their code
// (13k instructions for the backward one, which then ran from a missing instruction cache).
template <int kTo, int kFrom, int kCount, int kN>
__device__ __forceinline__ void move_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) d[kTo + i] = d[kFrom + i];
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Global address of a grouped row (or nullptr when the slab row is past the expert's count).
struct GroupedRowAddress {
  int64_t first_row;  // grouped row of slab row 0
  int32_t valid;      // slab rows [0, valid) belong to the expert
  __device__ GroupedRowAddress(const TileInfo& tile, int consumer) {
    const int32_t m0 = tile.m_block * kTileM + 64 * consumer;
    first_row = tile.row_begin + m0;
    valid = tile.row_count - m0;
  }
  // All 64 slab rows belong to the expert: the slab may be stored as one TMA box.
  __device__ bool whole() const { return valid >= 64; }
  template <class T>
  __device__ uint8_t* at(T* base, int64_t row_elems, int64_t col, int r) const {
    return r < valid ? reinterpret_cast<uint8_t*>(base + (first_row + r) * row_elems + col) : nullptr;
  }
};

// d[tile column n] += bias[column_of(n)] for every accumulator of this thread (column_of: the bias
// column of tile column n, or -1 past the expert's columns, which are never stored).
template <int kN, class ColumnOf>
__device__ __forceinline__ void add_column_bias(float (&d)[kN], int quad, const __nv_bfloat16* bias,
                                                ColumnOf&& column_of) {
#pragma unroll
  for (int j = 0; j < kN / 4; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int32_t col = column_of(8 * j + 2 * quad + c);
      const float b = col >= 0 ? __bfloat162float(bias[col]) : 0.0f;
      d[4 * j + c] += b;
      d[4 * j + 2 + c] += b;
    }
}

}  // namespace poise::sm90
