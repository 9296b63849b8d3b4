#include "pipeline/expert_compute.hpp"

#include <cstddef>

#include "ep/reference_grouped_gemm.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "poise/errors.hpp"

namespace poise::ep {
namespace {

// The expert groups of one GEMM call: the E_local own experts (weights and gradients from the
// call's arguments) or, with exact balance, the B replica slots (weights pushed into the
// workspace during dispatch, gradients into the workspace for the owners to collect).
struct GroupRange {
  int first = 0;
  int count = 0;
  bool replicas = false;
};

GroupRange own_groups(const EpLaunch& l) { return {0, l.dims.E_local, false}; }
GroupRange replica_groups(const EpLaunch& l) { return {l.dims.E_local, l.dims.replica_slots, true}; }
// Own experts, then replica slots when there are any.
int group_ranges(const EpLaunch& l, GroupRange (&ranges)[2]) {
  ranges[0] = own_groups(l);
  ranges[1] = replica_groups(l);
  return l.dims.balanced && l.dims.replica_slots > 0 ? 2 : 1;
}

RowGemmBatch row_batch(const EpLaunch& l, const GroupRange& range) {
  RowGemmBatch b;
  b.ranks = l.launch_ranks;
  b.groups = range.count;
  b.capacity_rows = l.dims.capacity_rows;
  b.D = l.dims.D;
  b.F = l.dims.F;
  b.swiglu_clamped = l.dims.swiglu_clamped;
  b.swiglu_alpha = l.dims.swiglu_alpha;
  b.swiglu_limit = l.dims.swiglu_limit;
  for (int s = 0; s < l.launch_ranks; ++s) {
    b.rank[s].group_offsets = l.scratch.rank[s].group_offsets + range.first;
    b.rank[s].group_counts = l.scratch.rank[s].group_counts + range.first;
    b.rank[s].error_code = l.scratch.rank[s].error_code;
  }
  return b;
}

const bf16* workspace_rows(const EpLaunch& l, int slot, size_t offset) {
  return reinterpret_cast<const bf16*>(l.scratch.rank[slot].workspace + offset);
}

// The weights (bf16) and weight gradients (fp32) of a group range on one rank.
const bf16* w13_of(const EpLaunch& l, const LaunchIo& io, int slot, const GroupRange& range) {
  return range.replicas ? workspace_rows(l, slot, l.ws.replica_w13) : io.rank[slot].w13_E2FD;
}
const bf16* w2_of(const EpLaunch& l, const LaunchIo& io, int slot, const GroupRange& range) {
  return range.replicas ? workspace_rows(l, slot, l.ws.replica_w2) : io.rank[slot].w2_EDF;
}
// Replica slots' gradients are always fp32; own experts' are Config::wgrad_dtype (the stand-in
// kernels, which only write fp32, run only with fp32: StagedPipeline checks).
void* grad_w13_of(const EpLaunch& l, const LaunchIo& io, int slot, const GroupRange& range) {
  return range.replicas ? l.scratch.rank[slot].workspace + l.ws.replica_grad_w13 : io.rank[slot].grad_w13_E2FD;
}
void* grad_w2_of(const EpLaunch& l, const LaunchIo& io, int slot, const GroupRange& range) {
  return range.replicas ? l.scratch.rank[slot].workspace + l.ws.replica_grad_w2 : io.rank[slot].grad_w2_EDF;
}

// The SM90 kernels cover a rank's own experts and its replica slots in one grouped GEMM each:
// groups [0, E_local) use the call's weights and gradients, [E_local, E_local + B) the replica
// weights and fp32 gradient slots in the workspace (unused slots get no tiles).
sm90::GroupedRows sm90_rows(const EpLaunch& l, int slot) {
  sm90::GroupedRows rows;
  rows.row_offsets_E = l.scratch.rank[slot].group_offsets;
  rows.row_counts_E = l.scratch.rank[slot].group_counts;
  rows.num_experts = l.dims.groups;
  rows.max_rows = l.dims.capacity_rows;
  rows.first_replica = l.dims.balanced && l.dims.replica_slots > 0 ? l.dims.E_local : -1;
  rows.tile_counters = l.gemm_tile_counters;
  rows.faults = {l.gemm_fault_word, l.gemm_wait_timeout_ns, l.gemm_drop_first_stage};
  return rows;
}

// Where FPROP W2 / DGRAD W13 put their rows with the direct combine: each valid row into slot
// origin % (T*K) of rank origin / (T*K)'s combine buffer, read through this rank's peer table (the
// addresses combine-push would have copied them to; EpDims::direct_combine).
sm90::RowScatter combine_scatter(const EpLaunch& l, int slot) {
  sm90::RowScatter s;
  s.row_origin_R = reinterpret_cast<const int32_t*>(l.scratch.rank[slot].workspace + l.ws.row_origin);
  // The table lives on the device: its base array's address, not read here.
  s.owner_bases = reinterpret_cast<char* const*>(reinterpret_cast<const char*>(l.tables + slot) +
                                                 offsetof(comm::PeerTable, base));
  s.slot_offset = static_cast<int64_t>(l.ws.combine);
  s.slots_per_owner = static_cast<int64_t>(l.dims.T) * l.dims.K;
  s.owners = l.dims.world;
  return s;
}

sm90::ExpertMlpShape sm90_shape(const EpLaunch& l) {
  sm90::ExpertMlpShape shape;
  shape.hidden_dim = l.dims.D;
  shape.intermediate_dim = l.dims.F;
  shape.activation = l.dims.swiglu_clamped ? Activation::swiglu_clamped : Activation::swiglu;
  shape.swiglu_alpha = l.dims.swiglu_alpha;
  shape.swiglu_limit = l.dims.swiglu_limit;
  shape.w13_layout = l.dims.w13_interleaved ? W13Layout::gate_up_interleaved : W13Layout::gate_up_blocked;
  return shape;
}

// h13 of a partial activation record: rows past the split in the working record's buffer.
sm90::H13Split h13_split(const EpLaunch& l, const RankScratch& rs) {
  if (rs.h13_split >= l.dims.capacity_rows) return {};
  return {rs.h13_split, rs.h13_hi_R2F};
}

// with_w2 = false: only h13 (and a), what a recomputed forward must give backward. tail_only: the
// rows of a partial record's groups past its split (RankScratch::tail_offsets / tail_counts).
void sm90_forward(const EpLaunch& l, const LaunchIo& io, bool with_w2, bool tail_only, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = sm90_shape(l);
  const GroupRange own = own_groups(l), replicas = replica_groups(l);
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    sm90::GroupedRows rows = sm90_rows(l, s);
    if (tail_only) rows.row_offsets_E = rs.tail_offsets, rows.row_counts_E = rs.tail_counts;
    sm90::FpropW13Args w13{workspace_rows(l, s, l.ws.recv_x), w13_of(l, io, s, own), rs.a_RF, rs.h13_R2F};
    w13.h13_split = h13_split(l, rs);
    sm90::FpropW2Args w2{rs.a_RF, w2_of(l, io, s, own), nullptr, rs.rows_out_RD};
    if (l.dims.direct_combine) w2.y_RD = nullptr, w2.scatter = combine_scatter(l, s);
    if (rows.first_replica >= 0) {
      w13.replica_w13_E2FD = w13_of(l, io, s, replicas);
      w2.replica_w2_EDF = w2_of(l, io, s, replicas);
    }
    sm90::expert_mlp_fprop_w13(rows, shape, w13, stream);
    if (with_w2) sm90::expert_mlp_fprop_w2(rows, shape, w2, stream);
  }
}

// grad_y rows are the dispatched grad_out rows, unscaled, in the receive buffer: DGRAD W2 applies
// each row's score (grad_a = score * grad_y . W2), writes score * a for the W2 weight gradient, and
// the score's gradient pieces that combine-push sends home. Replica slots' weight gradients are
// always overwritten (the owners accumulate them).
void sm90_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate, cudaStream_t stream) {
  const sm90::ExpertMlpShape shape = sm90_shape(l);
  const GroupRange own = own_groups(l), replicas = replica_groups(l);
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    const sm90::GroupedRows rows = sm90_rows(l, s);
    const bool has_replicas = rows.first_replica >= 0;
    const bf16* grad_y_RD = workspace_rows(l, s, l.ws.recv_grad);
    sm90::DgradW2Args dgrad_w2;
    dgrad_w2.grad_y_RD = grad_y_RD;
    dgrad_w2.w2_EDF = w2_of(l, io, s, own);
    dgrad_w2.h13_R2F = rs.h13_R2F;
    dgrad_w2.h13_split = h13_split(l, rs);
    dgrad_w2.scores_R = reinterpret_cast<const float*>(rs.workspace + l.ws.row_score);
    dgrad_w2.grad_h13_R2F = rs.grad_h13_R2F;
    dgrad_w2.a_RF = rs.a_RF;
    dgrad_w2.grad_score_partials_RP = rs.grad_score_partials_RP;
    sm90::DgradW13Args dgrad_w13{rs.grad_h13_R2F, w13_of(l, io, s, own), rs.rows_out_RD};
    if (l.dims.direct_combine) dgrad_w13.grad_x_RD = nullptr, dgrad_w13.scatter = combine_scatter(l, s);
    const DType own_dtype = l.dims.wgrad_bf16 ? DType::bf16 : DType::fp32;
    sm90::WgradOutput wgrad_w2{grad_w2_of(l, io, s, own), own_dtype, accumulate};
    sm90::WgradOutput wgrad_w13{grad_w13_of(l, io, s, own), own_dtype, accumulate};
    if (has_replicas) {
      dgrad_w2.replica_w2_EDF = w2_of(l, io, s, replicas);
      dgrad_w13.replica_w13_E2FD = w13_of(l, io, s, replicas);
      wgrad_w2.replica_grad_w = grad_w2_of(l, io, s, replicas);
      wgrad_w13.replica_grad_w = grad_w13_of(l, io, s, replicas);
    }
    sm90::expert_mlp_dgrad_w2(rows, shape, dgrad_w2, stream);
    sm90::expert_mlp_dgrad_w13(rows, shape, dgrad_w13, stream);
    sm90::expert_mlp_wgrad_w2(rows, shape, grad_y_RD, rs.a_RF, wgrad_w2, stream);
    sm90::expert_mlp_wgrad_w13(rows, shape, rs.grad_h13_R2F, workspace_rows(l, s, l.ws.recv_x), wgrad_w13, stream);
  }
}

}  // namespace

