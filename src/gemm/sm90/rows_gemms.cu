// The GEMMs whose output is one row per routed row: FPROP W2 (y = a . W2[e]^T, scaled by the row's
// score) and DGRAD W13 (grad_x = grad_h13 . W13[e]), stored as grouped rows or scattered to slots.
#include "gemm/sm90/epilogue_rows.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {
namespace {

RowsScatterEpilogue rows_scatter_epilogue(const RowScatter& scatter, const float* scores_R, int64_t N) {
  RowsScatterEpilogue epi{};
  epi.scores_R = scores_R;  // the base's rows pointer is not used
  epi.N = static_cast<int32_t>(N);
  epi.row_origin_R = scatter.row_origin_R;
  epi.owner_bases = scatter.owner_bases;
  epi.slot_offset = scatter.slot_offset;
  epi.slots_per_owner = static_cast<int32_t>(scatter.slots_per_owner);
  epi.origins = static_cast<int32_t>(scatter.owners * scatter.slots_per_owner);
  return epi;
}

// A rows GEMM into grouped rows rows_RD or, with scatter.row_origin_R, into the owners' slots.
template <bool kBMnMajor>
void launch_rows(const CUtensorMap& map_a, const WeightMaps& map_b, const GroupedGemmShape& s, void* rows_RD,
                 const RowScatter& scatter, const float* scores_R, int64_t D, cudaStream_t stream) {
  if (scatter.row_origin_R) {
    launch<RowsAre::M, kBMnMajor>(map_a, map_b, s, rows_scatter_epilogue(scatter, scores_R, D), stream);
  } else {
    launch<RowsAre::M, kBMnMajor>(map_a, map_b, s, RowsStoreEpilogue{bf16(rows_RD), scores_R, static_cast<int32_t>(D)},
                                  stream);
  }
}

}  // namespace

void expert_mlp_fprop_w2(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Args& args,
                         cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.a_RF, "a_RF");
  require_ptr(args.w2_EDF, "w2_EDF");
  validate_rows_output(args.y_RD, "y_RD", args.scatter, shape.hidden_dim);
  require_replica_ptr(rows, args.replica_w2_EDF, "replica_w2_EDF");
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.a_RF, rows, F, "a_RF");
  const WeightMaps map_b =
      weight_maps(rows, args.w2_EDF, "w2_EDF", args.replica_w2_EDF, "replica_w2_EDF", D, F, kBlockN / 2);
  const GroupedGemmShape s = rows_gemm_shape(rows, F, D, D, kBlockN);
  launch_rows<false>(map_a, map_b, s, args.y_RD, args.scatter, args.scores_R, D, stream);
}

void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW13Args& args,
                          cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  require_ptr(args.w13_E2FD, "w13_E2FD");
  validate_rows_output(args.grad_x_RD, "grad_x_RD", args.scatter, shape.hidden_dim);
  require_replica_ptr(rows, args.replica_w13_E2FD, "replica_w13_E2FD");
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.grad_h13_R2F, rows, 2 * F, "grad_h13_R2F");
  // W13[e] is [2F][D]: K = 2F rows, N = D contiguous -> MN-major B.
  const WeightMaps map_b =
      weight_maps(rows, args.w13_E2FD, "w13_E2FD", args.replica_w13_E2FD, "replica_w13_E2FD", 2 * F, D, 64);
  const GroupedGemmShape s = rows_gemm_shape(rows, 2 * F, 2 * F, D, kBlockN);
  launch_rows<true>(map_a, map_b, s, args.grad_x_RD, args.scatter, nullptr, D, stream);
}

}  // namespace poise::sm90
