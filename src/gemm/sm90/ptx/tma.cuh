// TMA (bulk tensor copy) loads into shared memory, completing on an mbarrier.
#pragma once

#include <cuda.h>
#include <cuda/ptx>
#include <cstdint>

namespace poise::sm90::ptx {

// Copies one 2D box at (inner, outer) element coordinates of `map` into `smem_dst`.
// Rows/columns outside the tensor are zero-filled by the hardware.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int32_t inner,
                                            int32_t outer, uint64_t* full_bar) {
  const int32_t coords[2] = {inner, outer};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem_dst,
                                  map, coords, full_bar);
}

// Stores one 2D box from shared memory (laid out as the map's swizzle expects) to global memory
// at (inner, outer); an asynchronous bulk group of the issuing thread.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* smem_src, int32_t inner,
                                             int32_t outer) {
  const int32_t coords[2] = {inner, outer};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, map, coords, smem_src);
}
// Adds one 2D box from shared memory into global memory at (inner, outer), element-wise in the
// map's type, done by the memory system (no read back to the SM); a bulk group like a store.
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* smem_src, int32_t inner,
                                                  int32_t outer) {
  const int32_t coords[2] = {inner, outer};
  cuda::ptx::cp_reduce_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add, map,
                                         coords, smem_src);
}
__device__ __forceinline__ void tma_store_commit() { cuda::ptx::cp_async_bulk_commit_group(); }
// The issuing thread's stores but the kPending most recent groups have finished reading shared
// memory (their buffers may be rewritten).
template <int kPending = 0>
__device__ __forceinline__ void tma_store_wait_read() {
  cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kPending>{});
}
// The issuing thread's stores are complete (before the CTA exits).
__device__ __forceinline__ void tma_store_wait_all() { cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{}); }

// Warms the descriptor cache so the first loads of a tile do not wait on the descriptor fetch.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders this thread's ordinary shared-memory writes before later async-proxy (wgmma/TMA) access.
__device__ __forceinline__ void fence_async_shared() {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
}

}  // namespace poise::sm90::ptx
