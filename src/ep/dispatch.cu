// Dispatch: token rows to the ranks that own their experts, straight into expert-grouped rows of
// the destination's receive buffer (the grouped GEMM reads them in place).
//
// One warp per token; lane k holds entry (t, k). Lanes whose experts live on the same rank find
// each other with __match_any_sync; the lowest such k is the token's primary entry on that rank
// and is the only one whose row crosses. The others get metadata pointing at the primary row, and
// the destination copies them locally (fanout) after the barrier. So a token row crosses to a rank
// once, even when several of its k experts live there. Entries on the token's own rank cross
// nothing: the dispatch writes each of their rows from the token row (L2 serves the re-reads), and
// the fanout leaves them alone (their origin is its own rank), which saves the fanout's second pass
// over those bytes (at EP1, every row).
#include "runtime/cuda_check.hpp"
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "ep/warp_rows.cuh"

namespace poise::ep {
namespace {

using comm::PeerTable;
using comm::Phase;

// Exact balance: this rank's experts that the plan replicates elsewhere go, weights W13 and W2 (and
// biases), into the replica slot of the rank hosting them, in 32 KiB chunks spread over warps. In the
// dispatch kernel after the token rows, before the barrier (which then publishes both, and the
// weight copies overlap other blocks' row traffic), and by every warp of the grid for each
// launched rank in turn: with virtual ranks the hot owner pushes all replicas, and its own blocks
// alone (1/R of the grid) took 5.4 ms at peak/mean 3 where the whole grid takes about 1.
constexpr size_t kWeightChunkBytes = 32 * 1024;

// One per-expert tensor a replica slot receives: the owner's experts at src, the slots at the
// workspace offset dst; `bytes` per expert (a multiple of 16).
struct ReplicaTensor {
  const char* src;
  size_t dst;
  size_t bytes;
  __device__ size_t chunks() const { return (bytes + kWeightChunkBytes - 1) / kWeightChunkBytes; }
};

// W13, W2 and, with expert biases, b13 and b2: returns how many.
__device__ int replica_tensors(const EpDims& dims, const WorkspaceOffsets& ws, const RankIo& rio,
                               ReplicaTensor (&t)[4]) {
  const size_t F2 = size_t(2) * dims.F, D = dims.D;
  t[0] = {reinterpret_cast<const char*>(rio.w13_E2FD), ws.replica_w13, F2 * D * sizeof(bf16)};
  t[1] = {reinterpret_cast<const char*>(rio.w2_EDF), ws.replica_w2, D * dims.F * sizeof(bf16)};
  if (!dims.biased) return 2;
  t[2] = {reinterpret_cast<const char*>(rio.b13_E2F), ws.replica_b13, F2 * sizeof(bf16)};
  t[3] = {reinterpret_cast<const char*>(rio.b2_ED), ws.replica_b2, D * sizeof(bf16)};
  return 4;
}

__device__ void push_replica_weights(const PeerTable& pt, const EpDims& dims, const WorkspaceOffsets& ws,
                                     const RankIo& rio, const RankScratch& rs, size_t first_unit,
                                     size_t unit_stride) {
  const int pieces = rs.plan_piece_first_E[dims.E];
  ReplicaTensor t[4];
  const int tensors = replica_tensors(dims, ws, rio, t);
  size_t chunks = 0;
  for (int i = 0; i < tensors; ++i) chunks += t[i].chunks();
  const int lane = threadIdx.x % 32;
  for (size_t unit = first_unit; unit < pieces * chunks; unit += unit_stride) {
    const plan::shared::ReplicaPiece p = rs.plan_pieces[unit / chunks];
    if (p.expert / dims.E_local != pt.rank) continue;
    const size_t local = p.expert % dims.E_local, replica = p.slot - dims.E_local;
    size_t chunk = unit % chunks;
    int i = 0;
    while (chunk >= t[i].chunks()) chunk -= t[i++].chunks();
    const size_t at = chunk * kWeightChunkBytes;
    const size_t len = t[i].bytes - at < kWeightChunkBytes ? t[i].bytes - at : kWeightChunkBytes;
    const char* src = t[i].src + local * t[i].bytes + at;
    char* dst = comm::peer_ptr<char>(pt, p.rank, t[i].dst) + replica * t[i].bytes + at;
    comm::warp_copy(dst, src, len, lane);
  }
}

// What a token row carries: its values (grad_out or x in BF16, or, EpDims::fp8 forward, x's e4m3
// values quantized before dispatch) and the FP8 values' scales (fp32, their own region).
struct RowPayload {
  const char* values_TD;
  size_t value_bytes, values_region;
  const char* scales_TD;  // null: no scales
  size_t scale_bytes, scales_region;

