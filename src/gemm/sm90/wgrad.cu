// The weight gradients: grad_W[e] (M x N) = A[e]^T . B[e] over each expert's rows (rows as K),
// fp32 accumulation, bf16 or fp32 out, overwritten or accumulated into.
#include <cuda_runtime.h>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/wgrad_common.cuh"

namespace poise::sm90 {
namespace {

// A = [R][M] rows, B = [R][N] rows, K = the expert's rows.
void wgrad(const GroupedRows& rows, const void* a_RM, const char* a_name, int64_t M, const void* b_RN,
           const char* b_name, int64_t N, const WgradOutput& out, cudaStream_t stream) {
  require_ptr(a_RM, a_name);
  require_ptr(b_RN, b_name);
  if (wgrad_output_without_rows(rows, M, N, out, stream)) return;
  const CUtensorMap map_a = make_bf16_tensor_map(a_RM, rows.max_rows, M, 64, a_name);
  const CUtensorMap map_b = make_bf16_tensor_map(b_RN, rows.max_rows, N, 64, b_name);
  GroupedGemmShape s = base_shape(rows);
  s.m_blocks = ceil_div(M, kTileM);
  s.n_blocks = ceil_div(N, kBlockN);
  auto run = [&](auto epi) { launch<RowsAre::K, true>(map_a, WeightMaps{map_b, map_b}, s, epi, stream); };
  // Every target bf16 and overwritten: the kernel compiled for that case alone.
  if (wgrad_bf16_overwrite(rows, out)) run(wgrad_store_epilogue<true>(rows, M, N, out, s.first_replica));
  else run(wgrad_store_epilogue<false>(rows, M, N, out, s.first_replica));
}

}  // namespace

// Transposed weights take their gradients transposed too: the same GEMM with A and B swapped.
void expert_mlp_wgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape, const void* grad_y_RD,
                         const void* a_RF, const WgradOutput& out, cudaStream_t stream) {
  validate(rows, shape);
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  if (shape.weights_transposed) wgrad(rows, a_RF, "a_RF", F, grad_y_RD, "grad_y_RD", D, out, stream);
  else wgrad(rows, grad_y_RD, "grad_y_RD", D, a_RF, "a_RF", F, out, stream);
}

void expert_mlp_wgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape, const void* grad_h13_R2F,
                          const void* x_RD, const WgradOutput& out, cudaStream_t stream) {
  validate(rows, shape);
  const int64_t D = shape.hidden_dim, F2 = 2 * shape.intermediate_dim;
  if (shape.weights_transposed) wgrad(rows, x_RD, "x_RD", D, grad_h13_R2F, "grad_h13_R2F", F2, out, stream);
  else wgrad(rows, grad_h13_R2F, "grad_h13_R2F", F2, x_RD, "x_RD", D, out, stream);
}

}  // namespace poise::sm90
