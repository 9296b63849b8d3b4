// The balance planner kernel (exact balance): after the counts exchange, one block per rank
// turns the all-gathered per-expert counts into the balance plan, with the shared
// __host__ __device__ planner of src/balance/balance_plan_device.cuh (the host tests run the very
// same functions). Every rank computes the identical plan from identical counts: no extra
// communication, no host sync.
//
//   1. per-expert totals, each rank's sequence (experts by rows, stable)  -- all threads
//   2. sequence starts per rank                                          -- one thread per rank
//   3. the donor/taker loop                                              -- thread 0 (<= R steps);
//      with the cost-aware plan (EpDims::cost_aware) first once per candidate row limit, scored
//      by shared::predicted_ns, then with the best
//   4. kept rows per expert, replica pieces sorted by (expert, begin),
//      every rank's group sizes and offsets (E_local own + B replica slots), capacity check
//
// State lives in shared memory; outputs go to the rank's private scratch (plan_*), which
// route_assign reads to place every (token, k) entry.
#include <string>

#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "poise/errors.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::ep {
namespace {

using comm::ErrorCode;
using comm::Phase;
using plan::shared::BalanceProblem;
using plan::shared::BalanceScratch;
using plan::shared::Planner;
using plan::shared::ReplicaPiece;

constexpr int kPlanThreads = 512;

struct PlanSmem {  // offsets (in int32 words) of the shared-memory arrays
  int counts, position, sequence, start, remaining, received, replicas, donors, takers, group_rows, needed, sent,
      group_count, pieces, words;
};

__host__ __device__ inline PlanSmem plan_smem(const EpDims& d) {
  const int E = d.E, R = d.world, L = d.E_local, G = d.groups, B = d.replica_slots;
  PlanSmem m;
  int at = 0;
  m.counts = at, at += E;
  m.position = at, at += E;
  m.sequence = at, at += E;
  m.start = at, at += R * (L + 1);
  m.remaining = at, at += R;
  m.received = at, at += R;
  m.replicas = at, at += R;
  m.donors = at, at += R;
  m.takers = at, at += 2 * R;
  m.group_rows = at, at += R * G;
  m.needed = at, at += R;
  m.sent = at, at += R;         // the cost-aware plan's scratch (shared::predicted_ns)
  m.group_count = at, at += R;
  m.pieces = at, at += (R * B > 0 ? R * B : 1) * static_cast<int>(sizeof(ReplicaPiece) / sizeof(int32_t));
  m.words = at;
  return m;
}

__device__ __forceinline__ int padded_rows(int rows) {
  return (rows + kGroupAlignment - 1) / kGroupAlignment * kGroupAlignment;
}

// The cost-aware plan (EpDims::cost_aware, thread 0): the row limit among
// shared::candidate_row_limit's, from T*K to dims.row_limit (shifted as `p` is when free entries
// left fewer rows), whose plan has the least predicted time (the first such), as
// plan::choose_row_limit chooses on the host. Leaves the state fresh for the chosen run.
__device__ int32_t cost_aware_row_limit(BalanceProblem p, const BalanceScratch& s, const EpDims& dims, int32_t* sent,
                                        int32_t* group_count) {
  const int32_t routed = dims.T * dims.K, shift = p.row_limit - dims.row_limit;
  int32_t best = p.row_limit;
  float best_ns = 0.0f;
  for (int32_t i = 0; i < plan::shared::kCostCandidates; ++i) {
    p.row_limit = plan::shared::candidate_row_limit(routed, dims.row_limit, i) + shift;
    for (int32_t r = 0; r < p.num_ranks; ++r) plan::shared::start_rank(p, s, r);
    Planner planner(p, s);
    planner.run();
    const float ns = plan::shared::predicted_ns(p, s, planner.num_pieces(), dims.cost_rates, sent, group_count);
    if (i == 0 || ns < best_ns) best = p.row_limit, best_ns = ns;
  }
  for (int32_t r = 0; r < p.num_ranks; ++r) plan::shared::start_rank(p, s, r);
  return best;
}

__global__ void __launch_bounds__(kPlanThreads)
    balance_plan_kernel(const comm::PeerTable* tables, EpDims dims, WorkspaceOffsets ws, LaunchScratch scratch) {
  extern __shared__ int32_t smem[];
  __shared__ int num_pieces, exact, overflow_rank, moved, max_rows;
  const int slot = blockIdx.x;
  const comm::PeerTable& pt = tables[slot];
  if (block_rank_failed(pt)) return;
  const RankScratch& rs = scratch.rank[slot];
  const int E = dims.E, R = dims.world, L = dims.E_local, G = dims.groups;
  const PlanSmem m = plan_smem(dims);
  int32_t* counts = smem + m.counts;
  int32_t* group_rows = smem + m.group_rows;
  int32_t* needed = smem + m.needed;
  ReplicaPiece* pieces = reinterpret_cast<ReplicaPiece*>(smem + m.pieces);
  const BalanceScratch state{smem + m.position, smem + m.sequence, smem + m.start, smem + m.remaining,
                             smem + m.received, smem + m.replicas, smem + m.donors, smem + m.takers, pieces};

  __shared__ int total_rows;
  if (threadIdx.x == 0) total_rows = 0;
  __syncthreads();
  const int32_t* counts_RE = comm::peer_ptr<int32_t>(pt, pt.rank, ws.counts_RE);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int total = 0;
    for (int s = 0; s < R; ++s) total += counts_RE[s * E + e];
    counts[e] = total;
    atomicAdd(&total_rows, total);
  }
  for (int i = threadIdx.x; i < R * G; i += blockDim.x) group_rows[i] = 0;
  __syncthreads();
  // Free entries (kNoExpert) leave fewer than R*T*K rows: balance them, ceil(total / R) per rank
  // (plan::balanced_rows_per_rank), the tolerance on top as configured.
  const int target = (total_rows + R - 1) / R;
  const BalanceProblem problem{counts, R, L, target, dims.row_limit - dims.T * dims.K + target, dims.replica_slots};
  for (int e = threadIdx.x; e < E; e += blockDim.x) plan::shared::place_expert(problem, state, e);
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x) plan::shared::start_rank(problem, state, r);
  __syncthreads();
  __shared__ int row_limit;
  if (threadIdx.x == 0) {
    BalanceProblem chosen = problem;
    if (dims.cost_aware) chosen.row_limit = cost_aware_row_limit(problem, state, dims, smem + m.sent, smem + m.group_count);
    row_limit = chosen.row_limit;
    Planner planner(chosen, state);
    exact = planner.run() ? 1 : 0;
    num_pieces = planner.num_pieces();
    moved = 0;
    max_rows = 0;
  }
  __syncthreads();

  // What each owner keeps (its own slots) and the replica pieces, sorted by (expert, begin).
  const int P = num_pieces;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int kept = plan::shared::kept_rows(problem, state, e);
    rs.plan_kept_E[e] = kept;
    group_rows[(e / L) * G + e % L] = kept;
    int before = 0;
    for (int i = 0; i < P; ++i) before += pieces[i].expert < e ? 1 : 0;
    rs.plan_piece_first_E[e] = before;
  }
  if (threadIdx.x == 0) rs.plan_piece_first_E[E] = P;
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const ReplicaPiece p = pieces[i];
    int place = 0;
    for (int j = 0; j < P; ++j) {
      const ReplicaPiece q = pieces[j];
      place += (q.expert < p.expert || (q.expert == p.expert && q.begin < p.begin)) ? 1 : 0;
    }
    rs.plan_pieces[place] = p;
    group_rows[p.rank * G + p.slot] = p.end - p.begin;
    atomicAdd(&moved, p.end - p.begin);
  }
  __syncthreads();

  // Every rank's group offsets (groups padded to kGroupAlignment rows) and routed rows.
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    int running = 0, rows = 0;
    int32_t* offsets = rs.plan_group_offsets_RG + d * (G + 1);
    for (int g = 0; g < G; ++g) {
      offsets[g] = running;
      running += padded_rows(group_rows[d * G + g]);
      rows += group_rows[d * G + g];
    }
    offsets[G] = running;
    needed[d] = running;
    atomicMax(&max_rows, rows);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Every rank sees the same plan, so an overflow (only possible when the plan is not exact,
    // B < E_local) stops all ranks together; the local groups are then left empty.
    overflow_rank = -1;
    for (int d = 0; d < R && overflow_rank < 0; ++d) {
      if (needed[d] > dims.capacity_rows) overflow_rank = d;
    }
    if (overflow_rank >= 0) {
      comm::report_error(pt, ErrorCode::capacity_overflow, Phase::route_assign, overflow_rank, needed[overflow_rank]);
    }
    rs.plan_stats[kPlanExact] = exact;
    rs.plan_stats[kPlanMovedRows] = moved;
    rs.plan_stats[kPlanPieces] = P;
    rs.plan_stats[kPlanMaxRankRows] = max_rows;
    rs.plan_stats[kPlanRowLimit] = row_limit;
  }
  __syncthreads();
  const bool ok = overflow_rank < 0;
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    rs.group_offsets[g] = ok ? rs.plan_group_offsets_RG[pt.rank * (G + 1) + g] : 0;
    rs.group_counts[g] = ok ? group_rows[pt.rank * G + g] : 0;
  }
  if (threadIdx.x == 0) rs.group_offsets[G] = ok ? needed[pt.rank] : 0;
}

}  // namespace

