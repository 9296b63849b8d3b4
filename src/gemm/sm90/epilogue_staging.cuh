// Staged epilogue stores: a consumer warpgroup writes its 64-row fragment, one 128-byte column
// chunk at a time (64 bf16 or 32 fp32 columns), into a shared-memory buffer, then either
//  - hands the whole 64 x 128-byte box to the TMA engine (when all 64 rows may be written), or
//  - copies the valid rows out with 16-byte stores (the last, partial slab of an expert).
// (Storing straight from the wgmma fragment writes 4 bytes x 8 rows per instruction: half-filled
// sectors.)
//
// Buffer layout: 64 rows x 128 bytes with the TMA 128-byte swizzle (16-byte unit u of row r lives
// at unit u ^ (r % 8)), 1024-byte aligned. Fragment writes (rows 16w + l/4 [+8], 4 bytes at
// 16j + 4(l%4)) then hit 32 distinct banks, and a row's 8 units are 8 distinct bank groups.
#pragma once

#include <cuda.h>
#include <cstdint>

#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/ptx/tma.cuh"
#include "gemm/sm90/ptx/warpgroup.cuh"

namespace poise::sm90 {

inline constexpr int kStagingBytes = 64 * 128;

// Barrier among the 128 threads of one consumer warpgroup (ids 2, 3; 1 is the consumers' shared one).
__device__ __forceinline__ void consumer_warpgroup_sync(int consumer) {
  ptx::named_barrier_sync(2 + consumer, 128);
}

// The 128-byte swizzle of the staging buffers (TMA's SWIZZLE_128B): 16-byte unit u (0..7) of row r
// sits at unit u ^ (r % 8) of that row.
__device__ __forceinline__ int swizzled_unit_offset(int row, int unit) { return row * 128 + ((unit ^ (row & 7)) << 4); }
// Byte byte_col (< 128) of row `row`.
__device__ __forceinline__ int staging_offset(int row, int byte_col) {
  return swizzled_unit_offset(row, byte_col >> 4) + (byte_col & 15);
}

// Through ptx/shared_memory.cuh: plain dereferences of the staging pointer compiled to generic
// 64-bit stores (16 live address pairs per chunk, and spills in four kernels).
__device__ __forceinline__ void stage_put_u32(uint8_t* buf, int row, int byte_col, uint32_t v) {
  ptx::st_shared_b32(ptx::shared_address(buf) + staging_offset(row, byte_col), v);
}
__device__ __forceinline__ void stage_put_u16(uint8_t* buf, int row, int byte_col, uint16_t v) {
  ptx::st_shared_b16(ptx::shared_address(buf) + staging_offset(row, byte_col), v);
}
__device__ __forceinline__ void stage_put_f32x2(uint8_t* buf, int row, int byte_col, float a, float b) {
  ptx::st_shared_v2_b32(ptx::shared_address(buf) + staging_offset(row, byte_col), __float_as_uint(a),
                        __float_as_uint(b));
}
__device__ __forceinline__ uint32_t stage_get_u32(const uint8_t* buf, int row, int byte_col) {
  return ptx::ld_shared_b32(ptx::shared_address(buf) + staging_offset(row, byte_col));
}
__device__ __forceinline__ uint4 stage_get_u128(const uint8_t* buf, int row, int byte_col) {
  return ptx::ld_shared_v4_b32(ptx::shared_address(buf) + staging_offset(row, byte_col));
}

// Before writing the warpgroup's staging buffers: the TMA stores issued from them (by thread 0)
// have read them, and every thread is done with the previous contents.
__device__ __forceinline__ void acquire_staging(int consumer, int thread) {
  if (thread == 0) ptx::tma_store_wait_read();
  consumer_warpgroup_sync(consumer);
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
    if (dst) *reinterpret_cast<uint4*>(dst + c * 16) = stage_get_u128(buf, r, c * 16);
  }
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
      *p = combine(stage_get_u128(buf, r, c * 16), *p);
    }
  }
}

