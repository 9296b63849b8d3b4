// Persistent tile scheduler over (expert, M block, N block) for expert-grouped rows.
//
// The per-expert row offsets and counts live on the device; every CTA reads them once into shared
// memory at start (no host sync), then walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... or, with
// GroupedGemmShape::tile_counters (rows-as-M GEMMs), takes each next tile from that counter
// (tile_queue.cuh). Both roles (TMA producer, wgmma consumers) walk the same sequence, so they
// agree on the stages.
//
//  - Rows as M (fprop, dgrad): expert e has ceil(count_e / 128) M blocks x n_blocks tiles; the
//    tile order is expert-major, M block fastest, so concurrent CTAs share one expert's weights.
//  - Rows as K (wgrad): every expert has m_blocks x n_blocks tiles (a replica without rows has
//    none); the K loop covers its rows.
//  - Clusters of 2 CTAs (TMA multicast) walk tile pairs of one expert instead: M blocks 2i, 2i + 1
//    of one N block (they share B), and for an odd M block count the last M block's N blocks
//    2j, 2j + 1 (they share A). With an odd N block count too, the last pair's second CTA has no
//    tile: it loads its share of A for its peer and computes nothing (TileInfo::valid).
//    Where the last M block's pairs go among the full pairs: pair_order.cuh.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/pair_order.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"

namespace poise::sm90 {

struct TileInfo {
  int32_t expert;
  int32_t m_block;
  int32_t n_block;
  int32_t row_begin;  // first row of the expert in the grouped buffers
  int32_t row_count;  // rows of the expert
  bool valid;         // false: a cluster peer's filler tile (load for the peer, compute nothing)
  // Pairs: this CTA shares B (same N block) or A (same M block) with its peer; each loads half of
  // the shared operand for both.
  bool shares_a, shares_b;
};

// Rows as M: the tile's second 64-row A box (and h13 half) lies wholly past its expert's rows, so it
// is not fetched (TMA zero-fills a box loaded from out of bounds instead).
__device__ __forceinline__ bool second_box_is_padding(const TileInfo& tile) {
  return tile.row_count - tile.m_block * kTileM <= 64;
}

struct SchedulerStorage {
  int32_t tile_prefix[kMaxExperts + 1];  // rows-as-M: first tile index of each expert
  int2 rows[kMaxExperts];                // (offset, count) per expert
};

template <RowsAre kRows, int kCluster = 1>
struct TileScheduler {
  static_assert(kCluster == 1 || kCluster == 2, "single tiles or tile pairs");
  // Tiles (kCluster 1) or tile pairs (2) of an expert with m_blocks x n_blocks tiles.
  __device__ static int32_t groups_of(int32_t m_blocks, int32_t n_blocks) {
    if constexpr (kCluster == 1) return m_blocks * n_blocks;
    else return pair_groups(m_blocks, n_blocks);
  }

  const SchedulerStorage* storage;
  // The kernel's __grid_constant__ parameter: fields are read from the constant bank where used.
  // A copy in registers made the consumers spill tile counts to local memory, reloaded per tile.
  const GroupedGemmShape* shape_;
  int32_t total_tiles;
  __device__ const GroupedGemmShape& shape() const { return *shape_; }

  // Called by all threads of the CTA; ends with __syncthreads().
  __device__ static TileScheduler build(SchedulerStorage& s, const GroupedGemmShape& shape) {
    constexpr int kItems = (kMaxExperts + kThreadsPerCta - 1) / kThreadsPerCta;
    using Scan = cub::BlockScan<int32_t, kThreadsPerCta>;
    __shared__ typename Scan::TempStorage scan_storage;
    int32_t tiles[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = threadIdx.x * kItems + i;
      tiles[i] = 0;
      if (e < shape.num_experts) {
        const int32_t offset = shape.row_offsets_E[e];
        const int32_t count = shape.row_counts_E[e];
        s.rows[e] = make_int2(offset, count);
        const int32_t m_blocks = kRows == RowsAre::M ? (count + kTileM - 1) / kTileM : shape.m_blocks;
        tiles[i] = kRows == RowsAre::K && count == 0 && e >= shape.first_replica ? 0
                                                                                : groups_of(m_blocks, shape.n_blocks);
      }
    }
    int32_t total = 0;
    Scan(scan_storage).ExclusiveSum(tiles, tiles, total);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = threadIdx.x * kItems + i;
      if (e < shape.num_experts) s.tile_prefix[e] = tiles[i];
    }
    if (threadIdx.x == 0) s.tile_prefix[shape.num_experts] = total;
    __syncthreads();
    return TileScheduler{&s, &shape, total};
  }

  // Tile (group) t as CTA `cluster_rank` of its cluster computes it.
  __device__ TileInfo tile(int32_t t, int32_t cluster_rank = 0) const {
    // Largest e with tile_prefix[e] <= t (experts without tiles have equal prefixes). Shared-space
    // loads: through the generic pointer each step of this search was a generic 64-bit load.
    const uint32_t prefix = ptx::shared_address(storage->tile_prefix);
    int lo = 0, hi = shape().num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (static_cast<int32_t>(ptx::ld_shared_b32(prefix + 4 * mid)) <= t) lo = mid; else hi = mid - 1;
    }
    const uint32_t rows_at = ptx::shared_address(&storage->rows[lo]);
    const int2 rows = make_int2(static_cast<int32_t>(ptx::ld_shared_b32(rows_at)),
                                static_cast<int32_t>(ptx::ld_shared_b32(rows_at + 4)));
    const int32_t m_blocks = kRows == RowsAre::M ? (rows.y + kTileM - 1) / kTileM : shape().m_blocks;
    const int32_t local = t - static_cast<int32_t>(ptx::ld_shared_b32(prefix + 4 * lo));
    TileInfo info;
    info.expert = lo;
    info.row_begin = rows.x;
    info.row_count = rows.y;
    info.valid = true;
    info.shares_a = false;
    info.shares_b = kCluster > 1;
    if constexpr (kCluster == 1) {
      info.m_block = local % m_blocks;
      info.n_block = local / m_blocks;
    } else {
      const bool beside = remainder_beside_pairs(m_blocks / 2, shape().n_blocks, gridDim.x / kCluster);
      pair_tile(local, cluster_rank, m_blocks, shape().n_blocks, beside, info.m_block, info.n_block, info.shares_a,
                info.shares_b, info.valid);
    }
    return info;
  }

  __device__ int32_t k_blocks(const TileInfo& info) const {
    if constexpr (kRows == RowsAre::M) return shape().k_blocks;
    else return (info.row_count + shape().k_block_rows - 1) / shape().k_block_rows;
  }
};

}  // namespace poise::sm90
