// Device helpers over a PeerTable: peer addresses, signals, bounded waits, barriers.
//
// Ordering model: data goes to peers by plain stores through peer pointers; a rank publishes
// "my stores to you are done" with a release store (system scope) of a growing epoch into its
// own slot of the peer's signal array, and a waiter reads its slots with acquire loads. A wait
// never spins forever: past PeerTable::timeout_ns it records {rank, phase, peer} in the rank's
// error word and gives up. A rank that records an error tells every peer at once (kFailedSignal in
// its signal slots), and once a rank's error word is set, every later kernel of that rank skips
// its work and its waits, so a broken call ends quickly on every rank, until reset().
#pragma once

#include <cstdint>

#include "comm/transport.hpp"

namespace poise::comm {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t load_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// Address of `offset` inside peer `peer`'s workspace.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const PeerTable& pt, int peer, size_t offset) {
  return reinterpret_cast<T*>(pt.base[peer] + offset);
}

__device__ __forceinline__ bool rank_failed(const PeerTable& pt) {
  return load_volatile(&pt.error->code) != 0;
}

// Rank `pt.rank` tells `peer` it reached epoch `epoch`.
__device__ __forceinline__ void signal_peer(const PeerTable& pt, int peer, uint64_t epoch) {
  store_release_sys(peer_ptr<uint64_t>(pt, peer, 0) + pt.rank, epoch);
}

// First error wins; later ones are dropped (the first is the cause). The first also tells every
// peer (kFailedSignal), whose waits on this rank then stop with ErrorCode::peer_failed.
__device__ __forceinline__ void report_error(const PeerTable& pt, ErrorCode code, Phase phase, int peer,
                                             int64_t value, int64_t token = -1) {
  if (atomicCAS(&pt.error->code, 0, static_cast<int32_t>(code)) == 0) {
    pt.error->phase = static_cast<int32_t>(phase);
    pt.error->rank = pt.rank;
    pt.error->peer = peer;
    pt.error->value = value;
    pt.error->token = token;
    __threadfence_system();
    for (int p = 0; p < pt.world; ++p) {
      if (p != pt.rank) signal_peer(pt, p, kFailedSignal);
    }
  }
}

// Waits until `peer` reached `epoch`. False on timeout (error recorded), if the peer failed (error
// recorded) or if this rank failed.
__device__ inline bool wait_peer(const PeerTable& pt, int peer, uint64_t epoch, Phase phase) {
  const uint64_t* slot = peer_ptr<uint64_t>(pt, pt.rank, 0) + peer;
  const uint64_t start = global_timer_ns();
  for (uint64_t seen = load_acquire_sys(slot);; seen = load_acquire_sys(slot)) {
    if (seen == kFailedSignal) {
      report_error(pt, ErrorCode::peer_failed, phase, peer, 0);
      return false;
    }
    if (seen >= epoch) return true;
    if (rank_failed(pt)) return false;
    if (global_timer_ns() - start > pt.timeout_ns) {
      report_error(pt, ErrorCode::timeout, phase, peer, static_cast<int64_t>(epoch));
      return false;
    }
    __nanosleep(128);
  }
}

// All ranks meet. Called by ONE thread per rank; orders everything this rank made visible
// (fenced) before the call with everything peers did before theirs.
// `absent_rank` (tests only) makes that rank skip the barrier, as a crashed peer would.
__device__ inline bool barrier_all(const PeerTable& pt, Phase phase, int absent_rank = -1) {
  if (rank_failed(pt)) return false;
  if (pt.rank == absent_rank) return false;
  const uint64_t epoch = ++*pt.epoch;
  __threadfence_system();
  for (int p = 0; p < pt.world; ++p) signal_peer(pt, p, epoch);
  for (int p = 0; p < pt.world; ++p) {
    if (!wait_peer(pt, p, epoch, phase)) return false;
  }
  return true;
}

// End of a launch that wrote to peers: every block of the rank arrives; the last one to arrive
// runs the barrier, so no block waits while another of its rank still has work to do (at most
// one waiting block per rank: deadlock-free as long as R blocks fit on the GPU at once).
// Every block must call this exactly once, also blocks that skipped their work.
__device__ inline void arrive_then_barrier(const PeerTable& pt, int blocks_per_rank, Phase phase) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t arrived = atomicAdd(pt.blocks_done, 1u) + 1;
    if (arrived == static_cast<uint32_t>(blocks_per_rank)) {
      *pt.blocks_done = 0;  // the next launch is stream-ordered after this one
      __threadfence_system();
      barrier_all(pt, phase);
    }
  }
}

// Warp-cooperative copy of `bytes` (a multiple of sizeof(Unit), both ends Unit-aligned; the ranges
// do not overlap): uint4 for rows of values, uint32_t for rows of fp32 scales. Each lane issues
// kCopyBatch loads before their stores: the compiler cannot hoist a load above the previous store
// (it cannot rule out aliasing), and one 16-byte load in flight per lane leaves a fanout of 14 KiB
// rows at ~1.8 TB/s.
inline constexpr int kCopyBatch = 4;
template <class Unit = uint4>
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane) {
  const Unit* s = static_cast<const Unit*>(src);
  Unit* d = static_cast<Unit*>(dst);
  const size_t n = bytes / sizeof(Unit);
  size_t i = lane;
  for (; i + 32 * (kCopyBatch - 1) < n; i += 32 * kCopyBatch) {
    Unit v[kCopyBatch];
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) v[j] = s[i + 32 * j];
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) d[i + 32 * j] = v[j];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

// warp_copy of one source to several destinations: the row of every lane in `lanes` (each
// lane's `dst`), the source read once. A warp serially copying one row to each would wait a load
// latency per destination (the EP1 dispatch writing a token's 8 rows ran at ~1.9 TB/s that way).
// Every lane runs every iteration: the shuffles need the whole warp (lanes that leave the chunk loop
// at different counts hang it).
template <class Unit = uint4>
__device__ __forceinline__ void warp_copy_to_lanes(void* dst, unsigned lanes, const void* src, size_t bytes,
                                                   int lane) {
  const Unit* s = static_cast<const Unit*>(src);
  const size_t n = bytes / sizeof(Unit);
  for (size_t base = 0; base < n; base += 32 * kCopyBatch) {
    Unit v[kCopyBatch];
#pragma unroll
    for (int j = 0; j < kCopyBatch; ++j) {
      const size_t i = base + lane + 32 * j;
      if (i < n) v[j] = s[i];
    }
    for (unsigned m = lanes; m; m &= m - 1) {
      Unit* d = reinterpret_cast<Unit*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(dst),
                                                    __ffs(m) - 1));
#pragma unroll
      for (int j = 0; j < kCopyBatch; ++j) {
        const size_t i = base + lane + 32 * j;
        if (i < n) d[i] = v[j];
      }
    }
  }
}

}  // namespace poise::comm
