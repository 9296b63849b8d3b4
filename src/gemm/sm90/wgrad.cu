// The weight gradients: grad_W[e] (M x N) = A[e]^T . B[e] over each expert's rows (rows as K),
// fp32 accumulation, bf16 or fp32 out, overwritten or accumulated into.
#include <cuda_runtime.h>

#include "gemm/sm90/epilogue_wgrad.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"

namespace poise::sm90 {
namespace {

// A = [R][M] rows, B = [R][N] rows, K = the expert's rows.
void wgrad(const GroupedRows& rows, const void* a_RM, const char* a_name, int64_t M, const void* b_RN,
           const char* b_name, int64_t N, const WgradOutput& out, cudaStream_t stream) {
  require_ptr(a_RM, a_name);
  require_ptr(b_RN, b_name);
  require_ptr(out.grad_w, "grad_w");
  const int64_t own = own_experts(rows), replicas = replica_experts(rows);
  require_replica_ptr(rows, out.replica_grad_w, "replica_grad_w");
  if (rows.max_rows == 0) {  // no rows anywhere: own experts get zeros (or keep theirs), replicas nothing
    if (!out.accumulate && own > 0) {
      const size_t bytes = own * M * N * (out.dtype == DType::fp32 ? 4 : 2);
      check_cuda(cudaMemsetAsync(out.grad_w, 0, bytes, stream), "cudaMemsetAsync(grad_w)");
    }
    return;
  }
  const CUtensorMap map_a = make_bf16_tensor_map(a_RM, rows.max_rows, M, 64, a_name);
  const CUtensorMap map_b = make_bf16_tensor_map(b_RN, rows.max_rows, N, 64, b_name);
  GroupedGemmShape s = base_shape(rows);
  s.m_blocks = ceil_div(M, kTileM);
  s.n_blocks = ceil_div(N, kBlockN);
  const bool fp32 = out.dtype == DType::fp32, replica_fp32 = out.replica_dtype == DType::fp32;
  auto run = [&](auto epi) {
    epi.out_map = make_store_tensor_map(own > 0 ? out.grad_w : nullptr, fp32, own * M, N, "grad_w");
    epi.replica_map = make_store_tensor_map(replicas > 0 ? out.replica_grad_w : nullptr, replica_fp32, replicas * M,
                                            N, "replica_grad_w");
    epi.out_EMN = out.grad_w;
    epi.M = static_cast<int32_t>(M);
    epi.N = static_cast<int32_t>(N);
    epi.out_fp32 = fp32 ? 1 : 0;
    epi.accumulate = out.accumulate ? 1 : 0;
    epi.replica_out_EMN = out.replica_grad_w;
    epi.replica_fp32 = replica_fp32 ? 1 : 0;
    epi.first_replica = s.first_replica;
    launch<RowsAre::K, true>(map_a, WeightMaps{map_b, map_b}, s, epi, stream);
  };
  // Every target bf16 and overwritten: the kernel compiled for that case alone.
  const bool bf16_overwrite = (own == 0 || (!fp32 && !out.accumulate)) && (replicas == 0 || !replica_fp32);
  if (bf16_overwrite) run(WgradStoreEpilogue<true>{});
  else run(WgradStoreEpilogue<false>{});
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
