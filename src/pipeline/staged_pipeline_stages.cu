// StagedPipeline's forward and backward: the call's arguments checked, then the stage sequences
// (pipeline/staged_pipeline.hpp), each stage announced to the hook before it is enqueued.
#include "pipeline/staged_pipeline.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "ep/data_path.hpp"
#include "pipeline/expert_compute.hpp"
#include "pipeline/pipeline_checks.hpp"
#include "poise/errors.hpp"

namespace poise::ep {
namespace {

std::string arg_name(int slot, const char* field) { return "args[" + std::to_string(slot) + "]." + field; }

void require_pointer(const void* p, int slot, const char* field, size_t alignment) {
  require(p != nullptr, arg_name(slot, field), "must not be null");
  require(reinterpret_cast<uintptr_t>(p) % alignment == 0, arg_name(slot, field),
          "must be " + std::to_string(alignment) + "-byte aligned");
}

// `backward`: the forward's inputs of a backward call (its out_TD is never used and may be null).
void validate_forward_args(const ForwardArgs& a, int slot, const ForwardArgs& first, bool backward) {
  require_pointer(a.x_TD, slot, "x_TD", 16);
  require_pointer(a.ids_TK, slot, "ids_TK", 4);
  require_pointer(a.scores_TK, slot, "scores_TK", a.scores_dtype == DType::fp32 ? 4 : 2);
  require_pointer(a.w13, slot, "w13", 16);
  require_pointer(a.w2, slot, "w2", 16);
  if (!backward) require_pointer(a.out_TD, slot, "out_TD", 16);
  require(a.scores_dtype == first.scores_dtype, arg_name(slot, "scores_dtype"),
          "must be the same on every rank of one call");
  require(a.w13_layout == first.w13_layout, arg_name(slot, "w13_layout"), "must be the same on every rank of one call");
  require(a.weights_transposed == first.weights_transposed, arg_name(slot, "weights_transposed"),
          "must be the same on every rank of one call");
  require((a.b13 == nullptr) == (a.b2 == nullptr), arg_name(slot, a.b13 ? "b2" : "b13"),
          "expert biases go together: set b13 and b2, or neither");
  require((a.b13 == nullptr) == (first.b13 == nullptr), arg_name(slot, "b13"),
          "must be set on every rank of one call or on none");
  if (a.b13) {
    require_pointer(a.b13, slot, "b13", 16);
    require_pointer(a.b2, slot, "b2", 16);
  }
  require((a.clip_counts_E2 == nullptr) == (first.clip_counts_E2 == nullptr), arg_name(slot, "clip_counts_E2"),
          "must be set on every rank of one call or on none");
  if (a.clip_counts_E2) require_pointer(a.clip_counts_E2, slot, "clip_counts_E2", 8);
}

// One set of prepared FP8 weights: w13's values and scales, then w2's, each with its field name.
struct PreparedSet {
  std::array<const void*, 4> pointers;
  std::array<const char*, 4> names;
  bool set() const { return std::any_of(pointers.begin(), pointers.end(), [](const void* p) { return p != nullptr; }); }
};
PreparedSet forward_set(const ForwardArgs& a) {
  return {{a.w13_fp8, a.w13_fp8_scales, a.w2_fp8, a.w2_fp8_scales},
          {"w13_fp8", "w13_fp8_scales", "w2_fp8", "w2_fp8_scales"}};
}
PreparedSet transposed_set(const BackwardArgs& a) {
  return {{a.w13_fp8_t, a.w13_fp8_t_scales, a.w2_fp8_t, a.w2_fp8_t_scales},
          {"w13_fp8_t", "w13_fp8_t_scales", "w2_fp8_t", "w2_fp8_t_scales"}};
}

// Prepared FP8 weights (ForwardArgs::w13_fp8 ..., BackwardArgs::w13_fp8_t ...): only where the GEMMs
// are FP8, all four (the missing one named), values 16-byte aligned (TMA), scales 4; on every rank
// or none.
void validate_prepared_set(const PreparedSet& p, int slot, const PreparedSet& first, bool fp8) {
  if (p.set()) {
    require(fp8, arg_name(slot, p.names[0]), "prepared FP8 weights are read only with gemm_precision fp8_block_scaled");
    for (int i = 0; i < 4; ++i) require_pointer(p.pointers[i], slot, p.names[i], i % 2 == 0 ? 16 : 4);
  }
  require(p.set() == first.set(), arg_name(slot, p.names[0]),
          "prepared FP8 weights must be set on every rank of one call or on none");
}

// The forward's; Config::prepared_fp8_weights (`required`): every forward passes them (no scratch
// to quantize into).
void validate_prepared_fp8(const ForwardArgs& a, int slot, const ForwardArgs& first, bool fp8, bool required) {
  const PreparedSet set = forward_set(a);
  require(set.set() || !required, arg_name(slot, "w13_fp8"),
          "Config::prepared_fp8_weights: every forward passes the prepared FP8 weights (w13_fp8, w13_fp8_scales, "
          "w2_fp8, w2_fp8_scales); the plan holds no scratch to quantize w13 and w2 into");
  validate_prepared_set(set, slot, forward_set(first), fp8);
}

// gemm_precision fp8_block_scaled: what the FP8 GEMMs do not take yet (sm90/expert_mlp_fp8.hpp).
void require_fp8_built(const ForwardArgs& a, int slot) {
  const auto refuse = [&](bool asked, const char* field, const char* what) {
    if (asked) {
      throw NotAvailable(arg_name(slot, field) + ": " + what +
                         " is not built for gemm_precision fp8_block_scaled on the GPU yet");
    }
  };
  refuse(a.w13_layout == W13Layout::gate_up_interleaved, "w13_layout", "the interleaved W13 layout");
  refuse(a.weights_transposed, "weights_transposed", "transposed weights");
  refuse(a.b13 != nullptr, "b13", "expert biases");
}

// What a call's arguments (the same on every rank, checked above) tell the kernels, and the score
// pieces per row its DGRAD W2 (and bias gradients) write.
void set_call_dims(EpDims& d, const ForwardArgs& a) {
  d.scores_bf16 = a.scores_dtype == DType::bf16;
  d.w13_interleaved = a.w13_layout == W13Layout::gate_up_interleaved;
  d.weights_transposed = a.weights_transposed ? 1 : 0;
  d.biased = a.b13 != nullptr ? 1 : 0;
  d.score_partials = static_cast<int32_t>(sm90::dgrad_w2_score_partials(expert_mlp_shape(d)));
}

}  // namespace

const char* to_string(Stage s) {
  switch (s) {
    case Stage::route: return "route";
    case Stage::dispatch: return "dispatch";
    case Stage::fanout: return "fanout";
    case Stage::experts: return "experts";
    case Stage::combine_push: return "combine_push";
    case Stage::combine_reduce: return "combine_reduce";
    case Stage::replica_grads: return "replica_grads";
    case Stage::recompute: return "recompute";
    case Stage::redispatch: return "redispatch";
    case Stage::recompute_rows: return "recompute_rows";
    case Stage::end: return "end";
  }
  return "?";
}

LaunchIo StagedPipeline::forward_io(std::span<const ForwardArgs> args, bool backward) const {
  require(static_cast<int>(args.size()) == launch_.launch_ranks, "args",
          "needs one entry per launch slot (" + std::to_string(launch_.launch_ranks) + "), got " +
              std::to_string(args.size()));
  LaunchIo io;
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const ForwardArgs& a = args[s];
    validate_forward_args(a, s, args[0], backward);
    validate_prepared_fp8(a, s, args[0], launch_.dims.fp8 != 0, config_.prepared_fp8_weights && !backward);
    if (launch_.dims.fp8) require_fp8_built(a, s);
    RankIo& r = io.rank[s];
    r.x_TD = static_cast<const bf16*>(a.x_TD);
    r.ids_TK = a.ids_TK;
    r.scores_TK = a.scores_TK;
    r.w13_E2FD = static_cast<const bf16*>(a.w13);
    r.w2_EDF = static_cast<const bf16*>(a.w2);
    r.w13_fp8 = static_cast<const uint8_t*>(a.w13_fp8);
    r.w13_fp8_scales = a.w13_fp8_scales;
    r.w2_fp8 = static_cast<const uint8_t*>(a.w2_fp8);
    r.w2_fp8_scales = a.w2_fp8_scales;
    r.b13_E2F = static_cast<const bf16*>(a.b13);
    r.b2_ED = static_cast<const bf16*>(a.b2);
    r.out_TD = static_cast<bf16*>(a.out_TD);
    r.clip_counts_E2 = backward ? nullptr : a.clip_counts_E2;
  }
  return io;
}

