// Combine: expert outputs back to the ranks that own their tokens, then the top-k sum.
//
// The experts' rows GEMMs store every received row's output (y, grad_x) straight into its owner's
// combine buffer at slot t*K+k (one writer per slot, no atomics). Push then only sends backward's
// score gradients and meets the barrier, after which the owners read their slots. Reduce: the
// owner sums its K slots per token in fp32, k in order, and rounds once to bf16, so the result
// does not depend on timing: combine is deterministic by construction.
#include "runtime/cuda_check.hpp"
#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "ep/warp_rows.cuh"

namespace poise::ep {
namespace {

using comm::ErrorCode;
using comm::PeerTable;
using comm::Phase;

// Backward: each received row's score gradient, its pieces summed in order (deterministic), into
// its owner's grad_scores_TK slot.
__device__ void push_score_grads(const PeerTable& pt, const EpDims& dims, const WorkspaceOffsets& ws,
                                 const RankScratch& rs, int blocks_per_rank) {
  const int32_t* row_origin = comm::peer_ptr<int32_t>(pt, pt.rank, ws.row_origin);
  const int TK = dims.T * dims.K;
  const bool lane0 = threadIdx.x % 32 == 0;
  for_each_row_in_use(rs, dims.groups, blocks_per_rank, [&](int r) {
    if (!lane0) return;
    const int origin = row_origin[r];
    const float* parts = rs.grad_score_partials_RP + static_cast<size_t>(r) * dims.score_partials;
    float sum = 0.0f;
    for (int p = 0; p < dims.score_partials; ++p) sum += parts[p];
    comm::peer_ptr<float>(pt, origin / TK, ws.grad_scores_TK)[origin % TK] = sum;
  });
}

template <bool kBackward>
__global__ void __launch_bounds__(kThreads) combine_push_kernel(const PeerTable* tables, EpDims dims,
                                                                WorkspaceOffsets ws, LaunchScratch scratch,
                                                                int blocks_per_rank) {
  const int slot = rank_slot(blocks_per_rank);
  const PeerTable& pt = tables[slot];
  // Every expert GEMM of the call has run: a fault one recorded stops the call on every rank here,
  // before the owners sum rows it may have left wrong.
  const unsigned long long gemm_fault = *reinterpret_cast<volatile unsigned long long*>(scratch.rank[slot].gemm_fault_word);
  if (gemm_fault != 0) {
    comm::report_error(pt, ErrorCode::expert_gemm_fault, kBackward ? Phase::combine_backward : Phase::combine, -1,
                       static_cast<int64_t>(gemm_fault));
  }
  if (kBackward && !comm::rank_failed(pt)) push_score_grads(pt, dims, ws, scratch.rank[slot], blocks_per_rank);
  comm::arrive_then_barrier(pt, blocks_per_rank, kBackward ? Phase::combine_backward : Phase::combine);
}

// One thread per (token, 8 columns).
template <bool kWeighted>
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(const PeerTable* tables, EpDims dims,
                                                                  WorkspaceOffsets ws, LaunchIo io,
                                                                  int blocks_per_rank) {
  const int slot = rank_slot(blocks_per_rank);
  const PeerTable& pt = tables[slot];
  if (comm::rank_failed(pt)) return;
  const RankIo& rio = io.rank[slot];
  const uint4* combine = comm::peer_ptr<uint4>(pt, pt.rank, ws.combine);
  uint4* out = reinterpret_cast<uint4*>(kWeighted ? rio.out_TD : rio.grad_x_TD);
  const int vecs = dims.D / 8;
  const size_t total = static_cast<size_t>(dims.T) * vecs;
  const size_t first = static_cast<size_t>(blockIdx.x % blocks_per_rank) * kThreads + threadIdx.x;
  const size_t stride = static_cast<size_t>(blocks_per_rank) * kThreads;
  if (!kWeighted) {  // backward: the score gradients the experts pushed
    const float* pushed = comm::peer_ptr<float>(pt, pt.rank, ws.grad_scores_TK);
    for (size_t i = first; i < static_cast<size_t>(dims.T) * dims.K; i += stride)
      store_score(rio.grad_scores_TK, i, dims.scores_bf16, rio.ids_TK[i] == kNoExpert ? 0.0f : pushed[i]);
  }
  for (size_t i = first; i < total; i += stride) {
    const size_t t = i / vecs, v = i % vecs;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < dims.K; ++k) {
      if (rio.ids_TK[t * dims.K + k] == kNoExpert) continue;  // free: no expert wrote its slot
      const float w = kWeighted ? load_score(rio.scores_TK, t * dims.K + k, dims.scores_bf16) : 1.0f;
      float y[8];
      unpack8(combine[(t * dims.K + k) * vecs + v], y);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += w * y[j];
    }
    out[i] = pack8(acc);
  }
}

int local_blocks(const EpLaunch& l, size_t work_items, int items_per_block) {
  const size_t want = (work_items + items_per_block - 1) / items_per_block;
  const size_t cap = 4 * static_cast<size_t>(l.num_sms);
  return static_cast<int>(want < 1 ? 1 : (want < cap ? want : cap));
}

template <bool kBackward>
void launch_push(const EpLaunch& l, cudaStream_t stream) {
  const int work_blocks = (l.dims.capacity_rows + kWarps - 1) / kWarps;
  const int blocks = persistent_blocks_per_rank(
      l, reinterpret_cast<const void*>(&combine_push_kernel<kBackward>), kThreads, work_blocks);
  combine_push_kernel<kBackward><<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws,
                                                                                  l.scratch, blocks);
}

}  // namespace

void launch_combine_push(const EpLaunch& l, bool backward, cudaStream_t stream) {
  if (backward) launch_push<true>(l, stream);
  else launch_push<false>(l, stream);
  runtime::cuda_check_launch("combine_push_kernel");
}

void launch_combine_reduce(const EpLaunch& l, const LaunchIo& io, bool backward, cudaStream_t stream) {
  const int blocks = local_blocks(l, static_cast<size_t>(l.dims.T) * (l.dims.D / 8), kThreads);
  if (backward) {
    combine_reduce_kernel<false><<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, io,
                                                                                  blocks);
  } else {
    combine_reduce_kernel<true><<<l.launch_ranks * blocks, kThreads, 0, stream>>>(l.tables, l.dims, l.ws, io,
                                                                                 blocks);
  }
  runtime::cuda_check_launch("combine_reduce_kernel");
}

}  // namespace poise::ep
