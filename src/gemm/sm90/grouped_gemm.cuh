// Persistent, warp-specialized grouped GEMM over expert-grouped rows (sm_90a).
//
//   warpgroup 0 (one elected thread): the TMA producer (producer.cuh);
//   warpgroups 1, 2: the wgmma consumers (consumer.cuh), then the epilogue (epilogue_*.cuh).
//
// Operand layouts (all 128-byte swizzled, see ptx/smem_desc.cuh):
//   rows as M (fprop/dgrad): A = grouped rows [R][K], K-major.  B = per-expert weights, K-major
//     ([E*N][K], one box or gate/up halves) or MN-major ([E*K][N], 64-column chunks); replica
//     experts (EP exact balance, e >= first_replica) read a second weight map at e - first_replica.
//   rows as K (wgrad): A = grouped rows [R][M], MN-major; B = grouped rows [R][N], MN-major.
//
// Epilogues may use ring stages too (Epilogue::kRingStages per tile, after the tile's K blocks):
// the producer fills each through Epilogue::load_ring_stage (operands the epilogue reads, e.g.
// h13 for the SwiGLU backward, or nothing), the consumers' epilogue waits on it like a K block,
// writes its outputs in place and releases it once its TMA stores have read it. The epilogue's
// inputs then arrive during the mainloop and its outputs need no staging buffers of their own.
//
// kCluster = 2: the kernel runs in clusters of two CTAs computing a tile pair of one expert that
// shares an operand (tile_scheduler.cuh). Each CTA loads half of the shared operand's boxes,
// multicast into both CTAs, and its other operand whole; a stage is then free only when the
// consumers of both CTAs released it.
#pragma once

#include <cuda.h>
#include <cstdint>

#include "gemm/sm90/consumer.cuh"
#include "gemm/sm90/fault.cuh"
#include "gemm/sm90/producer.cuh"
#include "gemm/sm90/ptx/cluster.cuh"
#include "gemm/sm90/ptx/grid_dependency.cuh"
#include "gemm/sm90/ptx/warpgroup.cuh"
#include "gemm/sm90/smem_layout.cuh"
#include "gemm/sm90/stage_ring.cuh"
#include "gemm/sm90/tile_queue.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

inline constexpr uint32_t kProducerRegisters = 40;
inline constexpr uint32_t kConsumerRegisters = 232;
// setmaxnreg moves registers within what the launch allocated (__launch_bounds__(kThreadsPerCta, 1):
// the 64K-register file split per thread, in steps of 8, 168 here): a consumer's increase waits
// until the producer's decrease freed enough, forever if the sum does not fit.
inline constexpr uint32_t kLaunchRegisters = 65536 / kThreadsPerCta / 8 * 8;
inline constexpr uint32_t kConsumerThreads = kConsumerWarps * 32;
static_assert((kThreadsPerCta - kConsumerThreads) * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                  kThreadsPerCta * kLaunchRegisters,
              "producer + consumer registers must fit the launch's allocation");

// kFp8: e4m3 operands with block scales (GroupedGemmShape::scales, mainloop_fp8.cuh). Their TMA maps
// describe e4m3 pairs as 16-bit elements (tensor_map.hpp), so a stage's boxes are the BF16 kernel's.
template <int kBlockN, int kStages, RowsAre kRows, bool kBMnMajor, class Epilogue, int kCluster, bool kFp8 = false>
__global__ void __launch_bounds__(kThreadsPerCta, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_b_replicas,  // experts >= first_replica
                        const __grid_constant__ GroupedGemmShape shape,
                        const __grid_constant__ Epilogue epilogue) {  // holds the output TMA maps
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = GroupedGemmSmem<kBlockN, kStages, Epilogue::kStagingBuffers, kFp8 && kRows == RowsAre::K>;
  static_assert(kStages >= 4, "one wgmma group in flight per consumer needs a fourth stage for the producer");
  static_assert(Epilogue::kRingStages == 0 || Epilogue::kStagingBuffers == 0,
                "an epilogue stages in ring stages or its own buffers");
  static_assert(kRows == RowsAre::M || kBMnMajor || kFp8, "BF16 wgrad reads both operands MN-major, FP8 K-major");
  static_assert(kCluster == 1 || Epilogue::kPairedTiles, "pairs only where the epilogue runs on them");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Smem::kBarrierOffset);
  const StageRing<kStages, kCluster, Smem::kStageBytes> ring{smem, full_bar, full_bar + kStages};
  const TileQueue queue{smem + Smem::kTileQueueOffset};
  auto& sched_storage = *reinterpret_cast<SchedulerStorage*>(smem + Smem::kSchedulerOffset);
  const int lane = threadIdx.x % 32;
  // Rows-as-M GEMMs only: the wgrad tiles share their operands across many N blocks either way.
  const bool dynamic_tiles = kRows == RowsAre::M && shape.tile_counters != nullptr;
  if (threadIdx.x == 0) {
    s_launch_faults = {shape.fault_word, shape.wait_timeout_ns};
    ring.init();
    if (dynamic_tiles) queue.init();
    ptx::fence_barrier_init();
  }
  // Programmatic dependent launch: everything above overlapped the previous kernel's last tiles;
  // the row offsets and counts the scheduler reads, and every operand, may be its outputs.
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_grids();
  const auto scheduler = TileScheduler<kRows, kCluster>::build(sched_storage, shape);  // syncs the CTA
  // Clusters: the peer's barriers are initialised before anyone multicasts or arrives remotely.
  const int32_t cluster_rank = kCluster > 1 ? static_cast<int32_t>(ptx::cluster_cta_rank()) : 0;
  if constexpr (kCluster > 1) ptx::cluster_sync();
  const int32_t first_tile = blockIdx.x / kCluster, tile_stride = gridDim.x / kCluster;

  if (threadIdx.x < 128) {
    ptx::warpgroup_release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      run_producer<kBlockN, kStages, kRows, kBMnMajor, kCluster, Smem::kStageBytes, Smem::kABytes>(
          ring, scheduler, queue, dynamic_tiles, first_tile, tile_stride, cluster_rank,
          map_a, map_b, map_b_replicas, shape, epilogue);
    }
  } else {
    ptx::warpgroup_claim_registers<kConsumerRegisters>();
    const ConsumerRing<kStages, kCluster, Smem::kStageBytes> consumer_ring{smem, full_bar, full_bar + kStages, lane};
    run_consumers<kBlockN, kRows, kBMnMajor, decltype(consumer_ring), Smem::kABytes, decltype(scheduler), Epilogue,
                  kCluster, kFp8>(consumer_ring, smem + Smem::kStagingOffset, Smem::kStagingPerConsumer,
                                  reinterpret_cast<float*>(smem + Smem::kColumnScalesOffset), scheduler, queue,
                                  dynamic_tiles, first_tile, tile_stride, cluster_rank, lane, epilogue);
  }
  // Clusters: no CTA leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) ptx::cluster_sync();
#endif
}

}  // namespace poise::sm90
