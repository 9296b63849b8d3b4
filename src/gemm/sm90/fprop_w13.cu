// FPROP W13 + SwiGLU: h13 = x . W13[e]^T + b13[e], a = act(h13).
#include "gemm/sm90/epilogue_swiglu_fprop.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {

namespace {

// B of FPROP W13: W13[e] as [2F][D] (K-major, read in boxes of kBlockN / 2 rows: the tile's gate and
// up halves when blocked) or transposed [D][2F] (MN-major, 64-column chunks of 64 K rows).
WeightMaps w13_maps(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Args& args) {
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  if (shape.weights_transposed)
    return weight_maps(rows, args.w13_E2FD, "w13_E2FD", args.replica_w13_E2FD, "replica_w13_E2FD", D, 2 * F, 64);
  return weight_maps(rows, args.w13_E2FD, "w13_E2FD", args.replica_w13_E2FD, "replica_w13_E2FD", 2 * F, D,
                     kBlockN / 2);
}

ExpertBias b13_of(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Args& args) {
  if (!shape.biased) return {};
  return expert_bias(rows, args.b13_E2F, "b13_E2F", args.replica_b13_E2F, "replica_b13_E2F",
                     2 * shape.intermediate_dim);
}

}  // namespace

void expert_mlp_fprop_w13(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Args& args,
                          cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.x_RD, "x_RD");
  require_ptr(args.w13_E2FD, "w13_E2FD");
  require_ptr(args.a_RF, "a_RF");
  require_replica_ptr(rows, args.replica_w13_E2FD, "replica_w13_E2FD");
  const ExpertBias b13 = b13_of(rows, shape, args);
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const bool blocked = shape.w13_layout == W13Layout::gate_up_blocked;
  GroupedGemmShape s = rows_gemm_shape(rows, D, shape.weights_transposed ? D : 2 * F, F, kBlockN / 2);
  s.b_gate_up_split = blocked ? static_cast<int32_t>(F) : 0;
  auto run = [&](auto epi) {  // built first: it checks h13_split before any descriptor
    const CUtensorMap map_a = rows_operand_map(args.x_RD, rows, D, "x_RD");
    const WeightMaps map_b = w13_maps(rows, shape, args);
    if (shape.weights_transposed) launch<RowsAre::M, true>(map_a, map_b, s, epi, stream);
    else launch<RowsAre::M, false>(map_a, map_b, s, epi, stream);
  };
  if (blocked) run(swiglu_fprop_epilogue<false>(rows, shape, args.a_RF, args.h13_R2F, args.h13_split, b13));
  else run(swiglu_fprop_epilogue<true>(rows, shape, args.a_RF, args.h13_R2F, args.h13_split, b13));
}

}  // namespace poise::sm90
