// StagedPipeline: routed_experts forward and backward over EP ranks, as separate kernels:
//
//   forward:  route -> dispatch -> fanout -> experts (W13+SwiGLU, W2) -> combine push -> combine reduce
//   backward: dispatch grad_out -> fanout -> experts backward -> combine push -> combine reduce
//
// The experts are the SM90 grouped GEMMs (pipeline/expert_compute.hpp). Their rows GEMMs store
// each y / grad_x row straight into its owner's combine slot, and DGRAD W2 applies the routing
// scores and computes their gradients, which combine-push sends home.
//
// One pipeline serves every rank this process drives: all R virtual ranks (one grid per stage,
// split by rank), or the single rank of a process-per-GPU NCCL group. Arguments come per launch
// slot.
//
// Activation records: backward reads what its forward left (routing layout, balance plan, the
// received x rows with their metadata, h13). Record 0 is the working record; records 1..N
// (PipelineOptions::activation_records) keep other layers' forwards, so several layers can run
// forward before their backwards (activation slots, docs/memory_plan.md). A call names its record;
// the kernels then read and write that record's buffers and window regions (pointers switched per
// call: no copies). Light records (PipelineOptions::light_activation_records, after the full ones)
// keep the layout and h13 but not the received x rows: they share the working record's window
// regions, and their backward dispatches the x rows again first (no routing, no GEMM). Partial
// records (after the light ones) are light records that keep h13 only for rows below
// partial_record_rows: the rest goes to the working record's h13, and their backward also
// recomputes h13 for the groups' rows past that point (a W13 GEMM over row windows the device
// derives from the kept layout: empty when every row fit). A backward
// whose record no longer holds its forward recomputes the forward's routing, dispatch and W13 GEMM
// into it first (no W2 GEMM, no combine: backward needs neither).
//
// Balance modes (Config::balance):
//  - exact: a planner kernel turns the all-gathered counts into a plan (docs/balance.md) so every
//    rank computes at most row_limit = T*K + floor(balance_tolerance * T*K) rows (exactly T*K with
//    tolerance 0), hot experts split over replica slots [E_local, E_local + B) of underloaded
//    ranks. Owners push replica weights during dispatch; backward brings the replicas' fp32 weight
//    gradients back to their owners. Receive rows: row_limit + padding of E_local + B groups.
//  - capacity: every row on its owner (receive rows = receive_capacity_factor * T*K + expert padding).
// An overflow (capacity mode, or exact with B < E_local when the plan cannot be exact) stops the
// call on every rank and check() reports it. Memory and launches never depend on the routing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "comm/transport.hpp"
#include "core/workspace_layout.hpp"
#include "ep/ep_params.hpp"
#include "poise/config.hpp"
#include "poise/context.hpp"

