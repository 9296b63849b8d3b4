// DGRAD W2 + SwiGLU backward: grad_a = score * (grad_y . W2[e]), grad_h13 = swiglu_backward(h13,
// grad_a), the W2 wgrad operand score * act(h13), and the scores' gradient pieces.
#include "gemm/sm90/epilogue_swiglu_dgrad.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"

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
  const int32_t split = h13_split_row(rows, args.h13_split);  // checked before any descriptor
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.grad_y_RD, rows, D, "grad_y_RD");
  // W2[e] is [D][F]: K = D rows, N = F contiguous -> MN-major B, 64 x 64 boxes; transposed [F][D]
  // -> K-major B, boxes of kBlockN / 2 rows.
  const bool mn_major = !shape.weights_transposed;
  const WeightMaps map_b = weight_maps(rows, args.w2_EDF, "w2_EDF", args.replica_w2_EDF, "replica_w2_EDF",
                                       mn_major ? D : F, mn_major ? F : D, mn_major ? 64 : kBlockN / 2);
  const GroupedGemmShape s = rows_gemm_shape(rows, D, mn_major ? D : F, F, kBlockN);
  auto run = [&](auto epi) {
    // h13 is read by the producer in 64 x 64 boxes; the low buffer's map must not reach past its rows.
    if (split > 0) epi.h13_map = make_bf16_tensor_map(args.h13_R2F, split, 2 * F, 64, "h13_R2F");
    if (split < rows.max_rows)
      epi.h13_hi_map = make_bf16_tensor_map(args.h13_split.hi_R2F, rows.max_rows, 2 * F, 64, "h13_split.hi_R2F");
    epi.grad_h13_map = make_store_tensor_map(args.grad_h13_R2F, false, rows.max_rows, 2 * F, "grad_h13_R2F");
    epi.a_map = make_store_tensor_map(args.a_RF, false, rows.max_rows, F, "a_RF");
    epi.h13_split = split;
    epi.grad_h13_R2F = bf16(args.grad_h13_R2F);
    epi.a_RF = bf16(args.a_RF);
    epi.scores_R = args.scores_R;
    epi.grad_score_partials_RP = args.grad_score_partials_RP;
    epi.score_partials = static_cast<int32_t>(dgrad_w2_score_partials(shape));
    epi.F = static_cast<int32_t>(F);
    epi.act = activation_params(shape);
    if (mn_major) launch<RowsAre::M, true>(map_a, map_b, s, epi, stream);
    else launch<RowsAre::M, false>(map_a, map_b, s, epi, stream);
  };
  if (shape.w13_layout == W13Layout::gate_up_blocked) run(SwigluDgradEpilogue<false>{});
  else run(SwigluDgradEpilogue<true>{});
}

}  // namespace poise::sm90
