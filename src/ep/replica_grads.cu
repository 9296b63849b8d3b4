// Exact balance, backward: replica weight (and bias) gradients back to their owners, summed in fp32
// (the owner's gradient may be bf16: then it is rounded once more, after the fp32 sum).
//
// A rank that computed rows of another rank's expert in a replica slot wrote that slot's weight
// gradients (in Config::replica_grad_dtype, bf16 by default: half the bytes on the link; biases in
// fp32; overwritten each backward) into its workspace (replica_grad_w13 / _w2). After
// the backward combine-push barrier every rank's expert backward is complete, so each owner reads
// them from its peers and adds them to its own gradients: for every element, its own value, then
// the replicas in plan order (expert, first row). Fixed order: deterministic, no atomics.
//
// Every block of the grid works through every launched rank's replicated experts in turn (with
// virtual ranks, a per-rank split of the grid left the one hot owner with 1/R of the GPU).
//
// Safe to reuse the replica buffers next call: a peer overwrites them only in its next backward,
// after barriers (next forward) that this rank reaches only once this kernel has finished.
#include "runtime/cuda_check.hpp"
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"

namespace poise::ep {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // float4 loads per thread in flight per source (own + each replica)

// Four gradient elements of the owner's buffer, fp32 or bf16 (rounded once, after the sum).
__device__ __forceinline__ float4 load4(const float* p, size_t i) { return reinterpret_cast<const float4*>(p)[i]; }
__device__ __forceinline__ float4 load4(const bf16* p, size_t i) {
  const uint2 w = reinterpret_cast<const uint2*>(p)[i];
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4(float* p, size_t i, float4 v) { reinterpret_cast<float4*>(p)[i] = v; }
__device__ __forceinline__ void store4(bf16* p, size_t i, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  reinterpret_cast<uint2*>(p)[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                              *reinterpret_cast<const uint32_t*>(&hi));
}

// own[i] += replica pieces' [i] (Replica: fp32 or bf16, added in fp32), for i in this block's share
// of the expert's elements: the whole grid shares every slot's work (with virtual ranks the hot owner
// alone would otherwise get 1/R of the GPU). A bf16 owner gradient is read, summed in fp32 with the
// replicas, rounded once.
template <class Replica, class Grad>
__device__ void add_replicas(const comm::PeerTable& pt, const RankScratch& rs, const EpDims& dims, size_t region,
                             Grad* grad, size_t expert_elems, int first_piece, int end_piece, size_t local) {
  Grad* own = grad + local * expert_elems;
  const size_t vecs = expert_elems / 4;
  const size_t stride = size_t(gridDim.x) * kThreads * kUnroll;
  for (size_t base = size_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < vecs; base += stride) {
    float4 acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * kThreads;
      if (i < vecs) acc[u] = load4(own, i);
    }
    for (int q = first_piece; q < end_piece; ++q) {
      const plan::shared::ReplicaPiece p = rs.plan_pieces[q];
      const Replica* replica = comm::peer_ptr<const Replica>(pt, p.rank, region) +
                               size_t(p.slot - dims.E_local) * expert_elems;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t i = base + size_t(u) * kThreads;
        if (i < vecs) {
          const float4 v = load4(replica, i);
          acc[u].x += v.x, acc[u].y += v.y, acc[u].z += v.z, acc[u].w += v.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + size_t(u) * kThreads;
      if (i < vecs) store4(own, i, acc[u]);
    }
  }
}

template <class Replica, class Grad>
__device__ void add_expert_replicas(const comm::PeerTable& pt, const RankScratch& rs, const EpDims& dims,
                                    const WorkspaceOffsets& ws, const RankIo& rio, int first, int end, size_t local) {
  const size_t w13_elems = size_t(2) * dims.F * dims.D, w2_elems = size_t(dims.D) * dims.F;
  add_replicas<Replica>(pt, rs, dims, ws.replica_grad_w13, static_cast<Grad*>(rio.grad_w13_E2FD), w13_elems, first,
                        end, local);
  add_replicas<Replica>(pt, rs, dims, ws.replica_grad_w2, static_cast<Grad*>(rio.grad_w2_EDF), w2_elems, first, end,
                        local);
  if (!dims.biased) return;
  add_replicas<float>(pt, rs, dims, ws.replica_grad_b13, static_cast<Grad*>(rio.grad_b13_E2F), size_t(2) * dims.F,
                      first, end, local);
  add_replicas<float>(pt, rs, dims, ws.replica_grad_b2, static_cast<Grad*>(rio.grad_b2_ED), size_t(dims.D), first,
                      end, local);
}

template <class Grad>
__device__ void add_expert_replicas(const comm::PeerTable& pt, const RankScratch& rs, const EpDims& dims,
                                    const WorkspaceOffsets& ws, const RankIo& rio, int first, int end, size_t local) {
  if (dims.replica_grad_bf16) add_expert_replicas<bf16, Grad>(pt, rs, dims, ws, rio, first, end, local);
  else add_expert_replicas<float, Grad>(pt, rs, dims, ws, rio, first, end, local);
}

__global__ void __launch_bounds__(kThreads) replica_grad_reduce_kernel(const comm::PeerTable* tables, EpDims dims,
                                                                       WorkspaceOffsets ws, LaunchIo io,
                                                                       LaunchScratch scratch, int launch_ranks) {
  for (int slot = 0; slot < launch_ranks; ++slot) {
    const comm::PeerTable& pt = tables[slot];
    if (comm::rank_failed(pt)) continue;  // uniform over the grid: no barrier follows
    const RankScratch& rs = scratch.rank[slot];
    const RankIo& rio = io.rank[slot];
    for (int local = 0; local < dims.E_local; ++local) {
      const int e = pt.rank * dims.E_local + local;
      const int first = rs.plan_piece_first_E[e], end = rs.plan_piece_first_E[e + 1];
      if (first == end) continue;  // not replicated: nothing to add
      if (dims.wgrad_bf16) add_expert_replicas<bf16>(pt, rs, dims, ws, rio, first, end, local);
      else add_expert_replicas<float>(pt, rs, dims, ws, rio, first, end, local);
    }
  }
}

}  // namespace

void launch_replica_grad_reduce(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  replica_grad_reduce_kernel<<<4 * l.num_sms, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, io, l.scratch,
                                                                      l.launch_ranks);
  runtime::cuda_check_launch("replica_grad_reduce_kernel");
}

}  // namespace poise::ep