void StagedPipeline::check_record(int record) const {
  require(record >= 0 && record < records(), "record",
          "must be in [0, " + std::to_string(records()) + "), got " + std::to_string(record));
}

void StagedPipeline::dispatch_x_rows(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  quantize_tokens_fp8(l, io, stream);
  launch_dispatch_forward(l, io, stream);
  launch_fanout_rows(l, /*backward=*/false, stream);
}

void StagedPipeline::forward(std::span<const ForwardArgs> args, cudaStream_t stream, int record) {
  check_record(record);
  const LaunchIo io = forward_io(args, /*backward=*/false);
  EpLaunch l = launch_for(record);
  set_call_dims(l.dims, args[0]);
  stage(Stage::route, stream);
  launch_route(l, io, stream);
  stage(Stage::dispatch, stream);
  quantize_tokens_fp8(l, io, stream);
  launch_dispatch_forward(l, io, stream);
  replicas_in_window_ = record;
  latest_forward_record_ = record;
  forward_ran_ = true;
  stage(Stage::fanout, stream);
  launch_fanout_rows(l, /*backward=*/false, stream);
  stage(Stage::experts, stream);
  expert_forward(l, io, stream);
  const bool clip_counts = io.rank[0].clip_counts_E2 != nullptr;
  if (clip_counts) launch_clip_count_groups(l, stream);
  stage(Stage::combine_push, stream);
  launch_combine_push(l, /*backward=*/false, stream);
  stage(Stage::combine_reduce, stream);
  if (clip_counts) launch_clip_count_reduce(l, io, stream);
  launch_combine_reduce(l, io, /*backward=*/false, stream);
  launch_call_end(l, io, /*backward=*/false, stream);
  stage(Stage::end, stream);
}

