// Host API of the SM90 expert-MLP kernels: BF16 grouped GEMMs over rows grouped by expert,
// SwiGLU fused into the epilogues, forward and backward.
//
// Grouped rows: every [R, *] buffer holds the rows of all local experts; expert e owns rows
// [row_offsets_E[e], row_offsets_E[e] + row_counts_E[e]). Offsets and counts live on the device
// (no host sync, CUDA-graph capturable). Contract the caller keeps (not checkable on the host):
// offsets are multiples of 128 (kExpertRowAlignment), groups do not overlap, and
// offset + round_up(count, 128) <= max_rows. Rows past an expert's count are padding: never
// written by these kernels and never contributing to weight gradients (their content is ignored).
//
// Every entry point validates its arguments on the host (poise::InvalidArgument naming the
// argument) before launching, enqueues on `stream`, and throws poise::DeviceError on a launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "poise/types.hpp"

namespace poise::sm90 {

struct GroupedRows {
  const int32_t* row_offsets_E = nullptr;  // device int32 [E]
  const int32_t* row_counts_E = nullptr;   // device int32 [E]
  int64_t num_experts = 0;                 // E: 1..1024
  int64_t max_rows = 0;                    // R: rows of every [R, *] buffer
  // EP exact balance: experts [first_replica, num_experts) are replica slots, so one GEMM covers a
  // rank's own experts and its replicas. Their weights come from the replica_* pointers (index
  // e - first_replica) and their weight gradients go to WgradOutput::replica_grad_w, always
  // overwritten; a replica without rows gets no weight-gradient tiles (its target is left as is).
  // -1: no replicas, every expert uses the main pointers.
  int64_t first_replica = -1;
  // Optional device workspace, int32 [2], zero-initialised: the fprop and dgrad GEMMs then take
  // their tiles in order from it, so tiles that read the same weights or rows run together and L2
  // serves them (DeepSeek-V3's fprop W13 read 5.8 instead of 3.8 GB from DRAM without it). Every
  // launch leaves it zero again; launches that share one must be ordered (one stream, or events).
  // Null: the static tile order. POISE_SM90_TILE_ORDER=static ignores it (A/B measurements).
  int32_t* tile_counters = nullptr;
};

struct ExpertMlpShape {
  int64_t hidden_dim = 0;        // D: multiple of 64
  int64_t intermediate_dim = 0;  // F: multiple of 64
  Activation activation = Activation::swiglu;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  W13Layout w13_layout = W13Layout::gate_up_blocked;
};

// h13 split by rows (EP activation records that keep part of a layer): rows [0, split_row) in
// one buffer, rows [split_row, max_rows) in another of max_rows rows (same row index).
// split_row: a multiple of 128 in [0, max_rows], or -1 (one buffer).
struct H13Split {
  int64_t split_row = -1;
  const void* hi_R2F = nullptr;
};

// Streamed rows: the rows operand of FPROP W13 (x_RD) or DGRAD W2 (grad_y_RD) may still be being
// written when the GEMM starts, by a kernel enqueued just before it that publishes each 128-row
// block of the grouped rows once its rows are in place (gather_rows_streamed). The GEMM then does
// not wait for that kernel to finish (programmatic dependent launch): its producer waits per tile
// for the tile's row block, so the copy runs under the GEMM instead of before it. Protocol, in
// `words` (device uint32 [streamed_rows_words(max_rows)], zero-initialised, one per stream):
//   words[0] generation: the GEMM's last CTA adds 1 at its end, so every call leaves it one higher;
//   words[1] the GEMM's CTAs done;  words[2 + b] = generation + 1 once block b's rows are written;
//   words[2 + B + b] the writer's rows done in block b (B = ceil(max_rows / 128); back to 0 once
//   the block is published).
// The writer and the GEMM must be consecutive in one stream; a wait is bounded like every pipeline
// wait (a timed-out one is reported: take_pipeline_fault, streamed_rows). Null: the rows operand is
// complete before the GEMM (stream order), as without streaming.
struct StreamedRows {
  uint32_t* words = nullptr;
};
int64_t streamed_rows_words(int64_t max_rows);

// dst_RD[r] = src_TD[token_of_row_R[r]] for every valid row r (rows past an expert's count are left
// as they are), publishing each row block to `ready` for the streamed GEMM enqueued next, in the
// order that GEMM takes its tiles (expert-major). The rows x_TD -> x_RD of the forward and
// grad_out_TD -> grad_y_RD of the backward. A row whose token is outside [0, tokens) is written as
// zeros and recorded as a device fault (take_pipeline_fault: bad_token). ctas: CTAs that copy
// (1..1024; at most the SM count to overlap): the GEMM's CTAs take the other SMs first and these as
// they finish.
struct RowGather {
  const int32_t* token_of_row_R = nullptr;  // device int32 [R]
  int64_t tokens = 0;                       // T
  int64_t dim = 0;                          // columns (bf16) of a row: multiple of 8
  const void* src_TD = nullptr;             // bf16 [T][dim], 16-byte aligned
  void* dst_RD = nullptr;                   // bf16 [R][dim], 16-byte aligned
  int ctas = 32;  // 16 starved DGRAD W2 at Qwen3 (0.69 vs 0.58 ms with 32, session 19)
};
void gather_rows_streamed(const GroupedRows& rows, const RowGather& gather, const StreamedRows& ready,
                          cudaStream_t stream);

// h13 = x . W13[e]^T, a = act(h13).  x_RD, a_RF, h13_R2F bf16; h13 keeps W13's row order.
struct FpropW13Args {
  const void* x_RD = nullptr;
  const void* w13_E2FD = nullptr;
  void* a_RF = nullptr;
  void* h13_R2F = nullptr;  // nullable: do not save h13 for backward
  const void* replica_w13_E2FD = nullptr;  // with GroupedRows::first_replica
  H13Split h13_split;  // rows past split_row go to h13_split.hi_R2F (written)
  StreamedRows x_ready;  // x_RD streamed in by the kernel before (gather_rows_streamed)
};
void expert_mlp_fprop_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const FpropW13Args& args, cudaStream_t stream);

