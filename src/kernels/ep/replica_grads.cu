// Exact balance, backward: replica weight gradients back to their owners, in fp32.
//
// A rank that computed rows of another rank's expert in a replica slot wrote that slot's weight
// gradients (fp32, overwritten each backward) into its workspace (replica_grad_w13 / _w2). After
// the backward combine-push barrier every rank's expert backward is complete, so each owner reads
// them from its peers and adds them to its own gradients: for every element, its own value, then
// the replicas in plan order (expert, first row). Fixed order: deterministic, no atomics.
//
// Safe to reuse the replica buffers next call: a peer overwrites them only in its next backward,
// after barriers (next forward) that this rank reaches only once this kernel has finished.
#include "comm/cuda_check.hpp"
#include "kernels/ep/data_path.hpp"
#include "kernels/ep/rank_view.cuh"

namespace poise::ep {
namespace {

constexpr int kThreads = 256;

__device__ void add_replicas(const comm::PeerTable& pt, const RankScratch& rs, const EpDims& dims, size_t region,
                             float* grad, size_t expert_floats, int first_piece, int end_piece, size_t local,
                             int blocks_per_rank) {
  float4* own = reinterpret_cast<float4*>(grad + local * expert_floats);
  const size_t vecs = expert_floats / 4;
  for (size_t i = size_t(blockIdx.x % blocks_per_rank) * kThreads + threadIdx.x; i < vecs;
       i += size_t(blocks_per_rank) * kThreads) {
    float4 acc = own[i];
    for (int q = first_piece; q < end_piece; ++q) {
      const plan::shared::ReplicaPiece p = rs.plan_pieces[q];
      const float4* replica = comm::peer_ptr<const float4>(pt, p.rank, region) +
                              size_t(p.slot - dims.E_local) * vecs;
      const float4 v = replica[i];
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    own[i] = acc;
  }
}

__global__ void __launch_bounds__(kThreads) replica_grad_reduce_kernel(const comm::PeerTable* tables, EpDims dims,
                                                                       WorkspaceOffsets ws, LaunchIo io,
                                                                       LaunchScratch scratch, int blocks_per_rank) {
  const int slot = blockIdx.x / blocks_per_rank;
  const comm::PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt)) return;
  const RankScratch& rs = scratch.rank[slot];
  const RankIo& rio = io.rank[slot];
  const size_t w13_floats = size_t(2) * dims.F * dims.D, w2_floats = size_t(dims.D) * dims.F;
  for (int local = 0; local < dims.E_local; ++local) {
    const int e = pt.rank * dims.E_local + local;
    const int first = rs.plan_piece_first_E[e], end = rs.plan_piece_first_E[e + 1];
    if (first == end) continue;  // not replicated: nothing to add (uniform over the block)
    add_replicas(pt, rs, dims, ws.replica_grad_w13, rio.grad_w13_E2FD, w13_floats, first, end, local,
                 blocks_per_rank);
    add_replicas(pt, rs, dims, ws.replica_grad_w2, rio.grad_w2_EDF, w2_floats, first, end, local, blocks_per_rank);
  }
}

}  // namespace

void launch_replica_grad_reduce(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  const int blocks = 2 * l.num_sms / l.launch_ranks > 0 ? 2 * l.num_sms / l.launch_ranks : 1;
  replica_grad_reduce_kernel<<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, io, l.scratch,
                                                                             blocks);
  comm::cuda_check_launch("replica_grad_reduce_kernel");
}

}  // namespace poise::ep
