// Persistent, warp-specialized grouped GEMM over expert-grouped rows (sm_90a).
//
//   warpgroup 0 (one elected thread): TMA producer. Walks the tile schedule and fills a ring of
//     kStages shared-memory stages; each stage's "full" mbarrier completes when its bytes land.
//     In the WGRAD kernels its warps 1-3 may run a side job meanwhile: a top-k combine of rows an
//     earlier kernel wrote (GroupedGemmShape::combine, token_combine.cuh).
//   warpgroups 1, 2: wgmma consumers. Each owns 64 of the tile's 128 rows and all kBlockN columns,
//     accumulates in fp32 registers, releases a stage through its "empty" mbarrier as soon as the
//     wgmma reading it retired, then hands its accumulators to the epilogue.
//
// Operand layouts (all 128-byte swizzled, see ptx/smem_desc.cuh):
//   rows as M (fprop/dgrad): A = grouped rows [R][K], K-major.  B = per-expert weights, K-major
//     ([E*N][K], one box or gate/up halves) or MN-major ([E*K][N], 64-column chunks); replica
//     experts (EP exact balance, e >= first_replica) read a second weight map at e - first_replica.
//   rows as K (wgrad): A = grouped rows [R][M], MN-major; B = grouped rows [R][N], MN-major.
//     Rows of a K block past the expert's count are zeroed in shared memory before the wgmma
//     (they hold padding or the next expert's rows), so they never contribute; k16 slices of the
//     expert's last K block wholly past the count are not computed (POISE_WGRAD_TAIL_SLICES).
//
// Epilogues may use ring stages too (Epilogue::kRingStages per tile, after the tile's K blocks):
// the producer fills each through Epilogue::load_ring_stage (operands the epilogue reads, e.g.
// h13 for the SwiGLU backward, or nothing), the consumers' epilogue waits on it like a K block,
// writes its outputs in place and releases it once its TMA stores have read it. The epilogue's
// inputs then arrive during the mainloop and its outputs need no staging buffers of their own.
//
// Both consumers read every stage in ring order, so neither waits on a stage more than one phase
// ahead of its barrier: mbarrier parity waits cannot tell phase p from p + 2. (A ping-pong variant
// where each warpgroup skips the other's tiles broke exactly this and hung: see performance.md v8.)
#pragma once

#include <cuda.h>
#include <cstdint>

#include "gemm/sm90/ptx/cluster.cuh"
#include "gemm/sm90/ptx/grid_dependency.cuh"
#include "gemm/sm90/ptx/mbarrier.cuh"
#include "gemm/sm90/ptx/shared_memory.cuh"
#include "gemm/sm90/ptx/smem_desc.cuh"
#include "gemm/sm90/ptx/tma.cuh"
#include "gemm/sm90/ptx/warpgroup.cuh"
#include "gemm/sm90/ptx/wgmma.cuh"
#include "gemm/sm90/epilogue_direct.cuh"
#include "gemm/sm90/epilogue_staging.cuh"
#include "gemm/sm90/phase_profile.cuh"
#include "gemm/sm90/streamed_rows.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

inline constexpr uint32_t kProducerRegisters = 40;
inline constexpr uint32_t kConsumerRegisters = 232;
inline constexpr int kConsumerWarps = 8;
// setmaxnreg moves registers within what the launch allocated (__launch_bounds__(kThreadsPerCta, 1):
// the 64K-register file split per thread, in steps of 8, 168 here): a consumer's increase waits
// until the producer's decrease freed enough, forever if the sum does not fit (a producer at 48
// registers hung every kernel: performance.md v15).
inline constexpr uint32_t kLaunchRegisters = 65536 / kThreadsPerCta / 8 * 8;
inline constexpr uint32_t kConsumerThreads = kConsumerWarps * 32;
static_assert((kThreadsPerCta - kConsumerThreads) * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                  kThreadsPerCta * kLaunchRegisters,
              "producer + consumer registers must fit the launch's allocation");
// Rows as K (wgrad): how finely an expert's last, partial K block is cut into k16 slices that are
// computed or skipped: 4 (1, 2 or 4 slices: a 3-slice group made the paired bf16 kernel spill),
// 2 (halves) or 0 (the whole block, its tail zeroed; A/B).
#ifndef POISE_WGRAD_TAIL_SLICES
#define POISE_WGRAD_TAIL_SLICES 2
#endif
inline constexpr int kTailSlices = POISE_WGRAD_TAIL_SLICES;
static_assert(kTailSlices == 0 || kTailSlices == 2 || kTailSlices == 4, "POISE_WGRAD_TAIL_SLICES: 0, 2 or 4");

