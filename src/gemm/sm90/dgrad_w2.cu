// DGRAD W2 + SwiGLU backward: grad_a = score * (grad_y . W2[e]), grad_h13 = swiglu_backward(h13,
// grad_a), the W2 wgrad operand score * act(h13), and the scores' gradient pieces.
#include "gemm/sm90/epilogue_swiglu_dgrad.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {

int64_t dgrad_w2_score_partials(const ExpertMlpShape& shape) {
  return ceil_div(shape.intermediate_dim, kBlockN) + (shape.biased ? 1 : 0);
}

void expert_mlp_dgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW2Args& args,
                         cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.grad_y_RD, "grad_y_RD");
  require_ptr(args.w2_EDF, "w2_EDF");
  require_ptr(args.h13_R2F, "h13_R2F");
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  require_replica_ptr(rows, args.replica_w2_EDF, "replica_w2_EDF");
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  // W2[e] is [D][F]: K = D rows, N = F contiguous -> MN-major B, 64 x 64 boxes; transposed [F][D]
  // -> K-major B, boxes of kBlockN / 2 rows.
  const bool mn_major = !shape.weights_transposed;
  const GroupedGemmShape s = rows_gemm_shape(rows, D, mn_major ? D : F, F, kBlockN);
  auto run = [&](auto epi) {  // built first: it checks h13_split before any descriptor
    const CUtensorMap map_a = rows_operand_map(args.grad_y_RD, rows, D, "grad_y_RD");
    const WeightMaps map_b = weight_maps(rows, args.w2_EDF, "w2_EDF", args.replica_w2_EDF, "replica_w2_EDF",
                                         mn_major ? D : F, mn_major ? F : D, mn_major ? 64 : kBlockN / 2);
    if (mn_major) launch<RowsAre::M, true>(map_a, map_b, s, epi, stream);
    else launch<RowsAre::M, false>(map_a, map_b, s, epi, stream);
  };
  const DgradW2Args& a = args;
  if (shape.w13_layout == W13Layout::gate_up_blocked) {
    run(swiglu_dgrad_epilogue<false>(rows, shape, a.h13_R2F, a.h13_split, a.grad_h13_R2F, a.a_RF, a.scores_R,
                                     a.grad_score_partials_RP));
  } else {
    run(swiglu_dgrad_epilogue<true>(rows, shape, a.h13_R2F, a.h13_split, a.grad_h13_R2F, a.a_RF, a.scores_R,
                                    a.grad_score_partials_RP));
  }
}

}  // namespace poise::sm90