  template <bool kBackward>
  __device__ static RowPayload of(const EpDims& dims, const WorkspaceOffsets& ws, const RankIo& rio,
                                  const RankScratch& rs) {
    if (kBackward) return {reinterpret_cast<const char*>(rio.grad_out_TD), size_t(dims.D) * sizeof(bf16), ws.recv_grad,
                           nullptr, 0, 0};
    if (!dims.fp8) return {reinterpret_cast<const char*>(rio.x_TD), x_row_value_bytes(dims), ws.recv_x, nullptr, 0, 0};
    return {reinterpret_cast<const char*>(rs.fp8.x_TD), x_row_value_bytes(dims), ws.recv_x,
            reinterpret_cast<const char*>(rs.fp8.x_scales), x_row_scale_bytes(dims), ws.recv_x_scales};
  }
  // Token t's row to receive row `row` of every lane in `lanes` (each lane's dest rank).
  __device__ void copy(const PeerTable& pt, int dest, int row, bool writes, unsigned lanes, int t, int lane) const {
    char* dst = writes ? comm::peer_ptr<char>(pt, dest, values_region) + size_t(row) * value_bytes : nullptr;
    comm::warp_copy_to_lanes(dst, lanes, values_TD + size_t(t) * value_bytes, value_bytes, lane);
    if (scales_TD == nullptr) return;
    dst = writes ? comm::peer_ptr<char>(pt, dest, scales_region) + size_t(row) * scale_bytes : nullptr;
    comm::warp_copy_to_lanes<uint32_t>(dst, lanes, scales_TD + size_t(t) * scale_bytes, scale_bytes, lane);
  }
};

template <bool kBackward>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(const PeerTable* tables, EpDims dims,
                                                            WorkspaceOffsets ws, LaunchIo io,
                                                            LaunchScratch scratch, int blocks_per_rank,
                                                            bool push_replicas) {
  const int slot = rank_slot(blocks_per_rank);
  const PeerTable& pt = tables[slot];
  if (!comm::rank_failed(pt)) {
    const RankIo& rio = io.rank[slot];
    const int32_t* dest_row = scratch.rank[slot].dest_row_TK;
    const RowPayload payload = RowPayload::of<kBackward>(dims, ws, rio, scratch.rank[slot]);
    const int lane = threadIdx.x % 32;
    const int TK = dims.T * dims.K;
    for (int t = first_warp_item(blocks_per_rank); t < dims.T; t += warp_item_stride(blocks_per_rank)) {
      const int entry = t * dims.K + lane;
      const int dest = lane < dims.K ? scratch.rank[slot].dest_rank_TK[entry] : -1;
      const bool active = dest >= 0;  // -1: a free entry (kNoExpert), dispatched nowhere
      const int row = active ? dest_row[entry] : -1;
      const unsigned same_dest = __match_any_sync(kFullMask, active ? dest : -1 - lane);
      const int primary_lane = __ffs(same_dest) - 1;
      const int primary_row = __shfl_sync(kFullMask, row, primary_lane);
      if (!kBackward && active) {
        comm::peer_ptr<int32_t>(pt, dest, ws.row_origin)[row] = pt.rank * TK + entry;
        comm::peer_ptr<int32_t>(pt, dest, ws.row_primary)[row] = primary_row;
        comm::peer_ptr<float>(pt, dest, ws.row_score)[row] = load_score(rio.scores_TK, entry, dims.scores_bf16);
      }
      const bool writes = active && (primary_lane == lane || dest == pt.rank);
      // The token row read once, stored to every row this warp writes (primaries on other ranks too).
      payload.copy(pt, dest, row, writes, __ballot_sync(kFullMask, writes), t, lane);
    }
  }
  if (push_replicas) {
    const size_t first = size_t(blockIdx.x) * kWarps + threadIdx.x / 32, stride = size_t(gridDim.x) * kWarps;
    for (int s = 0; s < int(gridDim.x) / blocks_per_rank; ++s) {
      if (!comm::rank_failed(tables[s]))
        push_replica_weights(tables[s], dims, ws, io.rank[s], scratch.rank[s], first, stride);
    }
  }
  comm::arrive_then_barrier(pt, blocks_per_rank, kBackward ? Phase::dispatch_backward : Phase::dispatch);
}

// Rows of non-primary entries from other ranks: copy the primary row (already here, after the
// barrier). This rank's own entries were written by its dispatch.
__global__ void __launch_bounds__(kThreads)
    fanout_rows_kernel(const PeerTable* tables, EpDims dims, WorkspaceOffsets ws, bool backward,
                       LaunchScratch scratch, int blocks_per_rank) {
  const int slot = rank_slot(blocks_per_rank);
  const PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt)) return;
  const RankScratch& rs = scratch.rank[slot];
  const int32_t* row_primary = comm::peer_ptr<int32_t>(pt, pt.rank, ws.row_primary);
  const int32_t* row_origin = comm::peer_ptr<int32_t>(pt, pt.rank, ws.row_origin);
  // The rows as dispatch wrote them: grad_out in BF16, or x (EpDims::fp8: e4m3 values, fp32 scales).
  char* rows = comm::peer_ptr<char>(pt, pt.rank, backward ? ws.recv_grad : ws.recv_x);
  const size_t row_bytes = backward ? size_t(dims.D) * sizeof(bf16) : x_row_value_bytes(dims);
  char* scales = backward ? nullptr : comm::peer_ptr<char>(pt, pt.rank, ws.recv_x_scales);
  const size_t scale_bytes = backward ? 0 : x_row_scale_bytes(dims);
  const int TK = dims.T * dims.K;
  const int lane = threadIdx.x % 32;
  for_each_row_in_use(rs, dims.groups, blocks_per_rank, [&](int r) {
    const int primary = row_primary[r];
    if (primary != r && row_origin[r] / TK != pt.rank) {
      comm::warp_copy(rows + r * row_bytes, rows + primary * row_bytes, row_bytes, lane);
      if (scale_bytes > 0)
        comm::warp_copy<uint32_t>(scales + r * scale_bytes, scales + primary * scale_bytes, scale_bytes, lane);
    }
  });
}