const char* to_string(ExpertKernels k) { return k == ExpertKernels::sm90 ? "sm90" : "standin"; }

void expert_forward_h13(const EpLaunch& l, const LaunchIo& io, ExpertKernels kernels, bool tail_only,
                        cudaStream_t stream) {
  if (kernels != ExpertKernels::sm90) throw NotAvailable("expert_forward_h13: SM90 expert kernels only");
  sm90_forward(l, io, /*with_w2=*/false, tail_only, stream);
}

void expert_forward(const EpLaunch& l, const LaunchIo& io, ExpertKernels kernels, cudaStream_t stream) {
  if (kernels == ExpertKernels::sm90) return sm90_forward(l, io, /*with_w2=*/true, /*tail_only=*/false, stream);
  GroupRange ranges[2];
  const int n = group_ranges(l, ranges);
  for (int i = 0; i < n; ++i) {
    RowGemmBatch w13 = row_batch(l, ranges[i]);
    RowGemmBatch w2 = row_batch(l, ranges[i]);
    for (int s = 0; s < l.launch_ranks; ++s) {
      const RankScratch& rs = l.scratch.rank[s];
      w13.rank[s].a = workspace_rows(l, s, l.ws.recv_x);
      w13.rank[s].b = w13_of(l, io, s, ranges[i]);
      w13.rank[s].out = rs.h13_R2F;
      w13.rank[s].out2 = rs.a_RF;
      w2.rank[s].a = rs.a_RF;
      w2.rank[s].b = w2_of(l, io, s, ranges[i]);
      w2.rank[s].out = rs.rows_out_RD;
    }
    launch_row_grouped_gemm(RowGemmKind::w13_swiglu, w13, stream);
    launch_row_grouped_gemm(RowGemmKind::w2_forward, w2, stream);
  }
}

