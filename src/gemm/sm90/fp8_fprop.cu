// The FP8 block-scaled forward GEMMs: FPROP W13 + SwiGLU and FPROP W2 into rows or slots
// (expert_mlp_fp8.hpp), on the grouped-GEMM kernel with its FP8 K loop (mainloop_fp8.cuh).
#include "gemm/sm90/epilogue_rows.cuh"
#include "gemm/sm90/epilogue_swiglu_fprop.cuh"
#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "poise/errors.hpp"

namespace poise::sm90 {
namespace {

void require_not_built(bool unsupported, const char* what) {
  if (unsupported) throw NotAvailable(std::string("FP8 expert GEMMs: ") + what + " is not built yet");
}

void validate_fp8(const GroupedRows& rows, const ExpertMlpShape& shape) {
  validate(rows, shape);
  require_not_built(shape.biased, "shape.biased (expert biases)");
  require_not_built(shape.weights_transposed, "shape.weights_transposed (FP8 wgmma reads K-major weights only)");
}

void require_scales(const float* p, const char* name) {
  require_ptr(p, name);
  require(reinterpret_cast<uintptr_t>(p) % alignof(float) == 0, name, "must be 4-byte aligned");
}

// An operand's values and scales, named as the caller passed them.
void require_rows(const Fp8Rows& a, const char* values_name, const char* scales_name) {
  require_ptr(a.values_RK, values_name);
  require_scales(a.scales_RKb, scales_name);
}
void require_weights(const GroupedRows& rows, const Fp8Weights& own, const Fp8Weights& replicas, const char* names[4]) {
  require_ptr(own.values, names[0]);
  require_scales(own.scales, names[1]);
  if (replica_experts(rows) > 0) {
    require_ptr(replicas.values, names[2]);
    require_scales(replicas.scales, names[3]);
  }
}

// A rows-as-M FP8 GEMM: A = rows [R][K], B = weights [E][b_rows][K] with their scales, N columns in
// n_tile-wide tiles (kBlockN / 2 activation columns of the blocked W13, kBlockN of W2's D rows).
struct Fp8Gemm {
  CUtensorMap map_a;
  WeightMaps map_b;
  GroupedGemmShape shape;
};
Fp8Gemm fp8_gemm(const GroupedRows& rows, const Fp8Rows& a, const char* a_name, const Fp8Weights& w,
                 const Fp8Weights& replica_w, const char* w_names[4], int64_t K, int64_t b_rows, int64_t N,
                 int64_t n_tile) {
  Fp8Gemm g;
  g.map_a = make_fp8_tensor_map(a.values_RK, rows.max_rows, K, kTileM / 2, a_name);
  g.map_b = weight_maps(rows, w.values, w_names[0], replica_w.values, w_names[2], b_rows, K, kBlockN / 2,
                        /*e4m3=*/true);
  g.shape = rows_gemm_shape(rows, K, b_rows, N, n_tile);
  g.shape.k_blocks = ceil_div(K, 128);
  g.shape.scales = {a.scales_RKb, w.scales, replica_w.scales, g.shape.k_blocks};
  return g;
}

}  // namespace

void expert_mlp_fprop_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW13Fp8Args& args,
                              cudaStream_t stream) {
  validate_fp8(rows, shape);
  require_not_built(shape.w13_layout != W13Layout::gate_up_blocked, "the interleaved W13 layout");
  const char* w_names[4] = {"w13.values", "w13.scales", "replica_w13.values", "replica_w13.scales"};
  require_rows(args.x, "x.values_RK", "x.scales_RKb");
  require_weights(rows, args.w13, args.replica_w13, w_names);
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

void expert_mlp_fprop_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const FpropW2Fp8Args& args,
                             cudaStream_t stream) {
  validate_fp8(rows, shape);
  const char* w_names[4] = {"w2.values", "w2.scales", "replica_w2.values", "replica_w2.scales"};
  require_rows(args.a, "a.values_RK", "a.scales_RKb");
  require_weights(rows, args.w2, args.replica_w2, w_names);
  validate_rows_output(args.y_RD, "y_RD", args.scatter, shape.hidden_dim);
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const Fp8Gemm g = fp8_gemm(rows, args.a, "a.values_RK", args.w2, args.replica_w2, w_names, F, D, D, kBlockN);
  if (args.scatter.row_origin_R) {
    launch<RowsAre::M, false, RowsScatterEpilogue, true>(g.map_a, g.map_b, g.shape,
                                                          rows_scatter_epilogue(args.scatter, args.scores_R, D), stream);
  } else {
    const RowsStoreEpilogue epi{bf16(args.y_RD), args.scores_R, static_cast<int32_t>(D), {}};
    launch<RowsAre::M, false, RowsStoreEpilogue, true>(g.map_a, g.map_b, g.shape, epi, stream);
  }
}

}  // namespace poise::sm90