// wgmma groups a consumer leaves in flight when it moves to the next stage (0 or 1); a build
// option so both pipelines can be measured against each other.
#ifndef POISE_WGMMA_GROUPS_IN_FLIGHT
#define POISE_WGMMA_GROUPS_IN_FLIGHT 1
#endif
inline constexpr int kWgmmaGroupsInFlight = POISE_WGMMA_GROUPS_IN_FLIGHT;
// Timing experiments only (never in a shipped build): 1 skips every epilogue, so a GEMM's time is its
// mainloop alone and outputs are not written; 2 skips only the epilogues whose outputs no other
// GEMM reads (rows and wgrad stores: FPROP W2, DGRAD W13, WGRAD), so those GEMMs still run on real
// inputs and the difference to a normal build is what their epilogues cost in all.
#ifndef POISE_SKIP_EPILOGUE_FOR_TIMING
#define POISE_SKIP_EPILOGUE_FOR_TIMING 0
#endif
// Timing experiments only (never in a shipped build; wrong results): rows-as-M GEMMs read expert 0's
// weights for every expert, so the weights stay in L2: how much of a tile's stage waits is the
// weights' DRAM latency (performance.md, session 10).
#ifndef POISE_SAME_WEIGHTS_FOR_TIMING
#define POISE_SAME_WEIGHTS_FOR_TIMING 0
#endif
inline constexpr bool kSameWeightsForTiming = POISE_SAME_WEIGHTS_FOR_TIMING;

// POISE_SKIP_EPILOGUE_FOR_TIMING builds: a skipped epilogue leaves the accumulators unread, and ptxas
// then deletes all but one wgmma per K block (a build without this sink measured >100% of the tensor
// peak); a store under a condition that never holds keeps them.
#if POISE_SKIP_EPILOGUE_FOR_TIMING
static __device__ float g_skipped_epilogue_sink;
#endif

// Tile order. With GroupedGemmShape::tile_counters set, rows-as-M GEMMs on 1-CTA or pair launches
// take their tiles in order from that device counter, claimed by whichever cluster is free, instead
// of the static blockIdx + k * gridDim sequence: the tiles that share an operand then start within
// a few microseconds of each other, so L2 serves the later readers. On the static sequence the
// clusters drift apart over a GEMM's ~30 tile waves, and DeepSeek-V3's fprop W13 read 2.5x its
// compulsory DRAM bytes (performance.md v21d/e). The producer claims each next tile (in pairs,
// rank 0's producer claims and mails the tile to rank 1's producer through rank 1's shared memory)
// and hands it to its consumers through a small shared-memory queue. The launch's last claimer
// resets the counters.
inline constexpr int kTileQueue = 4;
// A box row coordinate wholly outside every rows operand: TMA fills such a box with zeros and reads
// no memory.
inline constexpr int32_t kOutOfBoundsRow = -64;

// Tests only (drop_first_stage_for_tests, expert_mlp.cu): CTA 0's producer skips its first stage.
static __device__ int32_t g_drop_first_stage_for_tests = 0;

