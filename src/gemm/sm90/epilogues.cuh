// Epilogues of the grouped GEMM: what happens to a consumer warpgroup's 64 x kBlockN fp32
// accumulators (layout in ptx/wgmma.cuh). Each epilogue is called by the 128 threads of one
// consumer warpgroup as store<kBlockN>(acc, tile, consumer, thread, staging) and goes through
// shared-memory staging (epilogue_staging.cuh) so global stores are whole 128-byte rows.
// Rows past the expert's count and column chunks past N are never written (they may be padding
// rows or a neighbouring expert's weights). D and F are multiples of 64, so a 64-column chunk is
// either entirely inside N or entirely outside.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/activation.cuh"
#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/epilogue_staging.cuh"
#include "gemm/sm90/phase_profile.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// bf16 row outputs of the plain epilogues (rows, wgrad overwrite) stored straight from registers
// (epilogue_direct.cuh) instead of staged through shared memory.
#ifndef POISE_DIRECT_STORES
#define POISE_DIRECT_STORES 1
#endif

// Accumulating wgrad targets (fp32 or bf16) take each whole staged box by TMA reduce-add, done in
// the memory system, instead of row copies that read the old values back into the SM (0: those
// row copies, for A/B).
#ifndef POISE_WGRAD_TMA_REDUCE
#define POISE_WGRAD_TMA_REDUCE 1
#endif

// Parts the deferred wgrad stores are spread over (one per K block of the next tile; 0: none).
#ifndef POISE_WGRAD_DEFERRED_PARTS
#define POISE_WGRAD_DEFERRED_PARTS 4
#endif

// A/B builds only: the SwiGLU-backward GEMM on 2-CTA clusters (default: 1-CTA launches).
#ifndef POISE_DGRAD_W2_PAIRED
#define POISE_DGRAD_W2_PAIRED false
#endif
// A/B builds only: the SwiGLU-backward GEMM skips all-padding 64-row slabs like the others.
#ifndef POISE_DGRAD_W2_SKIPS_EMPTY_SLABS
#define POISE_DGRAD_W2_SKIPS_EMPTY_SLABS false
#endif
// Steps of the SwiGLU-backward epilogue whose h13 words are loaded ahead of a step's stores (an A/B
// option: 1, 4 and 8 measured, performance.md v19a).
#ifndef POISE_SWIGLU_BWD_LOADS_AHEAD
#define POISE_SWIGLU_BWD_LOADS_AHEAD 2
#endif

// Timing experiments only (never in a shipped build; wrong results): the direct bf16 stores (rows:
// FPROP W2, DGRAD W13; bf16-overwrite WGRAD tiles) do all their work but 1: store nothing (every row
// pointer null, decided at run time so the work stays), 2: store every tile into the output's first
// 64 rows (the same lines stay in L2: what the stores' DRAM traffic costs).
#ifndef POISE_EPILOGUE_STORES_FOR_TIMING
#define POISE_EPILOGUE_STORES_FOR_TIMING 0
#endif
template <class T>
__device__ __forceinline__ T* timing_store_target(T* real, T* base, int64_t row_elems, int64_t col, int slab_row) {
  if constexpr (POISE_EPILOGUE_STORES_FOR_TIMING == 1) return row_elems > 0 ? nullptr : real;
  if constexpr (POISE_EPILOGUE_STORES_FOR_TIMING == 2) return real ? base + slab_row * row_elems + col : nullptr;
  return real;
}

// Where one thread's accumulators sit in its warpgroup's 64-row slab:
// d[4j + 2h + c] is slab row `row + 8h`, column 8j + 2*quad + c.
struct Fragment {
  int row;
  int quad;
  __device__ explicit Fragment(int thread) : row(16 * (thread / 32) + (thread % 32) / 4), quad(thread % 4) {}
};

