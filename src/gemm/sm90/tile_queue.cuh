// The dynamic tile order of the rows-as-M GEMMs (GroupedGemmShape::tile_counters): instead of the
// static blockIdx + k * gridDim sequence, each next tile is claimed from a device counter by
// whichever cluster is free, so the tiles that share an operand start within a few microseconds of
// each other and L2 serves the later readers (on the static sequence the clusters drift apart over
// a GEMM's ~30 tile waves and DeepSeek-V3's fprop W13 read 2.5x its compulsory DRAM bytes).
//
// The producer (thread 0) claims; in a pair, rank 0's producer claims and mails the tile to rank 1's
// producer through rank 1's shared memory. Each producer publishes its tiles to its consumer warps
// through a small queue: entry q holds the q-th tile (t >= total_tiles ends the walk). The launch's
// last claimer resets the counters, so every launch finds them zero.
#pragma once

#include <cstdint>

#include "gemm/sm90/fault.cuh"
#include "gemm/sm90/ptx/cluster.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/stage_ring.cuh"

namespace poise::sm90 {

struct TileQueue {
  static constexpr int kEntries = 4;
  // [tile full][tile empty][mail full][mail empty] barriers, then [tile queue][mailbox] indices.
  static constexpr uint32_t kBytes = kEntries * (4 * sizeof(uint64_t) + 2 * sizeof(int32_t));

  uint8_t* base;

  __device__ uint64_t* tile_full() const { return reinterpret_cast<uint64_t*>(base); }
  __device__ uint64_t* tile_empty() const { return tile_full() + kEntries; }
  __device__ uint64_t* mail_full() const { return tile_empty() + kEntries; }
  __device__ uint64_t* mail_empty() const { return mail_full() + kEntries; }
  __device__ int32_t* tiles() const { return reinterpret_cast<int32_t*>(mail_empty() + kEntries); }
  __device__ int32_t* mailbox() const { return tiles() + kEntries; }

  // Thread 0, before the launch's first barrier.
  __device__ __forceinline__ void init() const {
    for (int q = 0; q < kEntries; ++q) {
      ptx::mbarrier_init(&tile_full()[q], 1);
      ptx::mbarrier_init(&tile_empty()[q], kConsumerWarps);
      ptx::mbarrier_init(&mail_full()[q], 1);
      ptx::mbarrier_init(&mail_empty()[q], 1);
    }
  }

  // Producer: publishes tile t as entry q.
  __device__ __forceinline__ void publish(uint32_t q, int32_t t) const {
    wait_barrier(&tile_empty()[q % kEntries], ((q / kEntries) & 1) ^ 1);
    ptx::st_shared_b32(ptx::shared_address(&tiles()[q % kEntries]), static_cast<uint32_t>(t));
    ptx::mbarrier_arrive(&tile_full()[q % kEntries]);
  }

  // Producer: the cluster's next tile (mail entry m). Rank 0 claims it and mails it to rank 1.
  template <int kCluster>
  __device__ __forceinline__ int32_t claim(uint32_t m, int32_t cluster_rank, int32_t tile_stride,
                                           int32_t* counters) const {
    const uint32_t slot = m % kEntries, parity = (m / kEntries) & 1;
    if (cluster_rank == 0) {
      const int32_t t = tile_stride + atomicAdd(&counters[0], 1);
      if constexpr (kCluster == 2) {
        wait_barrier(&mail_empty()[slot], parity ^ 1);
        ptx::st_shared_cluster_b32(&mailbox()[slot], 1, static_cast<uint32_t>(t));
        ptx::fence_cluster();
        ptx::mbarrier_arrive_cluster(&mail_full()[slot], 1);
      }
      return t;
    }
    wait_barrier(&mail_full()[slot], parity);
    ptx::fence_cluster();
    const int32_t t = static_cast<int32_t>(ptx::ld_shared_b32(ptx::shared_address(&mailbox()[slot])));
    ptx::mbarrier_arrive_cluster(&mail_empty()[slot], 0);
    return t;
  }

  // Producer, after its last claim: once every claimer has counted in, the last resets the counters.
  __device__ __forceinline__ static void finish(int32_t cluster_rank, int32_t tile_stride, int32_t* counters) {
    if (cluster_rank == 0 && atomicAdd(&counters[1], 1) == tile_stride - 1) {
      counters[0] = 0;
      counters[1] = 0;
    }
  }

  // Consumer warp: reads entry q and frees it.
  __device__ __forceinline__ int32_t read(uint32_t q, int lane) const {
    wait_barrier(&tile_full()[q % kEntries], (q / kEntries) & 1);
    const int32_t t = static_cast<int32_t>(ptx::ld_shared_b32(ptx::shared_address(&tiles()[q % kEntries])));
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&tile_empty()[q % kEntries]);
    return t;
  }
};

}  // namespace poise::sm90
