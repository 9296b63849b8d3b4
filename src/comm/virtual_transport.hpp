// VirtualTransport: R ranks inside one process on one GPU.
//
// Each rank gets its own cudaMalloc'ed workspace, error word and epoch; its PeerTable holds the
// plain device addresses of every rank's workspace. Kernels are launched once for all R ranks
// (launch_ranks() == R), the grid split by rank, so a waiting block never waits on a rank that
// has not been launched.
#pragma once

#include <memory>

#include "comm/transport.hpp"

namespace poise::comm {

class VirtualTransport final : public Transport {
 public:
  // Throws InvalidArgument("ep_size") outside [1, kMaxLaunchRanks]; DeviceError on CUDA failure.
  static std::unique_ptr<VirtualTransport> create(int ep_size, size_t workspace_bytes, uint64_t timeout_ns);
  ~VirtualTransport() override;

  int world_size() const override { return world_; }
  int launch_ranks() const override { return world_; }
  int rank_of_slot(int slot) const override { return slot; }
  const PeerTable* device_tables() const override { return tables_; }
  char* local_workspace(int slot) const override { return workspaces_[slot]; }
  const ErrorWord* device_error(int slot) const override { return errors_ + slot; }
  size_t workspace_bytes() const override { return workspace_bytes_; }
  uint64_t timeout_ns() const override { return timeout_ns_; }
  std::vector<ErrorWord> read_errors() const override;
  void reset() override;

 private:
  VirtualTransport() = default;
  int world_ = 0;
  size_t workspace_bytes_ = 0;
  uint64_t timeout_ns_ = 0;
  char* workspaces_[kMaxLaunchRanks] = {};
  ErrorWord* errors_ = nullptr;    // [R]
  uint64_t* epochs_ = nullptr;     // [R]
  uint32_t* arrivals_ = nullptr;   // [R]
  PeerTable* tables_ = nullptr;    // [R]
};

}  // namespace poise::comm
