// Persistent tile scheduler over (expert, M block, N block) for expert-grouped rows.
//
// The per-expert row offsets and counts live on the device; every CTA reads them once into shared
// memory at start (no host sync), then walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... or, with
// GroupedGemmShape::tile_counters (rows-as-M GEMMs), takes each next tile from that counter
// (grouped_gemm.cuh: the producer claims it and queues it for the consumers). Both roles (TMA
// producer, wgmma consumers) walk the same sequence, so they agree on the stages.
//
//  - Rows as M (fprop, dgrad): expert e has ceil(count_e / 128) M blocks x n_blocks tiles; the
//    tile order is expert-major, M block fastest, so concurrent CTAs share one expert's weights.
//  - Rows as K (wgrad): every expert has m_blocks x n_blocks tiles (a replica without rows has
//    none); the K loop covers its rows.
//  - Clusters of 2 CTAs (TMA multicast) walk tile pairs of one expert instead: M blocks 2i, 2i + 1
//    of one N block (they share B), and for an odd M block count the last M block's N blocks
//    2j, 2j + 1 (they share A). With an odd N block count too, the last pair's second CTA has no
//    tile: it loads its share of A for its peer and computes nothing (TileInfo::valid).
//    Where the last M block's pairs go among the full pairs: pair_order.cuh (kRemainderBesidePairs).
//  - Clusters of 4 CTAs (rows as M only) walk quads: CTA r computes M block 2i + (r & 1) of N block
//    2j + (r >> 1), sharing A with CTA r ^ 2 (same M block) and B with CTA r ^ 1 (same N block).
//    An odd last M block is walked in units of 4 N blocks, as two A-sharing pairs {0, 2} and
//    {1, 3}. CTAs past the last N block are fillers as above.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "gemm/sm90/pair_order.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/token_combine.cuh"

namespace poise::sm90 {

inline constexpr int kMaxExperts = 1024;
inline constexpr int kTileM = 128;       // rows of a tile: two consumer warpgroups x 64
inline constexpr int kTileK = 64;        // K elements per pipeline stage
inline constexpr int kThreadsPerCta = 384;  // producer warpgroup + two consumer warpgroups

enum class RowsAre { M, K };

// Rows as M: an expert's last M block does not fetch an all-padding 64-row A box (TMA zero-fills it
// from out of bounds) nor, in the SwiGLU backward, that half's h13 (grouped_gemm.cuh); 0 fetches
// them as before session 17 (A/B).
#ifndef POISE_SKIP_PADDING_BOXES
#define POISE_SKIP_PADDING_BOXES 1
#endif
inline constexpr bool kSkipPaddingBoxes = POISE_SKIP_PADDING_BOXES;

// Pairs: where an odd expert's last M block is walked (pair_order.cuh). 2: beside the full
// pairs of the N blocks it covers when the expert's full pairs take more than half a wave of the
// launch's clusters (else they all start within the time the L2 holds a line anyway); 1: always
// beside; 0: after all of them (the order before session 21). A/B knob.
#ifndef POISE_REMAINDER_BESIDE_PAIRS
#define POISE_REMAINDER_BESIDE_PAIRS 2
#endif
inline constexpr int kRemainderBesidePairs = POISE_REMAINDER_BESIDE_PAIRS;
static_assert(kRemainderBesidePairs >= 0 && kRemainderBesidePairs <= 2, "POISE_REMAINDER_BESIDE_PAIRS: 0, 1 or 2");

// What the scheduler and the producer need to know about one grouped GEMM.
struct GroupedGemmShape {
  const int32_t* row_offsets_E = nullptr;  // device [E]: first row of each expert (multiple of 128)
  const int32_t* row_counts_E = nullptr;   // device [E]: rows of each expert
  int32_t num_experts = 0;
  int32_t m_blocks = 0;          // rows-as-K: ceil(M / 128)
  int32_t n_blocks = 0;          // tiles along N
  int32_t k_blocks = 0;          // rows-as-M: K / 64
  int32_t b_rows_per_expert = 0; // rows-as-M: rows of B's 2D view that belong to one expert
  int32_t b_split_rows = 0;      // fprop blocked SwiGLU: gate-to-up row distance in B (F); 0 = one box
  // Experts [first_replica, num_experts) are replicas: rows-as-M GEMMs read their B block from the
  // kernel's second map at index e - first_replica; rows-as-K GEMMs give a replica without rows
  // no tiles (nobody reads its gradient). num_experts when there are none.
  int32_t first_replica = 0;
  // Rows-as-M GEMMs on 1-CTA or pair launches: device int32 [2] (next tile, claimers done), zero
  // between launches; tiles are then taken in order by whichever cluster is free (grouped_gemm.cuh).
  // Null: the static order.
  int32_t* tile_counters = nullptr;
  // The producer warpgroup's side of the launch, by kind (a union: a larger kernel parameter made
  // ptxas spill in the WGRAD pair kernel's consumers, 8 -> 24 bytes of stack).
  union {
    // Rows as K (WGRAD): a top-k combine the producer warpgroup's idle warps run alongside
    // (token_combine.cuh); combine.out_TD = nullptr: none.
    TokenCombineJob combine{};
    // Rows as M: the A operand is streamed in by the kernel before (streamed_rows.cuh,
    // StreamedRowsWords); the producer waits per tile for its row block. Null: A is complete.
    uint32_t* streamed_rows;
  };
};

struct TileInfo {
  int32_t expert;
  int32_t m_block;
  int32_t n_block;
  int32_t row_begin;  // first row of the expert in the grouped buffers
  int32_t row_count;  // rows of the expert
  bool valid;         // false: a cluster peer's filler tile (load for the peer, compute nothing)
  // Clusters: this CTA shares B with CTA rank ^ 1 (same N block), A with its A partner (rank ^ 1
  // in pairs, rank ^ 2 in quads: same M block); each loads half of a shared operand for both.
  bool shares_a, shares_b;
};

// Rows as M, with kSkipPaddingBoxes: the tile's second 64-row A box (and h13 half) lies wholly past
// its expert's rows, so it is not fetched.
__device__ __forceinline__ bool second_box_is_padding(const TileInfo& tile) {
  return kSkipPaddingBoxes && tile.row_count - tile.m_block * kTileM <= 64;
}

struct SchedulerStorage {
  int32_t tile_prefix[kMaxExperts + 1];  // rows-as-M: first tile index of each expert
  int2 rows[kMaxExperts];                // (offset, count) per expert
};

template <RowsAre kRows, int kCluster = 1>
struct TileScheduler {
  static_assert(kCluster == 1 || kCluster == 2 || (kCluster == 4 && kRows == RowsAre::M),
                "tile pairs, or quads over rows-as-M GEMMs");
  // Tiles (kCluster 1), tile pairs (2) or quads (4) of an expert with m_blocks x n_blocks tiles.
  __device__ static int32_t groups_of(int32_t m_blocks, int32_t n_blocks) {
    if constexpr (kCluster == 1) return m_blocks * n_blocks;
    if constexpr (kCluster == 2) return pair_groups(m_blocks, n_blocks);
    return m_blocks / 2 * ((n_blocks + 1) / 2) + m_blocks % 2 * ((n_blocks + 3) / 4);
  }

