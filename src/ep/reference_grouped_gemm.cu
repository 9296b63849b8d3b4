// STAND-IN grouped GEMMs (see reference_grouped_gemm.hpp). Correct first, not fast: synchronous
// tile loads into shared memory, 4 warps each computing a 32x32 WMMA sub-tile, fp32 accumulators
// spilled to shared memory for the epilogue.
#include <mma.h>

#include "runtime/cuda_check.hpp"
#include "ep/rank_view.cuh"
#include "ep/reference_grouped_gemm.hpp"
#include "ep/swiglu.cuh"

namespace poise::ep {
namespace {

using namespace nvcuda;

constexpr int kTileM = 64, kTileN = 64, kTileK = 32;
constexpr int kSmemK = kTileK + 8;  // row pitch 80 bytes: 16-byte aligned, fewer bank conflicts
constexpr int kThreads = 128;

struct TileSmem {
  alignas(128) bf16 a[kTileM][kSmemK];  // A tile, (m, k)
  alignas(128) bf16 b[kTileN][kSmemK];  // B tile, (n, k)
  alignas(128) float c[kTileM][kTileN + 4];
};

// Tile (o, k), o < 64, k < 32, of a matrix whose k index is contiguous: element at
// src[row(o) * ld + k0 + k], row(o) = o < split ? lo + o : hi + (o - split). Rows o >= valid read 0.
__device__ __forceinline__ void load_tile_k_contiguous(bf16 (*dst)[kSmemK], const bf16* src, int64_t ld,
                                                       int valid, int64_t lo, int64_t hi, int split, int k0) {
  for (int v = threadIdx.x; v < kTileM * kTileK / 8; v += kThreads) {
    const int o = v / (kTileK / 8), kv = (v % (kTileK / 8)) * 8;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (o < valid) {
      const int64_t row = o < split ? lo + o : hi + (o - split);
      w = *reinterpret_cast<const uint4*>(src + row * ld + k0 + kv);
    }
    *reinterpret_cast<uint4*>(&dst[o][kv]) = w;
  }
}

// Tile (o, k) of a matrix whose outer index is contiguous: element at src[(k0 + k) * ld + o0 + o].
// k0 + k >= k_valid reads 0.
__device__ __forceinline__ void load_tile_outer_contiguous(bf16 (*dst)[kSmemK], const bf16* src, int64_t ld,
                                                           int o0, int k0, int k_valid) {
  for (int v = threadIdx.x; v < kTileM * kTileK / 8; v += kThreads) {
    const int kk = v / (kTileM / 8), ov = (v % (kTileM / 8)) * 8;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (k0 + kk < k_valid) w = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(k0 + kk) * ld + o0 + ov);
    const bf16* e = reinterpret_cast<const bf16*>(&w);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[ov + i][kk] = e[i];
  }
}

struct Accumulator {
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> f[2][2];
};

__device__ __forceinline__ void zero(Accumulator& acc) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc.f[i][j], 0.0f);
}

// acc += A_tile . B_tile^T for this warp's 32x32 quarter.
__device__ __forceinline__ void mma_tile(const TileSmem& s, Accumulator& acc) {
  const int warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
  for (int kk = 0; kk < kTileK; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &s.a[wm * 32 + i * 16][kk], kSmemK);
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &s.b[wn * 32 + j * 16][kk], kSmemK);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::mma_sync(acc.f[i][j], fa[i], fb[j], acc.f[i][j]);
  }
}

__device__ __forceinline__ void spill(TileSmem& s, const Accumulator& acc) {
  const int warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&s.c[wm * 32 + i * 16][wn * 32 + j * 16], acc.f[i][j], kTileN + 4,
                              wmma::mem_row_major);
}