namespace poise::ep {

enum class Stage {
  route,
  dispatch,
  fanout,
  experts,
  combine_push,
  combine_reduce,
  replica_grads,  // exact balance, backward: replica weight gradients added to their owners'
  recompute,      // backward: the forward's route, dispatch, fanout and W13 GEMM again
  redispatch,     // backward from a light record: the forward's dispatch and fanout of x rows again
  recompute_rows, // backward from a partial record: h13 of the rows it did not keep
  end,
};
const char* to_string(Stage stage);

// The order of a pipeline's activation records, known to the pipeline (which kind a record is)
// and to Context (which record a slot's layer position takes): 0 the working record, then the
// whole records, the light ones, the partial ones.
struct RecordOrder {
  int whole = 0, light = 0, partial = 0;
  int whole_record(int64_t i) const { return static_cast<int>(1 + i); }
  int light_record(int64_t i) const { return static_cast<int>(1 + whole + i); }
  int partial_record(int64_t i) const { return static_cast<int>(1 + whole + light + i); }
  // Light and partial records share the working record's window regions (x rows, row metadata).
  bool shares_working_rows(int record) const { return record > whole; }
  bool partial_kind(int record) const { return record > whole + light; }
};

struct PipelineOptions {
  uint64_t timeout_ns = 10'000'000'000ull;  // bound on every wait for a peer
  // Replica slots per rank, B in [0, E_local]; -1: E_local (training default: always exact).
  // Fewer slots save memory; the plan is then exact when slots allow and overflows otherwise.
  int64_t replica_slots = -1;
  // Activation records besides the working record 0 (see above): full ones, then light ones.
  int activation_records = 0;
  int light_activation_records = 0;
  int partial_activation_records = 0;
  int64_t partial_record_rows = 0;  // a multiple of 128, below the receive rows
};

// Host copy of one slot's routing layout (tests, diagnostics).
struct LayoutSnapshot {
  std::vector<int32_t> dest_row_TK;    // [T*K]
  std::vector<int32_t> group_offsets;  // [E_local+1]
  std::vector<int32_t> group_counts;   // [E_local]
  std::vector<int32_t> row_origin;     // [capacity]
  std::vector<int32_t> row_primary;    // [capacity]
  std::vector<int32_t> dest_rank_TK;   // [T*K]
};

// Host copy of one slot's balance plan (exact balance).
struct PlanSnapshot {
  std::vector<int32_t> kept_E;                         // [E]
  std::vector<plan::shared::ReplicaPiece> pieces;      // sorted by expert, then begin
  std::vector<int32_t> group_offsets_RG;               // [R][groups+1]
  bool exact = false;
  int64_t moved_rows = 0, max_rank_rows = 0;
  int64_t row_limit = 0;  // the planner's row limit (with the cost-aware plan, its choice; free entries shift it)
};

class StagedPipeline {
 public:
  // Rows each rank can receive, rounded up to 128: capacity mode, receive_capacity_factor*T*K plus
  // 127 rows of padding per local expert; exact balance, row_limit plus 127 per group (E_local + B).
  static int64_t capacity_rows(const Config& config, int64_t ep_size, const PipelineOptions& options = {});
  // Bytes of the symmetric workspace each rank must register.
  static size_t workspace_bytes(const Config& config, int64_t ep_size, const PipelineOptions& options = {});
  // Device bytes a pipeline will hold per rank: the workspace and the rank's buffers.
  static size_t bytes_per_rank(const Config& config, int64_t ep_size, const PipelineOptions& options = {});
  // Replica slots B the options give (exact balance; 0 in capacity mode).
  static int64_t replica_slots(const Config& config, int64_t ep_size, const PipelineOptions& options = {});

  // All ep_size ranks in this process on the current GPU (virtual ranks).
  static std::unique_ptr<StagedPipeline> create_virtual(const Config& config, int64_t ep_size,
                                                        const PipelineOptions& options = {});
  // Over an existing transport (e.g. comm::NcclTransport), whose workspace holds workspace_bytes()
  // (options.timeout_ns is the transport's own and is ignored here).
  static std::unique_ptr<StagedPipeline> create(const Config& config, std::unique_ptr<comm::Transport> transport,
                                                const PipelineOptions& options = {});
  ~StagedPipeline();

  // Host-validates (InvalidArgument naming "args[slot].field") then enqueues. args: one per launch slot.
  // `record` in [0, records()): where the forward leaves what backward needs, where the backward
  // finds it. recompute: the record does not hold this backward's forward (overwritten, or never
  // kept): rebuild it first from args[].forward.
  void forward(std::span<const ForwardArgs> args, cudaStream_t stream, int record = 0);
  void backward(std::span<const BackwardArgs> args, cudaStream_t stream, int record = 0, bool recompute = false);
  int records() const { return static_cast<int>(record_windows_.size()); }
  const RecordOrder& record_order() const { return record_order_; }

  // Waits for `stream`, then throws DeviceError describing the first device error (rank, phase),
  // root causes (bad id, overflow) before the timeouts they caused. No-op when all is well.
  void check(cudaStream_t stream);
  // Without a sync: throws DeviceError when a call that already ended faulted (a fault stays until
  // reset(); the faulted call's outputs were filled with NaN). A call still running is not seen.
  void raise_if_faulted() const;
  // Clears error words, fault records and synchronization state; needed after a failed call.
  // Collective. Waits for the device first.
  void reset();

  // Fault injection (tests): the expert GEMMs' wait bound, and whether each GEMM's CTA 0 drops its
  // first stage (its consumers' wait then times out and the launch drains).
  void set_gemm_stall_for_tests(uint32_t wait_timeout_ns, bool drop_first_stage) {
    launch_.gemm_wait_timeout_ns = wait_timeout_ns;
    launch_.gemm_drop_first_stage = drop_first_stage;
  }