size_t balance_plan_smem_bytes(const EpDims& dims) { return sizeof(int32_t) * plan_smem(dims).words; }

void configure_balance_plan(const EpLaunch& l) {
  // Above 48 KiB the kernel must opt in. The attribute belongs to the kernel, not to this pipeline:
  // it is set to everything the device allows, so no pipeline's setting can fall below what
  // another (of a larger shape) launches with.
  int device = 0, optin = 0;
  runtime::cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  runtime::cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                      "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  cudaFuncAttributes attributes{};
  runtime::cuda_check(cudaFuncGetAttributes(&attributes, balance_plan_kernel), "cudaFuncGetAttributes(balance_plan_kernel)");
  const int dynamic_max = optin - static_cast<int>(attributes.sharedSizeBytes);
  if (static_cast<int64_t>(balance_plan_smem_bytes(l.dims)) > dynamic_max) {
    throw NotAvailable("balance=exact: the balance planner needs " + std::to_string(balance_plan_smem_bytes(l.dims)) +
                       " bytes of shared memory, more than the device's " + std::to_string(dynamic_max));
  }
  runtime::cuda_check(cudaFuncSetAttribute(balance_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_max),
                      "cudaFuncSetAttribute(balance_plan_kernel)");
}

void launch_balance_plan(const EpLaunch& l, cudaStream_t stream) {
  balance_plan_kernel<<<l.launch_ranks, kPlanThreads, balance_plan_smem_bytes(l.dims), stream>>>(l.tables, l.dims,
                                                                                                  l.ws, l.scratch);
  runtime::cuda_check_launch("balance_plan_kernel");
}

}  // namespace poise::ep
