// Context and the routed_experts entry points on raw device pointers + cudaStream_t.
//
// Contract (what an EP user must know):
//  - A Context is created collectively: every rank of the EP group creates it with the same Config.
//  - A Context drives launch_ranks() ranks from this process: 1 (one GPU per rank), or all ep_size
//    virtual ranks sharing the current GPU (create_virtual_ranks; tests and single-GPU development).
//  - Calls do not synchronize with the host. Device-side faults (an expert id out of range or picked
//    twice by one token, capacity overflow, a peer that never arrives, an expert-GEMM pipeline wait
//    past its 4 s bound) stop the call on every rank and fill its outputs (and gradients) with NaN.
//    A fault stays until reset(): every later call's outputs are NaN too, and a call raises
//    DeviceError at its entry, naming the fault (kind, rank, phase, value, token), once the faulted
//    call has ended on the device (read from host-mapped memory, no sync); at the latest the call
//    after the faulted one. check() waits for the stream and raises at once;
//    ContextOptions::sync_check (or POISE_SYNC_CHECK=1) does that after every call.
//  - It is sequentially reusable: one call in flight per context, calls ordered on the stream.
//  - After a fault or an aborted call, call reset() (collective) before the next call.
//  - close() releases every buffer; it is collective too. The destructor closes if needed.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "poise/config.hpp"
#include "poise/memory_plan.hpp"
#include "poise/types.hpp"

// Keeps this header free of CUDA headers: cudaStream_t is a pointer to this opaque struct.
struct CUstream_st;
// NCCL's communicator (ncclComm_t == ncclComm*), opaque here: see poise/nccl.hpp.
struct ncclComm;

