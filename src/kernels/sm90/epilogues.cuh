// Epilogues of the grouped GEMM: what happens to a warpgroup's 64 x kBlockN fp32 accumulators.
//
// Each is called as store<kBlockN>(acc, tile, consumer, thread) by every consumer thread, with the
// accumulator layout of ptx/wgmma.cuh: d[4j + 2h + c] is tile row 64*consumer + 16*(thread/32)
// + (thread%32)/4 + 8h, column 8j + 2*(thread%4) + c. Rows past the expert's count and columns
// past N are never written (they may hold padding rows or a neighbouring expert's weights).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/sm90/activation.cuh"
#include "kernels/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// Where one thread's accumulators land inside the tile.
struct FragmentCoords {
  int row0;  // tile row of d[..h=0..]; h = 1 adds 8
  int col0;  // tile column of d[4j + ...] minus 8j
  __device__ FragmentCoords(int consumer, int thread)
      : row0(64 * consumer + 16 * (thread / 32) + (thread % 32) / 4), col0(2 * (thread % 4)) {}
};

__device__ __forceinline__ __nv_bfloat162 pack_bf16x2(float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}

// FPROP W13 + SwiGLU. The tile's kBlockN h13 columns give kBlockN/2 activation columns:
//   blocked:     tile columns [0, kBlockN/2) are gate f0 + c, [kBlockN/2, kBlockN) up f0 + c
//   interleaved: tile column 2q is gate f0 + q, 2q + 1 up f0 + q
// Writes a_RF (bf16) and, when h13_R2F is set, h13 (bf16, in W13's row order) for backward.
struct SwigluFpropEpilogue {
  __nv_bfloat16* a_RF;
  __nv_bfloat16* h13_R2F;  // nullable: backward recomputes the forward instead
  int32_t F;
  int32_t interleaved;
  ActivationParams act;

  template <int kBlockN>
  __device__ __forceinline__ void store(const float (&d)[kBlockN / 2], const TileInfo& tile,
                                        int consumer, int thread) const {
    const FragmentCoords fc(consumer, thread);
    const int32_t f0 = tile.n_block * (kBlockN / 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t m = tile.m_block * kTileM + fc.row0 + 8 * h;
      if (m >= tile.row_count) continue;
      const int64_t row = tile.row_begin + m;
      if (!interleaved) {
#pragma unroll
        for (int j = 0; j < kBlockN / 16; ++j) {
          const int32_t f = f0 + 8 * j + fc.col0;
          if (f >= F) continue;
          const float g0 = d[4 * j + 2 * h], g1 = d[4 * j + 2 * h + 1];
          const float u0 = d[4 * (j + kBlockN / 16) + 2 * h], u1 = d[4 * (j + kBlockN / 16) + 2 * h + 1];
          *reinterpret_cast<__nv_bfloat162*>(a_RF + row * F + f) =
              pack_bf16x2(swiglu_forward(g0, u0, act), swiglu_forward(g1, u1, act));
          if (h13_R2F) {
            *reinterpret_cast<__nv_bfloat162*>(h13_R2F + row * 2 * F + f) = pack_bf16x2(g0, g1);
            *reinterpret_cast<__nv_bfloat162*>(h13_R2F + row * 2 * F + F + f) = pack_bf16x2(u0, u1);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const int32_t f = f0 + 4 * j + fc.col0 / 2;
          if (f >= F) continue;
          const float g = d[4 * j + 2 * h], u = d[4 * j + 2 * h + 1];
          a_RF[row * F + f] = __float2bfloat16_rn(swiglu_forward(g, u, act));
          if (h13_R2F)
            *reinterpret_cast<__nv_bfloat162*>(h13_R2F + row * 2 * F + 2 * f) = pack_bf16x2(g, u);
        }
      }
    }
  }
};

// Row-major bf16 store of grouped rows (FPROP W2 -> y_RD, DGRAD W13 -> grad_x_RD), optionally
// scaled per row by an fp32 routing score.
struct RowsStoreEpilogue {
  __nv_bfloat16* out_RN;
  const float* scores_R;  // nullable
  int32_t N;

  template <int kBlockN>
  __device__ __forceinline__ void store(const float (&d)[kBlockN / 2], const TileInfo& tile,
                                        int consumer, int thread) const {
    const FragmentCoords fc(consumer, thread);
    const int32_t n0 = tile.n_block * kBlockN + fc.col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t m = tile.m_block * kTileM + fc.row0 + 8 * h;
      if (m >= tile.row_count) continue;
      const int64_t row = tile.row_begin + m;
      const float scale = scores_R ? scores_R[row] : 1.0f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int32_t n = n0 + 8 * j;
        if (n >= N) continue;
        *reinterpret_cast<__nv_bfloat162*>(out_RN + row * N + n) =
            pack_bf16x2(d[4 * j + 2 * h] * scale, d[4 * j + 2 * h + 1] * scale);
      }
    }
  }
};

