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
// Faults only the device can see are recorded in GroupedRows::faults (take_pipeline_fault).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "poise/types.hpp"

namespace poise::sm90 {

// The bound on every pipeline wait of the grouped GEMMs (ns).
inline constexpr uint32_t kPipelineWaitTimeoutNs = 4'000'000'000u;

// Where a launch records its first device fault (a pipeline wait past its bound, a row scatter's
// origin outside its owners' slots), read and cleared by take_pipeline_fault. One word per user
// (an EP context): the faults of different users never mix.
struct FaultWord {
  unsigned long long* word = nullptr;                 // device uint64 [1], zero-initialised
  uint32_t wait_timeout_ns = kPipelineWaitTimeoutNs;  // bound on every pipeline wait
  bool drop_first_stage_for_tests = false;            // fault injection: CTA 0 never loads its first stage
};

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
  // Null: the static tile order.
  int32_t* tile_counters = nullptr;
  FaultWord faults;  // required: faults.word
};

struct ExpertMlpShape {
  int64_t hidden_dim = 0;        // D: multiple of 64
  int64_t intermediate_dim = 0;  // F: multiple of 64
  Activation activation = Activation::swiglu;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  W13Layout w13_layout = W13Layout::gate_up_blocked;
  // Weights as x @ W (gpt-oss): W13[e] is [D][2F] (columns in w13_layout's order), W2[e] is [F][D],
  // read as stored; weight gradients are written in the same layout. false: [2F][D] and [D][F].
  bool weights_transposed = false;
  // Expert biases (b13 / b2 in the fprop args, required then): the score gradient gets one more
  // piece per row (dgrad_w2_score_partials), written by expert_mlp_bias_grads.
  bool biased = false;
};

// h13 split by rows (EP activation records that keep part of a layer): rows [0, split_row) in
// one buffer, rows [split_row, max_rows) in another of max_rows rows (same row index).
// split_row: a multiple of 128 in [0, max_rows], or -1 (one buffer).
struct H13Split {
  int64_t split_row = -1;
  const void* hi_R2F = nullptr;
};

// h13 = x . W13[e]^T + b13[e], a = act(h13).  x_RD, a_RF, h13_R2F bf16; h13 keeps W13's row order.
struct FpropW13Args {
  const void* x_RD = nullptr;
  const void* w13_E2FD = nullptr;
  void* a_RF = nullptr;
  void* h13_R2F = nullptr;  // nullable: do not save h13 for backward
  const void* replica_w13_E2FD = nullptr;  // with GroupedRows::first_replica
  H13Split h13_split;  // rows past split_row go to h13_split.hi_R2F (written)
  const void* b13_E2F = nullptr;          // shape.biased: bf16 [E_own, 2F], W13's row order
  const void* replica_b13_E2F = nullptr;  // shape.biased with GroupedRows::first_replica
};
void expert_mlp_fprop_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const FpropW13Args& args, cudaStream_t stream);

// Rows scattered to slots instead of stored grouped (the EP pipeline's combine without its copy
// pass): every valid row r is stored whole, unscaled but for scores_R, at
//   owner_bases[o] + slot_offset + s * D * 2 bytes,  o = row_origin_R[r] / slots_per_owner,
//   s = row_origin_R[r] % slots_per_owner,
// the slot of (token, k) in its owner rank's combine buffer, which the owner then sums in k order:
// one writer per slot, no additions, so the combine stays deterministic. owner_bases is read on the
// device (the EP transport's peer table: NVLink addresses only the device knows). A valid row whose
// origin is outside [0, owners * slots_per_owner) is stored nowhere and recorded as a device fault
// (take_pipeline_fault: bad_origin).
struct RowScatter {
  const int32_t* row_origin_R = nullptr;  // device int32 [R]; null: no scatter
  char* const* owner_bases = nullptr;     // device [owners] base addresses
  int64_t slot_offset = 0;                // bytes; with the bases and D * 2, 16-byte aligned
  int64_t slots_per_owner = 0;
  int64_t owners = 0;                     // [1, 2^31 / slots_per_owner)
};

