// Staged epilogue stores: a consumer warpgroup writes its 64-row fragment, one 128-byte column
// chunk at a time (64 bf16 or 32 fp32 columns), into a shared-memory buffer, each warp its own 16
// rows, then each warp either
//  - hands its 16 x 128-byte box to the TMA engine (when all its rows may be written), or
//  - copies its valid rows out with 16-byte stores (the last, partial slab of an expert).
// (Storing straight from the wgmma fragment writes 4 bytes x 8 rows per instruction: half-filled
// sectors, measured at ~1.4 TB/s chip-wide in v1; copying rows out by hand still kept the
// warpgroup busy storing: v6.)
//
// Buffer layout: 64 rows x 128 bytes with the TMA 128-byte swizzle (16-byte unit u of row r lives
// at unit u ^ (r % 8)), 1024-byte aligned. Fragment writes (rows 16w + l/4 [+8], 4 bytes at
// 16j + 4(l%4)) then hit 32 distinct banks, and a row's 8 units are 8 distinct bank groups.
#pragma once

#include <cuda.h>
#include <cstdint>

#include "kernels/sm90/ptx/cp_async.cuh"
#include "kernels/sm90/ptx/tma.cuh"
#include "kernels/sm90/ptx/warpgroup.cuh"

namespace poise::sm90 {

inline constexpr int kStagingBytes = 64 * 128;
// Rows of the slab one warp owns: the wgmma accumulator layout gives warp w of a warpgroup rows
// [16w, 16w + 16). Staging is therefore warp-private: a warp writes, fences and sends its own
// 16 x 128-byte box (its own TMA store, its own bulk-group waits) with __syncwarp only. (With
// warpgroup barriers around every 64-column chunk, ncu showed CTA-barrier stalls as the largest
// stall reason of the epilogue-heavy GEMMs: 36% of issue-slot stalls.)
inline constexpr int kWarpRows = 16;
inline constexpr int kWarpStagingBytes = kWarpRows * 128;

__device__ __forceinline__ int staging_offset(int row, int byte_col) {
  return row * 128 + ((((byte_col >> 4) ^ row) & 7) << 4) + (byte_col & 15);
}

__device__ __forceinline__ void stage_put_u32(uint8_t* buf, int row, int byte_col, uint32_t v) {
  *reinterpret_cast<uint32_t*>(buf + staging_offset(row, byte_col)) = v;
}
__device__ __forceinline__ void stage_put_u16(uint8_t* buf, int row, int byte_col, uint16_t v) {
  *reinterpret_cast<uint16_t*>(buf + staging_offset(row, byte_col)) = v;
}
__device__ __forceinline__ void stage_put_f32x2(uint8_t* buf, int row, int byte_col, float a, float b) {
  *reinterpret_cast<float2*>(buf + staging_offset(row, byte_col)) = make_float2(a, b);
}
__device__ __forceinline__ uint32_t stage_get_u32(const uint8_t* buf, int row, int byte_col) {
  return *reinterpret_cast<const uint32_t*>(buf + staging_offset(row, byte_col));
}

// Before a warp writes its rows of a staging buffer: the TMA stores its lane 0 issued from them
// have read them, and every lane is done with the previous contents. `thread`: 0..127 in the
// warpgroup.
__device__ __forceinline__ void acquire_staging(int thread) {
  if (thread % 32 == 0) ptx::tma_store_wait_read();
  __syncwarp();
}

// The 16-byte units (slab row r, column unit c) a lane handles for its warp's 16 rows: 4 of 128.
template <class Fn>
__device__ __forceinline__ void for_warp_units(int thread, Fn&& fn) {
  const int lane = thread % 32, first_row = (thread / 32) * kWarpRows;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int u = lane + 32 * i;
    fn(first_row + (u >> 3), u & 7);
  }
}

// Copies the warp's staged rows out: row_dst(r) gives the global address of slab row r's 128
// bytes, or nullptr to skip the row.
template <class RowDst>
__device__ __forceinline__ void staged_copy_out(const uint8_t* buf, int thread, RowDst&& row_dst) {
  for_warp_units(thread, [&](int r, int c) {
    uint8_t* dst = row_dst(r);
    if (dst) *reinterpret_cast<uint4*>(dst + c * 16) = *reinterpret_cast<const uint4*>(buf + staging_offset(r, c * 16));
  });
}

// Same, combining with what is already there: combine(uint4 staged, uint4 old) -> uint4.
template <class RowDst, class Combine>
__device__ __forceinline__ void staged_combine_out(const uint8_t* buf, int thread, RowDst&& row_dst,
                                                   Combine&& combine) {
  __syncwarp();  // every lane's staging writes are in
  for_warp_units(thread, [&](int r, int c) {
    uint8_t* dst = row_dst(r);
    if (dst) {
      uint4* p = reinterpret_cast<uint4*>(dst + c * 16);
      *p = combine(*reinterpret_cast<const uint4*>(buf + staging_offset(r, c * 16)), *p);
    }
  });
}

// Emits the warp's rows of a fully written buffer: by one TMA store of its 16 x 128-byte box at
// (col, row + 16w) of `map` (boxes of 16 rows) when all 16 rows may be written (valid_rows counts
// the slab's rows that may be), else by copying its valid rows out. Ends the warp's use of the
// buffer for writing; the next writer calls acquire_staging first.
template <class RowDst>
__device__ __forceinline__ void emit_staged(const uint8_t* buf, int thread, int32_t valid_rows, const CUtensorMap* map,
                                            int32_t col, int64_t row, RowDst&& row_dst) {
  const int warp = thread / 32;
  if (valid_rows - warp * kWarpRows >= kWarpRows) {
    ptx::fence_async_shared();  // this lane's staging writes -> visible to the TMA engine
    __syncwarp();
    if (thread % 32 == 0) {
      ptx::tma_store_2d(map, buf + warp * kWarpStagingBytes, col, static_cast<int32_t>(row + warp * kWarpRows));
      ptx::tma_store_commit();
    }
  } else {
    __syncwarp();
    staged_copy_out(buf, thread, row_dst);
  }
}

// The reverse of a copy-out: fetches the warp's rows (row_src(r), or nullptr to skip) into the
// buffer with cp.async; the caller commits, waits (cp_async_wait_all) and __syncwarp()s.
template <class RowSrc>
__device__ __forceinline__ void staged_fetch_async(uint8_t* buf, int thread, RowSrc&& row_src) {
  for_warp_units(thread, [&](int r, int c) {
    const uint8_t* src = row_src(r);
    if (src) ptx::cp_async_16(buf + staging_offset(r, c * 16), src + c * 16);
  });
}

}  // namespace poise::sm90
