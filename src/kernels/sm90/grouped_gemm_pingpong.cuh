// Ping-pong variant of the persistent grouped GEMM (sm_90a): the same tiles (128 rows x kBlockN),
// the same tile schedule and the same epilogues as grouped_gemm.cuh, but the two consumer
// warpgroups no longer share each tile's mainloop. Warpgroup w computes half w of every tile
// (rows [64w, 64w + 64)) with its own K loop, and the halves run one after the other:
//
//   tensor cores:  [t0 half 0: wg1][t0 half 1: wg2][t1 half 0: wg1][t1 half 1: wg2] ...
//   wg1:           [mainloop      ][epilogue t0   ][mainloop      ][epilogue t1   ]
//   wg2:                           [mainloop      ][epilogue t0   ][mainloop      ]
//
// so each warpgroup's epilogue (SwiGLU, staging, stores) runs while the other one's wgmmas keep
// the tensor cores busy. The price: a stage holds 64 rows of A with the full B block (40 KiB for
// 64 x 256 of work instead of 48 KiB for 128 x 256), so B is read from L2 twice per tile.
//
// Stage order and barriers. The producer fills stages in (tile, half, k) order; each stage is
// consumed by one warpgroup, which alone releases it (empty barriers count 4 warps). A warpgroup
// skips the other's stages in its ring counter. It may start waiting on its first stage only
// after the other warpgroup has passed its last full-barrier wait of the previous half (the
// "order" mbarriers): then every stage barrier is at most one phase behind the phase awaited,
// which is what parity waits need (they cannot tell phase p from p + 2; performance.md v8 hung
// without this ordering).
#pragma once

#include "kernels/sm90/grouped_gemm.cuh"

