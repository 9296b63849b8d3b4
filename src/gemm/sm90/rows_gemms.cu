// The GEMMs whose output is one row per routed row: FPROP W2 (y = a . W2[e]^T + b2[e], scaled by
// the row's score) and DGRAD W13 (grad_x = grad_h13 . W13[e]), stored as grouped rows or scattered to slots.
#include "gemm/sm90/epilogue_rows.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {
namespace {

// What tells the two rows GEMMs apart: A = [rows][K], each expert's weights B (the replica
// experts' in replica_w), stored [K][D] (MN-major) or [D][K] (K-major), and FPROP W2's bias.
struct RowsOperands {
  const void* a;
  const char* a_name;
  int64_t K;
  const void* w;
  const char* w_name;
  const void* replica_w;
  const char* replica_name;
  bool b_mn_major;
  ExpertBias bias;  // FPROP W2's b2 [E_own, D], or none
};

// out_RD = A . B (+ bias) over each expert's rows: D columns, scaled by scores_R when set, into
// grouped rows out_RD or, with scatter.row_origin_R, the owners' slots.
template <bool kBMnMajor>
void launch_rows(const GroupedRows& rows, const RowsOperands& o, int64_t D, void* out_RD, const RowScatter& scatter,
                 const float* scores_R, cudaStream_t stream) {
  const int64_t b_rows = kBMnMajor ? o.K : D, b_cols = kBMnMajor ? D : o.K;
  const CUtensorMap map_a = rows_operand_map(o.a, rows, o.K, o.a_name);
  // MN-major: 64-column chunks of 64 K rows; K-major: two halves of the tile's kBlockN weight rows.
  const WeightMaps map_b = weight_maps(rows, o.w, o.w_name, o.replica_w, o.replica_name, b_rows, b_cols,
                                       kBMnMajor ? 64 : kBlockN / 2);
  const GroupedGemmShape s = rows_gemm_shape(rows, o.K, b_rows, D, kBlockN);
  if (scatter.row_origin_R) {
    RowsScatterEpilogue epi = rows_scatter_epilogue(scatter, scores_R, D);
    epi.bias = o.bias;
    launch<RowsAre::M, kBMnMajor>(map_a, map_b, s, epi, stream);
  } else {
    launch<RowsAre::M, kBMnMajor>(map_a, map_b, s,
                                  RowsStoreEpilogue{bf16(out_RD), scores_R, static_cast<int32_t>(D), o.bias}, stream);
  }
}

void rows_gemm(const GroupedRows& rows, const ExpertMlpShape& shape, const RowsOperands& o, void* out_RD,
               const char* out_name, const RowScatter& scatter, const float* scores_R, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(o.a, o.a_name);
  require_ptr(o.w, o.w_name);
  validate_rows_output(out_RD, out_name, scatter, shape.hidden_dim);
  require_replica_ptr(rows, o.replica_w, o.replica_name);
  if (rows.max_rows == 0) return;
  if (o.b_mn_major) launch_rows<true>(rows, o, shape.hidden_dim, out_RD, scatter, scores_R, stream);
  else launch_rows<false>(rows, o, shape.hidden_dim, out_RD, scatter, scores_R, stream);
}

}  // namespace

void expert_mlp_fprop_w2(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Args& args,
                         cudaStream_t stream) {
  // W2[e] is [D][F] (N = D rows, K = F contiguous: K-major B), or transposed [F][D] (MN-major).
  RowsOperands o{.a = args.a_RF, .a_name = "a_RF", .K = shape.intermediate_dim, .w = args.w2_EDF,
                 .w_name = "w2_EDF", .replica_w = args.replica_w2_EDF, .replica_name = "replica_w2_EDF",
                 .b_mn_major = shape.weights_transposed};
  if (shape.biased) o.bias = expert_bias(rows, args.b2_ED, "b2_ED", args.replica_b2_ED, "replica_b2_ED", shape.hidden_dim);
  rows_gemm(rows, shape, o, args.y_RD, "y_RD", args.scatter, args.scores_R, stream);
}

void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW13Args& args,
                          cudaStream_t stream) {
  // W13[e] is [2F][D] (K = 2F rows, N = D contiguous: MN-major B), or transposed [D][2F] (K-major).
  const RowsOperands o{.a = args.grad_h13_R2F, .a_name = "grad_h13_R2F", .K = 2 * shape.intermediate_dim,
                       .w = args.w13_E2FD, .w_name = "w13_E2FD", .replica_w = args.replica_w13_E2FD,
                       .replica_name = "replica_w13_E2FD", .b_mn_major = !shape.weights_transposed};
  rows_gemm(rows, shape, o, args.grad_x_RD, "grad_x_RD", args.scatter, nullptr, stream);
}

}  // namespace poise::sm90