// forward_io of the forward's inputs, with the backward's own arguments checked and added.
LaunchIo StagedPipeline::backward_io(std::span<const BackwardArgs> args) const {
  std::vector<ForwardArgs> fwd;
  for (const BackwardArgs& a : args) fwd.push_back(a.forward);
  LaunchIo io = forward_io(fwd, /*backward=*/true);
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const BackwardArgs& a = args[s];
    require_pointer(a.grad_out_TD, s, "grad_out_TD", 16);
    require_pointer(a.grad_x_TD, s, "grad_x_TD", 16);
    require_pointer(a.grad_scores_TK, s, "grad_scores_TK", a.forward.scores_dtype == DType::fp32 ? 4 : 2);
    require_pointer(a.grad_w13, s, "grad_w13", 16);
    require_pointer(a.grad_w2, s, "grad_w2", 16);
    if (a.forward.b13) {
      require_pointer(a.grad_b13, s, "grad_b13", 16);
      require_pointer(a.grad_b2, s, "grad_b2", 16);
    } else {
      for (const auto& [grad, name] : {std::pair{a.grad_b13, "grad_b13"}, std::pair{a.grad_b2, "grad_b2"}})
        require(grad == nullptr, arg_name(s, name), "must be null: the forward has no expert biases");
    }
    require(a.accumulate_wgrad == args[0].accumulate_wgrad, arg_name(s, "accumulate_wgrad"),
            "must be the same for every slot of one call");
    require(a.wgrad_dtype == args[0].wgrad_dtype, arg_name(s, "wgrad_dtype"),
            "must be the same for every slot of one call");
    validate_prepared_set(transposed_set(a), s, transposed_set(args[0]), launch_.dims.fp8 != 0);
    RankIo& r = io.rank[s];
    r.w13_fp8_t = static_cast<const uint8_t*>(a.w13_fp8_t);
    r.w13_fp8_t_scales = a.w13_fp8_t_scales;
    r.w2_fp8_t = static_cast<const uint8_t*>(a.w2_fp8_t);
    r.w2_fp8_t_scales = a.w2_fp8_t_scales;
    r.grad_out_TD = static_cast<const bf16*>(a.grad_out_TD);
    r.grad_x_TD = static_cast<bf16*>(a.grad_x_TD);
    r.grad_scores_TK = a.grad_scores_TK;
    r.grad_w13_E2FD = a.grad_w13;
    r.grad_w2_EDF = a.grad_w2;
    r.grad_b13_E2F = a.grad_b13;
    r.grad_b2_ED = a.grad_b2;
  }
  return io;
}

