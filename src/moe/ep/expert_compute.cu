#include "moe/ep/expert_compute.hpp"

#include "kernels/ep/reference_grouped_gemm.hpp"

namespace poise::ep {
namespace {

RowGemmBatch row_batch(const EpLaunch& l) {
  RowGemmBatch b;
  b.ranks = l.launch_ranks;
  b.groups = l.dims.E_local;
  b.capacity_rows = l.dims.capacity_rows;
  b.D = l.dims.D;
  b.F = l.dims.F;
  b.swiglu_clamped = l.dims.swiglu_clamped;
  b.swiglu_alpha = l.dims.swiglu_alpha;
  b.swiglu_limit = l.dims.swiglu_limit;
  for (int s = 0; s < l.launch_ranks; ++s) {
    b.rank[s].group_offsets = l.scratch.rank[s].group_offsets;
    b.rank[s].group_counts = l.scratch.rank[s].group_counts;
    b.rank[s].error_code = l.scratch.rank[s].error_code;
  }
  return b;
}

const bf16* workspace_rows(const EpLaunch& l, int slot, size_t offset) {
  return reinterpret_cast<const bf16*>(l.scratch.rank[slot].workspace + offset);
}

}  // namespace

void expert_forward(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  RowGemmBatch w13 = row_batch(l);
  RowGemmBatch w2 = row_batch(l);
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    w13.rank[s].a = workspace_rows(l, s, l.ws.recv_x);
    w13.rank[s].b = io.rank[s].w13_E2FD;
    w13.rank[s].out = rs.h13_R2F;
    w13.rank[s].out2 = rs.a_RF;
    w2.rank[s].a = rs.a_RF;
    w2.rank[s].b = io.rank[s].w2_EDF;
    w2.rank[s].out = rs.rows_out_RD;
  }
  launch_row_grouped_gemm(RowGemmKind::w13_swiglu, w13, stream);
  launch_row_grouped_gemm(RowGemmKind::w2_forward, w2, stream);
}

void expert_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate_wgrad, cudaStream_t stream) {
  RowGemmBatch w2_dgrad = row_batch(l);
  RowGemmBatch w13_dgrad = row_batch(l);
  WgradBatch w2_wgrad, w13_wgrad;
  w2_wgrad.ranks = w13_wgrad.ranks = l.launch_ranks;
  w2_wgrad.groups = w13_wgrad.groups = l.dims.E_local;
  w2_wgrad.accumulate = w13_wgrad.accumulate = accumulate_wgrad;
  w2_wgrad.m_dim = l.dims.D;      // grad_W2[e] [D][F] = grad_y^T a
  w2_wgrad.n_dim = l.dims.F;
  w13_wgrad.m_dim = 2 * l.dims.F;  // grad_W13[e] [2F][D] = grad_h13^T x
  w13_wgrad.n_dim = l.dims.D;
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RankScratch& rs = l.scratch.rank[s];
    w2_dgrad.rank[s].a = rs.grad_y_RD;
    w2_dgrad.rank[s].b = io.rank[s].w2_EDF;
    w2_dgrad.rank[s].aux = rs.h13_R2F;
    w2_dgrad.rank[s].out = rs.grad_h13_R2F;
    w13_dgrad.rank[s].a = rs.grad_h13_R2F;
    w13_dgrad.rank[s].b = io.rank[s].w13_E2FD;
    w13_dgrad.rank[s].out = rs.rows_out_RD;
    for (WgradBatch* w : {&w2_wgrad, &w13_wgrad}) {
      w->rank[s].group_offsets = rs.group_offsets;
      w->rank[s].group_counts = rs.group_counts;
      w->rank[s].error_code = rs.error_code;
    }
    w2_wgrad.rank[s].a = rs.grad_y_RD;
    w2_wgrad.rank[s].b = rs.a_RF;
    w2_wgrad.rank[s].c = io.rank[s].grad_w2_EDF;
    w13_wgrad.rank[s].a = rs.grad_h13_R2F;
    w13_wgrad.rank[s].b = workspace_rows(l, s, l.ws.recv_x);
    w13_wgrad.rank[s].c = io.rank[s].grad_w13_E2FD;
  }
  launch_row_grouped_gemm(RowGemmKind::w2_dgrad_swiglu, w2_dgrad, stream);
  launch_row_grouped_gemm(RowGemmKind::w13_dgrad, w13_dgrad, stream);
  launch_wgrad_grouped_gemm(w2_wgrad, stream);
  launch_wgrad_grouped_gemm(w13_wgrad, stream);
}

}  // namespace poise::ep
