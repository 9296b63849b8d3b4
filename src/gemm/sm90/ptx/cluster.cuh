// Thread-block-cluster primitives for 2-CTA TMA multicast: the two CTAs of a cluster compute
// vertically adjacent tiles that share their B operand, each loads half of B and multicasts it
// into both CTAs' shared memory, so B crosses L2 -> SM once per pair instead of once per CTA.
#pragma once

#include <cuda.h>
#include <cuda/ptx>
#include <cstdint>

namespace poise::sm90::ptx {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster; not .aligned, so divergent threads may call it.
// Release/acquire: barrier initialisation before it is visible to the peer after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset as `bar` in CTA `cta` of the cluster
// (this CTA included). Default semantics (release at CTA scope): what the arrival publishes is
// that this warp's wgmmas finished reading the stage, which the peer's TMA then overwrites; a
// cluster-scope release here made every arrival a heavy fence (the GEMMs ran 30% slower).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// A 32-bit store into the shared memory of CTA `cta` of the cluster, at `p`'s offset.
__device__ __forceinline__ void st_shared_cluster_b32(const void* p, uint32_t cta, uint32_t v) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(cta));
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
}
// Orders this thread's shared-memory accesses at cluster scope (a value handed to the peer through
// its shared memory, then signalled by a remote mbarrier arrival, or read after that arrival).
__device__ __forceinline__ void fence_cluster() { asm volatile("fence.acq_rel.cluster;" ::: "memory"); }

// One 2D box into `smem_dst` of every CTA in `cta_mask`, each completing bytes on its own mbarrier
// at `full_bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* map, int32_t inner,
                                                      int32_t outer, uint64_t* full_bar, uint16_t cta_mask) {
  const int32_t coords[2] = {inner, outer};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem_dst, map, coords,
                                  full_bar, cta_mask);
}

}  // namespace poise::sm90::ptx
