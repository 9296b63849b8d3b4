// FPROP W13 + SwiGLU: h13 = x . W13[e]^T + b13[e], a = act(h13).
#include "gemm/sm90/epilogue_swiglu_fprop.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"

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
  const int32_t split = h13_split_row(rows, args.h13_split);  // checked before any descriptor
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const bool blocked = shape.w13_layout == W13Layout::gate_up_blocked;
  const CUtensorMap map_a = rows_operand_map(args.x_RD, rows, D, "x_RD");
  const WeightMaps map_b = w13_maps(rows, shape, args);
  GroupedGemmShape s = rows_gemm_shape(rows, D, shape.weights_transposed ? D : 2 * F, F, kBlockN / 2);
  s.b_gate_up_split = blocked ? static_cast<int32_t>(F) : 0;
  const CUtensorMap a_map = make_store_tensor_map(args.a_RF, false, rows.max_rows, F, "a_RF");
  // The low buffer holds rows [0, split) only: its map must not reach past them.
  const CUtensorMap h13_map =
      split > 0 ? make_store_tensor_map(args.h13_R2F, false, split, 2 * F, "h13_R2F") : CUtensorMap{};
  const CUtensorMap h13_hi_map =
      split < rows.max_rows
          ? make_store_tensor_map(args.h13_split.hi_R2F, false, rows.max_rows, 2 * F, "h13_split.hi_R2F")
          : CUtensorMap{};
  auto run = [&](auto epi) {
    epi.a_map = a_map;
    epi.h13_map = h13_map;
    epi.h13_hi_map = h13_hi_map;
    epi.a_RF = bf16(args.a_RF);
    epi.h13_R2F = bf16(args.h13_R2F);
    epi.h13_hi_R2F = static_cast<__nv_bfloat16*>(const_cast<void*>(args.h13_split.hi_R2F));
    epi.h13_split = split;
    epi.F = static_cast<int32_t>(F);
    epi.act = activation_params(shape);
    epi.b13 = b13;
    if (shape.weights_transposed) launch<RowsAre::M, true>(map_a, map_b, s, epi, stream);
    else launch<RowsAre::M, false>(map_a, map_b, s, epi, stream);
  };
  if (blocked) run(SwigluFpropEpilogue<false>{});
  else run(SwigluFpropEpilogue<true>{});
}

}  // namespace poise::sm90