  const SchedulerStorage* storage;
  GroupedGemmShape shape;
  int32_t total_tiles;

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
    return TileScheduler{&s, shape, total};
  }

  // Tile (group) t as CTA `cluster_rank` of its cluster computes it.
  __device__ TileInfo tile(int32_t t, int32_t cluster_rank = 0) const {
    // Largest e with tile_prefix[e] <= t (experts without tiles have equal prefixes). Shared-space
    // loads: through the generic pointer each step of this search was a generic 64-bit load.
    const uint32_t prefix = ptx::shared_address(storage->tile_prefix);
    int lo = 0, hi = shape.num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (static_cast<int32_t>(ptx::ld_shared_b32(prefix + 4 * mid)) <= t) lo = mid; else hi = mid - 1;
    }
    const uint32_t rows_at = ptx::shared_address(&storage->rows[lo]);
    const int2 rows = make_int2(static_cast<int32_t>(ptx::ld_shared_b32(rows_at)),
                                static_cast<int32_t>(ptx::ld_shared_b32(rows_at + 4)));
    const int32_t m_blocks = kRows == RowsAre::M ? (rows.y + kTileM - 1) / kTileM : shape.m_blocks;
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
    } else if constexpr (kCluster == 4) {
      const int32_t m_pairs = m_blocks / 2, n_pairs = (shape.n_blocks + 1) / 2;
      if (local < m_pairs * n_pairs) {  // M blocks 2i, 2i + 1 x N blocks 2j, 2j + 1
        info.shares_a = true;
        info.m_block = 2 * (local % m_pairs) + (cluster_rank & 1);
        info.n_block = 2 * (local / m_pairs) + (cluster_rank >> 1);
      } else {  // the odd last M block: N blocks 4u .. 4u + 3, pairs {0, 2} and {1, 3} share A
        info.shares_a = true;
        info.shares_b = false;
        info.m_block = m_blocks - 1;
        info.n_block = 4 * (local - m_pairs * n_pairs) + 2 * (cluster_rank & 1) + (cluster_rank >> 1);
      }
      info.valid = info.n_block < shape.n_blocks;
    } else {
      const bool beside = kRemainderBesidePairs == 1 ||
                          (kRemainderBesidePairs == 2 &&
                           remainder_beside_pairs(m_blocks / 2, shape.n_blocks, gridDim.x / kCluster));
      pair_tile(local, cluster_rank, m_blocks, shape.n_blocks, beside, info.m_block, info.n_block, info.shares_a,
                info.shares_b, info.valid);
    }
    return info;
  }

  __device__ int32_t k_blocks(const TileInfo& info) const {
    if constexpr (kRows == RowsAre::M) return shape.k_blocks;
    else return (info.row_count + kTileK - 1) / kTileK;
  }
};

}  // namespace poise::sm90
