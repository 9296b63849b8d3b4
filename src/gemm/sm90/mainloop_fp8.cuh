// The FP8 block-scaled K loop of a consumer warpgroup (rows as M, both operands K-major e4m3), on
// the BF16 kernel's 128 x 256 tiles, stages and epilogues.
//
// A stage holds 128 e4m3 of K per row (the 128 bytes a BF16 stage holds as 64 values), so one
// stage is one scale block of both operands. A warpgroup's 64 x 256 tile is computed in two
// 64 x 128 halves: each half's four k32 wgmmas sum the block's products into `part`, which is then
// promoted: acc += part * scale_a[row] * scale_b[weight block]. wgmma's FP8 accumulation keeps
// fewer bits than fp32 (DeepSeek-V3's reason to promote every 128 of K), so no partial sum runs
// across blocks. acc (128 fp32) and one half's part (64) fit the consumers' registers; while one
// warpgroup promotes, the other's wgmmas keep the tensor cores busy.
//
// Tiles as wide as the BF16 kernel's also keep the bytes per flop that L2 must deliver as low as
// there: 128-wide FP8 tiles needed 1.5x of them per flop and ran at BF16 speed.
#pragma once

#include <cstdint>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/wgmma.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// The scales one consumer thread reads per K block: its two fragment rows' A scales, and the
// weight-block scale of each 64-column quarter of the tile. B rows are loaded as two halves of 128
// (gate and up F apart for the blocked W13, else consecutive); a quarter never crosses a 128-row
// block, and the first half starts on a block, so its quarters share one scale; the second half
// may straddle two blocks (the up half when F is 64 mod 128).
//
// Held as 32-bit element offsets from the kernel parameters' base pointers (BlockScales::a_RKb, and
// b_own or b_replicas): 64-bit addresses per load took more registers than the SwiGLU FPROP kernel
// had, which spilled seven of them and reloaded them from local memory every K block.
struct Fp8ScaleRows {
  const float* b;       // b_own or b_replicas: where the tile's expert's weight-block scales are
  uint32_t a_row;       // row r's first scale in a_RKb; row r + 8's are 8 rows of scales further
  uint32_t b_first;     // quarters 0 and 1: their first scale in b
  uint32_t b_second[2]; // quarters 2 and 3

  __device__ Fp8ScaleRows(const GroupedGemmShape& shape, const TileInfo& tile, int consumer, int thread) {
    const BlockScales& s = shape.scales;
    const int32_t row = tile.row_begin + tile.m_block * kTileM + 64 * consumer + Fragment(thread).row;
    a_row = uint32_t(row) * uint32_t(s.k_blocks);
    const int32_t b_row_blocks = (shape.b_rows_per_expert + 127) / 128;
    const bool replica = tile.expert >= shape.first_replica;
    b = replica ? s.b_replicas : s.b_own;
    const uint32_t expert_first = uint32_t(tile.expert - (replica ? shape.first_replica : 0)) *
                                  uint32_t(b_row_blocks) * uint32_t(s.k_blocks);
    const bool split = shape.b_gate_up_split > 0;
    const int32_t first = tile.n_block * (split ? kBlockN / 2 : kBlockN);
    const int32_t second = first + (split ? shape.b_gate_up_split : kBlockN / 2);
    // A quarter past N (a last tile of a dimension 64 mod 128) is never stored: its scale row is
    // clamped into the expert's rather than read past the scales.
    auto block_of = [&](int32_t b_row) {
      return expert_first + uint32_t(min(b_row / 128, b_row_blocks - 1) * s.k_blocks);
    };
    b_first = block_of(first);
    b_second[0] = block_of(second);
    b_second[1] = block_of(second + 64);
  }
};

// acc[64 half + i] += part[i] * scale_a[row] * scale_b[quarter]: part[4j + 2h + c] is fragment row
// half h, column 8j + ... of the half, so quarter j / 8 of it.
__device__ __forceinline__ void promote_fp8_half(float (&acc)[kBlockN / 2], const float (&part)[kBlockN / 4],
                                                 int half, const float (&sa)[2], const float (&sb)[4]) {
#pragma unroll
  for (int i = 0; i < kBlockN / 4; ++i) {
    const float scale = sa[(i >> 1) & 1] * sb[2 * half + i / 32];
    if (half == 0) acc[i] += part[i] * scale;
    else acc[kBlockN / 4 + i] += part[i] * scale;
  }
}

// One half's four k32 wgmmas (32 bytes of K each, as a BF16 k16 step) into `part`, waited for.
__device__ __forceinline__ void wgmma_fp8_half(float (&part)[kBlockN / 4], uint64_t desc_a, uint64_t desc_b) {
  ptx::fence_accumulators(part);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    ptx::wgmma_m64n128k32_e4m3(part, ptx::desc_advance(desc_a, kk * 32), ptx::desc_advance(desc_b, kk * 32),
                               kk > 0 ? 1 : 0);
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  ptx::fence_accumulators(part);
}

template <class Ring, uint32_t kABytes>
__device__ __forceinline__ uint32_t mainloop_fp8(const Ring& ring, uint32_t it, const TileInfo& tile,
                                                 int32_t k_blocks, int consumer, int thread,
                                                 const GroupedGemmShape& shape, float (&acc)[kBlockN / 2]) {
  float part[kBlockN / 4];
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
  const Fp8ScaleRows scales(shape, tile, consumer, thread);
  const float* const a_scales = shape.scales.a_RKb;
  for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
    // Issued before the stage's wait, used after its wgmmas: the loads' latency hides behind both.
    const uint32_t a_at = scales.a_row + uint32_t(kb);
    const float sa[2] = {__ldg(a_scales + a_at), __ldg(a_scales + (a_at + 8 * uint32_t(shape.scales.k_blocks)))};
    float sb[4];
    sb[0] = sb[1] = __ldg(scales.b + (scales.b_first + uint32_t(kb)));
    sb[2] = __ldg(scales.b + (scales.b_second[0] + uint32_t(kb)));
    sb[3] = __ldg(scales.b + (scales.b_second[1] + uint32_t(kb)));
    uint8_t* const a_smem = ring.wait(it);
    const uint64_t desc_a = ptx::make_k_major_desc(a_smem + consumer * 64 * 128);
    uint8_t* const b_smem = a_smem + kABytes;
    wgmma_fp8_half(part, desc_a, ptx::make_k_major_desc(b_smem));
    promote_fp8_half(acc, part, 0, sa, sb);
    wgmma_fp8_half(part, desc_a, ptx::make_k_major_desc(b_smem + (kBlockN / 2) * 128));
    ring.release(it);
    promote_fp8_half(acc, part, 1, sa, sb);
  }
  return it;
}

}  // namespace poise::sm90
