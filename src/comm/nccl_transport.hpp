// NcclTransport: one rank per process (one GPU each), the symmetric workspace allocated with
// ncclMemAlloc and registered once as an NCCL window; peers are reached through their LSA
// (load/store accessible, i.e. NVLink) pointers, read from the window on the device.
//
// The kernels see the same PeerTable as with virtual ranks (launch_ranks() == 1).
// Ranks outside one NVLink domain would need NCCL GIN: not built yet, create() says so.
#pragma once

#include <nccl.h>

#include <memory>

#include "comm/transport.hpp"

namespace poise::comm {

class NcclTransport final : public Transport {
 public:
  // Collective over `comm` (every rank calls it with the same workspace_bytes). Throws
  // NotAvailable when the ranks span more than one LSA (NVLink) domain, DeviceError on failure.
  static std::unique_ptr<NcclTransport> create(ncclComm_t comm, size_t workspace_bytes, uint64_t timeout_ns);
  ~NcclTransport() override;

  int world_size() const override { return world_; }
  int launch_ranks() const override { return 1; }
  int rank_of_slot(int) const override { return rank_; }
  const PeerTable* device_tables() const override { return table_; }
  char* local_workspace(int) const override { return workspace_; }
  const ErrorWord* device_error(int) const override { return error_; }
  size_t workspace_bytes() const override { return workspace_bytes_; }
  uint64_t timeout_ns() const override { return timeout_ns_; }
  std::vector<ErrorWord> read_errors() const override;
  // Collective: clears this rank's state, then an all-reduce keeps any rank from signalling
  // before every rank has cleared.
  void reset() override;

 private:
  NcclTransport() = default;
  ncclComm_t comm_ = nullptr;
  int world_ = 0, rank_ = 0;
  size_t workspace_bytes_ = 0;
  uint64_t timeout_ns_ = 0;
  char* workspace_ = nullptr;  // ncclMemAlloc
  ncclWindow_t window_ = nullptr;
  ErrorWord* error_ = nullptr;
  uint64_t* epoch_ = nullptr;
  uint32_t* arrivals_ = nullptr;
  PeerTable* table_ = nullptr;
  float* barrier_word_ = nullptr;  // all-reduce target of reset()
};

}  // namespace poise::comm
