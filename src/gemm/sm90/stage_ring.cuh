// The ring of kStages shared-memory stages between the TMA producer and the wgmma consumers.
// Each stage has a "full" barrier (its bytes landed) and an "empty" one (every consumer warp, of
// every CTA that loaded part of it, finished reading it).
//
// Both consumers read every stage in ring order, so neither waits on a stage more than one phase
// ahead of its barrier: mbarrier parity waits cannot tell phase p from p + 2 (a ping-pong variant
// where each warpgroup skipped the other's tiles broke exactly this and hung).
#pragma once

#include <cstdint>

#include "gemm/sm90/fault.cuh"
#include "gemm/sm90/kernel_params.hpp"
#include "gemm/sm90/ptx/cluster.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/warpgroup.cuh"

namespace poise::sm90 {

inline constexpr int kConsumerWarps = 8;

template <int kStages, int kCluster, uint32_t kStageBytes>
struct StageRing {
  uint8_t* smem;  // stage s at smem + s * kStageBytes: A, then B
  uint64_t* full_bar;
  uint64_t* empty_bar;

  // Thread 0, before the launch's first barrier: the producer arrives once per phase (expecting
  // the stage's bytes), every consumer warp of every CTA that loads into the stage once.
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full_bar[s], 1);
      ptx::mbarrier_init(&empty_bar[s], kConsumerWarps * kCluster);
    }
  }
  __device__ __forceinline__ uint8_t* stage(uint32_t it) const { return smem + (it % kStages) * kStageBytes; }

  // Producer: waits until the stage of ring iteration `it` is free to be refilled.
  __device__ __forceinline__ void wait_empty(uint32_t it) const {
    wait_barrier(&empty_bar[it % kStages], ((it / kStages) & 1) ^ 1);
  }
  __device__ __forceinline__ uint64_t* full(uint32_t it) const { return &full_bar[it % kStages]; }
};

// The consumers' view of the ring. Every consumer warp waits on every stage (wait) and releases it
// once (release: lane 0 arrives on the "empty" barrier of every CTA of the cluster, whose producers
// multicast part of the stage into it).
template <int kStages, int kCluster, uint32_t kStageBytes>
struct ConsumerRing {
  uint8_t* smem;
  uint64_t* full_bar;
  uint64_t* empty_bar;
  int lane;

  // Waits until the stage of ring iteration `it` has landed; returns its base.
  __device__ __forceinline__ uint8_t* wait(uint32_t it) const {
    wait_barrier(&full_bar[it % kStages], (it / kStages) & 1);
    return smem + (it % kStages) * kStageBytes;
  }
  __device__ __forceinline__ void release(uint32_t it) const {
    if (lane != 0) return;
    uint64_t* bar = &empty_bar[it % kStages];
    if constexpr (kCluster == 2) {
#pragma unroll
      for (int c = 0; c < kCluster; ++c) ptx::mbarrier_arrive_cluster(bar, c);
    } else {
      ptx::mbarrier_arrive(bar);
    }
  }
};

// Zeroes rows [valid_rows, end_row) of every 64-row MN-major chunk of this stage: kAChunks of A,
// then B's kBlockN / 64, by `kThreads` threads that then meet at named barrier `barrier_id`.
// Whole 128-byte rows are zeroed, so the swizzle (which permutes 16 B units within a row) is moot.
template <int kAChunks, int kBlockN, int kThreads>
__device__ __forceinline__ void zero_k_tail(uint8_t* stage_a, uint8_t* stage_b, int valid_rows, int end_row,
                                            int thread, uint32_t barrier_id) {
  constexpr int kChunks = kAChunks + kBlockN / 64;
  static_assert(kThreads % 8 == 0, "8 threads per 128-byte row");
  // Thread t zeroes 16-byte unit t % 8 of rows valid_rows + t / 8, + kThreads / 8, ... of every
  // chunk (no divisions: this runs on every expert's last K block).
  const uint32_t a = ptx::shared_address(stage_a), b = ptx::shared_address(stage_b);
  const uint32_t unit = 16 * (thread % 8);
  for (int row = valid_rows + thread / 8; row < end_row; row += kThreads / 8) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t chunk = c < kAChunks ? a + c * ptx::kMnChunkBytes : b + (c - kAChunks) * ptx::kMnChunkBytes;
      ptx::st_shared_v4_b32(chunk + row * 128 + unit, make_uint4(0, 0, 0, 0));
    }
  }
  ptx::fence_async_shared();
  ptx::named_barrier_sync(barrier_id, kThreads);
}

}  // namespace poise::sm90
