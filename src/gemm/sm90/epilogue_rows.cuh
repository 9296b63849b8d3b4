// The rows epilogues of FPROP W2 and DGRAD W13: grouped rows, or rows scattered to their slots.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "gemm/sm90/epilogue_common.cuh"
#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/fault.cuh"

namespace poise::sm90 {

// Row-major bf16 store of grouped rows (FPROP W2 -> y_RD, DGRAD W13 -> grad_x_RD), optionally
// scaled per row by an fp32 routing score, from registers (epilogue_direct.cuh).
struct RowsStoreEpilogue {
  // Stores at the end of its own tile (deferred into the next tile's K blocks it was 1% slower).
  static constexpr int kDeferredParts = 0;
  static constexpr int kStagingBuffers = 1;  // the warps' staging for the direct stores
  static constexpr int kRingStages = 0;
  static constexpr bool kPairedTiles = true;
  static constexpr bool kSkipsEmptySlabs = true;

  __nv_bfloat16* out_RN;
  const float* scores_R;  // nullable
  int32_t N;
  ExpertBias bias;        // FPROP W2's b2 [E, N], added before the score; or none

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
    store_direct<kBlockN>(d, tile, consumer, thread, buf, [&](const GroupedRowAddress& rows, int32_t n_first, int r) {
      return reinterpret_cast<__nv_bfloat16*>(rows.at(out_RN, N, n_first, r));
    });
  }

  // The tile's scored rows from registers (epilogue_direct.cuh): row_at(rows, n_first, r) is the
  // address of column n_first in slab row r (nullptr: not written).
  template <int kBlockN, class RowAt>
  __device__ __forceinline__ void store_direct(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                               int thread, uint8_t* buf, RowAt&& row_at) const {
    const Fragment fr(thread);
    const GroupedRowAddress rows(tile, consumer);
    float scale[2];
    row_scales(fr, rows, scale);
    const int32_t n_first = tile.n_block * kBlockN;
    if (bias.enabled()) {
      add_column_bias(d, fr.quad, bias.row(tile.expert),
                      [&](int n) -> int32_t { return n_first + n < N ? n_first + n : -1; });
    }
    store_bf16_rows_direct<kBlockN>(d, thread, buf, [&](int r) { return row_at(rows, n_first, r); }, scale,
                                          min(kBlockN, N - n_first));
  }

  // The tile's rows to rows named by an index per grouped row (index_R): valid row r goes to
  // row_of(index_R[r]) + n_first. An index outside [0, bound) is recorded as a device fault
  // (PipelineFaultWord::kBadOrigin) and its row goes nowhere.
  template <int kBlockN, class RowOf>
  __device__ __forceinline__ void store_indexed(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                                int thread, uint8_t* buf, const int32_t* index_R, int32_t bound,
                                                RowOf&& row_of) const {
    store_direct<kBlockN>(d, tile, consumer, thread, buf,
                                [&](const GroupedRowAddress& rows, int32_t n_first, int r) -> __nv_bfloat16* {
                                  if (r >= rows.valid) return nullptr;
                                  const int32_t index = index_R[rows.first_row + r];
                                  if (static_cast<uint32_t>(index) >= static_cast<uint32_t>(bound)) {
                                    record_fault(PipelineFaultWord::kBadOrigin);
                                    return nullptr;
                                  }
                                  return row_of(index) + n_first;
                                });
  }
};

// FPROP W2 / DGRAD W13 with the rows scattered to slots (sm90::RowScatter): each valid row is stored
// whole into slot row_origin_R[row] % slots_per_owner of its owner's buffer, whose base the device
// reads from owner_bases. Plain stores, one writer per slot: the bits of the grouped rows, and a
// combine that stays deterministic.
struct RowsScatterEpilogue : RowsStoreEpilogue {
  const int32_t* row_origin_R;
  char* const* owner_bases;
  int64_t slot_offset;
  int32_t slots_per_owner;
  int32_t origins;  // owners * slots_per_owner: a row whose origin is outside [0, origins) is stored nowhere

  template <int kBlockN>
  __device__ __forceinline__ void store(float (&d)[kBlockN / 2], const TileInfo& tile, int consumer,
                                        int thread, uint8_t* buf) const {
    store_indexed<kBlockN>(d, tile, consumer, thread, buf, row_origin_R, origins, [&](int32_t origin) {
      const int32_t owner = origin / slots_per_owner;
      const int64_t slot = origin - owner * slots_per_owner;
      return reinterpret_cast<__nv_bfloat16*>(owner_bases[owner] + slot_offset) + slot * N;
    });
  }
};

// The scatter epilogue of a launch (host side): the API's RowScatter, rows scaled by scores_R.
inline RowsScatterEpilogue rows_scatter_epilogue(const RowScatter& scatter, const float* scores_R, int64_t N) {
  RowsScatterEpilogue epi{};
  epi.scores_R = scores_R;  // the base's rows pointer is not used
  epi.N = static_cast<int32_t>(N);
  epi.row_origin_R = scatter.row_origin_R;
  epi.owner_bases = scatter.owner_bases;
  epi.slot_offset = scatter.slot_offset;
  epi.slots_per_owner = static_cast<int32_t>(scatter.slots_per_owner);
  epi.origins = static_cast<int32_t>(scatter.owners * scatter.slots_per_owner);
  return epi;
}

}  // namespace poise::sm90
