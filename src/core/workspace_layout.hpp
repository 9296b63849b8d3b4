// The one description of the device memory the staged EP pipeline holds per rank: every region of
// the symmetric workspace (the window peers write into, same offsets on every rank) and every
// private buffer of a rank. The pipeline allocates exactly this and points its kernels at these
// offsets; the memory planner (plan_memory) sums it. Host only: sizes are plain bytes (bf16 2,
// fp32 4), no CUDA types.
#pragma once

#include <cstdint>
#include <vector>

#include "poise/config.hpp"
#include "poise/memory_plan.hpp"

namespace poise::layout {

// Sizes owned by the layers above, as plain numbers (src/pipeline checks them against its types).
inline constexpr int64_t kSignalBytes = 512;       // comm::kSignalBytes: signal words at offset 0
inline constexpr int64_t kReplicaPieceBytes = 20;  // sizeof(plan::shared::ReplicaPiece)
inline constexpr int64_t kPlanStats = 5;           // ep::kPlanStats
inline constexpr int64_t kTokensPerChunk = 32;     // ep::kTokensPerChunk
// DGRAD W2 writes each row's score gradient in one piece per tile of activation columns; its tiles
// are at least this wide, so F / kScorePieceColumns pieces always fit, plus one for expert biases.
inline constexpr int64_t kScorePieceColumns = 64;
inline constexpr int64_t kRegionAlignment = 256;  // every region starts on, and is padded to, 256 B

struct Region {
  int64_t offset = 0;  // from the start of its block (the workspace, or the rank's buffers)
  int64_t bytes = 0;   // padding to kRegionAlignment included; 0: the region does not exist
};

// What the pipeline keeps besides one call's working memory.
struct Keep {
  int64_t replica_slots = 0;        // B: replica expert slots per rank (exact balance)
  int64_t whole_records = 0;        // activation records keeping layout, x rows and h13
  int64_t light_records = 0;        // keeping layout and h13 (backward sends the x rows again)
  int64_t partial_records = 0;      // keeping layout and h13 of their first partial_record_rows rows
  int64_t partial_record_rows = 0;  // a multiple of kExpertRowAlignment
};

// Window regions of a record that keeps its received rows (the working record, whole records).
struct RecordRows {
  Region row_origin;   // int32 [capacity]: src_rank * T*K + t*K + k of each received row
  Region row_primary;  // int32 [capacity]: the row holding the token's bytes
  Region row_score;    // fp32  [capacity]: the routing score of the row's (t, k)
  Region recv_x;       // bf16  [capacity][D]: dispatched x rows, expert-grouped (gemm_precision
                       // fp8_block_scaled: e4m3 [capacity][D], as they crossed the wire)
  Region recv_x_scales;  // fp32 [capacity][D/128]: the FP8 rows' scales (fp8_block_scaled only)
  int64_t bytes() const {
    return row_origin.bytes + row_primary.bytes + row_score.bytes + recv_x.bytes + recv_x_scales.bytes;
  }
};

// The symmetric workspace.
struct Window {
  Region signals;                   // kSignalBytes at offset 0
  Region counts_RE;                 // int32 [R][E]: all-gathered routed counts
  std::vector<RecordRows> records;  // [1 + whole_records]: the working record's, then each whole record's
  Region recv_grad;                 // bf16 [capacity][D]: dispatched grad_out rows (training)
  Region combine;                   // bf16 [T*K][D]: expert outputs at their owner (y, then grad_x rows)
  Region grad_scores_TK;            // fp32 [T*K]: score gradients pushed home (training)
  Region clip_counts_G2;            // u64 [groups][2]: SwiGLU clips per group
  Region replica_w13;               // bf16 [B][2F][D] (exact balance)
  Region replica_w2;                // bf16 [B][D][F]
  Region replica_grad_w13;          // fp32 [B][2F][D] (exact balance, training)
  Region replica_grad_w2;           // fp32 [B][D][F]
  Region replica_b13, replica_b2;            // bf16 [B][2F], [B][D]: expert biases (exact balance)
  Region replica_grad_b13, replica_grad_b2;  // fp32 [B][2F], [B][D] (exact balance, training)
  int64_t bytes = 0;
  int64_t replica_bytes() const {
    return replica_w13.bytes + replica_w2.bytes + replica_grad_w13.bytes + replica_grad_w2.bytes +
           replica_b13.bytes + replica_b2.bytes + replica_grad_b13.bytes + replica_grad_b2.bytes;
  }
};

// One record's private buffers: its routing layout (and balance plan), and h13.
struct RecordBuffers {
  Region dest_row_TK;            // int32 [T*K]
  Region dest_rank_TK;           // int32 [T*K]
  Region group_offsets;          // int32 [groups + 1]
  Region group_counts;           // int32 [groups]
  Region plan_kept_E;            // int32 [E] (exact balance: the plan)
  Region plan_piece_first_E;     // int32 [E + 1]
  Region plan_pieces;            // ReplicaPiece [max(1, R*B)]
  Region plan_group_offsets_RG;  // int32 [R][groups + 1]
  Region plan_stats;             // int32 [kPlanStats]
  Region h13_R2F;                // bf16 [rows][2F]: capacity rows, or a partial record's rows
  int64_t layout_bytes() const;  // everything but h13
  int64_t bytes() const { return layout_bytes() + h13_R2F.bytes; }
};

// FP8 operand tiles: e4m3 values and their fp32 scales.
struct Fp8Tiles {
  Region values, scales;
  int64_t bytes() const { return values.bytes + scales.bytes; }
};

// A rank's private buffers: one allocation.
struct RankBuffers {
  std::vector<RecordBuffers> records;  // [1 + whole + light + partial], in that order
  Region chunk_offsets_CE;             // int32 [ceil(T / kTokensPerChunk)][E]
  Region tail_offsets;                 // int32 [groups]
  Region tail_counts;                  // int32 [groups]
  Region a_RF;                         // bf16 [capacity][F]
  Region grad_score_partials_RP;       // fp32 [capacity][score_partials] (training)
  Region grad_h13_R2F;                 // bf16 [capacity][2F] (training)
  Region gemm_tile_counters;           // int32 [2]
  Region gemm_fault_word;              // u64 [1]: the expert GEMMs' device fault (sm90::FaultWord)
  // gemm_precision fp8_block_scaled: each call's FP8 operands (docs/fp8.md), e4m3 values and fp32
  // scales per 128 of K: the rank's tokens (quantized once, before dispatch) and the SwiGLU output,
  // 1 x 128 tiles; every group's weights (own experts, then replica slots; the replica slots only
  // with Config::prepared_fp8_weights in an inference context), 128 x 128 blocks; the backward
  // writes the weights' transposed copies there. Training: the backward's operand tiles.
  Region fp8_x_TD, fp8_x_scales;      // u8 [T][D], fp32 [T][D/128]
  Region fp8_a_RF, fp8_a_scales;      // u8 [capacity][F], fp32 [capacity][F/128]
  Region fp8_w13, fp8_w13_scales;     // u8 [groups][2F][D], fp32 [groups][2F/128][D/128]
  Region fp8_w2, fp8_w2_scales;       // u8 [groups][D][F], fp32 [groups][D/128][F/128]
  // [capacity] rows of up to max(D, 2F) values: row tiles of grad_y, then of grad_h13 (DGRAD),
  // then (Config::fp8_wgrad) column tiles of grad_y, then of grad_h13 (WGRAD).
  Fp8Tiles fp8_grad_tiles;
  // Config::fp8_wgrad: [capacity] rows of up to max(F, D) values: column tiles of a, then of x.
  Fp8Tiles fp8_activation_tiles;
  // Otherwise bf16 [capacity][D]: x's FP8 rows dequantized for the BF16 WGRAD of W13.
  Region wgrad_x_RD;
  int64_t bytes = 0;
  int64_t fp8_bytes() const {
    return fp8_x_TD.bytes + fp8_x_scales.bytes + fp8_a_RF.bytes + fp8_a_scales.bytes + fp8_w13.bytes +
           fp8_w13_scales.bytes + fp8_w2.bytes + fp8_w2_scales.bytes + fp8_grad_tiles.bytes() +
           fp8_activation_tiles.bytes() + wgrad_x_RD.bytes;
  }
};

struct WorkspaceLayout {
  int64_t groups = 0;          // expert groups per rank: E_local + B
  int64_t row_limit = 0;       // exact balance: the most rows a rank computes
  int64_t capacity_rows = 0;   // receive rows per rank, expert padding included
  int64_t score_partials = 0;  // room per row for DGRAD W2's score-gradient pieces
  Window window;
  RankBuffers buffers;
};

// T*K + floor(balance_tolerance * T*K): the most rows exact balance puts on a rank; with the
// cost-aware plan (Config::cost_aware_balance) at least ceil(receive_capacity_factor * T*K).
int64_t row_limit(const Config& config);
// `routed` rows in `groups` expert groups, each group starting on a kExpertRowAlignment row.
int64_t padded_rows(int64_t routed, int64_t groups);
// Receive rows per rank: exact balance, the row limit padded over E_local + B groups; capacity, the
// ceil(receive_capacity_factor * T*K) rows padded over E_local groups.
int64_t capacity_rows(const Config& config, int64_t ep_size, int64_t replica_slots);
// Bytes of one x row on the wire: BF16 values, or (fp8_block_scaled) e4m3 values and their fp32
// scales per 128 columns.
int64_t x_row_wire_bytes(const Config& config);
// Bytes of `rows` received rows kept whole in the window (metadata and x rows), and of their h13.
int64_t record_rows_bytes(const Config& config, int64_t rows);
int64_t h13_bytes(const Config& config, int64_t rows);

// Every region for a valid config (Config::validate) and what the pipeline keeps.
WorkspaceLayout workspace_layout(const Config& config, int64_t ep_size, const Keep& keep);

// What a Context's pipeline keeps: its plan's replica slots and every activation slot's records.
Keep keep_of(const MemoryPlan& plan);

}  // namespace poise::layout
