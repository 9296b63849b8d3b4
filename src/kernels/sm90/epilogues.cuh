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

#include "kernels/sm90/activation.cuh"
#include "kernels/sm90/epilogue_staging.cuh"
#include "kernels/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

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

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
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
template <bool kInterleaved>
struct SwigluFpropEpilogue {
  static constexpr int kStagingBuffers = 1;
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  static constexpr bool interleaved = kInterleaved;
  CUtensorMap a_map;    // a_RF, 64 x 64 boxes (tensor_map.hpp)
  CUtensorMap h13_map;  // h13_R2F, when set
  CUtensorMap h13_hi_map;  // h13_hi_R2F: rows >= h13_split
  __nv_bfloat16* a_RF;
  __nv_bfloat16* h13_R2F;  // nullable: backward recomputes the forward instead
  __nv_bfloat16* h13_hi_R2F;  // rows >= h13_split (same row index); unused when h13_split >= rows
  int32_t h13_split;       // a multiple of 128, so a 64-row slab lies on one side
  int32_t F;
  ActivationParams act;

  // Nothing to prefetch before the mainloop.
  template <int kBlockN>
  __device__ __forceinline__ void begin_tile(const TileInfo&, int, int, uint8_t*) const {}

  // Stages 32 accumulators d[kFirst..kFirst+31] (8 groups = 64 columns) as bf16 and writes them
  // to h13 column `col` of the warpgroup's rows.
  template <int kFirst, int kN>
  __device__ __forceinline__ void store_h13_piece(const float (&d)[kN], const Fragment& fr, const GroupedRowAddress& rows,
                                                  int64_t col, int consumer, int thread, uint8_t* buf) const {
    acquire_staging(consumer, thread);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2,
                      pack_bf16x2(d[kFirst + 4 * jj + 2 * h], d[kFirst + 4 * jj + 2 * h + 1]));
    const bool hi = rows.first_row >= h13_split;
    emit_staged(buf, consumer, thread, rows.whole(), hi ? &h13_hi_map : &h13_map, static_cast<int32_t>(col),
                rows.first_row, [&](int r) { return rows.at(hi ? h13_hi_R2F : h13_R2F, 2 * int64_t(F), col, r); });
  }

  template <int kBlockN, bool kClamped>
  __device__ __forceinline__ void store_impl(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                             int thread, uint8_t* buf) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    const int32_t f0 = tile.n_block * (kBlockN / 2);
    constexpr int kUp = kBlockN / 4;  // blocked: first accumulator of the up half
#pragma unroll 1
    for (int c = 0; c < kBlockN / 128; ++c) {  // 64 activation columns per chunk
      const int32_t fc = f0 + 64 * c;
      if (fc >= F) break;
      acquire_staging(consumer, thread);
      if constexpr (!interleaved) {  // gate d[0..31], up d[kUp..kUp+31]
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float a0 = swiglu_forward<kClamped>(d[4 * jj + 2 * h], d[kUp + 4 * jj + 2 * h], act);
            const float a1 = swiglu_forward<kClamped>(d[4 * jj + 2 * h + 1], d[kUp + 4 * jj + 2 * h + 1], act);
            stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2, pack_bf16x2(a0, a1));
          }
      } else {  // d[0..63]: group jl holds the (gate, up) pairs of activation columns 4jl + quad
#pragma unroll
        for (int jl = 0; jl < 16; ++jl)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const __nv_bfloat16 b = __float2bfloat16_rn(swiglu_forward<kClamped>(d[4 * jl + 2 * h], d[4 * jl + 2 * h + 1], act));
            stage_put_u16(buf, fr.row + 8 * h, (4 * jl + fr.quad) * 2, *reinterpret_cast<const uint16_t*>(&b));
          }
      }
      emit_staged(buf, consumer, thread, rows.whole(), &a_map, fc, rows.first_row,
                  [&](int r) { return rows.at(a_RF, F, fc, r); });
      if constexpr (!interleaved) {
        if (h13_R2F) {
          store_h13_piece<0>(d, fr, rows, fc, consumer, thread, buf);
          store_h13_piece<kUp>(d, fr, rows, int64_t(F) + fc, consumer, thread, buf);
        }
        move_accumulators<0, 32, kUp - 32>(d);
        move_accumulators<kUp, kUp + 32, kUp - 32>(d);
      } else {
        if (h13_R2F) {
          store_h13_piece<0>(d, fr, rows, 2 * int64_t(fc), consumer, thread, buf);
          store_h13_piece<32>(d, fr, rows, 2 * int64_t(fc) + 64, consumer, thread, buf);
        }
        move_accumulators<0, 64, kBlockN / 2 - 64>(d);
      }
    }
  }

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    if (act.clamped) store_impl<kBlockN, true>(d, tile, consumer, thread, buf);
    else store_impl<kBlockN, false>(d, tile, consumer, thread, buf);
  }
};