template <RowGemmKind kKind>
__global__ void __launch_bounds__(kThreads) row_grouped_gemm_kernel(RowGemmBatch batch) {
  __shared__ TileSmem s;
  const RowGemmRank& r = batch.rank[blockIdx.z];
  if (comm::load_volatile(r.error_code) != 0) return;
  const int m0 = blockIdx.x * kTileM;
  // A batch may cover a subset of a rank's groups (exact balance: own experts, then replicas).
  if (m0 < r.group_offsets[0] || m0 >= r.group_offsets[batch.groups]) return;
  const int g = group_of_row(r.group_offsets, batch.groups, m0);
  const int valid = min(kTileM, r.group_counts[g] - (m0 - r.group_offsets[g]));
  if (valid <= 0) return;  // expert padding
  const int64_t D = batch.D, F = batch.F;
  constexpr bool kPairs = kKind == RowGemmKind::w13_swiglu;
  const int n0 = blockIdx.y * (kPairs ? kTileN / 2 : kTileN);
  int64_t k_dim = 0;
  if constexpr (kKind == RowGemmKind::w13_swiglu || kKind == RowGemmKind::w2_dgrad_swiglu) k_dim = D;
  if constexpr (kKind == RowGemmKind::w2_forward) k_dim = F;
  if constexpr (kKind == RowGemmKind::w13_dgrad) k_dim = 2 * F;
  const bf16* a = r.a + static_cast<int64_t>(m0) * k_dim;
  const int64_t expert_stride = (kKind == RowGemmKind::w13_swiglu || kKind == RowGemmKind::w13_dgrad) ? 2 * F * D : D * F;
  const bf16* b = r.b + g * expert_stride;

  Accumulator acc;
  zero(acc);
  for (int k0 = 0; k0 < k_dim; k0 += kTileK) {
    load_tile_k_contiguous(s.a, a, k_dim, valid, 0, 0, kTileM, k0);
    if constexpr (kKind == RowGemmKind::w13_swiglu) {
      // columns [0,32): gate rows n0.., columns [32,64): up rows F+n0..
      load_tile_k_contiguous(s.b, b, D, kTileN, n0, F + n0, kTileN / 2, k0);
    } else if constexpr (kKind == RowGemmKind::w2_forward) {
      load_tile_k_contiguous(s.b, b, F, kTileN, n0, 0, kTileN, k0);
    } else if constexpr (kKind == RowGemmKind::w2_dgrad_swiglu) {
      load_tile_outer_contiguous(s.b, b, F, n0, k0, static_cast<int>(k_dim));  // B(f, d) = W2[d][f]
    } else {
      load_tile_outer_contiguous(s.b, b, D, n0, k0, static_cast<int>(k_dim));  // B(d, j) = W13[j][d]
    }
    __syncthreads();
    mma_tile(s, acc);
    __syncthreads();
  }
  spill(s, acc);
  __syncthreads();

  const SwigluParams act{batch.swiglu_clamped != 0, batch.swiglu_alpha, batch.swiglu_limit};
  if constexpr (kKind == RowGemmKind::w13_swiglu) {
    for (int i = threadIdx.x; i < kTileM * (kTileN / 2); i += kThreads) {
      const int m = i / (kTileN / 2), c = i % (kTileN / 2);
      if (m >= valid) continue;
      const int64_t row = m0 + m, f = n0 + c;
      const float gate = s.c[m][c], up = s.c[m][c + kTileN / 2];
      r.out[row * 2 * F + f] = __float2bfloat16(gate);
      r.out[row * 2 * F + F + f] = __float2bfloat16(up);
      r.out2[row * F + f] = __float2bfloat16(swiglu_forward(gate, up, act));
    }
  } else if constexpr (kKind == RowGemmKind::w2_dgrad_swiglu) {
    for (int i = threadIdx.x; i < kTileM * kTileN; i += kThreads) {
      const int m = i / kTileN, c = i % kTileN;
      if (m >= valid) continue;
      const int64_t row = m0 + m, f = n0 + c;
      const float gate = __bfloat162float(r.aux[row * 2 * F + f]);
      const float up = __bfloat162float(r.aux[row * 2 * F + F + f]);
      float grad_gate, grad_up;
      swiglu_backward(gate, up, s.c[m][c], act, grad_gate, grad_up);
      r.out[row * 2 * F + f] = __float2bfloat16(grad_gate);
      r.out[row * 2 * F + F + f] = __float2bfloat16(grad_up);
    }
  } else {
    for (int i = threadIdx.x; i < kTileM * kTileN; i += kThreads) {
      const int m = i / kTileN, c = i % kTileN;
      if (m >= valid) continue;
      r.out[(m0 + m) * D + n0 + c] = __float2bfloat16(s.c[m][c]);
    }
  }
}