// Moves accumulators [kFrom, kFrom + kCount) down to [kTo, kTo + kCount). The SwiGLU epilogues
// walk their column chunks in a loop that is not unrolled, reading each chunk at fixed register
// indices and shifting the next chunk into place: unrolling over chunks multiplied their code
// (13k instructions for the backward one, which then ran from a missing instruction cache).
template <int kTo, int kFrom, int kCount, int kN>
__device__ __forceinline__ void move_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) d[kTo + i] = d[kFrom + i];
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Global address of a grouped row (or nullptr when the slab row is past the expert's count).
struct GroupedRowAddress {
  int64_t first_row;  // grouped row of slab row 0
  int32_t valid;      // slab rows [0, valid) belong to the expert
  __device__ GroupedRowAddress(const TileInfo& tile, int consumer) {
    const int32_t m0 = tile.m_block * kTileM + 64 * consumer;
    first_row = tile.row_begin + m0;
    valid = tile.row_count - m0;
  }
  // All 64 slab rows belong to the expert: the slab may be stored as one TMA box.
  __device__ bool whole() const { return valid >= 64; }
  template <class T>
  __device__ uint8_t* at(T* base, int64_t row_elems, int64_t col, int r) const {
    return r < valid ? reinterpret_cast<uint8_t*>(base + (first_row + r) * row_elems + col) : nullptr;
  }
};

// FPROP W13 + SwiGLU. The tile's kBlockN h13 columns give kBlockN/2 activation columns:
//   blocked:     tile columns [0, kBlockN/2) are gate f0 + c, [kBlockN/2, kBlockN) up f0 + c
//   interleaved: tile column 2q is gate f0 + q, 2q + 1 up f0 + q
// Writes a_RF (bf16) and, when h13_R2F is set, h13 (bf16, in W13's row order) for backward.
// The layout is a template parameter (a run-time flag made the compiler spill registers).
// Stages in ring stages (grouped_gemm.cuh), one per 64 activation columns: [a][h13 first piece]
// [h13 second piece], each 128 rows x 128 bytes (one 64-row box per consumer warpgroup), all three
// leaving by TMA store without waiting on each other.
template <bool kInterleaved>
struct SwigluFpropEpilogue {
  static constexpr int kDeferredParts = 0;  // stores at the end of its own tile
  static constexpr int kStagingBuffers = 0;
  static constexpr int kRingStages = 2;  // kBlockN / 128 chunks (static_assert in store)
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kStreamedRows = true;  // its A operand may be streamed in (streamed_rows.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  static constexpr bool interleaved = kInterleaved;
  static constexpr uint32_t kPieceBytes = 2 * kStagingBytes;
  CUtensorMap a_map;    // a_RF, 64 x 64 boxes (tensor_map.hpp)
  CUtensorMap h13_map;  // h13_R2F, when set
  CUtensorMap h13_hi_map;  // h13_hi_R2F: rows >= h13_split
  __nv_bfloat16* a_RF;
  __nv_bfloat16* h13_R2F;  // nullable: backward recomputes the forward instead
  __nv_bfloat16* h13_hi_R2F;  // rows >= h13_split (same row index); unused when h13_split >= rows
  int32_t h13_split;       // a multiple of 128, so a 64-row slab lies on one side
  int32_t F;
  ActivationParams act;

  // Producer: the ring stages carry no operands, they are only staging space.
  template <int kBlockN>
  __device__ __forceinline__ void load_ring_stage(int, const TileInfo&, uint8_t*, uint64_t* full_bar) const {
    ptx::mbarrier_arrive(full_bar);
  }

  // Stages 32 accumulators d[kFirst..kFirst+31] (8 groups = 64 columns) as bf16.
  template <int kFirst, int kN>
  __device__ __forceinline__ static void stage_h13_piece(const float (&d)[kN], const Fragment& fr, uint8_t* buf) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2,
                      bf16x2_bits(d[kFirst + 4 * jj + 2 * h], d[kFirst + 4 * jj + 2 * h + 1]));
  }

  template <int kBlockN, bool kClamped, class Ring>
  __device__ __forceinline__ void store_impl(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                             int thread, const Ring& ring, uint32_t it0) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    const bool whole = rows.whole();
    const int32_t f0 = tile.n_block * (kBlockN / 2);
    constexpr int kUp = kBlockN / 4;  // blocked: first accumulator of the up half
    const bool hi = rows.first_row >= h13_split;
    __nv_bfloat16* const h13 = hi ? h13_hi_R2F : h13_R2F;
    RingStageRelease release;
