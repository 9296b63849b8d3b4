// The wgmma consumers of the grouped GEMM (warpgroups 1 and 2): each owns 64 of a tile's 128 rows
// and all kBlockN columns, accumulates in fp32 registers, releases a stage through its "empty"
// barrier as soon as the wgmma reading it retired, then hands its accumulators to the epilogue.
#pragma once

#include <cstdint>

#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/mainloop_fp8.cuh"
#include "gemm/sm90/mainloop_fp8_wgrad.cuh"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/tma.cuh"
#include "gemm/sm90/ptx/wgmma.cuh"
#include "gemm/sm90/stage_ring.cuh"
#include "gemm/sm90/tile_queue.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// One wgmma group: kSlices k16 steps of this warpgroup's A and the tile's B from one stage.
template <int kBlockN, bool kAMnMajor, bool kBMnMajor>
struct WgmmaGroup {
  template <int kSlices>
  __device__ __forceinline__ static void issue(float (&acc)[kBlockN / 2], uint64_t desc_a, uint64_t desc_b) {
    ptx::fence_accumulators(acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSlices; ++kk) {
      ptx::wgmma_k16<kBlockN, kAMnMajor ? 1 : 0, kBMnMajor ? 1 : 0>(
          acc, ptx::desc_advance(desc_a, kk * ptx::k16_slice_bytes<kAMnMajor>()),
          ptx::desc_advance(desc_b, kk * ptx::k16_slice_bytes<kBMnMajor>()), 1);
    }
    ptx::wgmma_commit_group();
  }
};

// Rows as K: how many k16 slices of K block kb hold the expert's rows. An expert's last K block
// holds the remainder of its rows: its first half alone is computed when the rows fit in it, and
// the rows past the count within what is computed are zeroed (they hold padding or the next
// expert's rows). Each slice count is a whole wgmma group on its own path: a wgmma under a
// condition inside a group makes ptxas serialize the kernel's wgmmas.
template <int kBlockN>
__device__ __forceinline__ int k_tail_slices(const TileInfo& tile, int32_t kb, uint8_t* a_smem, uint8_t* b_smem,
                                             int consumer_thread) {
  const int valid = tile.row_count - kb * kTileK;
  if (valid >= kTileK) return kTileK / 16;
  const int covered = valid <= kTileK / 2 ? kTileK / 2 : kTileK;
  if (valid < covered) zero_k_tail<kTileM / 64, kBlockN, 256>(a_smem, b_smem, valid, covered, consumer_thread, 1);
  return covered >> 4;
}

// The tile's K loop from ring iteration `it` (returned past it). One wgmma group stays in flight:
// a stage is released once the group after it was issued and it retired. kDeferredParts: the
// previous tile's packed rows are stored part p right after K block p is issued.
template <int kBlockN, RowsAre kRows, bool kBMnMajor, int kDeferredParts, class Ring, uint32_t kABytes>
__device__ __forceinline__ uint32_t mainloop(const Ring& ring, uint32_t it, const TileInfo& tile, int32_t k_blocks,
                                             int consumer, int consumer_thread, int lane, float (&acc)[kBlockN / 2],
                                             PendingRows<kBlockN>& pending) {
  constexpr bool kAMnMajor = kRows == RowsAre::K;
  using Group = WgmmaGroup<kBlockN, kAMnMajor, kBMnMajor>;
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
  uint32_t prev_it = 0;
  for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
    uint8_t* const a_smem = ring.wait(it);  // the stage: A, then B at kABytes
    uint8_t* const b_smem = a_smem + kABytes;
    int slices = kTileK / 16;
    if constexpr (kRows == RowsAre::K) slices = k_tail_slices<kBlockN>(tile, kb, a_smem, b_smem, consumer_thread);
    // A: this warpgroup's 64 rows; K-major rows are 128 B, MN-major chunks are 64 M wide.
    const uint64_t desc_a = kAMnMajor ? ptx::make_mn_major_desc(a_smem + consumer * ptx::kMnChunkBytes)
                                      : ptx::make_k_major_desc(a_smem + consumer * 64 * 128);
    const uint64_t desc_b = kBMnMajor ? ptx::make_mn_major_desc(b_smem) : ptx::make_k_major_desc(b_smem);
    if (slices == 2) Group::template issue<2>(acc, desc_a, desc_b);
    else Group::template issue<kTileK / 16>(acc, desc_a, desc_b);
    ptx::fence_accumulators(acc);
    if constexpr (kDeferredParts > 0) pending.template flush_part<kDeferredParts>(kb, lane);
    ptx::wgmma_wait_group<1>();
    ptx::fence_accumulators(acc);
    if (kb > 0) ring.release(prev_it);
    prev_it = it;
  }
  ptx::wgmma_wait_group<0>();
  ptx::fence_accumulators(acc);
  if (k_blocks > 0) ring.release(prev_it);
  return it;
}

