// mbarrier helpers: thin names over cuda::ptx for the producer/consumer pipeline.
// A "full" barrier completes when the copy engine has landed a stage's bytes; an "empty" barrier
// completes when every consumer warp has finished reading that stage.
#pragma once

#include <cuda/ptx>
#include <cstdint>
#include <cstdio>

namespace poise::sm90::ptx {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  cuda::ptx::mbarrier_init(bar, arrivals);
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}

// Producer: announce `bytes` of TMA traffic for this phase and count as one arrival.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                             cuda::ptx::space_shared, bar, bytes);
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  (void)cuda::ptx::mbarrier_arrive(bar);
}

// Every wait is bounded. One that lasts longer than g_mbarrier_timeout_ns (of %globaltimer, which
// runs the same on every SM, so a CTA preempted and resumed elsewhere measures true time) records
// the first such fault in g_pipeline_fault and returns as if the phase had completed; once a fault
// is recorded, every wait still pending returns after 1 ms. The launch then drains (its outputs are
// garbage) instead of hanging the stream, the CUDA context stays usable, and the host reports the
// fault (expert_mlp.cu, take_pipeline_fault). No correct launch waits that long: every TMA load
// completes, out-of-bounds boxes included. Neither a printf nor a trap on this path: a call in a
// kernel makes ptxas serialize its wgmmas, and a trap made it spill ~1800 instructions' worth
// across the kernels; debugging builds (-DPOISE_MBARRIER_WATCHDOG=1) print the block, thread,
// barrier and parity and trap. Only the SM90 GEMM translation unit includes this header.
#ifndef POISE_MBARRIER_WATCHDOG
#define POISE_MBARRIER_WATCHDOG 0
#endif
// In ns; below 2^32 (the waits compare the low word of %globaltimer: one register).
inline constexpr unsigned int kDefaultWaitTimeoutNs = 4'000'000'000u;
static __device__ unsigned int g_mbarrier_timeout_ns = kDefaultWaitTimeoutNs;

// The fault word: 0, or the first timed-out wait as bit 63 | block << 32 | thread << 20 |
// barrier shared-memory offset (18 bits) << 1 | parity. Packed on the device, unpacked on the host.
struct PipelineFaultWord {
  static constexpr unsigned long long kValid = 1ull << 63;
  // Barrier field of a fault that is no wait: a fused combine's row with a token out of range (no
  // barrier lives at this offset: shared memory ends below 0x3ffff).
  static constexpr unsigned kBadToken = 0x3ffffu;
  // A WGRAD side combine's row index outside the grouped rows (token_combine.cuh).
  static constexpr unsigned kBadRow = 0x3fffeu;
  // A GEMM producer's wait for a streamed row block (streamed_rows.cuh) that timed out.
  static constexpr unsigned kStreamedRows = 0x3fffdu;
  __host__ __device__ static constexpr unsigned long long pack(unsigned block, unsigned thread, unsigned barrier,
                                                               unsigned parity) {
    return kValid | (static_cast<unsigned long long>(block) << 32) | (static_cast<unsigned long long>(thread) << 20) |
           (static_cast<unsigned long long>(barrier & 0x3ffffu) << 1) | (parity & 1u);
  }
  static constexpr unsigned block(unsigned long long w) { return static_cast<unsigned>((w >> 32) & 0x7fffffffu); }
  static constexpr unsigned thread(unsigned long long w) { return static_cast<unsigned>((w >> 20) & 0xfffu); }
  static constexpr unsigned barrier(unsigned long long w) { return static_cast<unsigned>((w >> 1) & 0x3ffffu); }
  static constexpr unsigned parity(unsigned long long w) { return static_cast<unsigned>(w & 1u); }
};
static __device__ unsigned long long g_pipeline_fault = 0;

// Records a fault that is no mbarrier wait (`kind`: PipelineFaultWord::kBadToken / kBadRow /
// kStreamedRows) from this thread, unless one is recorded already: the first fault of a launch
// wins, the host reads it.
__device__ __forceinline__ void record_fault(unsigned kind) {
  atomicCAS(&g_pipeline_fault, 0ull, PipelineFaultWord::pack(blockIdx.x, threadIdx.x, kind, 0));
}

__device__ __forceinline__ unsigned int global_timer_lo_ns() {
  unsigned int t;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t));
  return t;
}

// Polls `ready` until it holds, within the bound above: once a fault is recorded it gives up after
// 1 ms, past g_mbarrier_timeout_ns it calls `on_timeout` (which records the fault) and returns. Every
// pipeline wait is one of these (the mbarrier waits below, the streamed rows' block waits).
template <class Ready, class OnTimeout>
__device__ __forceinline__ void bounded_wait(Ready ready, OnTimeout on_timeout) {
  if (ready()) return;
  const unsigned int start = global_timer_lo_ns();
  while (!ready()) {
    const unsigned int waited = global_timer_lo_ns() - start;  // unsigned: right across the wrap
    if (waited < (1u << 20)) continue;
    if (*reinterpret_cast<volatile unsigned long long*>(&g_pipeline_fault) != 0) return;
    if (waited > g_mbarrier_timeout_ns) {
      on_timeout();
      return;
    }
  }
}

// Waits until the phase with parity `parity` has completed (or gives up, see above).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  bounded_wait([&] { return cuda::ptx::mbarrier_try_wait_parity(bar, parity); },
               [&] {
#if POISE_MBARRIER_WATCHDOG
                 printf("poise sm90: mbarrier wait timed out: block %d thread %d, barrier at smem %u, parity %u\n",
                        blockIdx.x, threadIdx.x, static_cast<unsigned>(__cvta_generic_to_shared(bar)), parity);
                 __trap();
#endif
                 atomicCAS(&g_pipeline_fault, 0ull,
                           PipelineFaultWord::pack(blockIdx.x, threadIdx.x,
                                                   static_cast<unsigned>(__cvta_generic_to_shared(bar)), parity));
               });
}

}  // namespace poise::sm90::ptx