#pragma unroll 1
    for (int c = 0; c < kBlockN / 128; ++c) {  // 64 activation columns per chunk
      const uint32_t it = it0 + c;
      uint8_t* stage = ring.wait(it);
      const int32_t fc = f0 + 64 * c;
      if (fc < F) {
        uint8_t* buf_a = stage + consumer * kStagingBytes;
        uint8_t* buf_first = buf_a + kPieceBytes;
        uint8_t* buf_second = buf_first + kPieceBytes;
        if constexpr (!interleaved) {  // gate d[0..31], up d[kUp..kUp+31]
#pragma unroll
          for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float a0 = swiglu_forward<kClamped>(d[4 * jj + 2 * h], d[kUp + 4 * jj + 2 * h], act);
              const float a1 = swiglu_forward<kClamped>(d[4 * jj + 2 * h + 1], d[kUp + 4 * jj + 2 * h + 1], act);
              stage_put_u32(buf_a, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2, bf16x2_bits(a0, a1));
            }
          if (h13_R2F) {
            stage_h13_piece<0>(d, fr, buf_first);
            stage_h13_piece<kUp>(d, fr, buf_second);
          }
        } else {  // d[0..63]: group jl holds the (gate, up) pairs of activation columns 4jl + quad
#pragma unroll
          for (int jl = 0; jl < 16; ++jl)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const __nv_bfloat16 b = __float2bfloat16_rn(swiglu_forward<kClamped>(d[4 * jl + 2 * h], d[4 * jl + 2 * h + 1], act));
              stage_put_u16(buf_a, fr.row + 8 * h, (4 * jl + fr.quad) * 2, *reinterpret_cast<const uint16_t*>(&b));
            }
          if (h13_R2F) {
            stage_h13_piece<0>(d, fr, buf_first);
            stage_h13_piece<32>(d, fr, buf_second);
          }
        }
        // h13 columns of the two pieces: gate / up (blocked) or the chunk's two interleaved halves.
        const int32_t cols[3] = {fc, interleaved ? 2 * fc : fc, interleaved ? 2 * fc + 64 : F + fc};
        uint8_t* const bufs[3] = {buf_a, buf_first, buf_second};
        emit_ring_stage(
            consumer, thread, whole, h13_R2F ? 3 : 1,
            [&](int i) {
              ptx::tma_store_2d(i == 0 ? &a_map : hi ? &h13_hi_map : &h13_map, bufs[i], cols[i], rows.first_row);
            },
            [&](int i) {
              staged_copy_out(bufs[i], thread, [&](int r) {
                return i == 0 ? rows.at(a_RF, F, fc, r) : rows.at(h13, 2 * int64_t(F), cols[i], r);
              });
            });
      }
      if constexpr (!interleaved) {
        move_accumulators<0, 32, kUp - 32>(d);
        move_accumulators<kUp, kUp + 32, kUp - 32>(d);
      } else {
        move_accumulators<0, 64, kBlockN / 2 - 64>(d);
      }
      release.done(ring, it, thread, fc < F && whole);
    }
    release.finish(ring, thread);
  }

  template <int kBlockN, class Ring>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, const Ring& ring, uint32_t it) const {
    static_assert(kBlockN / 128 == kRingStages, "one ring stage per 64 activation columns");
    if (act.clamped) store_impl<kBlockN, true>(d, tile, consumer, thread, ring, it);
    else store_impl<kBlockN, false>(d, tile, consumer, thread, ring, it);
  }
};

// Row-major bf16 store of grouped rows (FPROP W2 -> y_RD, DGRAD W13 -> grad_x_RD), optionally
// scaled per row by an fp32 routing score.
struct RowsStoreEpilogue {
  // Stores at the end of its own tile: deferred into the next tile's K blocks like the wgrad stores,
  // it measured 1% slower (performance.md v20d).
  static constexpr int kDeferredParts = 0;
  static constexpr int kStagingBuffers = 1;
  static constexpr int kRingStages = 0;  // stages through its own buffer (grouped_gemm.cuh)
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  CUtensorMap out_map;  // out_RN, 64 x 64 boxes

  __nv_bfloat16* out_RN;
  const float* scores_R;  // nullable
  int32_t N;

