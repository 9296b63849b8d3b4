// The FP8 block-scaled K loop of a consumer warpgroup (rows as M, both operands K-major e4m3).
//
// A stage holds 128 e4m3 of K per row (the 128 bytes a BF16 stage holds as 64 values), so one
// stage is one scale block of both operands. Its four k32 wgmmas sum the block's products into
// `part`, which is then promoted: acc += part * scale_a[row] * scale_b[weight block]. wgmma's FP8
// accumulation keeps fewer bits than fp32 (DeepSeek-V3's reason to promote every 128 of K), so
// no partial sum runs across blocks.
//
// The promotion needs the block's sum in registers, so the warpgroup waits for its wgmmas before
// the next stage's: the other consumer warpgroup keeps the tensor cores busy meanwhile. A 128-wide
// tile keeps acc and part within the consumers' registers (64 + 64 fp32).
#pragma once

#include <cstdint>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/wgmma.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

inline constexpr int kFp8BlockN = 128;  // columns of an FP8 tile: acc and part fit the registers
inline constexpr int kFp8Stages = 6;    // 32 KiB stages

// The scale rows one consumer thread reads per K block: its two fragment rows' A scales and the
// tile's two 64-column halves' weight-block scales (B rows are loaded as two halves of 64: gate
// and up F apart for the blocked W13, else consecutive; neither half crosses a 128-row block).
struct Fp8ScaleRows {
  const float* a[2];
  const float* b[2];

  __device__ Fp8ScaleRows(const GroupedGemmShape& shape, const TileInfo& tile, int consumer, int thread) {
    const BlockScales& s = shape.scales;
    const int64_t row = tile.row_begin + tile.m_block * kTileM + 64 * consumer + Fragment(thread).row;
    a[0] = s.a_RKb + row * s.k_blocks;
    a[1] = a[0] + 8 * s.k_blocks;
    const int32_t b_row_blocks = (shape.b_rows_per_expert + 127) / 128;
    const float* expert = s.b_expert(tile.expert, shape.first_replica, b_row_blocks);
    const bool split = shape.b_gate_up_split > 0;
    const int32_t first = tile.n_block * (split ? kFp8BlockN / 2 : kFp8BlockN);
    const int32_t second = first + (split ? shape.b_gate_up_split : kFp8BlockN / 2);
    b[0] = expert + (first / 128) * s.k_blocks;
    // A last half past N (W2 with D = 64 mod 128) is never stored: its scale row is clamped into
    // the expert's rather than read past the scales.
    b[1] = expert + min(second / 128, b_row_blocks - 1) * s.k_blocks;
  }
};

template <class Ring, uint32_t kABytes>
__device__ __forceinline__ uint32_t mainloop_fp8(const Ring& ring, uint32_t it, const TileInfo& tile,
                                                 int32_t k_blocks, int consumer, int thread,
                                                 const GroupedGemmShape& shape, float (&acc)[kFp8BlockN / 2]) {
  constexpr int kN = kFp8BlockN / 2;
  float part[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i] = 0.0f;
  const Fp8ScaleRows scales(shape, tile, consumer, thread);
  for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
    // Issued before the stage's wait, used after its wgmmas: the loads' latency hides behind both.
    const float sa[2] = {__ldg(scales.a[0] + kb), __ldg(scales.a[1] + kb)};
    const float sb[2] = {__ldg(scales.b[0] + kb), __ldg(scales.b[1] + kb)};
    uint8_t* const a_smem = ring.wait(it);
    const uint64_t desc_a = ptx::make_k_major_desc(a_smem + consumer * 64 * 128);
    const uint64_t desc_b = ptx::make_k_major_desc(a_smem + kABytes);
    ptx::fence_accumulators(part);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 32 bytes of K per k32 step, as a BF16 k16 step
      ptx::wgmma_m64n128k32_e4m3(part, ptx::desc_advance(desc_a, kk * 32), ptx::desc_advance(desc_b, kk * 32),
                                 kk > 0 ? 1 : 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(part);
    ring.release(it);
    // part[4j + 2h + c]: fragment row half h, tile column 8j + ...: half j / 8 of the tile's columns.
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[i] += part[i] * (sa[(i >> 1) & 1] * sb[i / (kN / 2)]);
  }
  return it;
}

}  // namespace poise::sm90