// A top-k combine fused into a rows GEMM's epilogue (FPROP W2: the layer's output; DGRAD W13:
// grad_x). With out_TD set, the GEMM stores no grouped rows: every valid row's result is added into
// out_TD[token_of_row_R[row]] (bf16 [tokens][D]) by bf16 reductions in L2, so out_TD = what it held +
// the sum over a token's rows. Zero it first for the plain combine, or pass a sum to add to (a
// shared expert's output). A token's additions land in no fixed order and each rounds to bf16 (as
// torch's index_add_ on bf16 does): results are not bitwise reproducible from run to run; the
// separate combine (fp32 sums in k order, e.g. TokenCombine) is.
// Every valid row's token must be in [0, tokens): a row whose token is not is added nowhere and
// recorded as a device fault (take_pipeline_fault: bad_token).
struct FusedCombine {
  void* out_TD = nullptr;                   // bf16 [tokens][D], 16-byte aligned; null: no fused combine
  const int32_t* token_of_row_R = nullptr;  // device int32 [R]
  int64_t tokens = 0;                       // T
};

// Rows scattered to slots instead of stored grouped (the EP pipeline's combine without its copy
// pass): every valid row r is stored whole, unscaled but for scores_R, at
//   owner_bases[o] + slot_offset + s * D * 2 bytes,  o = row_origin_R[r] / slots_per_owner,
//   s = row_origin_R[r] % slots_per_owner,
// the slot of (token, k) in its owner rank's combine buffer, which the owner then sums in k order:
// one writer per slot, no additions, so the combine stays deterministic. owner_bases is read on the
// device (the EP transport's peer table: NVLink addresses only the device knows). A valid row whose
// origin is outside [0, owners * slots_per_owner) is stored nowhere and recorded as a device fault
// (take_pipeline_fault: bad_token).
struct RowScatter {
  const int32_t* row_origin_R = nullptr;  // device int32 [R]; null: no scatter
  char* const* owner_bases = nullptr;     // device [owners] base addresses
  int64_t slot_offset = 0;                // bytes; with the bases and D * 2, 16-byte aligned
  int64_t slots_per_owner = 0;
  int64_t owners = 0;                     // [1, 2^31 / slots_per_owner)
};

