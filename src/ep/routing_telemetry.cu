// Routing telemetry (Context::routing_stats): what the latest forward's route and balance plan left
// in a rank's buffers, summed by one block per launch rank into the caller's int32 buffers on the
// stream (no host sync). counts_RE and the plan are the same on every rank after the exchange, so
// each rank reports every rank's loads; the received token rows are its own.
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "runtime/cuda_check.hpp"

namespace poise::ep {
namespace {

constexpr int kThreads = 256;

__device__ void store(int32_t* p, int i, int32_t v) {
  if (p != nullptr) p[i] = v;
}

// A token row crosses to a rank once: its primary row there (row_primary[r] == r) stands for it.
__device__ int received_token_rows(const comm::PeerTable& pt, const EpDims& dims, const WorkspaceOffsets& ws,
                                   const RankScratch& rs) {
  const int32_t* row_primary = comm::peer_ptr<int32_t>(pt, pt.rank, ws.row_primary);
  int rows = 0;
  for (int g = 0; g < dims.groups; ++g) {
    const int first = rs.group_offsets[g], end = first + rs.group_counts[g];
    for (int r = first + threadIdx.x; r < end; r += blockDim.x) rows += row_primary[r] == r;
  }
  return rows;
}

__global__ void __launch_bounds__(kThreads) routing_stats_kernel(const comm::PeerTable* tables, EpDims dims,
                                                                 WorkspaceOffsets ws, LaunchScratch scratch,
                                                                 RoutingStatsLaunch out) {
  __shared__ int owner[comm::kMaxPeers], computed[comm::kMaxPeers], replicas[comm::kMaxPeers], received;
  const int slot = blockIdx.x, E = dims.E, R = dims.world, L = dims.E_local;
  const comm::PeerTable& pt = tables[slot];
  const RankScratch& rs = scratch.rank[slot];
  const RoutingStatsOut& o = out.rank[slot];
  if (comm::rank_failed(pt)) {  // the call stopped: no loads to report (the next call raises its fault)
    for (int e = threadIdx.x; e < E; e += blockDim.x) store(o.expert_rows_E, e, -1);
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      store(o.owner_rows_R, d, -1), store(o.computed_rows_R, d, -1), store(o.replicas_R, d, -1);
    }
    if (threadIdx.x == 0) store(o.received_token_rows, 0, -1);
    return;
  }
  for (int d = threadIdx.x; d < R; d += blockDim.x) owner[d] = computed[d] = replicas[d] = 0;
  if (threadIdx.x == 0) received = 0;
  __syncthreads();
  const int32_t* counts_RE = comm::peer_ptr<int32_t>(pt, pt.rank, ws.counts_RE);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int rows = 0;
    for (int s = 0; s < R; ++s) rows += counts_RE[s * E + e];
    store(o.expert_rows_E, e, rows);
    atomicAdd(&owner[e / L], rows);
    atomicAdd(&computed[e / L], dims.balanced ? rs.plan_kept_E[e] : rows);  // exact: what its owner keeps
  }
  const int pieces = dims.balanced ? rs.plan_piece_first_E[E] : 0;
  for (int i = threadIdx.x; i < pieces; i += blockDim.x) {
    const plan::shared::ReplicaPiece p = rs.plan_pieces[i];
    atomicAdd(&computed[p.rank], p.end - p.begin);
    atomicAdd(&replicas[p.rank], 1);
  }
  atomicAdd(&received, received_token_rows(pt, dims, ws, rs));
  __syncthreads();
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    store(o.owner_rows_R, d, owner[d]), store(o.computed_rows_R, d, computed[d]), store(o.replicas_R, d, replicas[d]);
  }
  if (threadIdx.x == 0) store(o.received_token_rows, 0, received);
}

}  // namespace

void launch_routing_stats(const EpLaunch& l, const RoutingStatsLaunch& out, cudaStream_t stream) {
  routing_stats_kernel<<<l.launch_ranks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, l.scratch, out);
  runtime::cuda_check_launch("routing_stats_kernel");
}

}  // namespace poise::ep
