// The FPROP W13 epilogue of 128-wide tiles (the FP8 kernel's), blocked W13 layout: tile columns
// [0, 64) are gate f0 + c, [64, 128) up f0 + c. SwiGLU in fp32 from the accumulators; a_RF and
// (when set) h13 leave as bf16 rows from registers through each warp's staging (epilogue_direct.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/activation.cuh"
#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/epilogue_direct.cuh"

namespace poise::sm90 {

struct SwigluFpropDirectEpilogue {
  static constexpr int kDeferredParts = 0;
  static constexpr int kStagingBuffers = 1;  // the warps' staging for the direct stores
  static constexpr int kRingStages = 0;
  static constexpr bool kPairedTiles = true;
  static constexpr bool kSkipsEmptySlabs = true;
  __nv_bfloat16* a_RF;
  __nv_bfloat16* h13_R2F;     // nullable: backward recomputes the forward instead
  __nv_bfloat16* h13_hi_R2F;  // rows >= h13_split (same row index)
  int32_t h13_split;          // a multiple of 128, so a 64-row slab lies on one side
  int32_t F;
  ActivationParams act;

  // 64 columns (32 accumulators of the fragment) as bf16 rows: row(r) is column 0 in slab row r.
  template <class RowPtr>
  __device__ __forceinline__ static void store_chunk(const float (&d)[32], int thread, uint8_t* buf, RowPtr&& row) {
    const float unscaled[2] = {1.0f, 1.0f};
    store_bf16_rows_direct<64>(d, thread, buf, row, unscaled, 64);
  }

  template <bool kClamped>
  __device__ __forceinline__ void store_impl(float (&d)[64], const TileInfo& tile, int consumer, int thread,
                                             uint8_t* buf) const {
    const GroupedRowAddress rows(tile, consumer);
    const int32_t f0 = tile.n_block * 64;
    float (&gate)[32] = *reinterpret_cast<float(*)[32]>(&d[0]);
    float (&up)[32] = *reinterpret_cast<float(*)[32]>(&d[32]);
    if (h13_R2F) {
      __nv_bfloat16* const h13 = rows.first_row >= h13_split ? h13_hi_R2F : h13_R2F;
      const int64_t width = 2 * int64_t(F);
      store_chunk(gate, thread, buf, [&](int r) { return reinterpret_cast<__nv_bfloat16*>(rows.at(h13, width, f0, r)); });
      store_chunk(up, thread, buf, [&](int r) { return reinterpret_cast<__nv_bfloat16*>(rows.at(h13, width, F + f0, r)); });
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) gate[i] = swiglu_forward<kClamped>(gate[i], up[i], act);
    store_chunk(gate, thread, buf, [&](int r) { return reinterpret_cast<__nv_bfloat16*>(rows.at(a_RF, F, f0, r)); });
  }

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer, int thread,
                                        uint8_t* buf) const {
    static_assert(kBlockN == 128, "64 gate and 64 up columns per tile");
    if (act.clamped) store_impl<true>(d, tile, consumer, thread, buf);
    else store_impl<false>(d, tile, consumer, thread, buf);
  }
};

}  // namespace poise::sm90