// Row-major bf16 store of grouped rows (FPROP W2 -> y_RD, DGRAD W13 -> grad_x_RD), optionally
// scaled per row by an fp32 routing score.
struct RowsStoreEpilogue {
  static constexpr int kStagingBuffers = 1;
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  CUtensorMap out_map;  // out_RN, 64 x 64 boxes
  // Nothing to prefetch before the mainloop.
  template <int kBlockN>
  __device__ __forceinline__ void begin_tile(const TileInfo&, int, int, uint8_t*) const {}

  __nv_bfloat16* out_RN;
  const float* scores_R;  // nullable
  int32_t N;

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = fr.row + 8 * h;
      scale[h] = (scores_R && r < rows.valid) ? scores_R[rows.first_row + r] : 1.0f;
    }
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
                        pack_bf16x2(d[4 * j + 2 * h] * scale[h], d[4 * j + 2 * h + 1] * scale[h]));
      }
      emit_staged(buf, consumer, thread, rows.whole(), &out_map, n0, rows.first_row,
                  [&](int r) { return rows.at(out_RN, N, n0, r); });
    }
  }
};

// DGRAD W2 + SwiGLU backward. Accumulators hold grad_y . W2 for activation columns f.
// With scores s (the forward scaled y by s): grad_a = s * acc, the wgrad operand is s * a, and
// the score's gradient piece of (row, tile) = sum_f acc * a over the tile's columns (a quad's lanes
// reduce, then one plain store per row and tile: summed in order later, deterministic).
// Per 64-column chunk, h13's two 128-byte pieces (gate / up, or the two halves of the interleaved
// pairs) arrive in staging buffers by cp.async (chunk 0 during the mainloop, via begin_tile),
// the gradients overwrite them in place, s * a goes to the third buffer, and all three are
// copied out as whole rows.
template <bool kInterleaved>
struct SwigluDgradEpilogue {
  static constexpr int kStagingBuffers = 3;
  // 1-CTA launches: at 3 stages, coupling two CTAs' pipelines cost more than the halved B
  // traffic saved (measured: 483 vs 500 TFLOP/s at DeepSeek-V3, 304 vs 325 at Qwen3).
  static constexpr bool kPairedTiles = false;
  // Both warpgroups compute every tile: letting the one with an all-padding slab run ahead made
  // this kernel 7-8% slower at DeepSeek-V3 (three runs; the other GEMMs: within noise or faster).
  static constexpr bool kSkipsEmptySlabs = false;
  static constexpr bool interleaved = kInterleaved;
  CUtensorMap grad_h13_map;  // grad_h13_R2F, 64 x 64 boxes
  CUtensorMap a_map;         // a_RF, when set
  const __nv_bfloat16* h13_R2F;  // saved pre-activation, W13's row order
  const __nv_bfloat16* h13_hi_R2F;  // rows >= h13_split (same row index)
  int32_t h13_split;                // a multiple of 128
  __nv_bfloat16* grad_h13_R2F;   // out
  __nv_bfloat16* a_RF;           // out, nullable: s * act(h13), the W2 wgrad operand
  const float* scores_R;         // nullable
  float* grad_score_partials_RP;  // nullable: [rows][score_partials], piece n_block of each row
  int32_t score_partials;
  int32_t F;
  ActivationParams act;

  // h13 columns of a chunk's two 128-byte pieces.
  __device__ int64_t first_col(int32_t fc) const { return interleaved ? 2 * int64_t(fc) : fc; }
  __device__ int64_t second_col(int32_t fc) const { return interleaved ? 2 * int64_t(fc) + 64 : int64_t(F) + fc; }

