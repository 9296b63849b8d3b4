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

// What tells the two rows GEMMs apart, besides B's major-ness: A = [rows][K], and each expert's
// weights B (the replica experts' in replica_w), read in b_box-row boxes.
struct RowsOperands {
  const void* a;
  const char* a_name;
  int64_t K;
  const void* w;
  const char* w_name;
  const void* replica_w;
  const char* replica_name;
  int b_box;
};

// out_RD = A . B over each expert's rows: D columns, scaled by scores_R when set. B per expert is
// [K][D] when MN-major, [D][K] when K-major.
template <bool kBMnMajor>
void rows_gemm(const GroupedRows& rows, const ExpertMlpShape& shape, const RowsOperands& o, void* out_RD,
               const char* out_name, const RowScatter& scatter, const float* scores_R, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(o.a, o.a_name);
  require_ptr(o.w, o.w_name);
  validate_rows_output(out_RD, out_name, scatter, shape.hidden_dim);
  require_replica_ptr(rows, o.replica_w, o.replica_name);
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim;
  const int64_t b_rows = kBMnMajor ? o.K : D, b_cols = kBMnMajor ? D : o.K;
  const CUtensorMap map_a = rows_operand_map(o.a, rows, o.K, o.a_name);
  const WeightMaps map_b = weight_maps(rows, o.w, o.w_name, o.replica_w, o.replica_name, b_rows, b_cols, o.b_box);
  const GroupedGemmShape s = rows_gemm_shape(rows, o.K, b_rows, D, kBlockN);
  launch_rows<kBMnMajor>(map_a, map_b, s, out_RD, scatter, scores_R, D, stream);
}

}  // namespace

void expert_mlp_fprop_w2(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Args& args,
                         cudaStream_t stream) {
  // W2[e] is [D][F]: N = D rows, K = F contiguous -> K-major B.
  const RowsOperands o{.a = args.a_RF, .a_name = "a_RF", .K = shape.intermediate_dim, .w = args.w2_EDF,
                       .w_name = "w2_EDF", .replica_w = args.replica_w2_EDF, .replica_name = "replica_w2_EDF",
                       .b_box = kBlockN / 2};
  rows_gemm<false>(rows, shape, o, args.y_RD, "y_RD", args.scatter, args.scores_R, stream);
}

void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW13Args& args,
                          cudaStream_t stream) {
  // W13[e] is [2F][D]: K = 2F rows, N = D contiguous -> MN-major B.
  const RowsOperands o{.a = args.grad_h13_R2F, .a_name = "grad_h13_R2F", .K = 2 * shape.intermediate_dim,
                       .w = args.w13_E2FD, .w_name = "w13_E2FD", .replica_w = args.replica_w13_E2FD,
                       .replica_name = "replica_w13_E2FD", .b_box = 64};
  rows_gemm<true>(rows, shape, o, args.grad_x_RD, "grad_x_RD", args.scatter, nullptr, stream);
}

}  // namespace poise::sm90
