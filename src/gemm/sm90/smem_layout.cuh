// Shared memory of one grouped-GEMM CTA: the stage ring, the epilogue's staging buffers, the
// ring's barriers, the tile scheduler's expert table and the dynamic tile order's queue.
#pragma once

#include <cstdint>

#include "gemm/sm90/epilogue_staging.cuh"
#include "gemm/sm90/tile_queue.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

// kColumnScales: FP8 WGRAD, two buffers of a K block's kBlockN B-column scales per consumer
// warpgroup (mainloop_fp8_wgrad.cuh).
template <int kBlockN, int kStages, int kStagingBuffers, bool kColumnScales = false>
struct GroupedGemmSmem {
  static constexpr uint32_t kABytes = kTileM * kTileK * 2;   // 16 KiB
  static constexpr uint32_t kBBytes = kBlockN * kTileK * 2;  // 32 KiB at kBlockN = 256
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  // Epilogue staging: kStagingBuffers buffers per consumer warpgroup (epilogue_staging.cuh).
  static constexpr uint32_t kStagingOffset = kStages * kStageBytes;
  static constexpr uint32_t kStagingPerConsumer = kStagingBuffers * kStagingBytes;
  static constexpr uint32_t kBarrierOffset = kStagingOffset + 2 * kStagingPerConsumer;
  static constexpr uint32_t kSchedulerOffset = kBarrierOffset + 2 * kStages * sizeof(uint64_t);
  static constexpr uint32_t kTileQueueOffset = (kSchedulerOffset + sizeof(SchedulerStorage) + 7) / 8 * 8;
  static constexpr uint32_t kColumnScalesOffset = (kTileQueueOffset + TileQueue::kBytes + 15) / 16 * 16;
  static constexpr uint32_t kColumnScalesPerConsumer = kColumnScales ? 2 * kBlockN * sizeof(float) : 0;
  // + 1024 so the kernel can round the dynamic smem base up to the swizzle atom.
  static constexpr uint32_t kTotalBytes = kColumnScalesOffset + 2 * kColumnScalesPerConsumer + 1024;
  static_assert(kTotalBytes <= 227 * 1024, "the SM90 shared-memory limit per CTA");
};

}  // namespace poise::sm90
