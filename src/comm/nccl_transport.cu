#include "comm/nccl_transport.hpp"

#include <nccl_device.h>

#include <string>

#include "runtime/cuda_check.hpp"
#include "comm/nccl_check.hpp"
#include "poise/errors.hpp"

namespace poise::comm {

using runtime::cuda_check;
using runtime::cuda_check_launch;
namespace {

// Every LSA peer's workspace address, as this rank dereferences it.
__global__ void fill_lsa_pointers(ncclWindow_t window, PeerTable* table, int lsa_ranks) {
  for (int p = threadIdx.x; p < lsa_ranks; p += blockDim.x) {
    table->base[p] = static_cast<char*>(ncclGetLsaPointer(window, 0, p));
  }
}

}  // namespace

std::unique_ptr<NcclTransport> NcclTransport::create(ncclComm_t comm, size_t workspace_bytes, uint64_t timeout_ns) {
  if (comm == nullptr) throw InvalidArgument("comm", "must not be null");
  std::unique_ptr<NcclTransport> t(new NcclTransport());
  t->comm_ = comm;
  t->timeout_ns_ = timeout_ns;
  nccl_check(ncclCommCount(comm, &t->world_), "ncclCommCount");
  nccl_check(ncclCommUserRank(comm, &t->rank_), "ncclCommUserRank");
  if (t->world_ > kMaxPeers) {
    throw InvalidArgument("comm", "at most " + std::to_string(kMaxPeers) + " ranks, got " + std::to_string(t->world_));
  }
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != t->world_) {
    throw NotAvailable("NcclTransport: the ranks span " + std::to_string(t->world_ / (lsa.nRanks > 0 ? lsa.nRanks : 1)) +
                       " NVLink domains; ranks outside one domain need NCCL GIN, which this build does not implement");
  }
  // Window sizes must be multiples of the registration granularity.
  t->workspace_bytes_ = (workspace_bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                        NCCL_WIN_REQUIRED_ALIGNMENT;
  void* ws = nullptr;
  nccl_check(ncclMemAlloc(&ws, t->workspace_bytes_), "ncclMemAlloc(workspace)");
  t->workspace_ = static_cast<char*>(ws);
  cuda_check(cudaMemset(t->workspace_, 0, t->workspace_bytes_), "cudaMemset(workspace)");
  nccl_check(ncclCommWindowRegister(comm, t->workspace_, t->workspace_bytes_, &t->window_, NCCL_WIN_COLL_SYMMETRIC),
             "ncclCommWindowRegister");
  cuda_check(cudaMalloc(&t->error_, sizeof(ErrorWord)), "cudaMalloc(error word)");
  cuda_check(cudaMalloc(&t->epoch_, sizeof(uint64_t)), "cudaMalloc(epoch)");
  cuda_check(cudaMalloc(&t->arrivals_, sizeof(uint32_t)), "cudaMalloc(arrivals)");
  cuda_check(cudaMalloc(&t->table_, sizeof(PeerTable)), "cudaMalloc(peer table)");
  cuda_check(cudaMalloc(&t->barrier_word_, sizeof(float)), "cudaMalloc(barrier word)");
  PeerTable host;
  host.rank = t->rank_;
  host.world = t->world_;
  host.timeout_ns = timeout_ns;
  host.error = t->error_;
  host.epoch = t->epoch_;
  host.blocks_done = t->arrivals_;
  cuda_check(cudaMemcpy(t->table_, &host, sizeof(PeerTable), cudaMemcpyHostToDevice), "cudaMemcpy(peer table)");
  fill_lsa_pointers<<<1, 64>>>(t->window_, t->table_, t->world_);
  cuda_check_launch("fill_lsa_pointers");
  cuda_check(cudaDeviceSynchronize(), "fill_lsa_pointers");
  t->reset();
  return t;
}

NcclTransport::~NcclTransport() {
  if (window_) ncclCommWindowDeregister(comm_, window_);
  if (workspace_) ncclMemFree(workspace_);
  cudaFree(error_);
  cudaFree(epoch_);
  cudaFree(arrivals_);
  cudaFree(table_);
  cudaFree(barrier_word_);
}

std::vector<ErrorWord> NcclTransport::read_errors() const {
  std::vector<ErrorWord> out(1);
  cuda_check(cudaMemcpy(out.data(), error_, sizeof(ErrorWord), cudaMemcpyDeviceToHost), "cudaMemcpy(error word)");
  return out;
}

void NcclTransport::reset() {
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
  const ErrorWord clean;
  cuda_check(cudaMemcpy(error_, &clean, sizeof(ErrorWord), cudaMemcpyHostToDevice), "reset: error word");
  cuda_check(cudaMemset(epoch_, 0, sizeof(uint64_t)), "reset: epoch");
  cuda_check(cudaMemset(arrivals_, 0, sizeof(uint32_t)), "reset: arrivals");
  cuda_check(cudaMemset(workspace_, 0, kSignalBytes), "reset: signals");
  cuda_check(cudaMemset(barrier_word_, 0, sizeof(float)), "reset: barrier word");
  nccl_check(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat, ncclSum, comm_, nullptr), "reset: ncclAllReduce");
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
}

}  // namespace poise::comm
