// FP8 DGRAD W2 + SwiGLU backward (expert_mlp_fp8.hpp): B is W2's transposed FP8 copy, read K-major
// as FP8 wgmma needs; the K loop is the forward's (mainloop_fp8.cuh), the epilogue the BF16 GEMM's.
#include "gemm/sm90/epilogue_swiglu_dgrad.cuh"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/fp8_gemm_args.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {

void expert_mlp_dgrad_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const DgradW2Fp8Args& args,
                             cudaStream_t stream) {
  validate_fp8(rows, shape);
  require_fp8_built(shape.w13_layout != W13Layout::gate_up_blocked, "the interleaved W13 layout");
  const char* const w_names[4] = {"w2_t.values", "w2_t.scales", "replica_w2_t.values", "replica_w2_t.scales"};
  require_fp8_rows(args.grad_y, "grad_y.values_RK", "grad_y.scales_RKb");
  require_fp8_weights(rows, args.w2_t, args.replica_w2_t, w_names);
  require_ptr(args.h13_R2F, "h13_R2F");
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  if (rows.max_rows == 0) return;
  const auto epi = swiglu_dgrad_epilogue<false>(rows, shape, args.h13_R2F, args.h13_split, args.grad_h13_R2F,
                                                args.a_RF, args.scores_R, args.grad_score_partials_RP);
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  // K = D; N = F activation columns, kBlockN per tile: B rows are W2^T's F rows.
  const Fp8Gemm g = fp8_gemm(rows, args.grad_y, "grad_y.values_RK", args.w2_t, args.replica_w2_t, w_names, D, F, F,
                             kBlockN);
  launch<RowsAre::M, false, SwigluDgradEpilogue<false>, /*kFp8=*/true>(g.map_a, g.map_b, g.shape, epi, stream);
}

}  // namespace poise::sm90
