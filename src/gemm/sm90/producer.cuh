// The TMA producer of the grouped GEMM (one elected thread of warpgroup 0): walks the tile sequence
// and fills the stage ring; each stage's "full" barrier completes when its bytes land.
//
// A stage is loaded as boxes: A as two 64-row (K-major) or 64-column (MN-major) halves, B as
// 64-column chunks (MN-major) or two halves of kBlockN / 2 weight rows (K-major: gate / up for the
// blocked W13 layout). The operand a pair shares (TileInfo::shares_b) is split between its CTAs,
// each multicasting its half of the boxes into both; the other operand each CTA loads whole.
#pragma once

#include <cuda.h>
#include <cstdint>

#include "gemm/sm90/fault.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/ptx/cluster.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/tma.cuh"
#include "gemm/sm90/stage_ring.cuh"
#include "gemm/sm90/tile_queue.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// A box row coordinate wholly outside every rows operand: TMA fills such a box with zeros and reads
// no memory.
inline constexpr int32_t kOutOfBoundsRow = -64;

// Loads boxes [first, end) of `boxes`: this CTA's half of a shared operand (multicast into both CTAs
// of the pair), or all of them.
template <int kCluster, class Load>
__device__ __forceinline__ void load_boxes(bool shared, int32_t cluster_rank, int boxes, Load&& load) {
  const int first = shared ? cluster_rank * (boxes / 2) : 0;
  const int end = shared ? first + boxes / 2 : boxes;
  for (int j = first; j < end; ++j) load(j);
}

template <int kCluster>
__device__ __forceinline__ void load_box(bool shared, void* dst, const CUtensorMap* map, int32_t inner,
                                         int32_t outer, uint64_t* bar) {
  // Masks and halves are computed where used: the producer runs on 40 registers, and holding them
  // for the whole loop made it spill.
  if (kCluster > 1 && shared) ptx::tma_load_2d_multicast(dst, map, inner, outer, bar, (1u << kCluster) - 1);
  else ptx::tma_load_2d(dst, map, inner, outer, bar);
}

// The boxes of K block kb of `tile` into `stage` (A at 0, B at kABytes).
//  a_row0_one_box: rows as M, the tile's first A row, bit 0 set when its second A box holds only
//    padding (loaded from out of bounds: TMA zero-fills it without reading memory, and the stage's
//    byte count stays). The first A row is a multiple of 64, so bit 0 is free: the producer runs
//    on 40 registers, and a separate count made the pair kernels spill.
template <int kBlockN, RowsAre kRows, bool kBMnMajor, int kCluster, uint32_t kABytes>
__device__ __forceinline__ void load_stage(uint8_t* stage, uint64_t* full, const TileInfo& tile, int32_t kb,
                                           int32_t a_row0_one_box, int32_t b_row0, const CUtensorMap* weights,
                                           const CUtensorMap& map_a, const CUtensorMap& map_b,
                                           const GroupedGemmShape& shape, int32_t cluster_rank) {
  constexpr int kABoxes = 2;
  constexpr int kBBoxes = kBMnMajor ? kBlockN / 64 : 2;
  uint8_t* const stage_b = stage + kABytes;
  // Pairs share A exactly where they do not share B.
  const bool share_b = kCluster > 1 && tile.shares_b;
  const bool share_a = kCluster > 1 && !tile.shares_b;
  if constexpr (kRows == RowsAre::M) {
    const int32_t k0 = kb * kTileK;
    load_boxes<kCluster>(share_a, cluster_rank, kABoxes, [&](int j) {
      load_box<kCluster>(share_a, stage + j * 64 * 128, &map_a, k0,
                         j == 1 && (a_row0_one_box & 1) ? kOutOfBoundsRow : (a_row0_one_box & ~1) + 64 * j, full);
    });
    if constexpr (kBMnMajor) {
      // 64-column chunks: the gate half's, then the up half's F columns on (blocked W13 stored
      // transposed), or the tile's kBlockN columns in order.
      const int32_t n0 = tile.n_block * (shape.b_gate_up_split > 0 ? kBlockN / 2 : kBlockN);
      load_boxes<kCluster>(share_b, cluster_rank, kBBoxes, [&](int j) {
        const bool up = shape.b_gate_up_split > 0 && j >= kBBoxes / 2;
        const int32_t col = n0 + 64 * j + (up ? shape.b_gate_up_split - kBlockN / 2 : 0);
        load_box<kCluster>(share_b, stage_b + j * ptx::kMnChunkBytes, weights, col, b_row0 + k0, full);
      });
    } else {
      // Gate and up rows F apart (blocked W13), or the two halves of the tile's kBlockN rows.
      const int32_t n0 = b_row0 + tile.n_block * (shape.b_gate_up_split > 0 ? kBlockN / 2 : kBlockN);
      const int32_t second = shape.b_gate_up_split > 0 ? shape.b_gate_up_split : kBlockN / 2;
      load_boxes<kCluster>(share_b, cluster_rank, kBBoxes, [&](int j) {
        load_box<kCluster>(share_b, stage_b + j * (kBlockN / 2) * 128, weights, k0, n0 + j * second, full);
      });
    }
  } else if constexpr (!kBMnMajor) {
    // Rows as K with both operands K-major: FP8 WGRAD's transposed column tiles, A [M][rows] and
    // B [N][rows] as e4m3 pairs, a stage 128 rows of K (groups start on 128-row blocks).
    const int32_t k0 = (tile.row_begin + kb * 128) / 2;
    load_boxes<kCluster>(share_a, cluster_rank, kABoxes, [&](int j) {
      load_box<kCluster>(share_a, stage + j * 64 * 128, &map_a, k0, tile.m_block * kTileM + 64 * j, full);
    });
    load_boxes<kCluster>(share_b, cluster_rank, 2, [&](int j) {
      load_box<kCluster>(share_b, stage_b + j * (kBlockN / 2) * 128, &map_b, k0,
                         tile.n_block * kBlockN + j * (kBlockN / 2), full);
    });
  } else {
    const int32_t r0 = tile.row_begin + kb * kTileK;
    load_boxes<kCluster>(share_a, cluster_rank, kABoxes, [&](int j) {
      load_box<kCluster>(share_a, stage + j * ptx::kMnChunkBytes, &map_a, tile.m_block * kTileM + 64 * j, r0, full);
    });
    load_boxes<kCluster>(share_b, cluster_rank, kBBoxes, [&](int j) {
      load_box<kCluster>(share_b, stage_b + j * ptx::kMnChunkBytes, &map_b, tile.n_block * kBlockN + 64 * j, r0, full);
    });
  }
}