// y = (a . W2[e]^T + b2[e]) * score (per row, when scores_R is set), into y_RD or scattered to slots.
struct FpropW2Args {
  const void* a_RF = nullptr;
  const void* w2_EDF = nullptr;
  const float* scores_R = nullptr;  // nullable
  void* y_RD = nullptr;             // null when scatter.row_origin_R is set
  const void* replica_w2_EDF = nullptr;  // with GroupedRows::first_replica
  RowScatter scatter;
  const void* b2_ED = nullptr;          // shape.biased: bf16 [E_own, D]
  const void* replica_b2_ED = nullptr;  // shape.biased with GroupedRows::first_replica
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
};
void expert_mlp_dgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const DgradW2Args& args, cudaStream_t stream);
// P of DgradW2Args::grad_score_partials_RP: one piece per tile of activation columns, and with
// shape.biased one more, the last, that expert_mlp_bias_grads writes.
int64_t dgrad_w2_score_partials(const ExpertMlpShape& shape);

// grad_x = grad_h13 . W13[e].
struct DgradW13Args {
  const void* grad_h13_R2F = nullptr;
  const void* w13_E2FD = nullptr;
  void* grad_x_RD = nullptr;  // null when scatter.row_origin_R is set
  const void* replica_w13_E2FD = nullptr;  // with GroupedRows::first_replica
  RowScatter scatter;         // or the rows' grad_x to their slots
};
void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const DgradW13Args& args, cudaStream_t stream);

// Weight gradients, fp32 accumulation over each expert's rows; output bf16 or fp32, overwritten
// or accumulated into (an expert with no rows then writes zeros / leaves the target unchanged).
struct WgradOutput {
  void* grad_w = nullptr;  // [E, D, F] for W2, [E, 2F, D] for W13 (W13's row order); the weights' layout
  DType dtype = DType::fp32;
  bool accumulate = false;
  void* replica_grad_w = nullptr;  // with GroupedRows::first_replica: [E - first_replica, ...]
  DType replica_dtype = DType::fp32;
};
// grad_W2[e] = grad_y[e]^T . a[e]   (a as written by expert_mlp_dgrad_w2: already score-scaled)
void expert_mlp_wgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const void* grad_y_RD, const void* a_RF, const WgradOutput& out,
                         cudaStream_t stream);
// grad_W13[e] = grad_h13[e]^T . x[e]
void expert_mlp_wgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const void* grad_h13_R2F, const void* x_RD, const WgradOutput& out,
                          cudaStream_t stream);

// The biases' gradients (shape.biased), after expert_mlp_dgrad_w2 wrote grad_h13, fp32 sums over
// each expert's rows in row order (deterministic):
//   grad_b13[e] = sum of grad_h13 rows,  grad_b2[e] = sum of score * grad_y rows,
// and the bias's part of the routing score's gradient, <grad_y[r], b2[e]>, into the last piece of
// grad_score_partials_RP (when set). Outputs as WgradOutput (grad_w: [E_own, 2F] / [E_own, D]).
struct BiasGradArgs {
  const void* grad_y_RD = nullptr;
  const void* grad_h13_R2F = nullptr;
  const float* scores_R = nullptr;  // nullable: score 1
  const void* b2_ED = nullptr;
  const void* replica_b2_ED = nullptr;      // with GroupedRows::first_replica
  float* grad_score_partials_RP = nullptr;  // nullable, fp32 [R][P]
  WgradOutput grad_b13, grad_b2;
};
void expert_mlp_bias_grads(const GroupedRows& rows, const ExpertMlpShape& shape, const BiasGradArgs& args,
                           cudaStream_t stream);

// A pipeline wait of a grouped GEMM that ran past its bound: the launch gave up on it and drained
// instead of hanging, its outputs are garbage, the CUDA context stays usable. Or (bad_origin) a row
// scatter's row named a slot outside its owners': that row was stored nowhere, the others were.
struct PipelineFault {
  bool occurred = false;
  bool bad_origin = false;  // a row_origin_R entry out of range (no barrier: barrier, parity 0)
  int32_t block = 0;        // the CTA that recorded it
  int32_t thread = 0;       // its thread
  uint32_t barrier = 0;     // the barrier's shared-memory offset
  uint32_t parity = 0;      // the phase parity it waited for
};
// Waits for `stream`, returns the fault `faults.word` holds; take_ also clears it.
PipelineFault read_pipeline_fault(const FaultWord& faults, cudaStream_t stream);
PipelineFault take_pipeline_fault(const FaultWord& faults, cudaStream_t stream);
// The fault a fault word's value holds (read elsewhere, e.g. copied to the host by the EP pipeline).
PipelineFault unpack_pipeline_fault(unsigned long long word);
// The fault in words, by kind, with where it was recorded; "" when none occurred.
std::string describe(const PipelineFault& fault);

}  // namespace poise::sm90
