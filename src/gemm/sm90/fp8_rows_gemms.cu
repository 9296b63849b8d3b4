// The FP8 GEMMs whose output is one row per routed row (expert_mlp_fp8.hpp): FPROP W2 (y = a . W2[e]^T,
// scaled by the row's score) and DGRAD W13 (grad_x = grad_h13 . W13[e], B W13's transposed FP8
// copy), stored as grouped rows or scattered to slots, with the BF16 GEMMs' rows epilogues.
#include "gemm/sm90/epilogue_rows.cuh"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/fp8_gemm_args.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {
namespace {

// out_RD = A . B over each expert's rows: D columns, scaled by scores_R when set, into grouped rows
// out_RD or, with scatter.row_origin_R, the owners' slots.
void launch_fp8_rows(const Fp8Gemm& g, int64_t D, void* out_RD, const RowScatter& scatter, const float* scores_R,
                     cudaStream_t stream) {
  if (scatter.row_origin_R) {
    launch<RowsAre::M, false, RowsScatterEpilogue, /*kFp8=*/true>(g.map_a, g.map_b, g.shape,
                                                                   rows_scatter_epilogue(scatter, scores_R, D), stream);
  } else {
    const RowsStoreEpilogue epi{bf16(out_RD), scores_R, static_cast<int32_t>(D), {}};
    launch<RowsAre::M, false, RowsStoreEpilogue, /*kFp8=*/true>(g.map_a, g.map_b, g.shape, epi, stream);
  }
}

}  // namespace

void expert_mlp_fprop_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Fp8Args& args,
                             cudaStream_t stream) {
  validate_fp8(rows, shape);
  const char* const w_names[4] = {"w2.values", "w2.scales", "replica_w2.values", "replica_w2.scales"};
  require_fp8_rows(args.a, "a.values_RK", "a.scales_RKb");
  require_fp8_weights(rows, args.w2, args.replica_w2, w_names);
  validate_rows_output(args.y_RD, "y_RD", args.scatter, shape.hidden_dim);
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  launch_fp8_rows(fp8_gemm(rows, args.a, "a.values_RK", args.w2, args.replica_w2, w_names, F, D, D, kBlockN), D,
                  args.y_RD, args.scatter, args.scores_R, stream);
}

void expert_mlp_dgrad_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW13Fp8Args& args,
                              cudaStream_t stream) {
  validate_fp8(rows, shape);
  const char* const w_names[4] = {"w13_t.values", "w13_t.scales", "replica_w13_t.values", "replica_w13_t.scales"};
  require_fp8_rows(args.grad_h13, "grad_h13.values_RK", "grad_h13.scales_RKb");
  require_fp8_weights(rows, args.w13_t, args.replica_w13_t, w_names);
  validate_rows_output(args.grad_x_RD, "grad_x_RD", args.scatter, shape.hidden_dim);
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  // K = 2F (W13's row order); B rows are W13^T's D rows.
  launch_fp8_rows(fp8_gemm(rows, args.grad_h13, "grad_h13.values_RK", args.w13_t, args.replica_w13_t, w_names,
                           2 * F, D, D, kBlockN),
                  D, args.grad_x_RD, args.scatter, nullptr, stream);
}

}  // namespace poise::sm90
