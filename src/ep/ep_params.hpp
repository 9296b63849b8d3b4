// What the EP data-path kernels take: the layer's dimensions, the byte offsets of the regions of
// the symmetric workspace (identical on every rank), each rank's private buffers and each rank's
// call arguments. Per-rank structs travel by value in the launch, one entry per launch slot.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "comm/transport.hpp"
#include "poise/types.hpp"  // kNoExpert, RoutingStatsOut
#include "balance/balance_cost.cuh"  // BalanceCostRates, and ReplicaPiece (balance_plan_device.cuh)
#include "numerics/block_scaling.hpp"

namespace poise::ep {

using bf16 = __nv_bfloat16;
using comm::kMaxLaunchRanks;

// Tokens one warp ranks in the routing layout (its (token, k) entries, in order).
inline constexpr int kTokensPerChunk = 32;
// Expert groups start at multiples of this many rows (poise::kExpertRowAlignment).
inline constexpr int kGroupAlignment = 128;
// Limits of this implementation (checked on the host).
inline constexpr int kMaxTopK = 32;      // one lane per k
inline constexpr int kMaxExperts = 1024; // per-warp expert counters in shared memory

struct EpDims {
  int32_t T = 0;             // tokens per rank
  int32_t D = 0;             // hidden
  int32_t F = 0;             // expert intermediate
  int32_t K = 0;             // top-k
  int32_t E = 0;             // experts (global)
  int32_t E_local = 0;       // experts per rank
  int32_t world = 1;         // EP ranks
  int32_t capacity_rows = 0; // receive rows per rank, expert padding included
  int32_t groups = 0;        // expert groups per rank: E_local (capacity), E_local + B (exact balance)
  int32_t balanced = 0;      // 1: exact balance (planner, replicas), 0: capacity (every row on its owner)
  int32_t replica_slots = 0; // B: replica slots per rank (exact balance)
  int32_t row_limit = 0;     // U = T*K + tolerance rows: the most rows the planner puts on a rank
  // Config::cost_aware_balance: the planner tries row limits from T*K to row_limit and keeps the
  // plan of least predicted time under these rates (plan::balance_cost_rates).
  int32_t cost_aware = 0;
  plan::shared::BalanceCostRates cost_rates;
  int32_t num_chunks = 0;    // ceil(T / kTokensPerChunk)
  int32_t scores_bf16 = 0;   // scores_TK dtype: 1 bf16, 0 fp32 (per call)
  int32_t w13_interleaved = 0;  // W13 rows: 1 gate/up interleaved, 0 blocked (per call)
  int32_t weights_transposed = 0;  // 1: w13 [E_local][D][2F], w2 [E_local][F][D] (per call)
  int32_t biased = 0;        // 1: expert biases b13, b2 (per call)
  int32_t wgrad_bf16 = 0;    // the call's weight gradients: 1 bf16, 0 fp32 (per backward call: BackwardArgs / Config)
  int32_t replica_grad_bf16 = 0;  // Config::replica_grad_dtype: replica weight gradients travel in bf16
  // Backward: grad_out rows go to the experts unscaled; DGRAD W2 applies the scores and computes
  // the scores' gradients per row in score_partials pieces, which combine-push sums and sends to
  // the owners (grad_scores_TK window region).
  int32_t score_partials = 0;  // P: pieces per row of the scores' gradients (per call)
  int32_t fp8 = 0;  // gemm_precision fp8_block_scaled: the GEMMs take FP8 operands
  // Config::prepared_fp8_weights of an inference context: Fp8Scratch holds the replica slots'
  // weights only (training keeps every group's, for the backward's transposed copies).
  int32_t fp8_weights_prepared = 0;
  int32_t fp8_wgrad = 0;  // Config::fp8_wgrad: the FP8 backward's WGRAD in FP8 too (else BF16)
  int32_t swiglu_clamped = 0;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
};

// Byte offsets inside every rank's symmetric workspace, as core/workspace_layout.hpp lays it out.
// [0, kSignalBytes) holds the signals.
struct WorkspaceOffsets {
  size_t counts_RE = 0;    // int32 [world][E]: rows each rank routes to each expert (all-gathered)
  size_t row_origin = 0;   // int32 [capacity]: src_rank*T*K + t*K + k of each received row
  size_t row_primary = 0;  // int32 [capacity]: the row holding the token's bytes (== own row if it crossed)
  size_t row_score = 0;    // fp32  [capacity]: the routing score of the row's (t, k)
  size_t recv_x = 0;       // bf16  [capacity][D]: dispatched x rows, expert-grouped (saved for backward);
                           // EpDims::fp8: e4m3 [capacity][D], the rows as they crossed
  size_t recv_x_scales = 0;  // EpDims::fp8: fp32 [capacity][D/128], the FP8 rows' scales
  size_t recv_grad = 0;    // bf16  [capacity][D]: dispatched grad_out rows (backward)
  size_t combine = 0;      // bf16  [T*K][D]: expert outputs back at their owner (y, then grad_x rows)
  size_t grad_scores_TK = 0;  // fp32 [T*K]: each (t, k)'s score gradient, from its row's rank (backward)
  size_t clip_counts_G2 = 0;  // u64 [groups][2]: SwiGLU clips counted per expert group (forward, on request)
  // Exact balance only (0 otherwise): replica experts' weights, pushed by their owners during
  // dispatch, and their weight gradients, read by the owners after the backward combine barrier.
  size_t replica_w13 = 0;       // bf16 [B][2F][D]
  size_t replica_w2 = 0;        // bf16 [B][D][F]
  size_t replica_grad_w13 = 0;  // fp32 or bf16 (EpDims::replica_grad_bf16) [B][2F][D] (training)
  size_t replica_grad_w2 = 0;   // fp32 or bf16 [B][D][F]  (training)
  // With expert biases (per call; the regions are always there under exact balance).
  size_t replica_b13 = 0;       // bf16 [B][2F]
  size_t replica_b2 = 0;        // bf16 [B][D]
  size_t replica_grad_b13 = 0;  // fp32 [B][2F] (training)
  size_t replica_grad_b2 = 0;   // fp32 [B][D]  (training)
};

// A rank's FP8 operands of one call (EpDims::fp8; layout::RankBuffers): e4m3 values, fp32 scales.
struct Fp8Scratch {
  uint8_t* x_TD = nullptr;   // [T][D]: the rank's tokens, 1 x 128 tiles, quantized before dispatch
  float* x_scales = nullptr;  // [T][D/128]
  uint8_t* a_RF = nullptr;   // [capacity][F]: the SwiGLU output
  float* a_scales = nullptr;
  uint8_t* w13 = nullptr;    // [groups][2F][D]: own experts', then replica slots' weights, 128 x 128 blocks
                             // (EpDims::fp8_weights_prepared: [B][2F][D], the replica slots' only);
                             // the backward's transposed copy, [groups][D][2F]
  float* w13_scales = nullptr;
  uint8_t* w2 = nullptr;     // [groups][D][F]; the backward's [groups][F][D]
  float* w2_scales = nullptr;
  // Training: the backward's operands (core/workspace_layout.hpp RankBuffers::fp8_grad_tiles ...).
  uint8_t* grad_tiles = nullptr;  // [capacity][max(D, 2F)]: grad_y, then grad_h13, row then column tiles
  float* grad_tile_scales = nullptr;
  uint8_t* activation_tiles = nullptr;  // EpDims::fp8_wgrad: [max(F, D)][capacity]: column tiles of a, then of x
  float* activation_tile_scales = nullptr;
  __nv_bfloat16* wgrad_x_RD = nullptr;  // otherwise [capacity][D]: x's rows dequantized for the BF16 WGRAD
};

// One x row on the wire: BF16 values, or (EpDims::fp8, forward) e4m3 values and then, in their own
// region, fp32 scales per 128 columns (layout::x_row_wire_bytes counts the same bytes).
__host__ __device__ inline size_t x_row_value_bytes(const EpDims& d) { return size_t(d.D) * (d.fp8 ? 1 : 2); }
__host__ __device__ inline size_t x_row_scale_bytes(const EpDims& d) {
  return d.fp8 ? sizeof(float) * size_t(numerics::scale_blocks(d.D)) : 0;
}

// One rank's private device buffers (and where its own workspace and error word are).
struct RankScratch {
  char* workspace = nullptr;            // this rank's symmetric workspace (local address)
  const int32_t* error_code = nullptr;  // this rank's ErrorWord::code
  int32_t* chunk_offsets_CE = nullptr;  // [num_chunks][E] per-chunk counts, then exclusive prefix
  int32_t* dest_row_TK = nullptr;       // [T*K] row of (t, k) on its destination rank (saved)
  int32_t* dest_rank_TK = nullptr;      // [T*K] destination rank of (t, k) (saved)
  int32_t* group_offsets = nullptr;     // [groups+1] first row of each expert group; last = rows used
  int32_t* group_counts = nullptr;      // [groups] rows of each expert group (padding excluded)
  // The balance plan (exact balance; every rank computes the same one from the same counts).
  int32_t* plan_kept_E = nullptr;                   // [E] rows [0, kept) of e stay on its owner
  int32_t* plan_piece_first_E = nullptr;            // [E+1] replica pieces of e: [first[e], first[e+1])
  plan::shared::ReplicaPiece* plan_pieces = nullptr;  // [R*B] sorted by expert, then first row
  int32_t* plan_group_offsets_RG = nullptr;         // [R][groups+1] every rank's group offsets
  int32_t* plan_stats = nullptr;                    // [kPlanStats] see PlanStat
  bf16* h13_R2F = nullptr;              // [capacity][2F] gate | up pre-activations (saved)
  // A partial activation record keeps h13 rows [0, h13_split) in h13_R2F; rows past it live in
  // the working record's h13 (same row index). h13_split = capacity: one buffer.
  bf16* h13_hi_R2F = nullptr;
  int32_t h13_split = 0;
  // Backward from a partial record: each group's rows at or past h13_split (tail_groups kernel).
  int32_t* tail_offsets = nullptr;      // [groups]
  int32_t* tail_counts = nullptr;       // [groups]
  bf16* a_RF = nullptr;                 // [capacity][F] SwiGLU output (saved)
  float* grad_score_partials_RP = nullptr;  // [capacity][score_partials] (backward)
  bf16* grad_h13_R2F = nullptr;         // [capacity][2F] (backward)
  // The SM90 expert GEMMs' tile counters (sm90::GroupedRows::tile_counters), int32 [2], zero
  // between launches; the rank's GEMMs run one after another on the pipeline's stream.
  int32_t* gemm_tile_counters = nullptr;
  unsigned long long* gemm_fault_word = nullptr;  // where this rank's expert GEMMs record a device fault
  Fp8Scratch fp8;  // EpDims::fp8
};

// One rank's call arguments (see poise::ForwardArgs / BackwardArgs).
struct RankIo {
  const bf16* x_TD = nullptr;
  const int32_t* ids_TK = nullptr;
  const void* scores_TK = nullptr;
  const bf16* w13_E2FD = nullptr;
  const bf16* w2_EDF = nullptr;
  // EpDims::fp8, nullable (all four or none): the prepared FP8 weights (ForwardArgs::w13_fp8 ...).
  const uint8_t* w13_fp8 = nullptr;
  const float* w13_fp8_scales = nullptr;
  const uint8_t* w2_fp8 = nullptr;
  const float* w2_fp8_scales = nullptr;
  // Backward, nullable (all four or none): the prepared transposed copies (BackwardArgs::w13_fp8_t ...).
  const uint8_t* w13_fp8_t = nullptr;
  const float* w13_fp8_t_scales = nullptr;
  const uint8_t* w2_fp8_t = nullptr;
  const float* w2_fp8_t_scales = nullptr;
  const bf16* b13_E2F = nullptr;  // EpDims::biased
  const bf16* b2_ED = nullptr;
  bf16* out_TD = nullptr;
  const bf16* grad_out_TD = nullptr;
  bf16* grad_x_TD = nullptr;
  void* grad_scores_TK = nullptr;
  int64_t* clip_counts_E2 = nullptr;  // forward, nullable: [E_local][2] gate / up inputs the clamp clipped
  void* grad_w13_E2FD = nullptr;  // fp32 or bf16 (EpDims::wgrad_bf16)
  void* grad_w2_EDF = nullptr;
  void* grad_b13_E2F = nullptr;  // EpDims::biased; the weight gradients' dtype
  void* grad_b2_ED = nullptr;
};

// What the planner kernel records about its plan (read by tests and the benchmark).
enum PlanStat : int {
  kPlanExact = 0,     // 1 when every rank computes at most row_limit rows
  kPlanMovedRows,     // rows computed away from their owner
  kPlanPieces,        // replica pieces (= replica weight copies)
  kPlanMaxRankRows,   // most rows any rank computes
  kPlanRowLimit,      // the row limit the plan was made with (the cost-aware choice, or row_limit)
  kPlanStats,
};

struct LaunchScratch {
  RankScratch rank[kMaxLaunchRanks];
};
struct LaunchIo {
  RankIo rank[kMaxLaunchRanks];
};

// Everything fixed for the life of a pipeline.
struct EpLaunch {
  const comm::PeerTable* tables = nullptr;  // [launch_ranks]
  int launch_ranks = 1;
  EpDims dims;
  WorkspaceOffsets ws;
  LaunchScratch scratch;
  int num_sms = 0;  // of the device the pipeline runs on (persistent grid sizing)
  // The expert GEMMs' bound on their pipeline waits, and fault injection for tests (each GEMM's CTA 0
  // never loads its first stage). Their fault words: RankScratch::gemm_fault_word.
  uint32_t gemm_wait_timeout_ns = 4'000'000'000u;
  bool gemm_drop_first_stage = false;
  // [launch_ranks] in host-mapped memory: each rank's first fault as the host sees it without a
  // sync (the call-end kernel writes it; reset() clears it).
  struct FaultRecord* fault_records = nullptr;
};

// A rank's fault as the host reads it from mapped memory: its error word, and its expert GEMMs'
// fault word. code == 0 and gemm_fault_word == 0: no fault.
struct FaultRecord {
  comm::ErrorWord error;
  unsigned long long gemm_fault_word = 0;
};

}  // namespace poise::ep
