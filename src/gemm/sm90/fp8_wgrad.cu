// The FP8 weight gradients: grad_W[e] (M x N) = A[e]^T . B[e] over each expert's rows (rows as K),
// both operands FP8 column tiles written transposed (K-major), promoted per 128-row block with
// column scales (mainloop_fp8_wgrad.cuh); the BF16 WGRAD's outputs and store epilogue.
#include <cuda_runtime.h>

#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/fp8_gemm_args.hpp"
#include "gemm/sm90/wgrad_common.cuh"

namespace poise::sm90 {
namespace {

void require_column_tiles(const Fp8ColumnTiles& t, const char* values_name, const char* scales_name) {
  require_ptr(t.values_CR, values_name);
  require_ptr(t.scales_BC, scales_name);
  require(reinterpret_cast<uintptr_t>(t.scales_BC) % alignof(float) == 0, scales_name, "must be 4-byte aligned");
}

// A = [M][R] and B = [N][R] column tiles, K = the expert's rows in 128-row blocks.
void wgrad_fp8(const GroupedRows& rows, const Fp8ColumnTiles& a, const char* const a_names[2], int64_t M,
               const Fp8ColumnTiles& b, const char* const b_names[2], int64_t N, const WgradOutput& out,
               cudaStream_t stream) {
  require_column_tiles(a, a_names[0], a_names[1]);
  require_column_tiles(b, b_names[0], b_names[1]);
  require(rows.max_rows % 128 == 0, "rows.max_rows",
          "must be a multiple of 128 (FP8 WGRAD's column tiles hold whole 128-row blocks)");
  if (wgrad_output_without_rows(rows, M, N, out, stream)) return;
  const CUtensorMap map_a = make_fp8_tensor_map(a.values_CR, M, rows.max_rows, kTileM / 2, a_names[0]);
  const CUtensorMap map_b = make_fp8_tensor_map(b.values_CR, N, rows.max_rows, kBlockN / 2, b_names[0]);
  GroupedGemmShape s = base_shape(rows);
  s.m_blocks = ceil_div(M, kTileM);
  s.n_blocks = ceil_div(N, kBlockN);
  s.k_block_rows = 128;
  s.column_scales = {a.scales_BC, b.scales_BC, static_cast<int32_t>(M), static_cast<int32_t>(N)};
  // The deferred bf16 stores share the K loop's registers with the promotion: the staged epilogue only.
  launch<RowsAre::K, false, WgradStoreEpilogue<false>, true>(
      map_a, WeightMaps{map_b, map_b}, s, wgrad_store_epilogue<false>(rows, M, N, out, s.first_replica), stream);
}

}  // namespace

void expert_mlp_wgrad_w2_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const Fp8ColumnTiles& grad_y,
                             const Fp8ColumnTiles& a, const WgradOutput& out, cudaStream_t stream) {
  validate_fp8(rows, shape);
  static const char* const grad_y_names[2] = {"grad_y.values_CR", "grad_y.scales_BC"};
  static const char* const a_names[2] = {"a.values_CR", "a.scales_BC"};
  wgrad_fp8(rows, grad_y, grad_y_names, shape.hidden_dim, a, a_names, shape.intermediate_dim, out, stream);
}

void expert_mlp_wgrad_w13_fp8(const GroupedRows& rows, const ExpertMlpShape& shape, const Fp8ColumnTiles& grad_h13,
                              const Fp8ColumnTiles& x, const WgradOutput& out, cudaStream_t stream) {
  validate_fp8(rows, shape);
  static const char* const grad_h13_names[2] = {"grad_h13.values_CR", "grad_h13.scales_BC"};
  static const char* const x_names[2] = {"x.values_CR", "x.scales_BC"};
  wgrad_fp8(rows, grad_h13, grad_h13_names, 2 * shape.intermediate_dim, x, x_names, shape.hidden_dim, out, stream);
}

}  // namespace poise::sm90
