// SwiGLU clip statistics (clamped SwiGLU, forward, on request): per local expert, how many gate
// inputs exceeded the limit and how many up inputs fell outside [-limit, limit], counted on h13 as
// saved for backward (bf16: the values whose clamp side backward also uses), over every row of the
// expert, wherever the balance plan computed it.
//
//   clip_count_groups   (before the combine-push barrier): each rank counts its rows per group
//                        (own experts and replica slots) into its window region clip_counts_G2.
//   clip_count_reduce   (after it): each owner adds, for every local expert, its own group and the
//                        replica pieces of that expert on other ranks, into the caller's
//                        clip_counts_E2 (int64 [E_local][2], overwritten).
#include "runtime/cuda_check.hpp"
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "ep/warp_rows.cuh"

namespace poise::ep {
namespace {

using comm::PeerTable;

__global__ void __launch_bounds__(kThreads) clip_count_groups_kernel(const PeerTable* tables, EpDims dims,
                                                                     WorkspaceOffsets ws, LaunchScratch scratch,
                                                                     int blocks_per_rank) {
  const int slot = rank_slot(blocks_per_rank);
  const PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt) || !dims.swiglu_clamped) return;  // plain SwiGLU clips nothing: zeros
  const RankScratch& rs = scratch.rank[slot];
  unsigned long long* counts = comm::peer_ptr<unsigned long long>(pt, pt.rank, ws.clip_counts_G2);
  const int lane = threadIdx.x % 32;
  const float limit = dims.swiglu_limit;
  for_each_row_in_use(rs, dims.groups, blocks_per_rank, [&](int r) {
    const bf16* h13 = (r < rs.h13_split ? rs.h13_R2F : rs.h13_hi_R2F) + static_cast<size_t>(r) * 2 * dims.F;
    unsigned gate = 0, up = 0;
    for (int f = lane; f < dims.F; f += 32) {
      const int g = dims.w13_interleaved ? 2 * f : f, u = dims.w13_interleaved ? 2 * f + 1 : dims.F + f;
      gate += __bfloat162float(h13[g]) > limit ? 1u : 0u;
      up += fabsf(__bfloat162float(h13[u])) > limit ? 1u : 0u;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      gate += __shfl_xor_sync(kFullMask, gate, offset);
      up += __shfl_xor_sync(kFullMask, up, offset);
    }
    if (lane == 0) {
      const int group = group_of_row(rs.group_offsets, dims.groups, r);
      if (gate) atomicAdd(&counts[2 * group], gate);
      if (up) atomicAdd(&counts[2 * group + 1], up);
    }
  });
}

__global__ void clip_count_reduce_kernel(const PeerTable* tables, EpDims dims, WorkspaceOffsets ws, LaunchIo io,
                                         LaunchScratch scratch) {
  const int slot = blockIdx.x;
  const PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt)) return;
  const RankScratch& rs = scratch.rank[slot];
  int64_t* out = io.rank[slot].clip_counts_E2;
  const unsigned long long* own = comm::peer_ptr<const unsigned long long>(pt, pt.rank, ws.clip_counts_G2);
  for (int i = threadIdx.x; i < 2 * dims.E_local; i += blockDim.x) {
    const int local = i / 2, column = i % 2;
    unsigned long long sum = own[i];
    if (dims.balanced) {  // replica pieces of this expert, in plan order
      const int e = pt.rank * dims.E_local + local;
      for (int q = rs.plan_piece_first_E[e]; q < rs.plan_piece_first_E[e + 1]; ++q) {
        const plan::shared::ReplicaPiece p = rs.plan_pieces[q];
        sum += comm::peer_ptr<const unsigned long long>(pt, p.rank, ws.clip_counts_G2)[2 * p.slot + column];
      }
    }
    out[i] = static_cast<int64_t>(sum);
  }
}

}  // namespace

void launch_clip_count_groups(const EpLaunch& l, cudaStream_t stream) {
  for (int s = 0; s < l.launch_ranks; ++s) {
    runtime::cuda_check(cudaMemsetAsync(l.scratch.rank[s].workspace + l.ws.clip_counts_G2, 0,
                                     sizeof(unsigned long long) * 2 * l.dims.groups, stream),
                     "cudaMemsetAsync(clip_counts_G2)");
  }
  const int want = (l.dims.capacity_rows + kWarps - 1) / kWarps, cap = 4 * l.num_sms;
  const int blocks = want < 1 ? 1 : (want < cap ? want : cap);
  clip_count_groups_kernel<<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, l.scratch,
                                                                             blocks);
  runtime::cuda_check_launch("clip_count_groups_kernel");
}

void launch_clip_count_reduce(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  clip_count_reduce_kernel<<<l.launch_ranks, 256, 0, stream>>>(l.tables, l.dims, l.ws, io, l.scratch);
  runtime::cuda_check_launch("clip_count_reduce_kernel");
}

}  // namespace poise::ep