  // The score of this thread's two fragment rows (1 without scores or past the expert's rows).
  __device__ __forceinline__ void row_scales(const Fragment& fr, const GroupedRowAddress& rows, float (&scale)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = fr.row + 8 * h;
      scale[h] = (scores_R && r < rows.valid) ? scores_R[rows.first_row + r] : 1.0f;
    }
  }

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    if constexpr (POISE_DIRECT_STORES) {
      store_direct<kBlockN, false>(d, tile, consumer, thread, buf, [&](const GroupedRowAddress& rows, int32_t n_first, int r) {
        return timing_store_target(reinterpret_cast<__nv_bfloat16*>(rows.at(out_RN, N, n_first, r)), out_RN, N, n_first, r);
      });
    } else {
      const Fragment fr(thread);
      const GroupedRowAddress rows(tile, consumer);
      float scale[2];
      row_scales(fr, rows, scale);
      store_staged<kBlockN>(d, tile, consumer, thread, buf, fr, rows, scale);
    }
  }

  // The tile's scored rows from registers (epilogue_direct.cuh): row_at(rows, n_first, r) is the
  // address of column n_first in slab row r (nullptr: not written); kAdd: added there, not stored.
  template <int kBlockN, bool kAdd, class RowAt>
  __device__ __forceinline__ void store_direct(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                               int thread, uint8_t* buf, RowAt&& row_at) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    float scale[2];
    row_scales(fr, rows, scale);
    const int32_t n_first = tile.n_block * kBlockN;
    store_bf16_rows_direct<kBlockN, kAdd>(d, thread, buf, [&](int r) { return row_at(rows, n_first, r); }, scale,
                                          min(kBlockN, N - n_first));
  }

  // The tile's rows to rows named by an index per grouped row (index_R): valid row r goes to
  // row_of(index_R[r]) + n_first (kAdd: added there). An index outside [0, bound) is recorded as a
  // device fault (bad_token) and its row goes nowhere.
  template <int kBlockN, bool kAdd, class RowOf>
  __device__ __forceinline__ void store_indexed(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                                int thread, uint8_t* buf, const int32_t* index_R, int32_t bound,
                                                RowOf&& row_of) const {
    store_direct<kBlockN, kAdd>(d, tile, consumer, thread, buf,
                                [&](const GroupedRowAddress& rows, int32_t n_first, int r) -> __nv_bfloat16* {
                                  if (r >= rows.valid) return nullptr;
                                  const int32_t index = index_R[rows.first_row + r];
                                  if (static_cast<uint32_t>(index) >= static_cast<uint32_t>(bound)) {
                                    ptx::record_fault(ptx::PipelineFaultWord::kBadToken);
                                    return nullptr;
                                  }
                                  return row_of(index) + n_first;
                                });
  }

  template <int kBlockN>
  __device__ __forceinline__ void store_staged(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                               int thread, uint8_t* buf, const Fragment& fr,
                                               const GroupedRowAddress& rows, const float (&scale)[2]) const {
#pragma unroll
    for (int c = 0; c < kBlockN / 64; ++c) {
      const int32_t n0 = tile.n_block * kBlockN + 64 * c;
      if (n0 >= N) break;
      acquire_staging(consumer, thread);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 8 * c + jj;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2,
                        bf16x2_bits(d[4 * j + 2 * h] * scale[h], d[4 * j + 2 * h + 1] * scale[h]));
      }
      emit_staged(buf, consumer, thread, rows.whole(), &out_map, n0, rows.first_row,
                  [&](int r) { return rows.at(out_RN, N, n0, r); });
    }
  }
};

// FPROP W2 with the top-k combine fused: each row's (score-scaled) y is added into token row
// token_of_row_R[row] of out_RN ([tokens][N], bf16) by reductions in L2 instead of being stored as
// a grouped row, so neither the y rows nor a combine pass over them exist (DGRAD W13 likewise for
// grad_x). A token's additions land in no fixed order, each rounded to bf16 (sm90::FusedCombine).
struct RowsCombineEpilogue : RowsStoreEpilogue {
  const int32_t* token_of_row_R;
  int32_t tokens;  // a row whose token is outside [0, tokens) is added nowhere and recorded as a fault

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    store_indexed<kBlockN, true>(d, tile, consumer, thread, buf, token_of_row_R, tokens,
                                 [&](int32_t token) { return out_RN + int64_t(token) * N; });
  }
};

// FPROP W2 / DGRAD W13 with the rows scattered to slots (sm90::RowScatter): each valid row is stored
// whole into slot row_origin_R[row] % slots_per_owner of its owner's buffer, whose base the device
// reads from owner_bases. Plain stores, one writer per slot: the bits of the grouped rows.
struct RowsScatterEpilogue : RowsStoreEpilogue {
  const int32_t* row_origin_R;
  char* const* owner_bases;
  int64_t slot_offset;
  int32_t slots_per_owner;
  int32_t origins;  // owners * slots_per_owner: a row whose origin is outside [0, origins) is stored nowhere

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    store_indexed<kBlockN, false>(d, tile, consumer, thread, buf, row_origin_R, origins, [&](int32_t origin) {
      const int32_t owner = origin / slots_per_owner;
      const int64_t slot = origin - owner * slots_per_owner;
      return reinterpret_cast<__nv_bfloat16*>(owner_bases[owner] + slot_offset) + slot * N;
    });
  }
};