namespace poise {

using Stream = CUstream_st*;

struct ForwardArgs {
  const void* x_TD = nullptr;          // bf16 [T, D]
  const int32_t* ids_TK = nullptr;     // int32 [T, K], global expert ids, or kNoExpert (-1)
  const void* scores_TK = nullptr;     // scores_dtype [T, K]
  DType scores_dtype = DType::fp32;
  const void* w13 = nullptr;           // bf16 [E_local, 2F, D]
  W13Layout w13_layout = W13Layout::gate_up_blocked;
  const void* w2 = nullptr;            // bf16 [E_local, D, F]
  void* out_TD = nullptr;              // bf16 [T, D]
  // Nullable: int64 [E_local, 2], overwritten with the number of gate inputs above swiglu_limit
  // and of up inputs outside [-limit, limit] over all rows of each local expert (clamped SwiGLU;
  // zeros for plain SwiGLU), counted on h13 as saved (bf16). Set on every rank or on none.
  int64_t* clip_counts_E2 = nullptr;
  // The weights as x @ W (transformers' is_transposed, gpt-oss): w13 [E_local, D, 2F] (columns in
  // w13_layout's order), w2 [E_local, F, D]. The GEMMs read them as stored (no copy). The same on
  // every rank of one call.
  bool weights_transposed = false;
  // Expert biases (gpt-oss), both or neither, on every rank or none: b13 bf16 [E_local, 2F] in
  // W13's row order, added before the activation; b2 bf16 [E_local, D], added before the score.
  const void* b13 = nullptr;
  const void* b2 = nullptr;
  // Config::gemm_precision fp8_block_scaled: the local experts' weights as quantize_fp8_weight_blocks
  // prepared them (poise/fp8.hpp: e4m3 in w13's / w2's shape, fp32 block scales), all four or none,
  // on every rank or none. The call reads them instead of quantizing w13 and w2, which it still
  // takes (exact balance pushes them to replica slots).
  const void* w13_fp8 = nullptr;
  const float* w13_fp8_scales = nullptr;
  const void* w2_fp8 = nullptr;
  const float* w2_fp8_scales = nullptr;
};

struct BackwardArgs {
  ForwardArgs forward;                 // the same inputs as the forward call being differentiated
                                       // (forward.out_TD is not used by backward and may be null)
  const void* grad_out_TD = nullptr;   // bf16 [T, D]
  void* grad_x_TD = nullptr;           // bf16 [T, D]
  void* grad_scores_TK = nullptr;      // scores_dtype [T, K]
  void* grad_w13 = nullptr;            // wgrad_dtype, w13's shape
  void* grad_w2 = nullptr;             // wgrad_dtype, w2's shape
  // With forward.b13 / b2 (required then, null otherwise): wgrad_dtype [E_local, 2F] / [E_local, D].
  void* grad_b13 = nullptr;
  void* grad_b2 = nullptr;
  bool accumulate_wgrad = false;       // add into grad_w13/grad_w2 (and the bias grads) instead of overwriting
  // This call's weight-gradient dtype; unset: Config::wgrad_dtype. The same for every rank of a
  // call. A caller that would only cast fp32 grads down to the weights' bf16 (PyTorch autograd
  // without main_grad) asks for bf16: the GEMMs round their fp32 sums once, to the same bits the
  // cast gives, and write half the bytes.
  std::optional<DType> wgrad_dtype;
  // Config::gemm_precision fp8_block_scaled, optional (all four or none, on every rank or none): the
  // local experts' weights transposed as quantize_fp8_weight_blocks_transposed prepared them
  // (poise/fp8.hpp: w13 e4m3 [E_local, D, 2F] with fp32 scales [E_local, D/128, 2F/128], w2
  // [E_local, F, D] with [E_local, F/128, D/128]), current for forward.w13 / w2: DGRAD reads them
  // instead of quantizing its transposed copies from the BF16 weights (the same bits).
  const void* w13_fp8_t = nullptr;
  const float* w13_fp8_t_scales = nullptr;
  const void* w2_fp8_t = nullptr;
  const float* w2_fp8_t_scales = nullptr;
};

// Where a GPU call's time went, stage by stage (route, dispatch, fanout, experts, combine_push, ...),
// in call order: Context::stage_times after Context::enable_stage_timing.
struct StageTime {
  std::string stage;
  double ms = 0.0;
};
struct StageTimes {
  std::vector<StageTime> forward, backward;  // of the last forward / backward call
};

// Where a forward left what its backward needs (returned by routed_experts_forward). A backward
// given a record that a later forward overwrote (or none kept: index -1) recomputes the part of
// its forward it needs (routing, dispatch, the W13 GEMM) first.
struct ActivationRecord {
  int64_t index = -1;
  uint64_t generation = 0;
};

struct ContextOptions {
  uint64_t wait_timeout_ns = 10'000'000'000ull;  // bound on every wait for a peer; then DeviceError
  // Debugging a bad batch: every call waits for its stream and raises DeviceError in that call (not
  // during a CUDA graph capture). Also on when the environment sets POISE_SYNC_CHECK=1.
  bool sync_check = false;
};

class Context {
 public:
  // One rank of an ep_size group. Creation needs no GPU (it validates and plans); the GPU buffers
  // are allocated by the first call, so run one eager call before capturing a CUDA graph.
  // The GPU path of this factory serves ep_size == 1; for more ranks use create_virtual_ranks
  // (one process, one GPU) or a communicator-backed context (multi-GPU).
  static std::unique_ptr<Context> create(const Config& config, int64_t ep_size, int64_t rank,
                                         const ContextOptions& options = {});
  // All ep_size ranks as virtual ranks on the current GPU, each with its own buffers; calls take
  // one argument set per rank. Allocates now (needs an SM90 GPU).
  static std::unique_ptr<Context> create_virtual_ranks(const Config& config, int64_t ep_size,
                                                       const ContextOptions& options = {});
  // One rank per process over an NCCL communicator (ep_size and rank are the communicator's).
  // Declared in poise/nccl.hpp's library poise_nccl; include poise/nccl.hpp to use it.
  static std::unique_ptr<Context> create_from_nccl(const Config& config, ncclComm* comm,
                                                   const ContextOptions& options = {});
  ~Context();

