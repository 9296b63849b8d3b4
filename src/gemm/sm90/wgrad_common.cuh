// Host side shared by the BF16 and FP8 WGRAD launches (wgrad.cu, fp8_wgrad.cu): the no-rows case
// and the store epilogue's setup for a WgradOutput.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/sm90/epilogue_wgrad.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/gemm_args.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"

namespace poise::sm90 {

// The output checks; true when no expert has rows anywhere: then the own experts' gradients are
// zeroed (or kept, accumulating), replicas get nothing, and no GEMM runs.
inline bool wgrad_output_without_rows(const GroupedRows& rows, int64_t M, int64_t N, const WgradOutput& out,
                                      cudaStream_t stream) {
  require_ptr(out.grad_w, "grad_w");
  require_replica_ptr(rows, out.replica_grad_w, "replica_grad_w");
  if (rows.max_rows != 0) return false;
  const int64_t own = own_experts(rows);
  if (!out.accumulate && own > 0) {
    const size_t bytes = own * M * N * (out.dtype == DType::fp32 ? 4 : 2);
    check_cuda(cudaMemsetAsync(out.grad_w, 0, bytes, stream), "cudaMemsetAsync(grad_w)");
  }
  return true;
}

// Every target bf16 and overwritten: the store epilogue compiled for that case alone can be used.
inline bool wgrad_bf16_overwrite(const GroupedRows& rows, const WgradOutput& out) {
  const bool fp32 = out.dtype == DType::fp32, replica_fp32 = out.replica_dtype == DType::fp32;
  return (own_experts(rows) == 0 || (!fp32 && !out.accumulate)) && (replica_experts(rows) == 0 || !replica_fp32);
}

// The store epilogue of an M x N weight gradient per expert into `out`.
template <bool kBf16Overwrite>
WgradStoreEpilogue<kBf16Overwrite> wgrad_store_epilogue(const GroupedRows& rows, int64_t M, int64_t N,
                                                        const WgradOutput& out, int32_t first_replica) {
  const int64_t own = own_experts(rows), replicas = replica_experts(rows);
  const bool fp32 = out.dtype == DType::fp32, replica_fp32 = out.replica_dtype == DType::fp32;
  WgradStoreEpilogue<kBf16Overwrite> epi{};
  epi.out_map = make_store_tensor_map(own > 0 ? out.grad_w : nullptr, fp32, own * M, N, "grad_w");
  epi.replica_map =
      make_store_tensor_map(replicas > 0 ? out.replica_grad_w : nullptr, replica_fp32, replicas * M, N, "replica_grad_w");
  epi.out_EMN = out.grad_w;
  epi.M = static_cast<int32_t>(M);
  epi.N = static_cast<int32_t>(N);
  epi.out_fp32 = fp32 ? 1 : 0;
  epi.accumulate = out.accumulate ? 1 : 0;
  epi.replica_out_EMN = out.replica_grad_w;
  epi.replica_fp32 = replica_fp32 ? 1 : 0;
  epi.first_replica = first_replica;
  return epi;
}

}  // namespace poise::sm90
