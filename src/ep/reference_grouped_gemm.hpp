// STAND-IN grouped GEMMs for the staged pipeline: simple, correct, tensor-core (WMMA) tiles of
// 64x64x32 with fp32 accumulation and no pipelining. They exist so the EP data path runs end to
// end before the SM90 wgmma kernels (src/gemm/sm90) land; src/pipeline/expert_compute.cu is the
// one place that chooses them.
//
// Row-grouped GEMM: for every rank and every local expert group g (rows [offsets[g], offsets[g] +
// counts[g]) of the grouped buffer), out_rows = A_rows . B_g with B_g = b + g * b_expert_stride.
// Groups start at multiples of 128 rows, so a 64-row tile never straddles two experts; tiles over
// padding or past the rows in use exit at once (the grid is static, the work is on the device).
// Weight-gradient GEMM: C_g (fp32, [m_dim][n_dim]) (+)= A_g^T . B_g over group g's rows.
#pragma once

#include <cuda_runtime.h>

#include "ep/ep_params.hpp"

namespace poise::ep {

enum class RowGemmKind {
  w13_swiglu,         // A x_R[D], B W13 [2F][D] (gate rows [0,F), up rows [F,2F)): out h13_R2F, out2 a_RF
  w2_forward,         // A a_R[F], B W2 [D][F]: out y_RD
  w2_dgrad_swiglu,    // A grad_y_R[D], B W2 [D][F] (B^T): grad_a -> SwiGLU backward at aux h13: out grad_h13_R2F
  w13_dgrad,          // A grad_h13_R[2F], B W13 [2F][D] (B^T): out grad_x rows [D]
};

struct RowGemmRank {
  const bf16* a = nullptr;
  const bf16* b = nullptr;    // local expert 0's weights
  bf16* out = nullptr;
  bf16* out2 = nullptr;       // w13_swiglu: a_RF
  const bf16* aux = nullptr;  // w2_dgrad_swiglu: h13_R2F
  const int32_t* group_offsets = nullptr;  // [groups+1]
  const int32_t* group_counts = nullptr;   // [groups]
  const int32_t* error_code = nullptr;     // rank's error word: skip the work when nonzero
};

struct RowGemmBatch {
  int ranks = 1;
  int groups = 0;          // E_local
  int capacity_rows = 0;
  int D = 0, F = 0;
  int swiglu_clamped = 0;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;
  RowGemmRank rank[kMaxLaunchRanks];
};

struct WgradRank {
  const bf16* a = nullptr;  // [rows][m_dim]
  const bf16* b = nullptr;  // [rows][n_dim]
  float* c = nullptr;       // [groups][m_dim][n_dim]
  const int32_t* group_offsets = nullptr;
  const int32_t* group_counts = nullptr;
  const int32_t* error_code = nullptr;
};

struct WgradBatch {
  int ranks = 1;
  int groups = 0;
  int m_dim = 0, n_dim = 0;  // multiples of 64
  bool accumulate = false;
  WgradRank rank[kMaxLaunchRanks];
};

void launch_row_grouped_gemm(RowGemmKind kind, const RowGemmBatch& batch, cudaStream_t stream);
void launch_wgrad_grouped_gemm(const WgradBatch& batch, cudaStream_t stream);

}  // namespace poise::ep