// Thread 0 of warpgroup 0: every tile's K blocks, then the epilogue's ring stages (its operands,
// or nothing, as soon as a stage is free), in the tile order the consumers walk too.
template <int kBlockN, int kStages, RowsAre kRows, bool kBMnMajor, int kCluster, uint32_t kStageBytes,
          uint32_t kABytes, class Scheduler, class Epilogue>
__device__ __forceinline__ void run_producer(const StageRing<kStages, kCluster, kStageBytes>& ring,
                                             const Scheduler& scheduler, const TileQueue& queue, bool dynamic_tiles,
                                             int32_t first_tile, int32_t tile_stride, int32_t cluster_rank,
                                             const CUtensorMap& map_a, const CUtensorMap& map_b,
                                             const CUtensorMap& map_b_replicas, const GroupedGemmShape& shape,
                                             const Epilogue& epilogue) {
  ptx::tma_prefetch_descriptor(&map_a);
  ptx::tma_prefetch_descriptor(&map_b);
  if (shape.first_replica < shape.num_experts) ptx::tma_prefetch_descriptor(&map_b_replicas);
  // Fault injection (tests): this stage's load is never issued, its consumers' wait times out.
  const bool drop_first = blockIdx.x == 0 && shape.drop_first_stage != 0;
  uint32_t it = 0, queued = 0;
  int32_t t = first_tile;
  if (dynamic_tiles) queue.publish(queued++, t);
  while (t < scheduler.total_tiles) {
    const TileInfo tile = scheduler.tile(t, cluster_rank);
    const int32_t k_blocks = scheduler.k_blocks(tile);
    const bool replica = tile.expert >= shape.first_replica;
    const CUtensorMap* weights = replica ? &map_b_replicas : &map_b;
    const int32_t b_row0 = (tile.expert - (replica ? shape.first_replica : 0)) * shape.b_rows_per_expert;
    const int32_t a_row0_one_box =
        (tile.row_begin + tile.m_block * kTileM) | (kRows == RowsAre::M && second_box_is_padding(tile) ? 1 : 0);
    for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
      ring.wait_empty(it);
      if (drop_first && it == 0) continue;
      ptx::mbarrier_arrive_expect_tx(ring.full(it), kStageBytes);
      load_stage<kBlockN, kRows, kBMnMajor, kCluster, kABytes>(ring.stage(it), ring.full(it), tile, kb,
                                                               a_row0_one_box, b_row0, weights, map_a, map_b, shape,
                                                               cluster_rank);
    }
    if constexpr (Epilogue::kRingStages > 0) {
      for (int j = 0; j < Epilogue::kRingStages; ++j, ++it) {
        ring.wait_empty(it);
        epilogue.template load_ring_stage<kBlockN>(j, tile, ring.stage(it), ring.full(it));
      }
    }
    if (dynamic_tiles) {
      t = queue.claim<kCluster>(queued - 1, cluster_rank, tile_stride, shape.tile_counters);
      queue.publish(queued++, t);
    } else {
      t += tile_stride;
    }
  }
  if (dynamic_tiles) TileQueue::finish(cluster_rank, tile_stride, shape.tile_counters);
}

}  // namespace poise::sm90
