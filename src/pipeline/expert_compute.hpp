// The expert MLP of the staged pipeline, over every rank's expert-grouped rows.
// THE one place that picks the GEMM kernels: the stand-in WMMA kernels of
// src/ep/reference_grouped_gemm.hpp or the SM90 wgmma kernels of src/gemm/sm90/expert_mlp.hpp.
#pragma once

#include <cuda_runtime.h>

#include "ep/ep_params.hpp"

namespace poise::ep {

enum class ExpertKernels {
  standin,  // src/ep/reference_grouped_gemm.cu: simple, one launch for all ranks
  sm90,     // src/gemm/sm90 (poise::sm90::expert_mlp_*): one launch per rank and GEMM
};
const char* to_string(ExpertKernels k);

// recv_x rows -> h13_R2F (saved), a_RF, y rows in rows_out_RD.
void expert_forward(const EpLaunch& l, const LaunchIo& io, ExpertKernels kernels, cudaStream_t stream);
// The part of the forward its backward needs again (recompute): recv_x rows -> h13_R2F (SM90 only);
// tail_only: only the rows of RankScratch::tail_offsets / tail_counts (a partial record's).
void expert_forward_h13(const EpLaunch& l, const LaunchIo& io, ExpertKernels kernels, bool tail_only,
                        cudaStream_t stream);

// grad_out rows (recv_grad; SM90: scores applied in DGRAD W2) -> grad_h13_R2F, grad_x rows in rows_out_RD, grad_w13 / grad_w2 (fp32, overwritten or
// accumulated). Experts that received no rows get zero gradients (or keep theirs when accumulating).
void expert_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate_wgrad, ExpertKernels kernels,
                     cudaStream_t stream);

}  // namespace poise::ep
