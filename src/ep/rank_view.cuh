// Small device helpers shared by the EP kernels: which rank a block works for, row validity,
// score loads.
#pragma once

#include "comm/transport_device.cuh"
#include "ep/ep_params.hpp"

namespace poise::ep {

inline constexpr unsigned kFullMask = 0xffffffffu;

// The rank's failure flag read once per block, so every thread of the block takes the same
// branch (a block-wide barrier may follow). Call at most once per kernel.
__device__ __forceinline__ bool block_rank_failed(const comm::PeerTable& pt) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = comm::rank_failed(pt) ? 1 : 0;
  __syncthreads();
  return failed != 0;
}

// Largest j in [0, n) with offsets[j] <= row (offsets non-decreasing, offsets[0] == 0).
__device__ __forceinline__ int group_of_row(const int32_t* offsets, int n, int row) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// True when `row` of a rank's grouped buffer holds a routed entry (not expert padding).
__device__ __forceinline__ bool row_in_use(const RankScratch& s, int groups, int row) {
  if (row >= s.group_offsets[groups]) return false;
  const int g = group_of_row(s.group_offsets, groups, row);
  return row - s.group_offsets[g] < s.group_counts[g];
}

__device__ __forceinline__ float load_score(const void* scores, int index, bool is_bf16) {
  return is_bf16 ? __bfloat162float(static_cast<const bf16*>(scores)[index])
                 : static_cast<const float*>(scores)[index];
}

__device__ __forceinline__ void store_score(void* scores, int index, bool is_bf16, float v) {
  if (is_bf16) static_cast<bf16*>(scores)[index] = __float2bfloat16(v);
  else static_cast<float*>(scores)[index] = v;
}

// 8 bf16 <-> 8 floats through one 16-byte word.
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 w;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return w;
}

}  // namespace poise::ep