// Warpgroups 1 and 2: every tile of the walk, its K loop (BF16, or kFp8: mainloop_fp8.cuh, and
// mainloop_fp8_wgrad.cuh for rows as K, which stages column scales in `column_scales`), then its
// epilogue.
template <int kBlockN, RowsAre kRows, bool kBMnMajor, class Ring, uint32_t kABytes, class Scheduler, class Epilogue,
          int kCluster, bool kFp8>
__device__ __forceinline__ void run_consumers(const Ring& ring, uint8_t* staging_base, uint32_t staging_per_consumer,
                                              float* column_scales, const Scheduler& scheduler,
                                              const TileQueue& queue, bool dynamic_tiles, int32_t first_tile,
                                              int32_t tile_stride, int32_t cluster_rank, int lane,
                                              const Epilogue& epilogue) {
  constexpr int kRingStages = Epilogue::kRingStages;
  constexpr int kDeferredParts = Epilogue::kDeferredParts;
  const int consumer = threadIdx.x / 128 - 1;  // rows [64 * consumer, 64 * consumer + 64) of the tile
  const int consumer_thread = threadIdx.x - 128;
  float acc[kBlockN / 2];
  PendingRows<kBlockN> pending;
  uint32_t it = 0, dequeued = 0;
  auto next_tile = [&](int32_t t) { return dynamic_tiles ? queue.read(dequeued++, lane) : t + tile_stride; };
  for (int32_t t = dynamic_tiles ? queue.read(dequeued++, lane) : first_tile; t < scheduler.total_tiles;
       t = next_tile(t)) {
    const TileInfo tile = scheduler.tile(t, cluster_rank);
    const int32_t k_blocks = scheduler.k_blocks(tile);
    // Rows as M: in an expert's last, partial M block a warpgroup whose 64 rows are all past the
    // expert's count issues no wgmma and stores nothing, so the other warpgroup's wgmmas have the
    // tensor cores to themselves. A separate path: wgmmas under a condition get serialized by ptxas.
    const bool idle = Epilogue::kSkipsEmptySlabs && kRows == RowsAre::M &&
                      tile.row_count - tile.m_block * kTileM - 64 * consumer <= 0;
    if ((kCluster > 1 && !tile.valid) || idle) {
      // A filler tile or an idle warpgroup: the stages (the peer's multicast half too) pass on.
      for (int32_t kb = 0; kb < k_blocks + kRingStages; ++kb, ++it) {
        ring.wait(it);
        ring.release(it);
      }
      continue;
    }
    if constexpr (kFp8 && kRows == RowsAre::M) {
      static_assert(!kBMnMajor && kDeferredParts == 0, "FP8: K-major operands");
      it = mainloop_fp8<Ring, kABytes>(ring, it, tile, k_blocks, consumer, consumer_thread % 128, scheduler.shape(),
                                       acc);
    } else if constexpr (kFp8) {
      static_assert(!kBMnMajor && kDeferredParts == 0, "FP8 WGRAD: K-major operands");
      it = mainloop_fp8_wgrad<Ring, kABytes>(ring, it, tile, k_blocks, consumer, consumer_thread % 128,
                                             scheduler.shape(), column_scales + consumer * 2 * kBlockN, acc);
    } else {
      it = mainloop<kBlockN, kRows, kBMnMajor, kDeferredParts, Ring, kABytes>(ring, it, tile, k_blocks, consumer,
                                                                               consumer_thread, lane, acc, pending);
    }
    // Computed here, not held through the loop: the consumers run at the edge of their registers.
    const int thread = consumer_thread % 128;
    uint8_t* const staging = staging_base + consumer * staging_per_consumer;
    if constexpr (kRingStages > 0) {
      epilogue.template store<kBlockN>(acc, tile, consumer, thread, ring, it);
      it += kRingStages;
    } else if constexpr (kDeferredParts > 0) {
      pending.template flush_from<kDeferredParts>(k_blocks, lane);  // parts a short K loop left
      epilogue.template store<kBlockN>(acc, tile, consumer, thread, staging, pending);
    } else {
      epilogue.template store<kBlockN>(acc, tile, consumer, thread, staging);
    }
  }
  if constexpr (kDeferredParts > 0) pending.template flush_from<kDeferredParts>(0, lane);
  // TMA stores read shared memory asynchronously: finish them before the CTA exits.
  if (consumer_thread % 128 == 0) ptx::tma_store_wait_all();
}

}  // namespace poise::sm90
