#include "comm/virtual_transport.hpp"

#include <string>

#include "runtime/cuda_check.hpp"
#include "poise/errors.hpp"

namespace poise::comm {

using runtime::cuda_check;

std::unique_ptr<VirtualTransport> VirtualTransport::create(int ep_size, size_t workspace_bytes,
                                                           uint64_t timeout_ns) {
  if (ep_size < 1 || ep_size > kMaxLaunchRanks) {
    throw InvalidArgument("ep_size", "virtual ranks support 1.." + std::to_string(kMaxLaunchRanks) + ", got " +
                                         std::to_string(ep_size));
  }
  if (workspace_bytes < kSignalBytes) {
    throw InvalidArgument("workspace_bytes", "must hold the signal words (" + std::to_string(kSignalBytes) +
                                                 " bytes)");
  }
  std::unique_ptr<VirtualTransport> t(new VirtualTransport());
  t->world_ = ep_size;
  t->workspace_bytes_ = workspace_bytes;
  t->timeout_ns_ = timeout_ns;
  for (int r = 0; r < ep_size; ++r) {
    cuda_check(cudaMalloc(&t->workspaces_[r], workspace_bytes), "cudaMalloc(virtual rank workspace)");
    cuda_check(cudaMemset(t->workspaces_[r], 0, workspace_bytes), "cudaMemset(workspace)");
  }
  cuda_check(cudaMalloc(&t->errors_, sizeof(ErrorWord) * ep_size), "cudaMalloc(error words)");
  cuda_check(cudaMalloc(&t->epochs_, sizeof(uint64_t) * ep_size), "cudaMalloc(epochs)");
  cuda_check(cudaMalloc(&t->arrivals_, sizeof(uint32_t) * ep_size), "cudaMalloc(arrivals)");
  cuda_check(cudaMalloc(&t->tables_, sizeof(PeerTable) * ep_size), "cudaMalloc(peer tables)");

  std::vector<PeerTable> host(ep_size);
  for (int r = 0; r < ep_size; ++r) {
    PeerTable& pt = host[r];
    pt.rank = r;
    pt.world = ep_size;
    pt.timeout_ns = timeout_ns;
    for (int p = 0; p < ep_size; ++p) pt.base[p] = t->workspaces_[p];
    pt.error = t->errors_ + r;
    pt.epoch = t->epochs_ + r;
    pt.blocks_done = t->arrivals_ + r;
  }
  cuda_check(cudaMemcpy(t->tables_, host.data(), sizeof(PeerTable) * ep_size, cudaMemcpyHostToDevice),
             "cudaMemcpy(peer tables)");
  t->reset();
  return t;
}

VirtualTransport::~VirtualTransport() {
  // Destructors never throw: a failed free here only leaks.
  for (char* w : workspaces_) {
    if (w) cudaFree(w);
  }
  cudaFree(errors_);
  cudaFree(epochs_);
  cudaFree(arrivals_);
  cudaFree(tables_);
}

std::vector<ErrorWord> VirtualTransport::read_errors() const {
  std::vector<ErrorWord> out(world_);
  cuda_check(cudaMemcpy(out.data(), errors_, sizeof(ErrorWord) * world_, cudaMemcpyDeviceToHost),
             "cudaMemcpy(error words)");
  return out;
}

void VirtualTransport::reset() {
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
  std::vector<ErrorWord> clean(world_);
  cuda_check(cudaMemcpy(errors_, clean.data(), sizeof(ErrorWord) * world_, cudaMemcpyHostToDevice),
             "reset: error words");
  cuda_check(cudaMemset(epochs_, 0, sizeof(uint64_t) * world_), "reset: epochs");
  cuda_check(cudaMemset(arrivals_, 0, sizeof(uint32_t) * world_), "reset: arrivals");
  for (int r = 0; r < world_; ++r) {
    cuda_check(cudaMemset(workspaces_[r], 0, kSignalBytes), "reset: signals");
  }
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
}

}  // namespace poise::comm