  // Called on the host before each stage is enqueued (and with Stage::end after the last).
  void set_stage_hook(std::function<void(Stage, cudaStream_t)> hook) { hook_ = std::move(hook); }

  // Device bytes held per launch rank: the symmetric workspace and the rank's buffers, as the
  // workspace layout lists them (what a Context's MemoryPlan sums).
  size_t device_bytes_per_rank() const {
    return transport_->workspace_bytes() + static_cast<size_t>(layout_.buffers.bytes);
  }

  int world_size() const { return transport_->world_size(); }
  int launch_ranks() const { return transport_->launch_ranks(); }
  const EpDims& dims() const { return launch_.dims; }
  // The launch parameters every stage uses (benchmarks time single kernels with them).
  const EpLaunch& launch_params() const { return launch_; }
  comm::Transport& transport() { return *transport_; }
  // Of the latest forward's record.
  LayoutSnapshot snapshot(int slot) const;
  // Routing telemetry of the latest forward into device buffers on `stream`, no sync (one buffer set
  // per launch rank; see launch_routing_stats). InvalidArgument("context") before any forward.
  void routing_stats(std::span<const RoutingStatsOut> per_rank, cudaStream_t stream) const;
  // Exact balance: the plan slot `slot` computed in the last forward (syncs the device).
  PlanSnapshot plan_snapshot(int slot) const;

  // What one record holds: per launch rank, private buffers; per rank, window regions.
  struct RecordBuffers {
    int32_t* dest_row_TK = nullptr;
    int32_t* dest_rank_TK = nullptr;
    int32_t* group_offsets = nullptr;
    int32_t* group_counts = nullptr;
    int32_t* plan_kept_E = nullptr;
    int32_t* plan_piece_first_E = nullptr;
    plan::shared::ReplicaPiece* plan_pieces = nullptr;
    int32_t* plan_group_offsets_RG = nullptr;
    int32_t* plan_stats = nullptr;
    bf16* h13_R2F = nullptr;
  };

  StagedPipeline(const StagedPipeline&) = delete;
  StagedPipeline& operator=(const StagedPipeline&) = delete;

 private:
  StagedPipeline(const Config& config, std::unique_ptr<comm::Transport> transport, const PipelineOptions& options);
  void stage(Stage s, cudaStream_t stream) {
    if (hook_) hook_(s, stream);
  }
  LaunchIo forward_io(std::span<const ForwardArgs> args, bool backward) const;
  LaunchIo backward_io(std::span<const BackwardArgs> args) const;
  // launch_ with `record`'s buffers and window regions in place of the working record's.
  EpLaunch launch_for(int record) const;
  void check_record(int record) const;
  void allocate_rank_buffers(int slot);
  void allocate_fault_records();
  // The faults the call-end kernel copied to the host (no sync), and a message of them, root causes first.
  std::vector<comm::ErrorWord> recorded_faults() const;
  std::string describe_faults(std::vector<comm::ErrorWord> faults) const;
  // A forward's dispatch of x rows (with the replica weight push) and fanout, from l's layout.
  void dispatch_x_rows(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);
  // Backward: what `record` lacks of its forward, rebuilt first (recompute: all the backward reads;
  // a light or partial record: the x rows, and h13 past the rows a partial record kept).
  void restore_record(const EpLaunch& l, const LaunchIo& io, int record, bool recompute, cudaStream_t stream);

  Config config_;
  std::unique_ptr<comm::Transport> transport_;
  layout::WorkspaceLayout layout_;  // what the workspace and each rank's buffers hold
  EpLaunch launch_;
  std::vector<void*> allocations_;             // [slot]: the rank's buffers
  std::vector<RecordBuffers> record_buffers_;  // [record * launch_ranks + slot]
  std::vector<layout::RecordRows> record_windows_;  // [record]
  RecordOrder record_order_;
  int32_t partial_rows_ = 0;
  int replicas_in_window_ = -1;                // record whose replica weights the window holds
  int latest_forward_record_ = 0;
  bool forward_ran_ = false;
  std::function<void(Stage, cudaStream_t)> hook_;
  FaultRecord* fault_records_ = nullptr;  // host-mapped [launch_ranks] (EpLaunch::fault_records)
};

}  // namespace poise::ep
