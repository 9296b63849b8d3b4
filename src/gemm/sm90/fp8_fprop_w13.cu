// FP8 FPROP W13 + SwiGLU (expert_mlp_fp8.hpp): the grouped-GEMM kernel with its FP8 K loop
// (mainloop_fp8.cuh) and the BF16 GEMM's epilogue.
#include "gemm/sm90/epilogue_swiglu_fprop.cuh"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/fp8_gemm_args.hpp"
#include "gemm/sm90/launch.cuh"

namespace poise::sm90 {

void expert_mlp_fprop_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Fp8Args& args,
                              cudaStream_t stream) {
  validate_fp8(rows, shape);
  require_fp8_built(shape.w13_layout != W13Layout::gate_up_blocked, "the interleaved W13 layout");
  const char* const w_names[4] = {"w13.values", "w13.scales", "replica_w13.values", "replica_w13.scales"};
  require_fp8_rows(args.x, "x.values_RK", "x.scales_RKb");
  require_fp8_weights(rows, args.w13, args.replica_w13, w_names);
  require_ptr(args.a_RF, "a_RF");
  if (rows.max_rows == 0) return;
  const auto epi = swiglu_fprop_epilogue<false>(rows, shape, args.a_RF, args.h13_R2F, args.h13_split, {});
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  // N = F activation columns, kBlockN / 2 per tile: the tile's B is that many gate rows and the up
  // rows F below them.
  Fp8Gemm g = fp8_gemm(rows, args.x, "x.values_RK", args.w13, args.replica_w13, w_names, D, 2 * F, F, kBlockN / 2);
  g.shape.b_gate_up_split = static_cast<int32_t>(F);
  launch<RowsAre::M, false, SwigluFpropEpilogue<false>, /*kFp8=*/true>(g.map_a, g.map_b, g.shape, epi, stream);
}

}  // namespace poise::sm90
