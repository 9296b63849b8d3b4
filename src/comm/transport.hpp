// Transport: how the ranks of an EP group reach each other's memory.
//
// Every rank owns one symmetric workspace (the same byte layout on every rank). A PeerTable
// gives a rank the address of every peer's workspace as this rank can dereference it (an NCCL
// LSA pointer over NVLink, or a plain device pointer for virtual ranks in one process). Kernels
// move data with ordinary loads/stores through those pointers and synchronize with signal words
// kept at the start of each workspace (see transport_device.cuh).
//
// Implementations: VirtualTransport (R ranks in one process on one GPU) and NcclTransport
// (one rank per process, workspace registered as an NCCL window). The kernels cannot tell them apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace poise::comm {

// Peers a table can address. Virtual ranks are further limited by kMaxLaunchRanks.
inline constexpr int kMaxPeers = 64;

// Ranks one launch can carry (per-rank launch arguments travel by value, see src/ep).
inline constexpr int kMaxLaunchRanks = 8;

// Signal words at the start of every workspace: slot s is written only by rank s.
inline constexpr size_t kSignalBytes = kMaxPeers * sizeof(uint64_t);

// Where a rank was when something went wrong. Stored in the device error word.
enum class Phase : int32_t {
  none = 0,
  route_count = 1,       // counting (token, k) entries per expert
  counts_exchange = 2,   // all-gather of per-expert counts
  route_assign = 3,      // destination rows, capacity check
  dispatch = 4,
  combine = 5,
  dispatch_backward = 6,
  combine_backward = 7,
  barrier_probe = 8,     // the stand-alone barrier used by tests
};

enum class ErrorCode : int32_t {
  ok = 0,
  timeout = 1,             // peer `peer` did not signal within the bound; value = awaited epoch
  capacity_overflow = 2,   // rank `peer` needs `value` receive rows, more than planned
  bad_expert_id = 3,       // ids_TK[token] holds `value`, outside [0, E)
  duplicate_expert_id = 4, // token `token` picks expert `value` more than once
  peer_failed = 5,         // rank `peer` failed (its own error names the cause); this rank stopped
  expert_gemm_fault = 6,   // an expert GEMM of this rank recorded a device fault (value: its fault word)
};

// The first error a rank hits. Written once per call (first writer wins); cleared by reset().
struct ErrorWord {
  int32_t code = 0;    // ErrorCode
  int32_t phase = 0;   // Phase
  int32_t rank = -1;   // the rank that recorded it
  int32_t peer = -1;   // the other rank involved, -1 if none
  int64_t value = 0;   // code-specific detail (see ErrorCode)
  int64_t token = -1;  // the token whose input was bad, -1 if none
};

// A signal value no barrier epoch reaches: a rank that fails writes it into every peer's slot, so
// peers waiting on it stop at once (ErrorCode::peer_failed) instead of after their timeout.
inline constexpr uint64_t kFailedSignal = ~uint64_t{0};

// One rank's view of the group. Lives in device memory; kernels read it by reference.
struct PeerTable {
  int32_t rank = 0;
  int32_t world = 1;
  uint64_t timeout_ns = 0;          // bound on every wait
  char* base[kMaxPeers] = {};       // peer p's workspace, addressable from this rank
  ErrorWord* error = nullptr;       // this rank's error word (local memory)
  uint64_t* epoch = nullptr;        // this rank's barrier epoch (local memory)
  uint32_t* blocks_done = nullptr;  // per-launch arrival counter of this rank's blocks (local)
};

const char* to_string(Phase phase);
const char* to_string(ErrorCode code);
// "rank 2, dispatch: timed out after 100 ms waiting for rank 1" and the like.
std::string describe(const ErrorWord& error, uint64_t timeout_ns);

// Host side of a transport: owns the workspaces and the tables.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int world_size() const = 0;
  // Ranks whose blocks one launch carries: all R for virtual ranks, 1 for a process-per-GPU rank.
  virtual int launch_ranks() const = 0;
  // Global rank of launch slot `slot`.
  virtual int rank_of_slot(int slot) const = 0;
  // Device array [launch_ranks()] of PeerTables.
  virtual const PeerTable* device_tables() const = 0;
  // Device address of slot `slot`'s own workspace.
  virtual char* local_workspace(int slot) const = 0;
  // Device address of slot `slot`'s error word.
  virtual const ErrorWord* device_error(int slot) const = 0;
  virtual size_t workspace_bytes() const = 0;
  virtual uint64_t timeout_ns() const = 0;
  // Error words of this process's ranks (the caller syncs its stream first).
  virtual std::vector<ErrorWord> read_errors() const = 0;
  // Clears error words, epochs, signals and arrival counters. Collective across processes.
  virtual void reset() = 0;
};

}  // namespace poise::comm