void expert_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate_wgrad, ExpertKernels kernels,
                     cudaStream_t stream) {
  if (kernels == ExpertKernels::sm90) return sm90_backward(l, io, accumulate_wgrad, stream);
  GroupRange ranges[2];
  const int n = group_ranges(l, ranges);
  for (int i = 0; i < n; ++i) {
    const GroupRange& range = ranges[i];
    RowGemmBatch w2_dgrad = row_batch(l, range);
    RowGemmBatch w13_dgrad = row_batch(l, range);
    WgradBatch w2_wgrad, w13_wgrad;
    w2_wgrad.ranks = w13_wgrad.ranks = l.launch_ranks;
    w2_wgrad.groups = w13_wgrad.groups = range.count;
    w2_wgrad.accumulate = w13_wgrad.accumulate = accumulate_wgrad && !range.replicas;
    w2_wgrad.m_dim = l.dims.D;      // grad_W2[e] [D][F] = grad_y^T a
    w2_wgrad.n_dim = l.dims.F;
    w13_wgrad.m_dim = 2 * l.dims.F;  // grad_W13[e] [2F][D] = grad_h13^T x
    w13_wgrad.n_dim = l.dims.D;
    for (int s = 0; s < l.launch_ranks; ++s) {
      const RankScratch& rs = l.scratch.rank[s];
      w2_dgrad.rank[s].a = rs.grad_y_RD;
      w2_dgrad.rank[s].b = w2_of(l, io, s, range);
      w2_dgrad.rank[s].aux = rs.h13_R2F;
      w2_dgrad.rank[s].out = rs.grad_h13_R2F;
      w13_dgrad.rank[s].a = rs.grad_h13_R2F;
      w13_dgrad.rank[s].b = w13_of(l, io, s, range);
      w13_dgrad.rank[s].out = rs.rows_out_RD;
      for (WgradBatch* w : {&w2_wgrad, &w13_wgrad}) {
        w->rank[s].group_offsets = rs.group_offsets + range.first;
        w->rank[s].group_counts = rs.group_counts + range.first;
        w->rank[s].error_code = rs.error_code;
      }
      w2_wgrad.rank[s].a = rs.grad_y_RD;
      w2_wgrad.rank[s].b = rs.a_RF;
      w2_wgrad.rank[s].c = static_cast<float*>(grad_w2_of(l, io, s, range));
      w13_wgrad.rank[s].a = rs.grad_h13_R2F;
      w13_wgrad.rank[s].b = workspace_rows(l, s, l.ws.recv_x);
      w13_wgrad.rank[s].c = static_cast<float*>(grad_w13_of(l, io, s, range));
    }
    launch_row_grouped_gemm(RowGemmKind::w2_dgrad_swiglu, w2_dgrad, stream);
    launch_row_grouped_gemm(RowGemmKind::w13_dgrad, w13_dgrad, stream);
    launch_wgrad_grouped_gemm(w2_wgrad, stream);
    launch_wgrad_grouped_gemm(w13_wgrad, stream);
  }
}

}  // namespace poise::ep
