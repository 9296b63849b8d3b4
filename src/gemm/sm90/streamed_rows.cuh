// Streamed rows (expert_mlp.hpp, StreamedRows): a rows-as-M GEMM whose A operand is still being
// written by the kernel before it. The writer publishes each 128-row block of the grouped rows with
// a release store of (generation + 1); the GEMM's TMA producer acquires it before the tile's first
// A load. TMA reads through the async proxy what the writer stored through the generic proxy, so
// both sides fence between the proxies. The GEMM's last CTA advances the generation, which makes
// the block words of this call stale for the next without resetting them.
#pragma once

#include <cuda/ptx>
#include <cstdint>

#include "gemm/sm90/ptx/mbarrier.cuh"

namespace poise::sm90 {

// Whether a rows-as-M GEMM's epilogue kind takes a streamed A operand (Epilogue::kStreamedRows).
template <class Epilogue>
__host__ __device__ constexpr bool streams_rows() {
  if constexpr (requires { Epilogue::kStreamedRows; }) return Epilogue::kStreamedRows;
  else return false;
}

struct StreamedRowsWords {
  static constexpr int kGeneration = 0;
  static constexpr int kCtasDone = 1;
  static constexpr int kBlocks = 2;  // then B block words, then B rows-done counters
  __host__ __device__ static constexpr int64_t blocks(int64_t max_rows) { return (max_rows + 127) / 128; }
  __host__ __device__ static constexpr int64_t count(int64_t max_rows) { return kBlocks + 2 * blocks(max_rows); }
};

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// GEMM producer: waits until row block `block` of this call is published, bounded like every
// pipeline wait (a timed-out one records PipelineFaultWord::kStreamedRows and returns).
__device__ __forceinline__ void wait_for_streamed_block(const uint32_t* words, int32_t block) {
  // The generation only moves at the end of this launch, after every producer's last wait.
  const uint32_t published = ld_relaxed_gpu(words + StreamedRowsWords::kGeneration) + 1;
  const uint32_t* word = words + StreamedRowsWords::kBlocks + block;
  ptx::bounded_wait([&] { return ld_acquire_gpu(word) == published; },
                    [] { ptx::record_fault(ptx::PipelineFaultWord::kStreamedRows); });
  cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the generic-proxy rows, to TMA's reads
}

// GEMM producer, after its last tile: the last CTA of the launch advances the generation.
__device__ __forceinline__ void finish_streamed_rows(uint32_t* words) {
  if (atomicAdd(words + StreamedRowsWords::kCtasDone, 1u) == gridDim.x - 1) {
    words[StreamedRowsWords::kCtasDone] = 0;
    atomicAdd(words + StreamedRowsWords::kGeneration, 1u);
  }
}

}  // namespace poise::sm90