// Emits a fully written buffer: by TMA store of the 64 x 128-byte box at (col, row) of `map` when
// `whole` (all 64 rows may be written), else by copying rows out. Ends the warpgroup's use of the
// buffer for writing; the next writer calls acquire_staging first. reduce_add: the box is added
// to what the target holds (TMA reduce; `whole` only).
template <class RowDst>
__device__ __forceinline__ void emit_staged(const uint8_t* buf, int consumer, int thread, bool whole,
                                            const CUtensorMap* map, int32_t col, int64_t row, RowDst&& row_dst,
                                            bool reduce_add = false) {
  if (whole) {
    ptx::fence_async_shared();  // this thread's staging writes -> visible to the TMA engine
    consumer_warpgroup_sync(consumer);
    if (thread == 0) {
      if (reduce_add) ptx::tma_reduce_add_2d(map, buf, col, static_cast<int32_t>(row));
      else ptx::tma_store_2d(map, buf, col, static_cast<int32_t>(row));
      ptx::tma_store_commit();
    }
  } else {
    consumer_warpgroup_sync(consumer);
    staged_copy_out(buf, thread, row_dst);
  }
}

// Emits a fully written buffer into a target that may hold values to add to: plain emit_staged
// when not `accumulate`; else TMA reduce-add of the whole box (all 64 rows below M, done in the
// memory system), or row copies that read the target back and write `combine(new, old)` per
// 16-byte unit (a partial slab).
template <class RowDst, class Combine>
__device__ __forceinline__ void emit_staged_add(const uint8_t* buf, int consumer, int thread, bool accumulate,
                                                int32_t valid, const CUtensorMap* map, int32_t col, int64_t row,
                                                RowDst&& row_dst, Combine&& combine) {
  if (accumulate && valid >= 64) {
    emit_staged(buf, consumer, thread, true, map, col, row, row_dst, /*reduce_add=*/true);
  } else if (accumulate) {
    consumer_warpgroup_sync(consumer);
    staged_combine_out(buf, thread, row_dst, combine);
  } else {
    emit_staged(buf, consumer, thread, valid >= 64, map, col, row, row_dst);
  }
}

// Epilogues that stage in ring stages (Epilogue::kRingStages): a warp releases a
// stage once done with it, except the warpgroup's first warp when its thread 0 issued TMA stores
// from the stage: it releases the stage after the next chunk's stores were issued and all but
// those have read shared memory (bulk groups), or at the end of the tile (finish).
struct RingStageRelease {
  bool pending = false;
  uint32_t pending_it = 0;

  template <class Ring>
  __device__ __forceinline__ void done(const Ring& ring, uint32_t it, int thread, bool stored_by_tma) {
    if (thread >= 32 || !stored_by_tma) {
      ring.release(it);
      return;
    }
    if (pending) {
      if (thread == 0) ptx::tma_store_wait_read<1>();
      ring.release(pending_it);
    }
    pending = true;
    pending_it = it;
  }
  template <class Ring>
  __device__ __forceinline__ void finish(const Ring& ring, int thread) {
    if (!pending) return;
    if (thread == 0) ptx::tma_store_wait_read<0>();
    ring.release(pending_it);
    pending = false;
  }
};

// A warpgroup's boxes staged in a ring stage leave together: by TMA store from thread 0 (one bulk
// group) when all 64 rows may be written, else by row copies. The stage's next writer is a TMA
// load, so every thread orders its staging writes before the async proxy either way.
// store(i) issues box i's TMA store; copy(i) copies box i's valid rows out.
template <class TmaStore, class CopyOut>
__device__ __forceinline__ void emit_ring_stage(int consumer, int thread, bool whole, int boxes, TmaStore&& store,
                                                CopyOut&& copy) {
  ptx::fence_async_shared();
  consumer_warpgroup_sync(consumer);
  if (whole) {
    if (thread == 0) {
      for (int i = 0; i < boxes; ++i) store(i);
      ptx::tma_store_commit();
    }
  } else {
    for (int i = 0; i < boxes; ++i) copy(i);
  }
}

}  // namespace poise::sm90