// y = (a . W2[e]^T) * score (per row, when scores_R is set), into y_RD, combined by token, or
// scattered to slots.
struct FpropW2Args {
  const void* a_RF = nullptr;
  const void* w2_EDF = nullptr;
  const float* scores_R = nullptr;  // nullable
  void* y_RD = nullptr;             // null when combine.out_TD or scatter.row_origin_R is set
  const void* replica_w2_EDF = nullptr;  // with GroupedRows::first_replica
  FusedCombine combine;
  RowScatter scatter;
};
void expert_mlp_fprop_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const FpropW2Args& args, cudaStream_t stream);

// grad_a = score * (grad_y . W2[e]);  grad_h13 = swiglu_backward(h13, grad_a).
// Also writes score * act(h13) into a_RF (the W2 wgrad operand) and, when grad_score_partials_RP
// is set, the routing score's gradient in P = dgrad_w2_score_partials(shape) pieces per row:
// partials[r][p] = sum over activation columns f of piece p of (grad_y . W2)[r, f] * a[r, f]
// (= <grad_y[r], y[r] / score[r]>). Summing a row's P pieces in order p gives the same bits on
// every run (no atomics); rows past an expert's count are not written.
struct DgradW2Args {
  const void* grad_y_RD = nullptr;
  const void* w2_EDF = nullptr;
  const void* h13_R2F = nullptr;
  const float* scores_R = nullptr;  // nullable
  void* grad_h13_R2F = nullptr;
  void* a_RF = nullptr;             // nullable
  float* grad_score_partials_RP = nullptr;  // nullable, fp32 [R][P]
  const void* replica_w2_EDF = nullptr;  // with GroupedRows::first_replica
  H13Split h13_split;  // rows past split_row are read from h13_split.hi_R2F
  StreamedRows grad_y_ready;  // grad_y_RD streamed in by the kernel before (gather_rows_streamed)
};
void expert_mlp_dgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const DgradW2Args& args, cudaStream_t stream);
// P of DgradW2Args::grad_score_partials_RP: one piece per tile of activation columns.
int64_t dgrad_w2_score_partials(const ExpertMlpShape& shape);

// grad_x = grad_h13 . W13[e].
struct DgradW13Args {
  const void* grad_h13_R2F = nullptr;
  const void* w13_E2FD = nullptr;
  void* grad_x_RD = nullptr;  // null when combine.out_TD or scatter.row_origin_R is set
  const void* replica_w13_E2FD = nullptr;  // with GroupedRows::first_replica
  FusedCombine combine;       // grad_x_TD += the rows' grad_x, by token
  RowScatter scatter;         // or the rows' grad_x to their slots
};
void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const DgradW13Args& args, cudaStream_t stream);

// Weight gradients, fp32 accumulation over each expert's rows; output bf16 or fp32, overwritten
// or accumulated into (an expert with no rows then writes zeros / leaves the target unchanged).
struct WgradOutput {
  void* grad_w = nullptr;  // [E, D, F] for W2, [E, 2F, D] for W13 (W13's row order)
  DType dtype = DType::fp32;
  bool accumulate = false;
  void* replica_grad_w = nullptr;  // with GroupedRows::first_replica: [E - first_replica, ...]
  DType replica_dtype = DType::fp32;
};
// The top-k combine of grouped rows into token rows, run by a WGRAD's idle producer warps while it
// computes (the grad_x combine after DGRAD W13 then costs the backward no pass of its own):
//   out_TD[t] = sum over k of rows_RD[row_of_tk[t * K + k]]  (fp32 in k order, bf16 out), and with
//   partials_RP also sums_TK[t * K + k] = sum over p of partials_RP[row][p]  (p in order; DGRAD W2's
//   routing-score gradient pieces).
// The same bits as summing in that order anywhere else. Its inputs must be complete before the
// WGRAD starts (written by earlier kernels in the stream); rows_RD is [R][hidden_dim].
struct TokenCombine {
  // device int32 [T * K]: valid rows, each at most once. An index outside [0, R) is read nowhere (the
  // piece counts as zeros, its sum as 0) and recorded as a device fault (take_pipeline_fault: bad_row).
  const int32_t* row_of_tk = nullptr;
  int64_t tokens = 0;                  // T
  int64_t top_k = 0;                   // K: 1..16
  const void* rows_RD = nullptr;       // bf16
  void* out_TD = nullptr;              // bf16 [T][hidden_dim]; nullptr: no combine
  const float* partials_RP = nullptr;  // nullable: fp32 [R][partials]
  int64_t partials = 0;
  float* sums_TK = nullptr;            // fp32 [T * K], with partials_RP
};

