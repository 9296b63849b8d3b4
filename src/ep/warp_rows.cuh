// Work split of the row-moving EP kernels (dispatch, fanout, combine): every rank gets
// blocks_per_rank consecutive blocks of kWarps warps, and the rank's warps take items in turn.
#pragma once

#include "ep/rank_view.cuh"

namespace poise::ep {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;

// The rank (launch slot) this block works for.
__device__ __forceinline__ int rank_slot(int blocks_per_rank) { return blockIdx.x / blocks_per_rank; }

// This warp's first item, and the step to its next, among the rank's warps (unsigned, as the
// blockIdx arithmetic it comes from; callers store it in their own index type).
__device__ __forceinline__ unsigned first_warp_item(int blocks_per_rank) {
  return (blockIdx.x % blocks_per_rank) * kWarps + threadIdx.x / 32;
}
__device__ __forceinline__ int warp_item_stride(int blocks_per_rank) { return blocks_per_rank * kWarps; }

// fn(row) on one warp for every row of the rank's grouped buffer that holds a routed entry.
template <class Fn>
__device__ __forceinline__ void for_each_row_in_use(const RankScratch& rs, int groups, int blocks_per_rank, Fn&& fn) {
  const int rows_used = rs.group_offsets[groups];
  for (int r = first_warp_item(blocks_per_rank); r < rows_used; r += warp_item_stride(blocks_per_rank)) {
    if (row_in_use(rs, groups, r)) fn(r);
  }
}

}  // namespace poise::ep