// DGRAD W2 + SwiGLU backward. Accumulators hold grad_y . W2 for activation columns f.
// With scores s (the forward scaled y by s): grad_a = s * acc, the wgrad operand is s * a, and
// the score's gradient piece of (row, tile) = sum_f acc * a over the tile's columns (a quad's lanes
// reduce, then one plain store per row and tile: summed in order later, deterministic).
// The epilogue runs in ring stages (grouped_gemm.cuh), one per 64 activation columns: the producer
// loads the tile's h13 pieces for that chunk (gate / up, or the two halves of the interleaved
// pairs: 128 rows x 128 bytes each) while the mainloop still runs; the gradients overwrite them in
// place, s * a goes to the stage's third 16 KiB, and all three leave by TMA store (row copies for a
// partial slab). Each chunk's stage is released once those stores have read it.
template <bool kInterleaved>
struct SwigluDgradEpilogue {
  static constexpr int kDeferredParts = 0;  // stores at the end of its own tile
  static constexpr int kStagingBuffers = 0;
  static constexpr int kRingStages = 4;  // kBlockN / 64 chunks (static_assert in store)
  // 1-CTA launches (measured with the v12 staging-buffer epilogue at 3 stages: coupling two CTAs'
  // pipelines cost more than the halved B traffic saved, 483 vs 500 TFLOP/s at DeepSeek-V3; with
  // the v14 ring stages, sustained: 534 vs 540 and 373 vs 390 at Qwen3, performance.md v15).
  static constexpr bool kPairedTiles = POISE_DGRAD_W2_PAIRED;
  static constexpr bool kStreamedRows = true;  // its A operand may be streamed in (streamed_rows.cuh)
  // Both warpgroups compute every tile: letting the one with an all-padding slab run ahead made
  // this kernel 7-8% slower at DeepSeek-V3 (three runs; the other GEMMs: within noise or faster),
  // 10% in sustained running (performance.md v15).
  static constexpr bool kSkipsEmptySlabs = POISE_DGRAD_W2_SKIPS_EMPTY_SLABS;
  static constexpr bool interleaved = kInterleaved;
  // Steps whose h13 words are loaded before a step's stores (1..16; see store_impl).
  static constexpr int kLoadsAhead = POISE_SWIGLU_BWD_LOADS_AHEAD;
  static_assert(kLoadsAhead >= 1 && kLoadsAhead <= 16, "loads ahead: 1..16 steps");
  // A chunk's stage: [first piece][second piece][s * a], each 128 rows x 128 bytes (two 64-row
  // boxes, one per consumer warpgroup).
  static constexpr uint32_t kPieceBytes = 2 * kStagingBytes;
  CUtensorMap h13_map;       // h13_R2F rows [0, h13_split), 64 x 64 boxes (loads)
  CUtensorMap h13_hi_map;    // h13_hi_R2F rows [h13_split, rows)
  CUtensorMap grad_h13_map;  // grad_h13_R2F, 64 x 64 boxes
  CUtensorMap a_map;         // a_RF, when set
  int32_t h13_split;                // a multiple of 128: a tile's rows lie on one side
  __nv_bfloat16* grad_h13_R2F;   // out
  __nv_bfloat16* a_RF;           // out, nullable: s * act(h13), the W2 wgrad operand
  const float* scores_R;         // nullable
  float* grad_score_partials_RP;  // nullable: [rows][score_partials], piece n_block of each row
  int32_t score_partials;
  int32_t F;
  ActivationParams act;

  // h13 columns of a chunk's two 128-byte pieces.
  __device__ int32_t first_col(int32_t fc) const { return interleaved ? 2 * fc : fc; }
  __device__ int32_t second_col(int32_t fc) const { return interleaved ? 2 * fc + 64 : F + fc; }

  // Producer: ring stage j of the tile holds chunk j's h13 (nothing past F or on a filler tile).
  template <int kBlockN>
  __device__ __forceinline__ void load_ring_stage(int j, const TileInfo& tile, uint8_t* stage, uint64_t* full_bar) const {
    const int32_t fc = tile.n_block * kBlockN + 64 * j;
    if (!tile.valid || fc >= F) {
      ptx::mbarrier_arrive(full_bar);
      return;
    }
    // A 64-row half wholly past the expert's rows is not loaded (as its A box, grouped_gemm.cuh).
    const int halves = 2 - static_cast<int>(second_box_is_padding(tile));
    ptx::mbarrier_arrive_expect_tx(full_bar, halves * kPieceBytes);
    const int32_t row0 = tile.row_begin + tile.m_block * kTileM;
    const CUtensorMap* map = row0 >= h13_split ? &h13_hi_map : &h13_map;
    for (int half = 0; half < halves; ++half) {
      ptx::tma_load_2d(stage + half * kStagingBytes, map, first_col(fc), row0 + 64 * half, full_bar);
      ptx::tma_load_2d(stage + kPieceBytes + half * kStagingBytes, map, second_col(fc), row0 + 64 * half, full_bar);
    }
  }