// kSideBytes: the WGRAD kernels' side-job buffer (token_combine.cuh), after everything else.
template <int kBlockN, int kStages, int kStagingBuffers, uint32_t kSideBytes = 0>
struct GroupedGemmSmem {
  static constexpr uint32_t kABytes = kTileM * kTileK * 2;   // 16 KiB
  static constexpr uint32_t kBBytes = kBlockN * kTileK * 2;  // 32 KiB at kBlockN = 256
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  // Epilogue staging: kStagingBuffers buffers per consumer warpgroup (epilogue_staging.cuh).
  static constexpr uint32_t kStagingOffset = kStages * kStageBytes;
  static constexpr uint32_t kStagingPerConsumer = kStagingBuffers * kStagingBytes;
  static constexpr uint32_t kBarrierOffset = kStagingOffset + 2 * kStagingPerConsumer;
  static constexpr uint32_t kSchedulerOffset = kBarrierOffset + 2 * kStages * sizeof(uint64_t);
  // Dynamic tile order: full / empty barriers and tile indices.
  static constexpr uint32_t kTileQueueOffset = (kSchedulerOffset + sizeof(SchedulerStorage) + 7) / 8 * 8;
  // [tile full][tile empty][mail full][mail empty] barriers, then [tile queue][mailbox] indices.
  static constexpr uint32_t kTileQueueBytes = kTileQueue * (4 * sizeof(uint64_t) + 2 * sizeof(int32_t));
  static constexpr uint32_t kSideOffset = (kTileQueueOffset + kTileQueueBytes + 127) / 128 * 128;
  // + 1024 so the kernel can round the dynamic smem base up to the swizzle atom.
  static constexpr uint32_t kTotalBytes = kSideOffset + kSideBytes + 1024;
  static_assert(kTotalBytes <= 227 * 1024, "the SM90 shared-memory limit per CTA");
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

// One wgmma group: kSlices k16 steps of this warpgroup's A and the tile's B from one stage.
template <int kBlockN, bool kAMnMajor, bool kBMnMajor>
struct WgmmaGroup {
  template <int kSlices>
  __device__ __forceinline__ static void issue(float (&acc)[kBlockN / 2], uint64_t desc_a, uint64_t desc_b) {
    ptx::fence_accumulators(acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kSlices; ++kk) {
      ptx::wgmma_k16<kBlockN, kAMnMajor ? 1 : 0, kBMnMajor ? 1 : 0>(
          acc, ptx::desc_advance(desc_a, kk * ptx::k16_slice_bytes<kAMnMajor>()),
          ptx::desc_advance(desc_b, kk * ptx::k16_slice_bytes<kBMnMajor>()), 1);
    }
    ptx::wgmma_commit_group();
  }
};

// CTAs of a cluster that load into one CTA's stages (itself included): every CTA of a pair; in a
// quad the CTA, its B partner (rank ^ 1) and its A partner (rank ^ 2), not the diagonal one.
template <int kCluster>
inline constexpr int kStageWriters = kCluster == 4 ? 3 : kCluster;

// The consumers' view of the stage ring. Every consumer warp waits on every stage (wait) and
// releases it once (release: lane 0 arrives on the "empty" barrier of every CTA that loaded part
// of it; with clusters the peers multicast half of an operand into it).
template <int kStages, int kCluster, uint32_t kStageBytes>
struct ConsumerRing {
  uint8_t* smem;
  uint64_t* full_bar;
  uint64_t* empty_bar;
  int lane;
  uint32_t cluster_rank;

  // Waits until the stage of ring iteration `it` has landed; returns its base.
  __device__ __forceinline__ uint8_t* wait(uint32_t it) const {
    ptx::mbarrier_wait(&full_bar[it % kStages], (it / kStages) & 1);
    return smem + (it % kStages) * kStageBytes;
  }
  __device__ __forceinline__ void release(uint32_t it) const {
    if (lane != 0) return;
    uint64_t* bar = &empty_bar[it % kStages];
    if constexpr (kCluster == 4) {
      ptx::mbarrier_arrive_cluster(bar, cluster_rank);
      ptx::mbarrier_arrive_cluster(bar, cluster_rank ^ 1);
      ptx::mbarrier_arrive_cluster(bar, cluster_rank ^ 2);
    } else if constexpr (kCluster == 2) {
#pragma unroll
      for (int c = 0; c < kCluster; ++c) ptx::mbarrier_arrive_cluster(bar, c);
    } else {
      ptx::mbarrier_arrive(bar);
    }
  }
};

// kCluster = 2: the kernel runs in clusters of two CTAs computing a tile pair of one expert that
// shares an operand (tile_scheduler.cuh): M blocks 2i, 2i + 1 share B, N blocks 2j, 2j + 1 of an
// odd last M block share A. Each CTA loads half of the shared operand's boxes, multicast into both
// CTAs, and its other operand whole. A stage is then free only when the consumers of both CTAs
// released it, so every consumer warp arrives on the "empty" barrier of both CTAs.
// kCluster = 4 (rows as M, an A/B option: slower than pairs on the H200, where only 120 of 132 SMs
// take quads): 2 M blocks x 2 N blocks; a CTA shares A with rank ^ 2 and B with rank ^ 1, loading
// half of each (a quarter less L2 -> SM traffic than pairs), and releases a stage to itself and
// those two partners (kStageWriters).
template <int kBlockN, int kStages, RowsAre kRows, bool kBMnMajor, class Epilogue, int kCluster = 1>
__global__ void __launch_bounds__(kThreadsPerCta, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_b_replicas,  // experts >= first_replica
                        const GroupedGemmShape shape,
                        const __grid_constant__ Epilogue epilogue) {  // holds the output TMA maps
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = GroupedGemmSmem<kBlockN, kStages, Epilogue::kStagingBuffers, kRows == RowsAre::K ? kSideBytes : 0>;
  constexpr bool kAMnMajor = kRows == RowsAre::K;
  // The GEMMs over gathered rows (FPROP W13, DGRAD W2) may take them streamed (streamed_rows.cuh).
  constexpr bool kStreamedRows = kRows == RowsAre::M && streams_rows<Epilogue>();
  // With 3 stages, release each stage as soon as it is read (one more stage of TMA prefetch).
  constexpr int kInFlight = kStages >= 4 ? kWgmmaGroupsInFlight : 0;
  constexpr int kRingStages = Epilogue::kRingStages;
  constexpr bool kSkipEpilogue =
      POISE_SKIP_EPILOGUE_FOR_TIMING == 1 || (POISE_SKIP_EPILOGUE_FOR_TIMING == 2 && kRingStages == 0);
  static_assert(kRingStages == 0 || Epilogue::kStagingBuffers == 0, "an epilogue stages in ring stages or its own buffers");
  static_assert(kRows == RowsAre::M || kBMnMajor, "wgrad reads both operands MN-major");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Smem::kBarrierOffset);
  uint64_t* empty_bar = full_bar + kStages;
  auto& sched_storage = *reinterpret_cast<SchedulerStorage*>(smem + Smem::kSchedulerOffset);
  auto stage_a = [&](int s) { return smem + s * Smem::kStageBytes; };
  auto stage_b = [&](int s) { return smem + s * Smem::kStageBytes + Smem::kABytes; };

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;

