// Staged epilogue stores: a consumer warpgroup writes its 64-row fragment, one 128-byte column
// chunk at a time (64 bf16 or 32 fp32 columns), into a padded shared-memory buffer, then copies
// whole rows out with 16-byte stores, so each warp instruction writes full 128-byte lines.
// (Storing straight from the wgmma fragment writes 4 bytes x 8 rows per instruction: half-filled
// sectors, measured at ~1.4 TB/s chip-wide in v1.)
//
// Buffer: 64 rows x 144 bytes (128 data + 16 pad). Fragment writes (row 16w + l/4 [+8],
// 4 bytes at column 4*(l%4) + 16j) then hit 32 distinct banks; row reads of 16 B are conflict-free.
#pragma once

#include <cstdint>

#include "kernels/sm90/ptx/cp_async.cuh"
#include "kernels/sm90/ptx/warpgroup.cuh"

namespace poise::sm90 {

inline constexpr int kStagingPitch = 144;
inline constexpr int kStagingBytes = 64 * kStagingPitch;

// Barrier among the 128 threads of one consumer warpgroup (ids 2, 3; 1 is the consumers' shared one).
__device__ __forceinline__ void consumer_warpgroup_sync(int consumer) {
  ptx::named_barrier_sync(2 + consumer, 128);
}

__device__ __forceinline__ void stage_put_u32(uint8_t* buf, int row, int byte_col, uint32_t v) {
  *reinterpret_cast<uint32_t*>(buf + row * kStagingPitch + byte_col) = v;
}
__device__ __forceinline__ void stage_put_u16(uint8_t* buf, int row, int byte_col, uint16_t v) {
  *reinterpret_cast<uint16_t*>(buf + row * kStagingPitch + byte_col) = v;
}
__device__ __forceinline__ void stage_put_f32x2(uint8_t* buf, int row, int byte_col, float a, float b) {
  *reinterpret_cast<float2*>(buf + row * kStagingPitch + byte_col) = make_float2(a, b);
}

// Copies the 64 staged rows out: row_dst(r) gives the global address of row r's 128 bytes, or
// nullptr to skip the row. 16-byte units, 8 threads per row, 4 rows per warp instruction.
template <class RowDst>
__device__ __forceinline__ void staged_copy_out(const uint8_t* buf, int thread, RowDst&& row_dst) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int u = thread + 128 * i;
    const int r = u >> 3, c = u & 7;
    uint8_t* dst = row_dst(r);
    if (dst)
      *reinterpret_cast<uint4*>(dst + c * 16) = *reinterpret_cast<const uint4*>(buf + r * kStagingPitch + c * 16);
  }
}

// The reverse: fetches 64 rows of 128 bytes (row_src(r), or nullptr to skip) into the buffer with
// cp.async; the caller commits, waits and syncs before reading.
template <class RowSrc>
__device__ __forceinline__ void staged_fetch_async(uint8_t* buf, int thread, RowSrc&& row_src) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int u = thread + 128 * i;
    const int r = u >> 3, c = u & 7;
    const uint8_t* src = row_src(r);
    if (src) ptx::cp_async_16(buf + r * kStagingPitch + c * 16, src + c * 16);
  }
}

__device__ __forceinline__ uint32_t stage_get_u32(const uint8_t* buf, int row, int byte_col) {
  return *reinterpret_cast<const uint32_t*>(buf + row * kStagingPitch + byte_col);
}

// Same, combining with what is already there: combine(uint4 staged, uint4 old) -> uint4.
template <class RowDst, class Combine>
__device__ __forceinline__ void staged_combine_out(const uint8_t* buf, int thread, RowDst&& row_dst,
                                                   Combine&& combine) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int u = thread + 128 * i;
    const int r = u >> 3, c = u & 7;
    uint8_t* dst = row_dst(r);
    if (dst) {
      uint4* p = reinterpret_cast<uint4*>(dst + c * 16);
      *p = combine(*reinterpret_cast<const uint4*>(buf + r * kStagingPitch + c * 16), *p);
    }
  }
}

}  // namespace poise::sm90