void StagedPipeline::restore_record(const EpLaunch& l, const LaunchIo& io, int record, bool recompute,
                                    cudaStream_t stream) {
  if (recompute) {
    // Only what backward reads: the layout, the received x rows, h13 (and the replica weights).
    stage(Stage::recompute, stream);
    launch_route(l, io, stream);
    dispatch_x_rows(l, io, stream);
    expert_forward_h13(l, io, /*tail_only=*/false, stream);
    replicas_in_window_ = record;
  }
  if (!recompute && record_order_.shares_working_rows(record)) {
    // The layout and h13 were kept, the x rows were not: send them again (and the replica weights).
    stage(Stage::redispatch, stream);
    dispatch_x_rows(l, io, stream);
    replicas_in_window_ = record;
    if (record_order_.partial_kind(record)) {  // h13 of the rows past what the record kept
      stage(Stage::recompute_rows, stream);
      launch_tail_groups(l, stream);
      expert_forward_h13(l, io, /*tail_only=*/true, stream);
    }
  }
}

void StagedPipeline::backward(std::span<const BackwardArgs> args, cudaStream_t stream, int record, bool recompute) {
  if (config_.inference) throw InvalidArgument("inference", "the pipeline was created for inference: no backward");
  check_record(record);
  const LaunchIo io = backward_io(args);
  const DType wgrad_dtype = args[0].wgrad_dtype.value_or(config_.wgrad_dtype);
  EpLaunch l = launch_for(record);
  set_call_dims(l.dims, args[0].forward);
  l.dims.wgrad_bf16 = wgrad_dtype == DType::bf16 ? 1 : 0;
  restore_record(l, io, record, recompute, stream);
  // Exact balance: the window's replica weights are those of the latest forward (or recompute).
  const bool push_replicas = l.dims.balanced && replicas_in_window_ != record;
  replicas_in_window_ = record;
  stage(Stage::dispatch, stream);
  launch_dispatch_backward(l, io, push_replicas, stream);
  stage(Stage::fanout, stream);
  launch_fanout_rows(l, /*backward=*/true, stream);  // the experts read grad_out rows in place, unscaled
  stage(Stage::experts, stream);
  expert_backward(l, io, args[0].accumulate_wgrad, stream);
  stage(Stage::combine_push, stream);
  launch_combine_push(l, /*backward=*/true, stream);
  if (l.dims.balanced) {
    // After the combine barrier every rank's replica weight gradients are complete.
    stage(Stage::replica_grads, stream);
    launch_replica_grad_reduce(l, io, stream);
  }
  stage(Stage::combine_reduce, stream);
  launch_combine_reduce(l, io, /*backward=*/true, stream);
  launch_call_end(l, io, /*backward=*/true, stream);
  stage(Stage::end, stream);
}

}  // namespace poise::ep