// DGRAD W2 + SwiGLU backward. Accumulators hold grad_y . W2 for activation columns f.
// With scores s (the forward scaled y by s): grad_a = s * acc, the wgrad operand is s * a, and
// grad_score[row] += sum_f acc * a (lanes of a row reduce, then one atomic per row and thread quad).
struct SwigluDgradEpilogue {
  const __nv_bfloat16* h13_R2F;  // saved (or recomputed) pre-activation, W13's row order
  __nv_bfloat16* grad_h13_R2F;   // out
  __nv_bfloat16* a_RF;           // out, nullable: s * act(h13), the W2 wgrad operand
  const float* scores_R;         // nullable
  float* grad_scores_R;          // nullable, accumulated atomically (caller zeroes it)
  int32_t F;
  int32_t interleaved;
  ActivationParams act;

  template <int kBlockN>
  __device__ __forceinline__ void store(const float (&d)[kBlockN / 2], const TileInfo& tile,
                                        int consumer, int thread) const {
    const FragmentCoords fc(consumer, thread);
    const int32_t f_base = tile.n_block * kBlockN + fc.col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t m = tile.m_block * kTileM + fc.row0 + 8 * h;
      const bool row_ok = m < tile.row_count;
      const int64_t row = tile.row_begin + m;
      const float s = (row_ok && scores_R) ? scores_R[row] : 1.0f;
      float score_grad = 0.0f;
      if (row_ok) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const int32_t f = f_base + 8 * j;
          if (f >= F) continue;
          float g[2], u[2];
          if (!interleaved) {
            const __nv_bfloat162 gg = *reinterpret_cast<const __nv_bfloat162*>(h13_R2F + row * 2 * F + f);
            const __nv_bfloat162 uu = *reinterpret_cast<const __nv_bfloat162*>(h13_R2F + row * 2 * F + F + f);
            g[0] = __low2float(gg); g[1] = __high2float(gg);
            u[0] = __low2float(uu); u[1] = __high2float(uu);
          } else {
            const uint2 raw = *reinterpret_cast<const uint2*>(h13_R2F + row * 2 * F + 2 * f);
            const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
            const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
            g[0] = __low2float(p0); u[0] = __high2float(p0);
            g[1] = __low2float(p1); u[1] = __high2float(p1);
          }
          float a[2], gg[2], gu[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float acc = d[4 * j + 2 * h + c];
            swiglu_backward(g[c], u[c], s * acc, act, a[c], gg[c], gu[c]);
            score_grad += acc * a[c];
          }
          if (!interleaved) {
            *reinterpret_cast<__nv_bfloat162*>(grad_h13_R2F + row * 2 * F + f) = pack_bf16x2(gg[0], gg[1]);
            *reinterpret_cast<__nv_bfloat162*>(grad_h13_R2F + row * 2 * F + F + f) = pack_bf16x2(gu[0], gu[1]);
          } else {
            uint2 raw;
            *reinterpret_cast<__nv_bfloat162*>(&raw.x) = pack_bf16x2(gg[0], gu[0]);
            *reinterpret_cast<__nv_bfloat162*>(&raw.y) = pack_bf16x2(gg[1], gu[1]);
            *reinterpret_cast<uint2*>(grad_h13_R2F + row * 2 * F + 2 * f) = raw;
          }
          if (a_RF) *reinterpret_cast<__nv_bfloat162*>(a_RF + row * F + f) = pack_bf16x2(s * a[0], s * a[1]);
        }
      }
      if (grad_scores_R) {
        // The 4 lanes of a quad share the row; all lanes take part in the shuffles.
        score_grad += __shfl_xor_sync(0xffffffffu, score_grad, 1);
        score_grad += __shfl_xor_sync(0xffffffffu, score_grad, 2);
        if (row_ok && (thread % 4) == 0) atomicAdd(grad_scores_R + row, score_grad);
      }
    }
  }
};

// WGRAD store: out[e][m][n] for m < M, n < N, fp32 or bf16, overwrite or accumulate.
struct WgradStoreEpilogue {
  void* out_EMN;
  int32_t M;
  int32_t N;
  int32_t out_fp32;
  int32_t accumulate;

  template <int kBlockN>
  __device__ __forceinline__ void store(const float (&d)[kBlockN / 2], const TileInfo& tile,
                                        int consumer, int thread) const {
    const FragmentCoords fc(consumer, thread);
    const int32_t n0 = tile.n_block * kBlockN + fc.col0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t m = tile.m_block * kTileM + fc.row0 + 8 * h;
      if (m >= M) continue;
      const int64_t base = (static_cast<int64_t>(tile.expert) * M + m) * N;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int32_t n = n0 + 8 * j;
        if (n >= N) continue;
        float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
        if (out_fp32) {
          float2* p = reinterpret_cast<float2*>(static_cast<float*>(out_EMN) + base + n);
          if (accumulate) { const float2 old = *p; v0 += old.x; v1 += old.y; }
          *p = make_float2(v0, v1);
        } else {
          __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out_EMN) + base + n);
          if (accumulate) { const __nv_bfloat162 old = *p; v0 += __low2float(old); v1 += __high2float(old); }
          *p = pack_bf16x2(v0, v1);
        }
      }
    }
  }
};

}  // namespace poise::sm90