__global__ void __launch_bounds__(kThreads) wgrad_grouped_gemm_kernel(WgradBatch batch) {
  __shared__ TileSmem s;
  const int g = blockIdx.z % batch.groups;
  const WgradRank& r = batch.rank[blockIdx.z / batch.groups];
  if (comm::load_volatile(r.error_code) != 0) return;
  const int m0 = blockIdx.x * kTileM, n0 = blockIdx.y * kTileN;
  const int first = r.group_offsets[g], rows = r.group_counts[g];
  const bf16* a = r.a + static_cast<int64_t>(first) * batch.m_dim;
  const bf16* b = r.b + static_cast<int64_t>(first) * batch.n_dim;
  Accumulator acc;
  zero(acc);
  for (int k0 = 0; k0 < rows; k0 += kTileK) {
    load_tile_outer_contiguous(s.a, a, batch.m_dim, m0, k0, rows);
    load_tile_outer_contiguous(s.b, b, batch.n_dim, n0, k0, rows);
    __syncthreads();
    mma_tile(s, acc);
    __syncthreads();
  }
  spill(s, acc);
  __syncthreads();
  float* c = r.c + static_cast<int64_t>(g) * batch.m_dim * batch.n_dim;
  for (int i = threadIdx.x; i < kTileM * kTileN; i += kThreads) {
    const int m = i / kTileN, n = i % kTileN;
    const int64_t idx = static_cast<int64_t>(m0 + m) * batch.n_dim + n0 + n;
    c[idx] = batch.accumulate ? c[idx] + s.c[m][n] : s.c[m][n];
  }
}

template <RowGemmKind kKind>
void launch_row(const RowGemmBatch& batch, int n_tiles, cudaStream_t stream) {
  const dim3 grid(batch.capacity_rows / kTileM, n_tiles, batch.ranks);
  row_grouped_gemm_kernel<kKind><<<grid, kThreads, 0, stream>>>(batch);
  runtime::cuda_check_launch("row_grouped_gemm_kernel");
}

}  // namespace

void launch_row_grouped_gemm(RowGemmKind kind, const RowGemmBatch& batch, cudaStream_t stream) {
  switch (kind) {
    case RowGemmKind::w13_swiglu: launch_row<RowGemmKind::w13_swiglu>(batch, batch.F / (kTileN / 2), stream); break;
    case RowGemmKind::w2_forward: launch_row<RowGemmKind::w2_forward>(batch, batch.D / kTileN, stream); break;
    case RowGemmKind::w2_dgrad_swiglu:
      launch_row<RowGemmKind::w2_dgrad_swiglu>(batch, batch.F / kTileN, stream);
      break;
    case RowGemmKind::w13_dgrad: launch_row<RowGemmKind::w13_dgrad>(batch, batch.D / kTileN, stream); break;
  }
}

void launch_wgrad_grouped_gemm(const WgradBatch& batch, cudaStream_t stream) {
  const dim3 grid(batch.m_dim / kTileM, batch.n_dim / kTileN, batch.groups * batch.ranks);
  wgrad_grouped_gemm_kernel<<<grid, kThreads, 0, stream>>>(batch);
  runtime::cuda_check_launch("wgrad_grouped_gemm_kernel");
}

}  // namespace poise::ep