  __device__ void fetch_h13(uint8_t* buf, const GroupedRowAddress& rows, int32_t fc, int thread) const {
    const int64_t F2 = 2 * int64_t(F);
    const __nv_bfloat16* h13 = rows.first_row >= h13_split ? h13_hi_R2F : h13_R2F;
    auto src = [&](int64_t col) {
      return [&, col](int r) -> const uint8_t* {
        return r < rows.valid ? reinterpret_cast<const uint8_t*>(h13 + (rows.first_row + r) * F2 + col) : nullptr;
      };
    };
    staged_fetch_async(buf, thread, src(first_col(fc)));
    staged_fetch_async(buf + kStagingBytes, thread, src(second_col(fc)));
    ptx::cp_async_commit();
  }

  // Chunk 0's h13 is fetched before the mainloop so its latency hides behind the wgmmas.
  template <int kBlockN>
  __device__ __forceinline__ void begin_tile(const TileInfo& tile, int consumer, int thread, uint8_t* buf) const {
    const int32_t fc = tile.n_block * kBlockN;
    acquire_staging(consumer, thread);  // the previous tile's stores are done with the buffers
    if (fc < F) fetch_h13(buf, GroupedRowAddress(tile, consumer), fc, thread);
  }

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    if (act.clamped) store_impl<kBlockN, true>(d, tile, consumer, thread, buf);
    else store_impl<kBlockN, false>(d, tile, consumer, thread, buf);
  }

  template <int kBlockN, bool kClamped>
  __device__ __forceinline__ void store_impl(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                             int thread, uint8_t* buf) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    uint8_t* buf_first = buf;
    uint8_t* buf_second = buf + kStagingBytes;
    uint8_t* buf_a = buf + 2 * kStagingBytes;
    const int64_t F2 = 2 * int64_t(F);
    float s[2], score_grad[2] = {0.0f, 0.0f};
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = fr.row + 8 * h;
      row_ok[h] = r < rows.valid;
      s[h] = (scores_R && row_ok[h]) ? scores_R[rows.first_row + r] : 1.0f;
    }
#pragma unroll 1
    for (int c = 0; c < kBlockN / 64; ++c) {  // this chunk's accumulators are d[0..31]
      const int32_t fc = tile.n_block * kBlockN + 64 * c;
      if (fc >= F) break;
      if (c > 0) {
        acquire_staging(consumer, thread);  // the previous chunk's stores are done
        fetch_h13(buf, rows, fc, thread);
      }
      ptx::cp_async_wait_all();
      consumer_warpgroup_sync(consumer);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = fr.row + 8 * h;
          // lo/hi: blocked (g_f, g_f+1) / (u_f, u_f+1); interleaved (g_f, u_f) / (g_f+1, u_f+1).
          uint8_t* lo_buf = interleaved ? (jj < 4 ? buf_first : buf_second) : buf_first;
          uint8_t* hi_buf = interleaved ? lo_buf : buf_second;
          const int lo_col = interleaved ? ((16 * jj + 4 * fr.quad) % 64) * 2 : (8 * jj + 2 * fr.quad) * 2;
          const int hi_col = interleaved ? lo_col + 4 : lo_col;
          const uint32_t lo = stage_get_u32(lo_buf, row, lo_col);
          const uint32_t hi = stage_get_u32(hi_buf, row, hi_col);
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
            const float acc = d[4 * j + 2 * h + cc];
            swiglu_backward<kClamped>(g[cc], u[cc], s[h] * acc, act, a[cc], gg[cc], gu[cc]);
            if (row_ok[h]) score_grad[h] += acc * a[cc];
          }
          if (!interleaved) {
            stage_put_u32(lo_buf, row, lo_col, pack_bf16x2(gg[0], gg[1]));
            stage_put_u32(hi_buf, row, hi_col, pack_bf16x2(gu[0], gu[1]));
          } else {
            stage_put_u32(lo_buf, row, lo_col, pack_bf16x2(gg[0], gu[0]));
            stage_put_u32(hi_buf, row, hi_col, pack_bf16x2(gg[1], gu[1]));
          }
          stage_put_u32(buf_a, row, (8 * jj + 2 * fr.quad) * 2, pack_bf16x2(s[h] * a[0], s[h] * a[1]));
        }
      }
      const int64_t col1 = first_col(fc), col2 = second_col(fc);
      const bool whole = rows.whole();
      emit_staged(buf_first, consumer, thread, whole, &grad_h13_map, static_cast<int32_t>(col1), rows.first_row,
                  [&](int r) { return rows.at(grad_h13_R2F, F2, col1, r); });
      emit_staged(buf_second, consumer, thread, whole, &grad_h13_map, static_cast<int32_t>(col2), rows.first_row,
                  [&](int r) { return rows.at(grad_h13_R2F, F2, col2, r); });
      if (a_RF)
        emit_staged(buf_a, consumer, thread, whole, &a_map, fc, rows.first_row,
                    [&](int r) { return rows.at(a_RF, F, fc, r); });
      move_accumulators<0, 32, kBlockN / 2 - 32>(d);
    }
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
struct WgradStoreEpilogue {
  static constexpr int kStagingBuffers = 1;
  static constexpr bool kPairedTiles = true;  // 2-CTA clusters with multicast (grouped_gemm.cuh)
  static constexpr bool kSkipsEmptySlabs = true;  // an all-padding 64-row slab is skipped (grouped_gemm.cuh)
  CUtensorMap out_map;      // out viewed as [E*M][N]; boxes of 64 rows x 128 bytes (overwrite only)
  CUtensorMap replica_map;  // the replicas' target, same boxes
  // Nothing to prefetch before the mainloop.
  template <int kBlockN>
  __device__ __forceinline__ void begin_tile(const TileInfo&, int, int, uint8_t*) const {}

