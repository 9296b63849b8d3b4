// The WGRAD epilogue: weight gradients, fp32 or bf16, overwritten or accumulated.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/epilogue_staging.cuh"

namespace poise::sm90 {

// WGRAD store: out[e][m][n] for m < M, n < N, fp32 or bf16, overwrite or accumulate. Replica
// experts (e >= first_replica) go to their own target at e - first_replica (always overwritten).
// kBf16Overwrite: every tile's target is bf16 and overwritten (own experts and replicas), the
// common case, compiled on its own: its rows are packed in registers and stored during the next
// tile's first K blocks (PendingRows, epilogue_direct.cuh).
template <bool kBf16Overwrite>
struct WgradStoreEpilogue {
  static constexpr int kStagingBuffers = 1;
  // Parts the deferred stores are spread over: one per K block of the next tile.
  static constexpr int kDeferredParts = kBf16Overwrite ? 4 : 0;
  static constexpr int kRingStages = 0;
  static constexpr bool kPairedTiles = true;
  static constexpr bool kSkipsEmptySlabs = true;
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
    return [this, s, out, n_first](int r) { return r < s.valid ? out + (s.first + r) * N + n_first : nullptr; };
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
        emit_staged_add(buf, consumer, thread, accumulate, valid, map, n0, first, dst,
                        [](uint4 v, uint4 o) {
                          return make_uint4(__float_as_uint(__uint_as_float(v.x) + __uint_as_float(o.x)),
                                            __float_as_uint(__uint_as_float(v.y) + __uint_as_float(o.y)),
                                            __float_as_uint(__uint_as_float(v.z) + __uint_as_float(o.z)),
                                            __float_as_uint(__uint_as_float(v.w) + __uint_as_float(o.w)));
                        });
        move_accumulators<0, 16, kBlockN / 2 - 16>(d);
      }
    } else if (!accumulate) {
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
        emit_staged_add(buf, consumer, thread, accumulate, valid, map, n0, first, dst,
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
