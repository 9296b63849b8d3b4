// Device faults of one grouped-GEMM launch, and the bounded waits that turn a hang into one.
//
// A launch records its first fault in its own word (GroupedGemmShape::fault_word, packed as in
// fault_word.hpp): a pipeline wait that ran past wait_timeout_ns, or a row whose index names no
// slot. Every wait is bounded: one that lasts longer than the bound (by %globaltimer, which runs the
// same on every SM, so a CTA preempted and resumed elsewhere measures true time) records the fault
// and returns as if the phase had completed; once a fault is recorded, every wait still pending
// returns after 1 ms. The launch then drains (its outputs are garbage) instead of hanging the
// stream, the CUDA context stays usable, and the host reports the fault (take_pipeline_fault). No
// correct launch waits that long: every TMA load completes, out-of-bounds boxes included. Neither a
// printf nor a trap on this path: a call in a kernel makes ptxas serialize its wgmmas.
#pragma once

#include <cstdint>

#include "gemm/sm90/fault_word.hpp"
#include "gemm/sm90/ptx/mbarrier.cuh"

namespace poise::sm90 {

// The launch's fault word and wait bound, copied into shared memory by thread 0 before the
// kernel's first __syncthreads (every wait reads them only once it has waited 1 ms).
struct LaunchFaults {
  unsigned long long* word;
  unsigned int timeout_ns;  // below 2^32: the waits compare the low word of %globaltimer
};
static __shared__ LaunchFaults s_launch_faults;

// Read through volatile loads where needed, so the compiler cannot hoist them out of the waits and
// hold them in registers through the kernel (that made the consumers spill).
__device__ __forceinline__ unsigned long long* launch_fault_word() {
  unsigned long long p;
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(p) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&s_launch_faults.word))));
  return reinterpret_cast<unsigned long long*>(p);
}
__device__ __forceinline__ unsigned int launch_wait_timeout_ns() {
  unsigned int t;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(t) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&s_launch_faults.timeout_ns))));
  return t;
}

// The word is in global memory: said in the instructions, so the compiler emits no generic-address
// paths (a generic 64-bit CAS also handles shared memory, and the code every wait site inlines grew
// by a third, with the wgrad kernels 8% slower).
__device__ __forceinline__ unsigned long long load_fault_word_volatile(unsigned long long* word) {
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(word) : "memory");
  return v;
}

// Records a fault of kind `barrier` (an mbarrier's shared offset, or PipelineFaultWord::kBadOrigin)
// from this thread, unless one is recorded already: the first fault of a launch wins.
__device__ __forceinline__ void record_fault(unsigned barrier, unsigned parity = 0) {
  const unsigned long long fault = PipelineFaultWord::pack(blockIdx.x, threadIdx.x, barrier, parity);
  [[maybe_unused]] unsigned long long old;  // the CAS must name a destination; the first writer wins
  asm volatile("atom.global.cas.b64 %0, [%1], 0, %2;" : "=l"(old) : "l"(launch_fault_word()), "l"(fault) : "memory");
}

__device__ __forceinline__ unsigned int global_timer_lo_ns() {
  unsigned int t;
  asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t));
  return t;
}

// Polls `ready` until it holds, within the bound above: once a fault is recorded it gives up after
// 1 ms, past the launch's bound it calls `on_timeout` (which records the fault) and returns.
template <class Ready, class OnTimeout>
__device__ __forceinline__ void bounded_wait(Ready ready, OnTimeout on_timeout) {
  if (ready()) return;
  const unsigned int start = global_timer_lo_ns();
  while (!ready()) {
    const unsigned int waited = global_timer_lo_ns() - start;  // unsigned: right across the wrap
    if (waited < (1u << 20)) continue;
    if (load_fault_word_volatile(launch_fault_word()) != 0) return;
    if (waited > launch_wait_timeout_ns()) {
      on_timeout();
      return;
    }
  }
}

// Waits until the phase with parity `parity` of `bar` has completed (or gives up, see above).
__device__ __forceinline__ void wait_barrier(uint64_t* bar, uint32_t parity) {
  bounded_wait([&] { return ptx::mbarrier_try_wait(bar, parity); },
               [&] { record_fault(static_cast<unsigned>(__cvta_generic_to_shared(bar)), parity); });
}

}  // namespace poise::sm90