  template <int kBlockN, class Ring>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, const Ring& ring, uint32_t it) const {
    static_assert(kBlockN / 64 == kRingStages, "one ring stage per 64-column chunk");
    if (act.clamped) store_impl<kBlockN, true>(d, tile, consumer, thread, ring, it);
    else store_impl<kBlockN, false>(d, tile, consumer, thread, ring, it);
  }

  template <int kBlockN, bool kClamped, class Ring>
  __device__ __forceinline__ void store_impl(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                             int thread, const Ring& ring, uint32_t it0) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    const bool whole = rows.whole();
    const int64_t F2 = 2 * int64_t(F);
    float s[2], score_grad[2] = {0.0f, 0.0f};
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = fr.row + 8 * h;
      row_ok[h] = r < rows.valid;
      s[h] = (scores_R && row_ok[h]) ? scores_R[rows.first_row + r] : 1.0f;
    }
    RingStageRelease release;
    POISE_PHASE(long long t_wait = 0, t_emit = 0;)
#pragma unroll 1
    for (int c = 0; c < kBlockN / 64; ++c) {  // this chunk's accumulators are d[0..31]
      const uint32_t it = it0 + c;
      POISE_PHASE(const long long w0 = clock64();)
      uint8_t* stage = ring.wait(it);
      POISE_PHASE(t_wait += clock64() - w0;)
      const int32_t fc = tile.n_block * kBlockN + 64 * c;
      if (fc < F) {
        uint8_t* buf_first = stage + consumer * kStagingBytes;
        uint8_t* buf_second = buf_first + kPieceBytes;
        uint8_t* buf_a = buf_second + kPieceBytes;
        // Step i = 2 jj + h: fragment row fr.row + 8h, column group jj. lo/hi: blocked (g_f, g_f+1) /
        // (u_f, u_f+1); interleaved (g_f, u_f) / (g_f+1, u_f+1).
        auto lo_buf_of = [&](int i) { return interleaved ? (i / 2 < 4 ? buf_first : buf_second) : buf_first; };
        auto hi_buf_of = [&](int i) { return interleaved ? lo_buf_of(i) : buf_second; };
        auto lo_col_of = [&](int i) {
          return interleaved ? ((16 * (i / 2) + 4 * fr.quad) % 64) * 2 : (8 * (i / 2) + 2 * fr.quad) * 2;
        };
        auto hi_col_of = [&](int i) { return interleaved ? lo_col_of(i) + 4 : lo_col_of(i); };
        auto row_of = [&](int i) { return fr.row + 8 * (i % 2); };
        // The shared-memory accesses are volatile: a step's loads cannot pass the previous step's
        // stores, so the words of the next kLoadsAhead steps are loaded before this step's stores
        // and their math can overlap this one's (loaded in place, the steps ran one after another:
        // Qwen3's dgrad W2 406 vs 417-418 TFLOP/s sustained, performance.md v18f; 2 steps instead
        // of 1: +1%, 4 or 8: no more, v19a).
        uint32_t words_lo[16], words_hi[16];
        auto load_step = [&](int i) {
          words_lo[i] = stage_get_u32(lo_buf_of(i), row_of(i), lo_col_of(i));
          words_hi[i] = stage_get_u32(hi_buf_of(i), row_of(i), hi_col_of(i));
        };
#pragma unroll
        for (int i = 0; i < kLoadsAhead; ++i) load_step(i);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int jj = i / 2, h = i % 2;
          const int row = row_of(i);
          uint8_t* lo_buf = lo_buf_of(i);
          uint8_t* hi_buf = hi_buf_of(i);
          const int lo_col = lo_col_of(i), hi_col = hi_col_of(i);
          if (i + kLoadsAhead < 16) load_step(i + kLoadsAhead);
          const uint32_t lo = words_lo[i], hi = words_hi[i];
          float g[2], u[2];
          if (!interleaved) {
            g[0] = bf16_lo(lo); g[1] = bf16_hi(lo);
            u[0] = bf16_lo(hi); u[1] = bf16_hi(hi);
          } else {
            g[0] = bf16_lo(lo); u[0] = bf16_hi(lo);
            g[1] = bf16_lo(hi); u[1] = bf16_hi(hi);
          }
          float a[2], gg[2], gu[2];
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            const float acc = d[4 * jj + 2 * h + cc];
            swiglu_backward<kClamped>(g[cc], u[cc], s[h] * acc, act, a[cc], gg[cc], gu[cc]);
            if (row_ok[h]) score_grad[h] += acc * a[cc];
          }
          if (!interleaved) {
            stage_put_u32(lo_buf, row, lo_col, bf16x2_bits(gg[0], gg[1]));
            stage_put_u32(hi_buf, row, hi_col, bf16x2_bits(gu[0], gu[1]));
          } else {
            stage_put_u32(lo_buf, row, lo_col, bf16x2_bits(gg[0], gu[0]));
            stage_put_u32(hi_buf, row, hi_col, bf16x2_bits(gg[1], gu[1]));
          }
          stage_put_u32(buf_a, row, (8 * jj + 2 * fr.quad) * 2, bf16x2_bits(s[h] * a[0], s[h] * a[1]));
        }
        POISE_PHASE(const long long m0 = clock64();)
        const int32_t col1 = first_col(fc), col2 = second_col(fc);
        uint8_t* const bufs[3] = {buf_first, buf_second, buf_a};
        const int32_t cols[3] = {col1, col2, fc};
        emit_ring_stage(
            consumer, thread, whole, a_RF ? 3 : 2,
            [&](int i) { ptx::tma_store_2d(i < 2 ? &grad_h13_map : &a_map, bufs[i], cols[i], rows.first_row); },
            [&](int i) {
              staged_copy_out(bufs[i], thread, [&](int r) {
                return i < 2 ? rows.at(grad_h13_R2F, F2, cols[i], r) : rows.at(a_RF, F, fc, r);
              });
            });
        POISE_PHASE(t_emit += clock64() - m0;)
      }
      move_accumulators<0, 32, kBlockN / 2 - 32>(d);
      POISE_PHASE(const long long r0 = clock64();)
      release.done(ring, it, thread, fc < F && whole);
      POISE_PHASE(t_emit += clock64() - r0;)
    }
    POISE_PHASE(const long long f0 = clock64();)
    release.finish(ring, thread);
    POISE_PHASE(t_emit += clock64() - f0;
                if (thread == 0) {
                  atomicAdd(&g_phase_cycles[6], (unsigned long long)t_wait);
                  atomicAdd(&g_phase_cycles[7], (unsigned long long)t_emit);
                })
    if (grad_score_partials_RP) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = score_grad[h];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (row_ok[h] && fr.quad == 0)
          grad_score_partials_RP[(rows.first_row + fr.row + 8 * h) * score_partials + tile.n_block] = v;
      }
    }
  }
};