  // Rows-as-M GEMMs only: the wgrad tiles share their operands across many N blocks either way
  // (their 1-CTA probe: no gain, v21d), and the paired bf16 wgrad kernel spilled with the queue.
  constexpr bool kDynamicCapable = kCluster <= 2 && kRows == RowsAre::M;
  const bool dynamic_tiles = kDynamicCapable && shape.tile_counters != nullptr;
  uint64_t* tile_full = reinterpret_cast<uint64_t*>(smem + Smem::kTileQueueOffset);
  uint64_t* tile_empty = tile_full + kTileQueue;
  uint64_t* mail_full = tile_empty + kTileQueue;
  uint64_t* mail_empty = mail_full + kTileQueue;
  int32_t* tile_queue = reinterpret_cast<int32_t*>(mail_empty + kTileQueue);
  int32_t* mailbox = tile_queue + kTileQueue;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full_bar[s], 1);
      ptx::mbarrier_init(&empty_bar[s], kConsumerWarps * kStageWriters<kCluster>);
    }
    if (dynamic_tiles) {
      for (int q = 0; q < kTileQueue; ++q) {
        ptx::mbarrier_init(&tile_full[q], 1);
        ptx::mbarrier_init(&tile_empty[q], kConsumerWarps);
        ptx::mbarrier_init(&mail_full[q], 1);
        ptx::mbarrier_init(&mail_empty[q], 1);
      }
    }
    if (kRows == RowsAre::K) init_token_combine(smem + Smem::kSideOffset);
    ptx::fence_barrier_init();
  }
  // Programmatic dependent launch: everything above overlapped the previous kernel's last tiles;
  // the row offsets and counts the scheduler reads, and every operand, may be its outputs. With
  // streamed rows the previous kernel is their writer and still runs: it started after its own
  // predecessors completed, and the producer waits for each row block it publishes.
  if (!kStreamedRows || shape.streamed_rows == nullptr) ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_grids();
  const auto scheduler = TileScheduler<kRows, kCluster>::build(sched_storage, shape);  // syncs the CTA
  // Clusters: the peer's barriers are initialised before anyone multicasts or arrives remotely.
  const int32_t cluster_rank = kCluster > 1 ? static_cast<int32_t>(ptx::cluster_cta_rank()) : 0;
  if constexpr (kCluster > 1) ptx::cluster_sync();
  const int32_t first_tile = blockIdx.x / kCluster, tile_stride = gridDim.x / kCluster;
  // Dynamic order: the producer publishes tile t as entry q of the queue (t >= total_tiles ends the
  // loop) and claims the next; each consumer warp reads entry q and frees it.
  auto publish_tile = [&](uint32_t q, int32_t t) {
    ptx::mbarrier_wait(&tile_empty[q % kTileQueue], ((q / kTileQueue) & 1) ^ 1);
    ptx::st_shared_b32(ptx::shared_address(&tile_queue[q % kTileQueue]), static_cast<uint32_t>(t));
    ptx::mbarrier_arrive(&tile_full[q % kTileQueue]);
  };
  // The next tile of this cluster: rank 0 claims it and mails it to rank 1 (mail entry m).
  auto claim_tile = [&](uint32_t m) -> int32_t {
    const uint32_t slot = m % kTileQueue, parity = (m / kTileQueue) & 1;
    if (cluster_rank == 0) {
      const int32_t t = tile_stride + atomicAdd(&shape.tile_counters[0], 1);
      if constexpr (kCluster == 2) {
        ptx::mbarrier_wait(&mail_empty[slot], parity ^ 1);
        ptx::st_shared_cluster_b32(&mailbox[slot], 1, static_cast<uint32_t>(t));
        ptx::fence_cluster();
        ptx::mbarrier_arrive_cluster(&mail_full[slot], 1);
      }
      return t;
    }
    ptx::mbarrier_wait(&mail_full[slot], parity);
    ptx::fence_cluster();
    const int32_t t = static_cast<int32_t>(ptx::ld_shared_b32(ptx::shared_address(&mailbox[slot])));
    ptx::mbarrier_arrive_cluster(&mail_empty[slot], 0);
    return t;
  };
  auto read_tile = [&](uint32_t q) -> int32_t {
    ptx::mbarrier_wait(&tile_full[q % kTileQueue], (q / kTileQueue) & 1);
    const int32_t t = static_cast<int32_t>(ptx::ld_shared_b32(ptx::shared_address(&tile_queue[q % kTileQueue])));
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&tile_empty[q % kTileQueue]);
    return t;
  };
  // A stage is loaded as boxes: A as two 64-row (K-major) or 64-column (MN-major) halves, B as
  // 64-column chunks (MN-major) or two halves of kBlockN / 2 weight rows (K-major: gate / up for
  // the blocked W13 layout). The operand a cluster shares (TileInfo::shares_b) is split between
  // its CTAs, each multicasting its boxes into both; the other operand each CTA loads whole.
  constexpr int kABoxes = 2;
  constexpr int kBBoxes = kBMnMajor ? kBlockN / 64 : 2;
  // An operand shared with a partner: this CTA loads half of its boxes (its index among the two
  // sharers picks which half) into both CTAs. Pairs: the peer, compile-time masks. Quads: A with
  // rank ^ 2, B with rank ^ 1. Computed where used: the producer runs on 40 registers, and holding
  // masks and halves for the whole loop made it spill (24-32 bytes of stack, the pair GEMMs 5-6%
  // slower in sustained running, performance.md v17).
  auto a_mask = [&]() -> uint16_t {
    if constexpr (kCluster == 4) return static_cast<uint16_t>(0x5u << (cluster_rank & 1));
    else return static_cast<uint16_t>((1u << kCluster) - 1);
  };
  auto b_mask = [&]() -> uint16_t {
    if constexpr (kCluster == 4) return static_cast<uint16_t>(0x3u << (cluster_rank & 2));
    else return static_cast<uint16_t>((1u << kCluster) - 1);
  };
  auto a_half = [&] { return kCluster == 4 ? cluster_rank >> 1 : cluster_rank; };
  auto b_half = [&] { return kCluster == 4 ? cluster_rank & 1 : cluster_rank; };
  auto load_box = [&](bool shared, uint16_t mask, uint8_t* dst, const CUtensorMap* map, int32_t inner,
                      int32_t outer, uint64_t* bar) {
    if (kCluster > 1 && shared) ptx::tma_load_2d_multicast(dst, map, inner, outer, bar, mask);
    else ptx::tma_load_2d(dst, map, inner, outer, bar);
  };
  // Boxes [first, end) of `boxes` this CTA loads.
  auto box_range = [&](bool shared, int half, int boxes, int& first, int& end) {
    first = shared ? half * (boxes / 2) : 0;
    end = shared ? first + boxes / 2 : boxes;
  };

  if (warpgroup == 0) {
    // ---------------- TMA producer ----------------
    ptx::warpgroup_release_registers<kProducerRegisters>();
    if constexpr (kRows == RowsAre::K) {
      // Warps 1-3: the launch's side job, if it carries one (its inputs are complete: every thread
      // waited for the previous grid above).
      if (threadIdx.x >= 32 && shape.combine.out_TD != nullptr)
        run_token_combine(shape.combine, smem + Smem::kSideOffset, threadIdx.x / 32, lane);
    }
    if (threadIdx.x == 0) {
      ptx::tma_prefetch_descriptor(&map_a);
      ptx::tma_prefetch_descriptor(&map_b);
      if (shape.first_replica < shape.num_experts) ptx::tma_prefetch_descriptor(&map_b_replicas);
      uint32_t it = 0;
      // Fault injection (tests): this stage's load is never issued, its consumers' wait times out.
      const bool drop_first = blockIdx.x == 0 && g_drop_first_stage_for_tests != 0;
      POISE_PHASE(long long p_begin = clock64(), p_wait = 0;)
      uint32_t queued = 0;
      int32_t t = first_tile;
      if (dynamic_tiles) publish_tile(queued++, t);
      for (; t < scheduler.total_tiles;) {
        const TileInfo tile = scheduler.tile(t, cluster_rank);
        const int32_t k_blocks = scheduler.k_blocks(tile);
        const bool replica = tile.expert >= shape.first_replica;
        const CUtensorMap* weights = replica ? &map_b_replicas : &map_b;
        const int32_t b_row0 =
            kSameWeightsForTiming ? 0 : (tile.expert - (replica ? shape.first_replica : 0)) * shape.b_rows_per_expert;
        // Rows as M: in an expert's last M block, an A box (64 rows) wholly past its rows holds only
        // padding. It is loaded from outside the rows operand instead, so TMA zero-fills it without
        // reading memory (the stage's byte count stays); that warpgroup skips its wgmmas
        // (Epilogue::kSkipsEmptySlabs) or computes zero rows nobody stores. The tile's first A row is
        // a multiple of 64, so bit 0 carries "box 1 is padding": the producer runs on 40 registers, and
        // a separate count (fewer boxes, fewer bytes expected) made the pair kernels spill (8 -> 32
        // bytes of stack).
        const int32_t a_row0_one_box =
            (tile.row_begin + tile.m_block * kTileM) |
            (kRows == RowsAre::M && second_box_is_padding(tile) ? 1 : 0);
        if constexpr (kStreamedRows) {
          if (shape.streamed_rows != nullptr)
            wait_for_streamed_block(shape.streamed_rows, tile.row_begin / kTileM + tile.m_block);
        }
        for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kStages;
          POISE_PHASE(const long long w0 = clock64();)
          ptx::mbarrier_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
          POISE_PHASE(p_wait += clock64() - w0;)
          if (drop_first && it == 0) continue;
          ptx::mbarrier_arrive_expect_tx(&full_bar[s], Smem::kStageBytes);
          // Pairs share A exactly where they do not share B (one flag, as the v12 producer).
          const bool share_b = kCluster > 1 && tile.shares_b;
          const bool share_a = kCluster == 4 ? tile.shares_a : kCluster > 1 && !tile.shares_b;
          int a_first, a_end, b_first, b_end;
          box_range(share_a, a_half(), kABoxes, a_first, a_end);
          box_range(share_b, b_half(), kBBoxes, b_first, b_end);
          if constexpr (kRows == RowsAre::M) {
            const int32_t k0 = kb * kTileK;
            for (int j = a_first; j < a_end; ++j)
              load_box(share_a, a_mask(), stage_a(s) + j * 64 * 128, &map_a, k0,
                       j == 1 && (a_row0_one_box & 1) ? kOutOfBoundsRow : (a_row0_one_box & ~1) + 64 * j, &full_bar[s]);
            if constexpr (kBMnMajor) {
              for (int j = b_first; j < b_end; ++j)
                load_box(share_b, b_mask(), stage_b(s) + j * ptx::kMnChunkBytes, weights, tile.n_block * kBlockN + 64 * j,
                         b_row0 + k0, &full_bar[s]);
            } else {
              // Gate and up rows F apart (blocked W13), or the two halves of the tile's kBlockN rows.
              const int32_t n0 = b_row0 + tile.n_block * (shape.b_split_rows > 0 ? kBlockN / 2 : kBlockN);
              const int32_t second = shape.b_split_rows > 0 ? shape.b_split_rows : kBlockN / 2;
              for (int j = b_first; j < b_end; ++j)
                load_box(share_b, b_mask(), stage_b(s) + j * (kBlockN / 2) * 128, weights, k0, n0 + j * second,
                         &full_bar[s]);
            }
          } else {
            const int32_t r0 = tile.row_begin + kb * kTileK;
            for (int j = a_first; j < a_end; ++j)
              load_box(share_a, a_mask(), stage_a(s) + j * ptx::kMnChunkBytes, &map_a, tile.m_block * kTileM + 64 * j, r0,
                       &full_bar[s]);
            for (int j = b_first; j < b_end; ++j)
              load_box(share_b, b_mask(), stage_b(s) + j * ptx::kMnChunkBytes, &map_b, tile.n_block * kBlockN + 64 * j, r0,
                       &full_bar[s]);
          }
        }
        // The epilogue's stages: its operands (or nothing) as soon as a stage is free.
        if constexpr (kRingStages > 0) {
          for (int j = 0; j < kRingStages; ++j, ++it) {
            const int s = it % kStages;
            ptx::mbarrier_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
            epilogue.template load_ring_stage<kBlockN>(j, tile, stage_a(s), &full_bar[s]);
          }
        }
        if (dynamic_tiles) {
          t = claim_tile(queued - 1);
          publish_tile(queued++, t);
        } else {
          t += tile_stride;
        }
      }
      // Every claimer has made its last claim once all have counted in: the last resets the pair.
      if (dynamic_tiles && cluster_rank == 0 && atomicAdd(&shape.tile_counters[1], 1) == tile_stride - 1) {
        shape.tile_counters[0] = 0;
        shape.tile_counters[1] = 0;
      }
      POISE_PHASE(atomicAdd(&g_phase_cycles[4], (unsigned long long)p_wait);
                  atomicAdd(&g_phase_cycles[5], (unsigned long long)(clock64() - p_begin));)
    }
  } else {
    // ---------------- wgmma consumers ----------------
    ptx::warpgroup_claim_registers<kConsumerRegisters>();
    const int consumer = warpgroup - 1;  // rows [64 * consumer, 64 * consumer + 64) of the tile
    const int consumer_thread = threadIdx.x - 128;
    float acc[kBlockN / 2];
    const ConsumerRing<kStages, kCluster, Smem::kStageBytes> ring{smem, full_bar, empty_bar, lane,
                                                                 static_cast<uint32_t>(cluster_rank)};
    // Epilogue::kDeferredParts: the previous tile's packed rows, stored part p right after this
    // tile's K block p is issued (epilogue_direct.cuh).
    constexpr int kDeferredParts = Epilogue::kDeferredParts;
    PendingRows<kBlockN> pending;
    uint32_t it = 0;
    POISE_PHASE(long long c_begin = clock64(), c_wait = 0, c_epi = 0, c_tiles = 0;)
    uint32_t dequeued = 0;
    auto next_tile = [&](int32_t t) { return dynamic_tiles ? read_tile(dequeued++) : t + tile_stride; };
    for (int32_t t = dynamic_tiles ? read_tile(dequeued++) : first_tile; t < scheduler.total_tiles; t = next_tile(t)) {
      const TileInfo tile = scheduler.tile(t, cluster_rank);
      const int32_t k_blocks = scheduler.k_blocks(tile);
      POISE_PHASE(++c_tiles;)
      POISE_TIMELINE(const int32_t timeline_at = t * kCluster + cluster_rank;
                     const bool timeline_writer = consumer_thread == 0 && timeline_at < kTimelineTiles;
                     if (timeline_writer) {
                       g_tile_start_ns[timeline_at] = timeline_now();
                       g_tile_sm[timeline_at] = timeline_smid();
                       g_tile_what[timeline_at] = (unsigned(tile.expert) << 16) | (unsigned(tile.n_block) << 8) |
                                                  unsigned(tile.m_block) | (tile.valid ? 0u : 0x80u << 24);
                     })
      uint8_t* staging = smem + Smem::kStagingOffset + consumer * Smem::kStagingPerConsumer;
      // Rows as M: in an expert's last, partial M block a warpgroup whose 64 rows are all past the
      // expert's count issues no wgmma and stores nothing, so the other warpgroup's wgmmas have the
      // tensor cores to themselves (Epilogue::kSkipsEmptySlabs). A separate path: wgmmas under a
      // condition get serialized by ptxas.
      const bool idle = Epilogue::kSkipsEmptySlabs && kRows == RowsAre::M &&
                        tile.row_count - tile.m_block * kTileM - 64 * consumer <= 0;
      if ((kCluster > 1 && !tile.valid) || idle) {
        // A filler tile or an idle warpgroup: the stages (the peer's multicast half too) pass on.
        for (int32_t kb = 0; kb < k_blocks + kRingStages; ++kb, ++it) {
          ring.wait(it);
          ring.release(it);
        }
        POISE_TIMELINE(if (timeline_writer) g_tile_end_ns[timeline_at] = timeline_now();)
        continue;
      }
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) acc[i] = 0.0f;
      uint32_t prev_it = 0;
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        POISE_PHASE(const long long w0 = clock64();)
        uint8_t* const a_smem = ring.wait(it);  // the stage: A, then B at kABytes
        uint8_t* const b_smem = a_smem + Smem::kABytes;
        POISE_PHASE(c_wait += clock64() - w0;)
        // Rows as K: an expert's last K block holds the remainder of its rows. Only the k16 slices
        // that hold rows are computed (POISE_WGRAD_TAIL_SLICES), and only the rows past the count
        // within the last of them are zeroed. Each slice count is a whole wgmma group on its own
        // path: a wgmma under a condition inside a group makes ptxas serialize the kernel's wgmmas.
        int slices = kTileK / 16;
        if constexpr (kRows == RowsAre::K) {
          const int valid = tile.row_count - kb * kTileK;
          if (valid < kTileK) {
            constexpr int kTailRows = kTailSlices > 0 ? kTileK / kTailSlices : kTileK;  // a power of 2
            int covered = kTailSlices == 0 ? kTileK : (valid + kTailRows - 1) & ~(kTailRows - 1);
            if (covered > kTileK / 2) covered = kTileK;  // 3 slices: the whole block (a 3-wgmma group spills)
            if (valid < covered)
              zero_k_tail<kTileM / 64, kBlockN, 256>(a_smem, b_smem, valid, covered, consumer_thread, 1);
            slices = covered >> 4;
          }
        }
        // A: this warpgroup's 64 rows; K-major rows are 128 B, MN-major chunks are 64 M wide.
        const uint64_t desc_a = kAMnMajor ? ptx::make_mn_major_desc(a_smem + consumer * ptx::kMnChunkBytes)
                                          : ptx::make_k_major_desc(a_smem + consumer * 64 * 128);
        const uint64_t desc_b = kBMnMajor ? ptx::make_mn_major_desc(b_smem) : ptx::make_k_major_desc(b_smem);
        using Group = WgmmaGroup<kBlockN, kAMnMajor, kBMnMajor>;
        switch (slices) {
          case 1: if constexpr (kTailSlices == 4) { Group::template issue<1>(acc, desc_a, desc_b); break; }
          case 2: Group::template issue<2>(acc, desc_a, desc_b); break;
          default: Group::template issue<kTileK / 16>(acc, desc_a, desc_b);
        }
        ptx::fence_accumulators(acc);
        if constexpr (kDeferredParts > 0) pending.template flush_part<kDeferredParts>(kb, lane);
        if constexpr (kInFlight == 0) {
          // Release the stage as soon as its own wgmmas retired (the other warpgroup keeps the
          // tensor cores busy meanwhile): one more stage can be in flight on the TMA side.
          ptx::wgmma_wait_group<0>();
          ptx::fence_accumulators(acc);
          ring.release(it);
        } else {
          // Keep one group in flight: the previous stage is free once its group retired.
          ptx::wgmma_wait_group<1>();
          ptx::fence_accumulators(acc);
          if (kb > 0) ring.release(prev_it);
          prev_it = it;
        }
      }
      if constexpr (kInFlight == 1) {
        ptx::wgmma_wait_group<0>();
        ptx::fence_accumulators(acc);
        if (k_blocks > 0) ring.release(prev_it);
      }
      POISE_PHASE(const long long e0 = clock64();)
      if constexpr (kRingStages > 0) {
        if constexpr (kSkipEpilogue) {
          for (int j = 0; j < kRingStages; ++j) {
            ring.wait(it + j);
            ring.release(it + j);
          }
        } else {
          epilogue.template store<kBlockN>(acc, tile, consumer, consumer_thread % 128, ring, it);
        }
        it += kRingStages;
      } else if constexpr (kDeferredParts > 0) {
        pending.template flush_from<kDeferredParts>(k_blocks, lane);  // parts a short K loop left
        if constexpr (!kSkipEpilogue)
          epilogue.template store<kBlockN>(acc, tile, consumer, consumer_thread % 128, staging, pending);
      } else if constexpr (!kSkipEpilogue) {
        epilogue.template store<kBlockN>(acc, tile, consumer, consumer_thread % 128, staging);
      }
