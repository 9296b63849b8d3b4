// The DGRAD W2 epilogue: the SwiGLU backward, grad_h13, the wgrad operand and the scores' gradients.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/activation.cuh"
#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/epilogue_staging.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/gemm_args.hpp"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/tma.cuh"
#include "gemm/sm90/tensor_map.hpp"

namespace poise::sm90 {

// DGRAD W2 + SwiGLU backward. Accumulators hold grad_y . W2 for activation columns f.
// With scores s (the forward scaled y by s): grad_a = s * acc, the wgrad operand is s * a, and
// the score's gradient piece of (row, tile) = sum_f acc * a over the tile's columns (a quad's lanes
// reduce, then one plain store per row and tile: summed in order later, deterministic).
// The epilogue runs in ring stages, one per 64 activation columns: the producer
// loads the tile's h13 pieces for that chunk (gate / up, or the two halves of the interleaved
// pairs: 128 rows x 128 bytes each) while the mainloop still runs; the gradients overwrite them in
// place, s * a goes to the stage's third 16 KiB, and all three leave by TMA store (row copies for a
// partial slab). Each chunk's stage is released once those stores have read it.
template <bool kInterleaved>
struct SwigluDgradEpilogue {
  static constexpr int kDeferredParts = 0;  // stores at the end of its own tile
  static constexpr int kStagingBuffers = 0;
  static constexpr int kRingStages = 4;  // kBlockN / 64 chunks (static_assert in store)
  // 1-CTA launches: coupling two CTAs' pipelines cost more than the halved B traffic saved
  // (534 vs 540 TFLOP/s at DeepSeek-V3, 373 vs 390 at Qwen3, sustained).
  static constexpr bool kPairedTiles = false;
  // Both warpgroups compute every tile: letting the one with an all-padding slab run ahead made
  // this kernel 7-10% slower at DeepSeek-V3.
  static constexpr bool kSkipsEmptySlabs = false;
  static constexpr bool interleaved = kInterleaved;
  // Steps whose h13 words are loaded before a step's stores (see store_impl).
  static constexpr int kLoadsAhead = 2;
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
    // A 64-row half wholly past the expert's rows is not loaded (as its A box, producer.cuh).
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
#pragma unroll 1
    for (int c = 0; c < kBlockN / 64; ++c) {  // this chunk's accumulators are d[0..31]
      const uint32_t it = it0 + c;
      uint8_t* stage = ring.wait(it);
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
        // and their math can overlap this one's (loaded in place, the steps ran one after another,
        // 3% slower at Qwen3; 2 steps ahead gained 1% over 1, 4 or 8 no more).
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
      }
      move_accumulators<0, 32, kBlockN / 2 - 32>(d);
      release.done(ring, it, thread, fc < F && whole);
    }
    release.finish(ring, thread);
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

// The epilogue of one DGRAD W2 launch (host side; BF16 and FP8 operands alike), from the outputs and
// inputs DgradW2Args names (h13 split at h13_split_row's row into h13_split.hi_R2F).
template <bool kInterleaved>
SwigluDgradEpilogue<kInterleaved> swiglu_dgrad_epilogue(const GroupedRows& rows, const ExpertMlpShape& shape,
                                                        const void* h13_R2F, const H13Split& h13_split,
                                                        void* grad_h13_R2F, void* a_RF, const float* scores_R,
                                                        float* grad_score_partials_RP) {
  const int32_t split = h13_split_row(rows, h13_split);  // checked before any descriptor
  const int64_t F = shape.intermediate_dim;
  SwigluDgradEpilogue<kInterleaved> epi{};
  // h13 is read by the producer in 64 x 64 boxes; the low buffer's map must not reach past its rows.
  if (split > 0) epi.h13_map = make_bf16_tensor_map(h13_R2F, split, 2 * F, 64, "h13_R2F");
  if (split < rows.max_rows)
    epi.h13_hi_map = make_bf16_tensor_map(h13_split.hi_R2F, rows.max_rows, 2 * F, 64, "h13_split.hi_R2F");
  epi.grad_h13_map = make_store_tensor_map(grad_h13_R2F, false, rows.max_rows, 2 * F, "grad_h13_R2F");
  epi.a_map = make_store_tensor_map(a_RF, false, rows.max_rows, F, "a_RF");
  epi.h13_split = split;
  epi.grad_h13_R2F = bf16(grad_h13_R2F);
  epi.a_RF = bf16(a_RF);
  epi.scores_R = scores_R;
  epi.grad_score_partials_RP = grad_score_partials_RP;
  epi.score_partials = static_cast<int32_t>(dgrad_w2_score_partials(shape));
  epi.F = static_cast<int32_t>(F);
  epi.act = activation_params(shape);
  return epi;
}

}  // namespace poise::sm90