// WGRAD store: out[e][m][n] for m < M, n < N, fp32 or bf16, overwrite or accumulate. Replica
// experts (e >= first_replica) go to their own target at e - first_replica (always overwritten).
// kBf16Overwrite: every tile's target is bf16 and overwritten (own experts and replicas), the
// common case, compiled on its own: its rows are packed in registers and stored during the next
// tile's first K blocks (PendingRows, epilogue_direct.cuh).
template <bool kBf16Overwrite>
struct WgradStoreEpilogue {
  static constexpr int kStagingBuffers = 1;
  static constexpr int kDeferredParts = kBf16Overwrite ? POISE_WGRAD_DEFERRED_PARTS : 0;
  static constexpr int kRingStages = 0;  // stages through its own buffer (grouped_gemm.cuh)
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  CUtensorMap out_map;      // out viewed as [E*M][N]; boxes of 64 rows x 128 bytes (overwrite only)
  CUtensorMap replica_map;  // the replicas' target, same boxes

  void* out_EMN;
  int32_t M;
  int32_t N;
  int32_t out_fp32;
  int32_t accumulate;
  void* replica_out_EMN;
  int32_t replica_fp32;
  int32_t first_replica;  // num_experts when there are none

  // Where a consumer warpgroup's 64 rows of a tile go: the replica's or the own target, its first
  // row in the [E*M][N] view, and how many of the 64 rows are below M.
  struct Slab {
    bool replica;
    int64_t first;
    int32_t valid;
  };
  __device__ __forceinline__ Slab slab(const TileInfo& tile, int consumer) const {
    const bool replica = tile.expert >= first_replica;
    const int32_t m0 = tile.m_block * kTileM + 64 * consumer;
    return {replica, int64_t(tile.expert - (replica ? first_replica : 0)) * M + m0, M - m0};
  }
  // The direct bf16 stores' row(r): column n_first of slab row r, nullptr past M.
  __device__ __forceinline__ auto bf16_rows(const Slab& s, int32_t n_first) const {
    __nv_bfloat16* const out = static_cast<__nv_bfloat16*>(s.replica ? replica_out_EMN : out_EMN);
    return [this, s, out, n_first](int r) {
      return timing_store_target(r < s.valid ? out + (s.first + r) * N + n_first : nullptr, out, N, n_first, r);
    };
  }

