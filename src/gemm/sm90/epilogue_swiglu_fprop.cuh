// The FPROP W13 epilogue: SwiGLU, a_RF and h13 out.
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

// FPROP W13 + SwiGLU. The tile's kBlockN h13 columns give kBlockN/2 activation columns:
//   blocked:     tile columns [0, kBlockN/2) are gate f0 + c, [kBlockN/2, kBlockN) up f0 + c
//   interleaved: tile column 2q is gate f0 + q, 2q + 1 up f0 + q
// Writes a_RF (bf16) and, when h13_R2F is set, h13 (bf16, in W13's row order) for backward.
// The layout is a template parameter (a run-time flag made the compiler spill registers).
// Stages in ring stages, one per 64 activation columns: [a][h13 first piece]
// [h13 second piece], each 128 rows x 128 bytes (one 64-row box per consumer warpgroup), all three
// leaving by TMA store without waiting on each other.
template <bool kInterleaved>
struct SwigluFpropEpilogue {
  static constexpr int kDeferredParts = 0;  // stores at the end of its own tile
  static constexpr int kStagingBuffers = 0;
  static constexpr int kRingStages = 2;  // kBlockN / 128 chunks (static_assert in store)
  static constexpr bool kPairedTiles = true;
  static constexpr bool kSkipsEmptySlabs = true;
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
  ExpertBias b13;  // [E, 2F] in W13's row order, added to h13 before the activation

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
    if (b13.enabled()) {
      // Tile column n is W13 row f0 + n (blocked gate), F + f0 + n - kBlockN / 2 (blocked up), or
      // 2 f0 + n (interleaved); past F activation columns there is no bias (and no store).
      add_column_bias(d, fr.quad, b13.row(tile.expert), [&](int n) -> int32_t {
        const int32_t f = f0 + (interleaved ? n / 2 : n % (kBlockN / 2));
        if (f >= F) return -1;
        return interleaved ? 2 * f0 + n : (n < kBlockN / 2 ? f : F + f);
      });
    }
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

// The epilogue of one FPROP W13 launch (host side; BF16 and FP8 operands alike): a_RF, h13 (null:
// not saved) split at h13_split_row's row into args.h13_split.hi_R2F, the shape's activation, b13.
template <bool kInterleaved>
SwigluFpropEpilogue<kInterleaved> swiglu_fprop_epilogue(const GroupedRows& rows, const ExpertMlpShape& shape,
                                                        void* a_RF, void* h13_R2F, const H13Split& h13_split,
                                                        const ExpertBias& b13) {
  const int32_t split = h13_split_row(rows, h13_split);  // checked before any descriptor
  const int64_t F = shape.intermediate_dim;
  SwigluFpropEpilogue<kInterleaved> epi{};
  epi.a_map = make_store_tensor_map(a_RF, false, rows.max_rows, F, "a_RF");
  // The low buffer holds rows [0, split) only: its map must not reach past them.
  if (split > 0) epi.h13_map = make_store_tensor_map(h13_R2F, false, split, 2 * F, "h13_R2F");
  if (split < rows.max_rows)
    epi.h13_hi_map = make_store_tensor_map(h13_split.hi_R2F, false, rows.max_rows, 2 * F, "h13_split.hi_R2F");
  epi.a_RF = bf16(a_RF);
  epi.h13_R2F = bf16(h13_R2F);
  epi.h13_hi_R2F = static_cast<__nv_bfloat16*>(const_cast<void*>(h13_split.hi_R2F));
  epi.h13_split = split;
  epi.F = static_cast<int32_t>(F);
  epi.act = activation_params(shape);
  epi.b13 = b13;
  return epi;
}

}  // namespace poise::sm90