namespace poise::sm90 {

inline constexpr int kHalfRows = 64;  // rows of A a ping-pong stage holds: one warpgroup's half tile

template <int kBlockN, int kStages, int kStagingBuffers>
struct PingPongSmem {
  static constexpr uint32_t kABytes = kHalfRows * kTileK * 2;  // 8 KiB
  static constexpr uint32_t kBBytes = kBlockN * kTileK * 2;    // 32 KiB at kBlockN = 256
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr uint32_t kStagingOffset = kStages * kStageBytes;
  static constexpr uint32_t kStagingPerConsumer = kStagingBuffers * kStagingBytes;
  // full[kStages], empty[kStages], order[2]
  static constexpr uint32_t kBarrierOffset = kStagingOffset + 2 * kStagingPerConsumer;
  static constexpr uint32_t kSchedulerOffset = kBarrierOffset + (2 * kStages + 2) * sizeof(uint64_t);
  static constexpr uint32_t kTotalBytes = kSchedulerOffset + sizeof(SchedulerStorage) + 1024;
};

template <int kBlockN, int kStages, RowsAre kRows, bool kBMnMajor, class Epilogue>
__global__ void __launch_bounds__(kThreadsPerCta, 1)
    grouped_gemm_pingpong_kernel(const __grid_constant__ CUtensorMap map_a,  // rows-as-M: 64-row boxes
                                 const __grid_constant__ CUtensorMap map_b,
                                 const __grid_constant__ CUtensorMap map_b_replicas,
                                 const GroupedGemmShape shape, const __grid_constant__ Epilogue epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = PingPongSmem<kBlockN, kStages, Epilogue::kStagingBuffers>;
  constexpr bool kAMnMajor = kRows == RowsAre::K;
  constexpr int kInFlight = kStages >= 4 ? kWgmmaGroupsInFlight : 0;
  static_assert(kRows == RowsAre::M || kBMnMajor, "wgrad reads both operands MN-major");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Smem::kBarrierOffset);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* order_bar = empty_bar + kStages;  // order_bar[w]: the other warpgroup finished its K loop
  auto& sched_storage = *reinterpret_cast<SchedulerStorage*>(smem + Smem::kSchedulerOffset);
  auto stage_a = [&](int s) { return smem + s * Smem::kStageBytes; };
  auto stage_b = [&](int s) { return smem + s * Smem::kStageBytes + Smem::kABytes; };

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full_bar[s], 1);
      ptx::mbarrier_init(&empty_bar[s], kConsumerWarps / 2);  // one warpgroup consumes a stage
    }
    ptx::mbarrier_init(&order_bar[0], 1);
    ptx::mbarrier_init(&order_bar[1], 1);
    ptx::fence_barrier_init();
  }
  const auto scheduler = TileScheduler<kRows>::build(sched_storage, shape);  // syncs the CTA

  if (warpgroup == 0) {
    // ---------------- TMA producer: (tile, half, k) order ----------------
    ptx::warpgroup_release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::tma_prefetch_descriptor(&map_a);
      ptx::tma_prefetch_descriptor(&map_b);
      if (shape.first_replica < shape.num_experts) ptx::tma_prefetch_descriptor(&map_b_replicas);
      uint32_t it = 0;
      for (int32_t t = blockIdx.x; t < scheduler.total_tiles; t += gridDim.x) {
        const TileInfo tile = scheduler.tile(t);
        const int32_t k_blocks = scheduler.k_blocks(tile);
        const bool replica = tile.expert >= shape.first_replica;
        const CUtensorMap* weights = replica ? &map_b_replicas : &map_b;
        const int32_t b_row0 = (tile.expert - (replica ? shape.first_replica : 0)) * shape.b_rows_per_expert;
        for (int half = 0; half < 2; ++half) {
          const int32_t a_first = tile.m_block * kTileM + kHalfRows * half;  // row (M) or column (K) of A
          for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
            const int s = it % kStages;
            ptx::mbarrier_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
            ptx::mbarrier_arrive_expect_tx(&full_bar[s], Smem::kStageBytes);
            if constexpr (kRows == RowsAre::M) {
              const int32_t k0 = kb * kTileK;
              ptx::tma_load_2d(stage_a(s), &map_a, k0, tile.row_begin + a_first, &full_bar[s]);
              if constexpr (kBMnMajor) {
#pragma unroll
                for (int j = 0; j < kBlockN / 64; ++j)
                  ptx::tma_load_2d(stage_b(s) + j * ptx::kMnChunkBytes, weights,
                                   tile.n_block * kBlockN + 64 * j, b_row0 + k0, &full_bar[s]);
              } else if (shape.b_split_rows > 0) {
                const int32_t n0 = b_row0 + tile.n_block * (kBlockN / 2);
                ptx::tma_load_2d(stage_b(s), weights, k0, n0, &full_bar[s]);
                ptx::tma_load_2d(stage_b(s) + (kBlockN / 2) * 128, weights, k0, n0 + shape.b_split_rows,
                                 &full_bar[s]);
              } else {
                ptx::tma_load_2d(stage_b(s), weights, k0, b_row0 + tile.n_block * kBlockN, &full_bar[s]);
              }
            } else {
              const int32_t r0 = tile.row_begin + kb * kTileK;
              ptx::tma_load_2d(stage_a(s), &map_a, a_first, r0, &full_bar[s]);
#pragma unroll
              for (int j = 0; j < kBlockN / 64; ++j)
                ptx::tma_load_2d(stage_b(s) + j * ptx::kMnChunkBytes, &map_b, tile.n_block * kBlockN + 64 * j,
                                 r0, &full_bar[s]);
            }
          }
        }
      }
    }
  } else {
    // ---------------- wgmma consumers: warpgroup w takes half w of every tile ----------------
    ptx::warpgroup_claim_registers<kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int thread = threadIdx.x % 128;
    uint8_t* staging = smem + Smem::kStagingOffset + consumer * Smem::kStagingPerConsumer;
    float acc[kBlockN / 2];
    uint32_t it = 0, order_phase = 0;
    bool first = true;
    for (int32_t t = blockIdx.x; t < scheduler.total_tiles; t += gridDim.x) {
      const TileInfo tile = scheduler.tile(t);
      const int32_t k_blocks = scheduler.k_blocks(tile);
      if (consumer == 1) it += k_blocks;  // half 0's stages
      epilogue.template begin_tile<kBlockN>(tile, consumer, thread, staging);
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
      // Half 1 follows half 0 of the same tile; half 0 follows half 1 of the previous tile.
      if (consumer == 1 || !first) {
        ptx::mbarrier_wait(&order_bar[consumer], order_phase);
        order_phase ^= 1;
      }
      first = false;
      int prev_stage = 0;
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        ptx::mbarrier_wait(&full_bar[s], (it / kStages) & 1);
        if constexpr (kRows == RowsAre::K) {
          const int valid = tile.row_count - kb * kTileK;
          if (valid < kTileK) zero_k_tail<1, kBlockN, 128>(stage_a(s), stage_b(s), valid, thread, 2 + consumer);
        }
        const uint64_t desc_a = kAMnMajor ? ptx::make_mn_major_desc(stage_a(s)) : ptx::make_k_major_desc(stage_a(s));
        const uint64_t desc_b = kBMnMajor ? ptx::make_mn_major_desc(stage_b(s)) : ptx::make_k_major_desc(stage_b(s));
        ptx::fence_accumulators(acc);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) {
          ptx::wgmma_k16<kBlockN, kAMnMajor ? 1 : 0, kBMnMajor ? 1 : 0>(
              acc, ptx::desc_advance(desc_a, kk * ptx::k16_slice_bytes<kAMnMajor>()),
              ptx::desc_advance(desc_b, kk * ptx::k16_slice_bytes<kBMnMajor>()), 1);
        }
        ptx::wgmma_commit_group();
        ptx::fence_accumulators(acc);
        if constexpr (kInFlight == 0) {
          ptx::wgmma_wait_group<0>();
          ptx::fence_accumulators(acc);
          if (lane == 0) ptx::mbarrier_arrive(&empty_bar[s]);
        } else {
          ptx::wgmma_wait_group<1>();
          ptx::fence_accumulators(acc);
          if (kb > 0 && lane == 0) ptx::mbarrier_arrive(&empty_bar[prev_stage]);
          prev_stage = s;
        }
      }
      // Every full-barrier wait of this half is behind us: the other warpgroup may start its
      // K loop (its wgmmas queue behind ours on the tensor cores).
      if (thread == 0) ptx::mbarrier_arrive(&order_bar[consumer ^ 1]);
      if constexpr (kInFlight == 1) {
        ptx::wgmma_wait_group<0>();
        ptx::fence_accumulators(acc);
        if (k_blocks > 0 && lane == 0) ptx::mbarrier_arrive(&empty_bar[prev_stage]);
      }
      if constexpr (!POISE_SKIP_EPILOGUE_FOR_TIMING)
        epilogue.template store<kBlockN>(acc, tile, consumer, thread, staging);
      if (consumer == 0) it += k_blocks;  // half 1's stages
    }
    if (thread == 0) ptx::tma_store_wait_all();
  }
#endif
}

}  // namespace poise::sm90
