// The end of every call: a rank that faulted (its error word, or its expert GEMMs' fault word) has
// its fault copied where the host reads it without a sync (EpLaunch::fault_records, host-mapped),
// and this call's outputs filled with NaN, so nothing a faulted call or any call after it (the
// fault stays until reset) returns can pass for a result: the loss shows it, the next call raises.
#include <cuda_bf16.h>

#include <cmath>

#include "ep/data_path.hpp"
#include "ep/rank_view.cuh"
#include "runtime/cuda_check.hpp"

namespace poise::ep {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerRank = 32;

template <class T>
__device__ void fill_nan(T* p, int64_t n, int64_t first, int64_t stride) {
  T nan_value;
  if constexpr (sizeof(T) == 2) nan_value = __float2bfloat16(NAN);
  else nan_value = NAN;
  for (int64_t i = first; i < n; i += stride) p[i] = nan_value;
}

// Fills n elements of a bf16 or fp32 tensor (nullable) with NaN, grid-stride over the rank's blocks.
__device__ void fill_nan(void* p, bool is_bf16, int64_t n, int64_t first, int64_t stride) {
  if (p == nullptr) return;
  if (is_bf16) fill_nan(static_cast<bf16*>(p), n, first, stride);
  else fill_nan(static_cast<float*>(p), n, first, stride);
}

__global__ void __launch_bounds__(kThreads) call_end_kernel(const comm::PeerTable* tables, EpDims dims,
                                                            LaunchIo io, LaunchScratch scratch,
                                                            FaultRecord* records, bool backward) {
  const int slot = blockIdx.x / kBlocksPerRank;
  const comm::PeerTable& pt = tables[slot];
  const unsigned long long gemm_fault =
      *reinterpret_cast<volatile unsigned long long*>(scratch.rank[slot].gemm_fault_word);
  if (!comm::rank_failed(pt) && gemm_fault == 0) return;
  if (blockIdx.x % kBlocksPerRank == 0 && threadIdx.x == 0) {
    volatile FaultRecord& record = records[slot];
    const int32_t code = pt.error->code != 0 ? pt.error->code : static_cast<int32_t>(comm::ErrorCode::expert_gemm_fault);
    record.error.phase = pt.error->phase;
    record.error.rank = pt.error->code != 0 ? pt.error->rank : pt.rank;
    record.error.peer = pt.error->peer;
    record.error.value = pt.error->value;
    record.error.token = pt.error->token;
    record.gemm_fault_word = gemm_fault;
    __threadfence_system();
    record.error.code = code;  // last: the host reads a record whose code is set
    __threadfence_system();
  }
  const RankIo& r = io.rank[slot];
  const int64_t first = static_cast<int64_t>(blockIdx.x % kBlocksPerRank) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(kBlocksPerRank) * kThreads;
  const int64_t TD = int64_t(dims.T) * dims.D, TK = int64_t(dims.T) * dims.K;
  const int64_t w13 = int64_t(dims.E_local) * 2 * dims.F * dims.D, w2 = int64_t(dims.E_local) * dims.D * dims.F;
  if (!backward) {
    fill_nan(r.out_TD, TD, first, stride);
    return;
  }
  fill_nan(r.grad_x_TD, TD, first, stride);
  fill_nan(r.grad_scores_TK, dims.scores_bf16 != 0, TK, first, stride);
  fill_nan(r.grad_w13_E2FD, dims.wgrad_bf16 != 0, w13, first, stride);
  fill_nan(r.grad_w2_EDF, dims.wgrad_bf16 != 0, w2, first, stride);
}

}  // namespace

void launch_call_end(const EpLaunch& l, const LaunchIo& io, bool backward, cudaStream_t stream) {
  call_end_kernel<<<l.launch_ranks * kBlocksPerRank, kThreads, 0, stream>>>(l.tables, l.dims, io, l.scratch,
                                                                           l.fault_records, backward);
  runtime::cuda_check_launch("call_end_kernel");
}

}  // namespace poise::ep