  const ContextOptions& options() const;
  int64_t launch_ranks() const;  // argument sets per call: 1, or ep_size for virtual ranks
  // Waits for `stream`, then throws DeviceError for the first device-side fault of the last calls.
  void check(Stream stream);
  // Throws DeviceError for a fault of an earlier call that has ended on the device, without waiting:
  // what each call does at its entry, for a caller that replays captured calls as a CUDA graph (the
  // replay runs no host code of the call).
  void raise_if_faulted() const;

  const Config& config() const;
  const MemoryPlan& plan() const;
  // GPU contexts: the device bytes this context holds per rank (communication window and buffers),
  // to compare with plan().total_device_bytes; 0 until its first call allocated them (one rank) or
  // on the CPU reference.
  int64_t device_bytes() const;
  int64_t ep_size() const;
  int64_t rank() const;
  bool closed() const;

  void reset();
  void close();

  // Activation slots (training; sized by the plan: activation_records_per_slot layers kept whole
  // per slot). The next num_moe_layers_in_slot forwards that keep state for backward take layer
  // positions 0, 1, ... of slot `slot`; positions the slot has room for keep their forward's state
  // until that slot is selected again, the others (and forwards past num_moe_layers_in_slot) run
  // from the working buffers and their backward recomputes. Without a selection, forwards run from
  // the working buffers, kept until the next forward. Collective: every rank selects the same
  // slots in the same order.
  void select_activation_slot(int64_t slot, int64_t num_moe_layers_in_slot);
  // Diagnostics: backwards so far that had to rebuild their forward (its record was overwritten).
  int64_t recomputed_forwards() const;

  // Diagnostics: with stage timing on, every GPU call records a CUDA event at each stage boundary
  // (a few microseconds per stage; off by default). stage_times waits for `stream` and returns the
  // last forward's and backward's stages (milliseconds, call order, all launch ranks together).
  void enable_stage_timing(bool on);
  StageTimes stage_times(Stream stream);

  // Routing telemetry of the latest forward, enqueued on `stream` (no host sync; graph-safe), one
  // RoutingStatsOut per launch rank. It reads what that forward left in this context's buffers:
  // call it after the forward and before a call on another layer (its backward may come between).
  // InvalidArgument("context") before any forward.
  void routing_stats(std::span<const RoutingStatsOut> per_launch_rank, Stream stream);

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 private:
  Context(const Config& config, int64_t ep_size, int64_t rank, const ContextOptions& options);
  struct State;
  std::unique_ptr<State> state_;
  friend struct ContextAccess;  // src/api/context_internal.hpp: contexts whose pipeline is built elsewhere
  friend ActivationRecord routed_experts_forward(Context&, std::span<const ForwardArgs>, Stream, bool);
  friend void routed_experts_backward(Context&, std::span<const BackwardArgs>, Stream, const ActivationRecord*);
};

// Validate arguments on the host (InvalidArgument naming the argument), then enqueue on stream.
// One argument set per launch rank (context.launch_ranks()).
// Forward: keep_for_backward = false (evaluation) takes no slot position. Returns where its state is.
// Backward: `record` (null: the latest forward's) names the forward it differentiates; args.forward
// must be that forward's inputs (they rebuild its state when the record was overwritten).
ActivationRecord routed_experts_forward(Context& context, std::span<const ForwardArgs> args_per_rank, Stream stream,
                                        bool keep_for_backward = true);
void routed_experts_backward(Context& context, std::span<const BackwardArgs> args_per_rank, Stream stream,
                             const ActivationRecord* record = nullptr);
inline ActivationRecord routed_experts_forward(Context& context, const ForwardArgs& args, Stream stream,
                                               bool keep_for_backward = true) {
  return routed_experts_forward(context, std::span<const ForwardArgs>(&args, 1), stream, keep_for_backward);
}
inline void routed_experts_backward(Context& context, const BackwardArgs& args, Stream stream,
                                    const ActivationRecord* record = nullptr) {
  routed_experts_backward(context, std::span<const BackwardArgs>(&args, 1), stream, record);
}

}  // namespace poise