__global__ void tail_groups_kernel(EpDims dims, LaunchScratch scratch) {
  const RankScratch& rs = scratch.rank[blockIdx.x];
  for (int g = threadIdx.x; g < dims.groups; g += blockDim.x) {
    const int32_t offset = rs.group_offsets[g], end = offset + rs.group_counts[g];
    const int32_t first = offset > rs.h13_split ? offset : rs.h13_split;
    rs.tail_offsets[g] = first;
    rs.tail_counts[g] = end > first ? end - first : 0;
  }
}

int local_blocks_per_rank(const EpLaunch& l) {
  // Enough warps to cover the rows, capped at a few waves.
  const int want = (l.dims.capacity_rows + kWarps - 1) / kWarps;
  const int cap = 4 * l.num_sms;
  return want < cap ? (want > 0 ? want : 1) : cap;
}

template <bool kBackward>
void launch_dispatch(const EpLaunch& l, const LaunchIo& io, bool push_replicas, cudaStream_t stream) {
  const int work_blocks = (l.dims.T + kWarps - 1) / kWarps;
  const int blocks = persistent_blocks_per_rank(l, reinterpret_cast<const void*>(&dispatch_kernel<kBackward>),
                                                kThreads, work_blocks);
  dispatch_kernel<kBackward><<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, io,
                                                                               l.scratch, blocks, push_replicas);
  runtime::cuda_check_launch("dispatch_kernel");
}

}  // namespace

void launch_dispatch_forward(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  launch_dispatch<false>(l, io, l.dims.balanced != 0, stream);
}

void launch_dispatch_backward(const EpLaunch& l, const LaunchIo& io, bool push_replicas, cudaStream_t stream) {
  launch_dispatch<true>(l, io, push_replicas && l.dims.balanced, stream);
}

void launch_tail_groups(const EpLaunch& l, cudaStream_t stream) {
  tail_groups_kernel<<<l.launch_ranks, 256, 0, stream>>>(l.dims, l.scratch);
  runtime::cuda_check_launch("tail_groups_kernel");
}

void launch_fanout_rows(const EpLaunch& l, bool backward, cudaStream_t stream) {
  const int blocks = local_blocks_per_rank(l);
  fanout_rows_kernel<<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, backward, l.scratch,
                                                                     blocks);
  runtime::cuda_check_launch("fanout_rows_kernel");
}

}  // namespace poise::ep
