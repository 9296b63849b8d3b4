// Routing layout on the GPU, no host sync.
//
//   route_count:     one warp per chunk of kTokensPerChunk tokens counts its (t, k) entries per expert
//   counts_exchange: one block per rank turns chunk counts into exclusive offsets, puts the rank's
//                    per-expert totals into every peer's counts_RE[rank] row, barrier
//   route_assign:    every block derives, from counts_RE (identical on all ranks), each expert
//                    group's first row on its destination and this rank's offset inside it; each warp
//                    re-ranks its chunk and writes dest_row_TK. Block 0 writes the local groups and
//                    checks every rank's rows against the capacity (all ranks see the same numbers,
//                    so all ranks stop together on overflow).
//   (exact balance)  between the two, balance_plan (balance_planner.cu) computes the plan, the
//                    groups (E_local own + B replica slots) and the capacity check; route_assign
//                    then places each entry in the plan's piece that holds its row.
//
// Order inside an expert group on rank d: source rank, then token, then k: deterministic.
#include "runtime/cuda_check.hpp"
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"

namespace poise::ep {
namespace {

using comm::ErrorCode;
using comm::PeerTable;
using comm::Phase;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Walks entries [begin, end) of ids in order, 32 at a time. `counts` (this warp's, in shared
// memory, zeroed) accumulates per-expert counts; visit(idx, expert, slot) gets each valid entry's
// position among the chunk's entries of the same expert, in (t, k) order.
template <class Visit>
__device__ void rank_chunk_entries(const int32_t* ids, int begin, int end, int E, int32_t* counts, int lane,
                                   Visit visit) {
  for (int i0 = begin; i0 < end; i0 += 32) {
    const int idx = i0 + lane;
    const int e = idx < end ? ids[idx] : -1;
    const bool valid = e >= 0 && e < E;
    const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1 - lane);
    const int base = valid ? counts[e] : 0;
    __syncwarp();
    if (valid) {
      if (lane == __ffs(peers) - 1) counts[e] = base + __popc(peers);
      visit(idx, e, base + __popc(peers & ((1u << lane) - 1u)));
    }
    __syncwarp();
  }
}

// Every entry's expert id is kNoExpert or in [0, E) and differs from the token's earlier picks: a
// bad entry is recorded (the call stops on every rank) with its value and token.
__device__ void check_ids(const PeerTable& pt, const int32_t* ids, int begin, int end, const EpDims& dims, int lane) {
  for (int i = begin + lane; i < end; i += 32) {
    const int e = ids[i];
    const int token = i / dims.K, first = token * dims.K;
    if (e == kNoExpert) continue;
    if (e < 0 || e >= dims.E) {
      comm::report_error(pt, ErrorCode::bad_expert_id, Phase::route_count, -1, e, token);
      continue;
    }
    for (int j = first; j < i; ++j) {
      if (ids[j] == e) comm::report_error(pt, ErrorCode::duplicate_expert_id, Phase::route_count, -1, e, token);
    }
  }
}

__global__ void __launch_bounds__(kThreads) route_count_kernel(const PeerTable* tables, EpDims dims, LaunchIo io,
                                                               LaunchScratch scratch, int blocks_per_rank) {
  extern __shared__ int32_t warp_counts[];  // [kWarps][E]
  const int slot = blockIdx.x / blocks_per_rank;
  const PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = (blockIdx.x % blocks_per_rank) * kWarps + warp;
  if (chunk >= dims.num_chunks) return;
  const int32_t* ids = io.rank[slot].ids_TK;
  int32_t* counts = warp_counts + warp * dims.E;
  for (int e = lane; e < dims.E; e += 32) counts[e] = 0;
  __syncwarp();
  const int begin = chunk * kTokensPerChunk * dims.K;
  const int end = min(dims.T, (chunk + 1) * kTokensPerChunk) * dims.K;
  check_ids(pt, ids, begin, end, dims, lane);
  rank_chunk_entries(ids, begin, end, dims.E, counts, lane, [](int, int, int) {});
  int32_t* out = scratch.rank[slot].chunk_offsets_CE + static_cast<size_t>(chunk) * dims.E;
  for (int e = lane; e < dims.E; e += 32) out[e] = counts[e];
}

constexpr int kExchangeThreads = 256;

__global__ void __launch_bounds__(kExchangeThreads)
    counts_exchange_kernel(const PeerTable* tables, EpDims dims, WorkspaceOffsets ws, LaunchScratch scratch) {
  const int slot = blockIdx.x;
  const PeerTable& pt = tables[slot];
  if (block_rank_failed(pt)) return;  // peers time out on this rank: it reports its own cause
  int32_t* chunk_offsets = scratch.rank[slot].chunk_offsets_CE;
  for (int e = threadIdx.x; e < dims.E; e += blockDim.x) {
    int running = 0;
    for (int c = 0; c < dims.num_chunks; ++c) {
      const int v = chunk_offsets[static_cast<size_t>(c) * dims.E + e];
      chunk_offsets[static_cast<size_t>(c) * dims.E + e] = running;
      running += v;
    }
    for (int p = 0; p < dims.world; ++p) {
      comm::peer_ptr<int32_t>(pt, p, ws.counts_RE)[pt.rank * dims.E + e] = running;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) comm::barrier_all(pt, Phase::counts_exchange);
}

__device__ __forceinline__ int padded_rows(int rows) {
  return (rows + kGroupAlignment - 1) / kGroupAlignment * kGroupAlignment;
}

__global__ void __launch_bounds__(kThreads) route_assign_kernel(const PeerTable* tables, EpDims dims,
                                                                WorkspaceOffsets ws, LaunchIo io,
                                                                LaunchScratch scratch, int blocks_per_rank) {
  extern __shared__ int32_t smem[];
  int32_t* row_base = smem;                 // [E] padded sizes -> group starts -> this rank's first row
  int32_t* before_me = smem + dims.E;       // [E] rows of lower ranks in the group
  int32_t* needed = smem + 2 * dims.E;      // [world] rows each rank needs
  int32_t* warp_counts = needed + comm::kMaxPeers;  // [kWarps][E]
  const int slot = blockIdx.x / blocks_per_rank;
  const int local_block = blockIdx.x % blocks_per_rank;
  const PeerTable& pt = tables[slot];
  if (block_rank_failed(pt)) return;
  const RankScratch& rs = scratch.rank[slot];
  const int32_t* counts_RE = comm::peer_ptr<int32_t>(pt, pt.rank, ws.counts_RE);

  for (int e = threadIdx.x; e < dims.E; e += blockDim.x) {
    int total = 0, before = 0;
    for (int s = 0; s < dims.world; ++s) {
      const int c = counts_RE[s * dims.E + e];
      total += c;
      if (s < pt.rank) before += c;
    }
    row_base[e] = padded_rows(total);
    before_me[e] = before;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dims.world && !dims.balanced; d += blockDim.x) {
    int running = 0;
    for (int j = 0; j < dims.E_local; ++j) {
      const int e = d * dims.E_local + j;
      const int size = row_base[e];
      row_base[e] = running;
      running += size;
    }
    needed[d] = running;
  }
  __syncthreads();
  if (local_block == 0 && !dims.balanced) {  // exact balance: the planner kernel did this
    // Overflow anywhere stops every rank (all see the same counts). The local groups are then
    // left empty, so no later kernel (ours or the SM90 GEMMs) touches a row past the capacity.
    __shared__ int overflow_rank;
    if (threadIdx.x == 0) {
      overflow_rank = -1;
      for (int d = 0; d < dims.world && overflow_rank < 0; ++d) {
        if (needed[d] > dims.capacity_rows) overflow_rank = d;
      }
      if (overflow_rank >= 0) {
        comm::report_error(pt, ErrorCode::capacity_overflow, Phase::route_assign, overflow_rank,
                           needed[overflow_rank]);
      }
      rs.group_offsets[dims.E_local] = overflow_rank < 0 ? needed[pt.rank] : 0;
    }
    __syncthreads();
    const int first = pt.rank * dims.E_local;
    for (int j = threadIdx.x; j < dims.E_local; j += blockDim.x) {
      int total = 0;
      for (int s = 0; s < dims.world; ++s) total += counts_RE[s * dims.E + first + j];
      rs.group_offsets[j] = overflow_rank < 0 ? row_base[first + j] : 0;
      rs.group_counts[j] = overflow_rank < 0 ? total : 0;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < dims.E && !dims.balanced; e += blockDim.x) row_base[e] += before_me[e];
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunk = local_block * kWarps + warp;
  if (chunk >= dims.num_chunks) return;
  int32_t* counts = warp_counts + warp * dims.E;
  for (int e = lane; e < dims.E; e += 32) counts[e] = 0;
  __syncwarp();
  const int32_t* chunk_offsets = rs.chunk_offsets_CE + static_cast<size_t>(chunk) * dims.E;
  int32_t* dest_row = rs.dest_row_TK;
  const int begin = chunk * kTokensPerChunk * dims.K;
  const int end = min(dims.T, (chunk + 1) * kTokensPerChunk) * dims.K;
  int32_t* dest_rank = rs.dest_rank_TK;
  const int32_t* ids = io.rank[slot].ids_TK;
  for (int idx = begin + lane; idx < end; idx += 32) {
    if (ids[idx] == kNoExpert) dest_row[idx] = dest_rank[idx] = -1;  // free: no rank computes it
  }
  if (!dims.balanced) {
    rank_chunk_entries(ids, begin, end, dims.E, counts, lane, [&](int idx, int e, int in_chunk) {
      dest_row[idx] = row_base[e] + chunk_offsets[e] + in_chunk;
      dest_rank[idx] = e / dims.E_local;
    });
    return;
  }
  // Exact balance: the entry's row in its expert's global order (source rank, token, k) says
  // which piece of the plan holds it: the owner's kept prefix, or one replica piece.
  const int G = dims.groups;
  rank_chunk_entries(ids, begin, end, dims.E, counts, lane, [&](int idx, int e, int in_chunk) {
    const int row = before_me[e] + chunk_offsets[e] + in_chunk;
    int d = e / dims.E_local, group = e % dims.E_local, first = 0;
    if (row >= rs.plan_kept_E[e]) {
      for (int i = rs.plan_piece_first_E[e]; i < rs.plan_piece_first_E[e + 1]; ++i) {
        const plan::shared::ReplicaPiece p = rs.plan_pieces[i];
        if (row < p.end) {
          d = p.rank, group = p.slot, first = p.begin;
          break;
        }
      }
    }
    dest_row[idx] = rs.plan_group_offsets_RG[d * (G + 1) + group] + row - first;
    dest_rank[idx] = d;
  });
}

}  // namespace

void launch_route(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  const int blocks_per_rank = (l.dims.num_chunks + kWarps - 1) / kWarps;
  const size_t count_smem = sizeof(int32_t) * kWarps * l.dims.E;
  route_count_kernel<<<l.launch_ranks * blocks_per_rank, kThreads, count_smem, stream>>>(l.tables, l.dims, io,
                                                                                        l.scratch, blocks_per_rank);
  runtime::cuda_check_launch("route_count_kernel");
  // One block per rank: every waiting block is resident.
  counts_exchange_kernel<<<l.launch_ranks, kExchangeThreads, 0, stream>>>(l.tables, l.dims, l.ws, l.scratch);
  runtime::cuda_check_launch("counts_exchange_kernel");
  if (l.dims.balanced) launch_balance_plan(l, stream);
  const size_t assign_smem = sizeof(int32_t) * (2 * l.dims.E + comm::kMaxPeers + kWarps * l.dims.E);
  route_assign_kernel<<<l.launch_ranks * blocks_per_rank, kThreads, assign_smem, stream>>>(
      l.tables, l.dims, l.ws, io, l.scratch, blocks_per_rank);
  runtime::cuda_check_launch("route_assign_kernel");
}

int persistent_blocks_per_rank(const EpLaunch& l, const void* kernel, int threads, int work_blocks) {
  int per_sm = 0;
  runtime::cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0),
                   "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int resident = per_sm * l.num_sms;
  const int fit = resident / l.launch_ranks;
  if (fit < 1) throw DeviceError("EP launch: not even one block per rank fits on the GPU at once");
  return work_blocks < 1 ? 1 : (work_blocks < fit ? work_blocks : fit);
}

}  // namespace poise::ep