// grad_W2[e] = grad_y[e]^T . a[e]   (a as written by expert_mlp_dgrad_w2: already score-scaled)
void expert_mlp_wgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const void* grad_y_RD, const void* a_RF, const WgradOutput& out,
                         cudaStream_t stream, const TokenCombine& combine = {});
// grad_W13[e] = grad_h13[e]^T . x[e]
void expert_mlp_wgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const void* grad_h13_R2F, const void* x_RD, const WgradOutput& out,
                          cudaStream_t stream, const TokenCombine& combine = {});

// Whether the grouped GEMMs are launched with programmatic dependent launch (they set up while the
// previous kernel in the stream finishes, then wait for it: ptx/grid_dependency.cuh); false with
// POISE_SM90_PDL=0 (A/B measurements). Kernels launched next to them (the bench glue) follow it.
bool dependent_launch_allowed();
// The launch attribute that asks for it (cudaLaunchAttributeProgrammaticStreamSerialization).
cudaLaunchAttribute dependent_launch_attribute();

// The bound on every pipeline wait of the grouped GEMMs (ns).
inline constexpr uint32_t kPipelineWaitTimeoutNs = 4'000'000'000u;

// A pipeline wait of a grouped GEMM that ran past its bound (ptx/mbarrier.cuh): the launch
// gave up on it and drained instead of hanging, its outputs are garbage, the CUDA context stays
// usable (streamed_rows: the wait was for a streamed row block). Or (bad_token) a fused combine's
// or a streamed gather's row named a token outside [0, tokens), or a row scatter's row a slot
// outside its owners': that row was not added or stored anywhere (combine, scatter) or written as
// zeros (gather), the others were. Or (bad_row) a WGRAD side combine's row_of_tk named a row outside
// [0, R): that piece was read as zeros, the rest combined. The first since the last call; one record
// per device, whichever caller reads it.
struct PipelineFault {
  bool occurred = false;
  bool bad_token = false;   // a token_of_row_R / row_origin_R entry out of range (no barrier: barrier, parity 0)
  bool bad_row = false;     // TokenCombine::row_of_tk out of range (no barrier: barrier, parity 0)
  bool streamed_rows = false;  // a wait for a streamed row block (StreamedRows) timed out (barrier: 0)
  int32_t block = 0;        // CTA of the wait / the row
  int32_t thread = 0;       // its thread
  uint32_t barrier = 0;     // the barrier's shared-memory offset
  uint32_t parity = 0;      // the phase parity it waited for
};
// Waits for `stream`, returns and clears the current device's record.
PipelineFault take_pipeline_fault(cudaStream_t stream);
// The fault in words, by kind (a timed-out wait, a fused combine's bad token, a side combine's bad
// row), with where it was recorded; "" when none occurred.
std::string describe(const PipelineFault& fault);

// Fault injection for tests only: the bound of every wait (ns; default kPipelineWaitTimeoutNs), and a
// stage whose load CTA 0 skips once (its first), so that its consumers wait for a phase that
// never completes. Both stay set until changed.
void set_pipeline_wait_timeout_for_tests(uint32_t timeout_ns);
void drop_first_stage_for_tests(bool drop);

}  // namespace poise::sm90