  void* out_EMN;
  int32_t M;
  int32_t N;
  int32_t out_fp32;
  int32_t accumulate;
  void* replica_out_EMN;
  int32_t replica_fp32;
  int32_t first_replica;  // num_experts when there are none

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    const Fragment fr(thread);
    const bool replica = tile.expert >= first_replica;
    const CUtensorMap* map = replica ? &replica_map : &out_map;
    void* const target = replica ? replica_out_EMN : out_EMN;
    const bool accumulate = replica ? false : this->accumulate != 0;
    const int32_t m0 = tile.m_block * kTileM + 64 * consumer;
    const int64_t first = int64_t(tile.expert - (replica ? first_replica : 0)) * M + m0;
    const int32_t valid = M - m0;
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
        if (accumulate) {
          consumer_warpgroup_sync(consumer);
          staged_combine_out(buf, thread, dst, [](uint4 v, uint4 o) {
            return make_uint4(__float_as_uint(__uint_as_float(v.x) + __uint_as_float(o.x)),
                              __float_as_uint(__uint_as_float(v.y) + __uint_as_float(o.y)),
                              __float_as_uint(__uint_as_float(v.z) + __uint_as_float(o.z)),
                              __float_as_uint(__uint_as_float(v.w) + __uint_as_float(o.w)));
          });
        } else {
          emit_staged(buf, consumer, thread, valid >= 64, map, n0, first, dst);
        }
        move_accumulators<0, 16, kBlockN / 2 - 16>(d);
      }
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
            stage_put_u32(buf, fr.row + 8 * h, (8 * jj + 2 * fr.quad) * 2, pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
        }
        auto dst = [&](int r) { return r < valid ? reinterpret_cast<uint8_t*>(out + (first + r) * N + n0) : nullptr; };
        if (accumulate) {
          consumer_warpgroup_sync(consumer);
          staged_combine_out(buf, thread, dst, [](uint4 v, uint4 o) {
            uint32_t in[4] = {v.x, v.y, v.z, v.w}, old[4] = {o.x, o.y, o.z, o.w}, res[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
              res[i] = pack_bf16x2(bf16_lo(in[i]) + bf16_lo(old[i]), bf16_hi(in[i]) + bf16_hi(old[i]));
            return make_uint4(res[0], res[1], res[2], res[3]);
          });
        } else {
          emit_staged(buf, consumer, thread, valid >= 64, map, n0, first, dst);
        }
        move_accumulators<0, 32, kBlockN / 2 - 32>(d);
      }
    }
  }
};

}  // namespace poise::sm90