  // kBf16Overwrite: packs the tile for the kernel to store during the next tile's mainloop.
  template <int kBlockN>
  __device__ __forceinline__ void store(const float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf, PendingRows<kBlockN>& pending) const {
    const int32_t n_first = tile.n_block * kBlockN;
    pending.pack(d, thread, buf, bf16_rows(slab(tile, consumer), n_first), min(kBlockN, N - n_first), N);
  }

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    const Fragment fr(thread);
    const Slab sl = slab(tile, consumer);
    const bool replica = sl.replica;
    const CUtensorMap* map = replica ? &replica_map : &out_map;
    void* const target = replica ? replica_out_EMN : out_EMN;
    const bool accumulate = replica ? false : this->accumulate != 0;
    const int64_t first = sl.first;
    const int32_t valid = sl.valid;
    if (replica ? replica_fp32 : out_fp32) {
      float* out = static_cast<float*>(target);
#pragma unroll 1
      for (int c = 0; c < kBlockN / 32; ++c) {  // 32 fp32 columns = 128 bytes per chunk; d[0..15]
        const int32_t n0 = tile.n_block * kBlockN + 32 * c;
        if (n0 >= N) break;
        acquire_staging(consumer, thread);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = jj;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            stage_put_f32x2(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 4, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
        auto dst = [&](int r) { return r < valid ? reinterpret_cast<uint8_t*>(out + (first + r) * N + n0) : nullptr; };
        emit_staged_add(buf, consumer, thread, accumulate, POISE_WGRAD_TMA_REDUCE, valid, map, n0, first, dst,
                        [](uint4 v, uint4 o) {
                          return make_uint4(__float_as_uint(__uint_as_float(v.x) + __uint_as_float(o.x)),
                                            __float_as_uint(__uint_as_float(v.y) + __uint_as_float(o.y)),
                                            __float_as_uint(__uint_as_float(v.z) + __uint_as_float(o.z)),
                                            __float_as_uint(__uint_as_float(v.w) + __uint_as_float(o.w)));
                        });
        move_accumulators<0, 16, kBlockN / 2 - 16>(d);
      }
    } else if (POISE_DIRECT_STORES && !accumulate) {
      // The direct stores pass through the staging buffer too: an earlier tile's TMA stores (fp32
      // or accumulated targets in this kernel) may still be reading it.
      acquire_staging(consumer, thread);
      const int32_t n_first = tile.n_block * kBlockN;
      const float one[2] = {1.0f, 1.0f};
      store_bf16_rows_direct<kBlockN>(d, thread, buf, bf16_rows(sl, n_first), one, min(kBlockN, N - n_first));
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(target);
#pragma unroll 1
      for (int c = 0; c < kBlockN / 64; ++c) {  // d[0..31]
        const int32_t n0 = tile.n_block * kBlockN + 64 * c;
        if (n0 >= N) break;
        acquire_staging(consumer, thread);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = jj;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2, bf16x2_bits(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
        }
        auto dst = [&](int r) { return r < valid ? reinterpret_cast<uint8_t*>(out + (first + r) * N + n0) : nullptr; };
        emit_staged_add(buf, consumer, thread, accumulate, POISE_WGRAD_TMA_REDUCE, valid, map, n0, first, dst,
                        [](uint4 v, uint4 o) {
                          uint32_t in[4] = {v.x, v.y, v.z, v.w}, old[4] = {o.x, o.y, o.z, o.w}, res[4];
#pragma unroll
                          for (int i = 0; i < 4; ++i)
                            res[i] = bf16x2_bits(bf16_lo(in[i]) + bf16_lo(old[i]), bf16_hi(in[i]) + bf16_hi(old[i]));
                          return make_uint4(res[0], res[1], res[2], res[3]);
                        });
        move_accumulators<0, 32, kBlockN / 2 - 32>(d);
      }
    }
  }
};

}  // namespace poise::sm90
