// What the host passes the grouped-GEMM kernels, as plain structs (host and device compilers).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "numerics/host_device.hpp"

namespace poise::sm90 {

inline constexpr int kMaxExperts = 1024;
inline constexpr int kTileM = 128;          // rows of a tile: two consumer warpgroups x 64
inline constexpr int kTileK = 64;           // K elements per pipeline stage
inline constexpr int kBlockN = 256;         // columns of a tile
inline constexpr int kStages = 4;           // 4 stages of 48 KiB leave room for one staging buffer per consumer
inline constexpr int kThreadsPerCta = 384;  // producer warpgroup + two consumer warpgroups

// Which GEMM dimension the expert-grouped rows are: M (fprop, dgrad: A = rows) or K (wgrad:
// the sum runs over an expert's rows).
enum class RowsAre { M, K };

// FP8 block-scaled rows-as-M GEMMs (expert_mlp_fp8.hpp): the fp32 scales of both operands, one per
// 128-wide K block. A: [R][k_blocks] per row; B: [experts][ceil(b_rows_per_expert / 128)][k_blocks]
// per 128 x 128 weight block, the replica experts' (e >= first_replica) at e - first_replica.
struct BlockScales {
  const float* a_RKb = nullptr;
  const float* b_own = nullptr;
  const float* b_replicas = nullptr;
  int32_t k_blocks = 0;  // ceil(K / 128)
  POISE_HD const float* b_expert(int32_t expert, int32_t first_replica, int32_t b_row_blocks) const {
    return expert < first_replica ? b_own + int64_t(expert) * b_row_blocks * k_blocks
                                  : b_replicas + int64_t(expert - first_replica) * b_row_blocks * k_blocks;
  }
};

// FP8 WGRAD (rows as K, both operands transposed column tiles, quant/column_tiles.hpp): one fp32
// scale per 128-row block of the grouped rows and per column of each operand, [row blocks][M] and
// [row blocks][N]; the promotion scales a tile element by its A row's and its B column's.
struct ColumnScales {
  const float* a_BM = nullptr;
  const float* b_BN = nullptr;
  int32_t M = 0, N = 0;
};

// What the scheduler and the producer need to know about one grouped GEMM.
struct GroupedGemmShape {
  const int32_t* row_offsets_E = nullptr;  // device [E]: first row of each expert (multiple of 128)
  const int32_t* row_counts_E = nullptr;   // device [E]: rows of each expert
  int32_t num_experts = 0;
  int32_t m_blocks = 0;          // rows-as-K: ceil(M / 128)
  int32_t n_blocks = 0;          // tiles along N
  int32_t k_blocks = 0;          // rows-as-M: K / 64 (FP8: ceil(K / 128), a stage holding 128 e4m3 of K)
  int32_t k_block_rows = kTileK;  // rows-as-K: rows per stage (FP8: 128, a stage holding 128 e4m3 rows)
  int32_t b_rows_per_expert = 0; // rows-as-M: rows of B's 2D view that belong to one expert
  int32_t b_gate_up_split = 0;   // fprop blocked SwiGLU: gate-to-up distance (F) along B's N; 0 = none
  // Experts [first_replica, num_experts) are replicas: rows-as-M GEMMs read their B block from the
  // kernel's second map at index e - first_replica; rows-as-K GEMMs give a replica without rows
  // no tiles (nobody reads its gradient). num_experts when there are none.
  int32_t first_replica = 0;
  // Rows-as-M GEMMs: device int32 [2] (next tile, claimers done), zero between launches; tiles are
  // then taken in order by whichever cluster is free (tile_queue.cuh). Null: the static order.
  int32_t* tile_counters = nullptr;
  // Where the launch records its first device fault (fault.cuh), and the bound on every wait.
  unsigned long long* fault_word = nullptr;
  uint32_t wait_timeout_ns = 0;
  int32_t drop_first_stage = 0;  // fault injection (tests): CTA 0 never loads its first stage
  BlockScales scales;            // FP8 rows-as-M kernels only
  ColumnScales column_scales;    // FP8 rows-as-K (WGRAD) kernels only
};

// Expert biases (gpt-oss), added to the accumulators before an epilogue's math: bf16 rows of N,
// the own experts' at own_EN, replica experts' (e >= first_replica) at replicas_EN. No bias: null
// (built on the host by gemm_args.hpp's expert_bias).
struct ExpertBias {
  const __nv_bfloat16* own_EN = nullptr;
  const __nv_bfloat16* replicas_EN = nullptr;
  int32_t first_replica = 0;
  int32_t N = 0;
  POISE_HD bool enabled() const { return own_EN != nullptr || replicas_EN != nullptr; }
  POISE_HD const __nv_bfloat16* row(int32_t expert) const {
    return expert < first_replica ? own_EN + int64_t(expert) * N : replicas_EN + int64_t(expert - first_replica) * N;
  }
};

// The SwiGLU variant of the fprop and dgrad epilogues (activation.cuh).
struct ActivationParams {
  int32_t clamped = 0;  // 0: swiglu, 1: swiglu_clamped
  float alpha = 1.702f;
  float limit = 7.0f;
};

}  // namespace poise::sm90
