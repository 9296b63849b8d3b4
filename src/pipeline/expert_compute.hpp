// The expert MLP of the staged pipeline, over every rank's expert-grouped rows: the SM90 wgmma
// kernels of src/gemm/sm90/expert_mlp.hpp, one launch per rank and GEMM. The rows GEMMs (FPROP W2,
// DGRAD W13) store each output row straight into its owner's combine slot.
#pragma once

#include <cuda_runtime.h>

#include "ep/ep_params.hpp"
#include "gemm/sm90/expert_mlp.hpp"

namespace poise::ep {

// The expert MLP's shape for the SM90 kernels: the layer's, with the call's per-call fields.
sm90::ExpertMlpShape expert_mlp_shape(const EpDims& dims);

// gemm_precision fp8_block_scaled, before dispatch: each rank's tokens x_TD into 1 x 128 FP8 tiles
// (RankScratch::fp8.x_TD, x_scales), the rows the dispatch sends (half the bytes of BF16 rows).
void quantize_tokens_fp8(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);

// recv_x rows -> h13_R2F (saved), a_RF, y rows in the owners' combine slots.
void expert_forward(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);
// The part of the forward its backward needs again (recompute): recv_x rows -> h13_R2F;
// tail_only: only the rows of RankScratch::tail_offsets / tail_counts (a partial record's).
void expert_forward_h13(const EpLaunch& l, const LaunchIo& io, bool tail_only, cudaStream_t stream);

// grad_out rows (recv_grad, unscaled: DGRAD W2 applies the scores) -> grad_h13_R2F, the scores'
// gradient pieces, grad_x rows in the owners' combine slots, grad_w13 / grad_w2 (overwritten or
// accumulated). Experts that received no rows get zero gradients (or keep theirs when accumulating).
void expert_backward(const EpLaunch& l, const LaunchIo& io, bool accumulate_wgrad, cudaStream_t stream);

}  // namespace poise::ep