#if POISE_SKIP_EPILOGUE_FOR_TIMING
      if constexpr (kSkipEpilogue) {
        if (shape.num_experts < 0) g_skipped_epilogue_sink = acc[0];
      }
#endif
      POISE_PHASE(c_epi += clock64() - e0;)
      POISE_TIMELINE(if (timeline_writer) g_tile_end_ns[timeline_at] = timeline_now();)
    }
    POISE_PHASE(if (consumer_thread % 128 == 0) {
      atomicAdd(&g_phase_cycles[0], (unsigned long long)(clock64() - c_begin));
      atomicAdd(&g_phase_cycles[1], (unsigned long long)c_wait);
      atomicAdd(&g_phase_cycles[2], (unsigned long long)c_epi);
      atomicAdd(&g_phase_cycles[3], (unsigned long long)c_tiles);
    })
    if constexpr (kDeferredParts > 0) pending.template flush_from<kDeferredParts>(0, lane);
    // TMA stores read shared memory asynchronously: finish them before the CTA exits.
    if (consumer_thread % 128 == 0) ptx::tma_store_wait_all();
  }
  // Clusters: no CTA leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) ptx::cluster_sync();
  // Streamed rows: the producer (thread 0) has made its last wait. Here, where nothing else is live
  // (after its tile loop, the pair kernels' producers spilled 8 more bytes).
  if constexpr (kStreamedRows) {
    if (threadIdx.x == 0 && shape.streamed_rows != nullptr) finish_streamed_rows(shape.streamed_rows);
  }
#endif
}

}  // namespace poise::sm90
