// The expert biases' gradients: per-expert column sums of grouped rows (grad_b13 from grad_h13,
// grad_b2 from score * grad_y) and the bias's part of the routing scores' gradient.
//
// Memory-bound passes over rows the GEMMs wrote; each sum runs in a fixed order (rows in steps of
// the row groups, then the groups in order), so every run gives the same bits.
#include <cuda_bf16.h>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/gemm_args.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::sm90 {
namespace {

constexpr int kRowGroups = 8;                      // warps of a block, each summing every 8th row
constexpr int kColsPerLane = 8;                    // one 16-byte load
constexpr int kBlockCols = 32 * kColsPerLane;      // 256 columns per block
constexpr int kThreads = kRowGroups * 32;
constexpr int kScoreBlocksPerExpert = 32;

// Where an expert's sums go: own experts [0, first_replica) into own_EC (overwritten or added to),
// replicas into replica_EC (overwritten); fp32 or bf16 (rounded once, after the sum).
struct SumTargets {
  void* own_EC;
  void* replica_EC;
  int32_t first_replica;
  int32_t own_fp32, replica_fp32, accumulate;
};

struct ColumnSums {
  const int32_t* row_offsets_E;
  const int32_t* row_counts_E;
  const __nv_bfloat16* in_RC;
  const float* scales_R;  // nullable: 1
  int32_t C;
  SumTargets out;
};

__device__ void store_sum(const SumTargets& t, int32_t e, int32_t C, int32_t col, float sum) {
  const bool replica = e >= t.first_replica;
  const int64_t i = int64_t(replica ? e - t.first_replica : e) * C + col;
  void* base = replica ? t.replica_EC : t.own_EC;
  const bool fp32 = replica ? t.replica_fp32 : t.own_fp32;
  const bool add = !replica && t.accumulate;
  if (fp32) {
    float* p = static_cast<float*>(base) + i;
    *p = add ? *p + sum : sum;
  } else {
    __nv_bfloat16* p = static_cast<__nv_bfloat16*>(base) + i;
    *p = __float2bfloat16_rn(add ? __bfloat162float(*p) + sum : sum);
  }
}

// Block (column block x, expert y): warp g sums rows g, g + 8, ... of the expert over its lane's 8
// columns; the 8 warps' sums are then added in order.
__global__ void __launch_bounds__(kThreads) column_sums_kernel(ColumnSums a) {
  __shared__ float partial[kRowGroups][kBlockCols];
  const int32_t e = blockIdx.y, lane = threadIdx.x % 32, group = threadIdx.x / 32;
  const int32_t first = a.row_offsets_E[e], count = a.row_counts_E[e];
  if (e >= a.out.first_replica && count == 0) return;  // a replica slot without rows: nobody reads it
  const int32_t col = blockIdx.x * kBlockCols + lane * kColsPerLane;
  float acc[kColsPerLane] = {};
  if (col < a.C) {  // C is a multiple of 64: a lane's 8 columns are all inside or all outside
    for (int32_t r = group; r < count; r += kRowGroups) {
      const int64_t row = int64_t(first) + r;
      const uint4 v = *reinterpret_cast<const uint4*>(a.in_RC + row * a.C + col);
      const float s = a.scales_R ? a.scales_R[row] : 1.0f;
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += s * bf16_lo(w[i]);
        acc[2 * i + 1] += s * bf16_hi(w[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) partial[group][lane * kColsPerLane + i] = acc[i];
  __syncthreads();
  const int32_t c = blockIdx.x * kBlockCols + threadIdx.x;
  if (c >= a.C) return;
  float sum = 0.0f;
#pragma unroll
  for (int g = 0; g < kRowGroups; ++g) sum += partial[g][threadIdx.x];
  store_sum(a.out, e, a.C, c, sum);
}

struct BiasScore {
  const int32_t* row_offsets_E;
  const int32_t* row_counts_E;
  const __nv_bfloat16* grad_y_RD;
  ExpertBias b2;
  float* partials_RP;
  int32_t P;  // the bias piece is the last
};

// One warp per row: <grad_y[r], b2[e]> into the row's last score piece (butterfly sum: fixed order).
__global__ void __launch_bounds__(kThreads) bias_score_kernel(BiasScore a) {
  const int32_t e = blockIdx.y, lane = threadIdx.x % 32;
  const int32_t first = a.row_offsets_E[e], count = a.row_counts_E[e], D = a.b2.N;
  const __nv_bfloat16* b = a.b2.row(e);
  for (int32_t r = blockIdx.x * kRowGroups + threadIdx.x / 32; r < count; r += gridDim.x * kRowGroups) {
    const int64_t row = int64_t(first) + r;
    float sum = 0.0f;
    for (int32_t c = lane * kColsPerLane; c < D; c += kBlockCols) {
      const uint4 g = *reinterpret_cast<const uint4*>(a.grad_y_RD + row * D + c);
      const uint4 w = *reinterpret_cast<const uint4*>(b + c);
      const uint32_t gs[4] = {g.x, g.y, g.z, g.w}, ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) sum += bf16_lo(gs[i]) * bf16_lo(ws[i]) + bf16_hi(gs[i]) * bf16_hi(ws[i]);
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
    if (lane == 0) a.partials_RP[row * a.P + a.P - 1] = sum;
  }
}

SumTargets sum_targets(const GroupedRows& rows, const WgradOutput& out) {
  return {out.grad_w, out.replica_grad_w, static_cast<int32_t>(own_experts(rows)), out.dtype == DType::fp32,
          out.replica_dtype == DType::fp32, out.accumulate};
}

void launch_column_sums(const GroupedRows& rows, const void* in_RC, const float* scales_R, int64_t C,
                        const WgradOutput& out, cudaStream_t stream) {
  const ColumnSums a{rows.row_offsets_E, rows.row_counts_E, static_cast<const __nv_bfloat16*>(in_RC), scales_R,
                     static_cast<int32_t>(C), sum_targets(rows, out)};
  const dim3 grid(ceil_div(C, kBlockCols), static_cast<uint32_t>(rows.num_experts));
  column_sums_kernel<<<grid, kThreads, 0, stream>>>(a);
  runtime::cuda_check_launch("column_sums_kernel");
}

void require_sum_targets(const GroupedRows& rows, const WgradOutput& out, const char* name,
                         const char* replica_name) {
  if (own_experts(rows) > 0) require_ptr(out.grad_w, name);
  require_replica_ptr(rows, out.replica_grad_w, replica_name);
}

}  // namespace

void expert_mlp_bias_grads(const GroupedRows& rows, const ExpertMlpShape& shape, const BiasGradArgs& args,
                           cudaStream_t stream) {
  validate(rows, shape);
  require(shape.biased, "shape.biased", "must be set: bias gradients belong to a biased expert MLP");
  require_ptr(args.grad_y_RD, "grad_y_RD");
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  require_sum_targets(rows, args.grad_b13, "grad_b13.grad_w", "grad_b13.replica_grad_w");
  require_sum_targets(rows, args.grad_b2, "grad_b2.grad_w", "grad_b2.replica_grad_w");
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const ExpertBias b2 = args.grad_score_partials_RP
                            ? expert_bias(rows, args.b2_ED, "b2_ED", args.replica_b2_ED, "replica_b2_ED", D)
                            : ExpertBias{};
  launch_column_sums(rows, args.grad_h13_R2F, nullptr, 2 * F, args.grad_b13, stream);
  launch_column_sums(rows, args.grad_y_RD, args.scores_R, D, args.grad_b2, stream);
  if (!args.grad_score_partials_RP) return;
  const BiasScore a{rows.row_offsets_E, rows.row_counts_E, static_cast<const __nv_bfloat16*>(args.grad_y_RD), b2,
                    args.grad_score_partials_RP, static_cast<int32_t>(dgrad_w2_score_partials(shape))};
  bias_score_kernel<<<dim3(kScoreBlocksPerExpert, static_cast<uint32_t>(rows.num_experts)), kThreads, 0, stream>>>(a);
  runtime::cuda_check_launch("bias_score_kernel");
}

}  // namespace poise::sm90
