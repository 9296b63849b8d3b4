// Ampere-style asynchronous global -> shared copies (cp.async): they land in shared memory
// without occupying registers, so an epilogue can have many loads in flight next to the 128
// accumulator registers of a 64 x 256 wgmma tile. (Loads into registers were serialized by the
// compiler for lack of registers: measured ~70 us per tile in the SwiGLU-backward epilogue.)
#pragma once

#include <cstdint>

namespace poise::sm90::ptx {

// 16 bytes, cached in L2 only.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until every committed cp.async group of this thread has landed.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace poise::sm90::ptx
