// The GPU entry points on raw device pointers and a CUDA stream, for poise.torch's CUDA engine:
// torch passes data_ptr() and torch.cuda.current_stream().cuda_stream, so no DLPack conversion (and
// none of its stream synchronization) sits on the hot path. Pointers arrive as integers; the C++
// side validates them (InvalidArgument) and enqueues the staged GPU pipeline on the stream.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "poise/context.hpp"
#include "poise/errors.hpp"
#include "poise/fp8.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {
namespace {

template <typename T>
T* pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// ActivationRecord as a Python (index, generation) pair; None for a backward: the latest forward's.
using Record = std::pair<int64_t, uint64_t>;
Record to_python(const ActivationRecord& r) { return {r.index, r.generation}; }
std::optional<ActivationRecord> from_python(const std::optional<Record>& r) {
  if (!r) return std::nullopt;
  return ActivationRecord{r->first, r->second};
}

// A backward's weight-gradient dtype: 'bf16' / 'fp32', or None for Config.wgrad_dtype.
std::optional<DType> call_wgrad_dtype(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return dtype_from_string(*name, "wgrad_dtype");
}

// The weights of one rank's call as the C++ API takes them: w13 / w2 as stored (weights_transposed:
// x @ W, gpt-oss), and the expert biases b13 / b2 (0: none; both or neither, checked by the Context).
struct Weights {
  uintptr_t w13 = 0;
  std::string w13_layout;
  uintptr_t w2 = 0;
  bool transposed = false;
  uintptr_t b13 = 0, b2 = 0;
};

// Prepared FP8 weights of one rank's forward (ForwardArgs::w13_fp8 ...; 0: none; all four or none,
// checked by the Context).
struct PreparedFp8 {
  uintptr_t w13 = 0, w13_scales = 0, w2 = 0, w2_scales = 0;
};

void set_prepared(ForwardArgs& args, const PreparedFp8& p) {
  args.w13_fp8 = pointer<const void>(p.w13);
  args.w13_fp8_scales = pointer<const float>(p.w13_scales);
  args.w2_fp8 = pointer<const void>(p.w2);
  args.w2_fp8_scales = pointer<const float>(p.w2_scales);
}

ForwardArgs forward_args(uintptr_t x_TD, uintptr_t ids_TK, uintptr_t scores_TK, const std::string& scores_dtype,
                         const Weights& weights) {
  ForwardArgs args;
  args.x_TD = pointer<const void>(x_TD);
  args.ids_TK = pointer<const int32_t>(ids_TK);
  args.scores_TK = pointer<const void>(scores_TK);
  args.scores_dtype = dtype_from_string(scores_dtype, "scores_TK");
  args.w13 = pointer<const void>(weights.w13);
  args.w13_layout = w13_layout_from_string(weights.w13_layout);
  args.w2 = pointer<const void>(weights.w2);
  args.weights_transposed = weights.transposed;
  args.b13 = pointer<const void>(weights.b13);
  args.b2 = pointer<const void>(weights.b2);
  return args;
}

Record forward(Context& context, uintptr_t x_TD, uintptr_t ids_TK, uintptr_t scores_TK, const std::string& scores_dtype,
               uintptr_t w13, const std::string& w13_layout, uintptr_t w2, uintptr_t out_TD, uintptr_t stream,
               uintptr_t clip_counts_E2, bool keep_for_backward, uintptr_t b13, uintptr_t b2,
               bool weights_transposed, uintptr_t w13_fp8, uintptr_t w13_fp8_scales, uintptr_t w2_fp8,
               uintptr_t w2_fp8_scales) {
  ForwardArgs args =
      forward_args(x_TD, ids_TK, scores_TK, scores_dtype, {w13, w13_layout, w2, weights_transposed, b13, b2});
  set_prepared(args, {w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales});
  args.out_TD = pointer<void>(out_TD);
  args.clip_counts_E2 = pointer<int64_t>(clip_counts_E2);
  nb::gil_scoped_release release;
  return to_python(routed_experts_forward(context, args, pointer<CUstream_st>(stream), keep_for_backward));
}

void backward(Context& context, uintptr_t x_TD, uintptr_t ids_TK, uintptr_t scores_TK, const std::string& scores_dtype,
              uintptr_t w13, const std::string& w13_layout, uintptr_t w2, uintptr_t grad_out_TD, uintptr_t grad_x_TD,
              uintptr_t grad_scores_TK, uintptr_t grad_w13, uintptr_t grad_w2, bool accumulate_wgrad,
              uintptr_t stream, const std::optional<Record>& record, const std::optional<std::string>& wgrad_dtype,
              uintptr_t b13, uintptr_t b2, bool weights_transposed, uintptr_t grad_b13, uintptr_t grad_b2,
              uintptr_t w13_fp8_t, uintptr_t w13_fp8_t_scales, uintptr_t w2_fp8_t, uintptr_t w2_fp8_t_scales) {
  BackwardArgs args;
  args.forward = forward_args(x_TD, ids_TK, scores_TK, scores_dtype, {w13, w13_layout, w2, weights_transposed, b13, b2});
  args.grad_out_TD = pointer<const void>(grad_out_TD);
  args.grad_x_TD = pointer<void>(grad_x_TD);
  args.grad_scores_TK = pointer<void>(grad_scores_TK);
  args.grad_w13 = pointer<void>(grad_w13);
  args.grad_w2 = pointer<void>(grad_w2);
  args.grad_b13 = pointer<void>(grad_b13);
  args.grad_b2 = pointer<void>(grad_b2);
  args.accumulate_wgrad = accumulate_wgrad;
  args.wgrad_dtype = call_wgrad_dtype(wgrad_dtype);
  args.w13_fp8_t = pointer<const void>(w13_fp8_t);
  args.w13_fp8_t_scales = pointer<const float>(w13_fp8_t_scales);
  args.w2_fp8_t = pointer<const void>(w2_fp8_t);
  args.w2_fp8_t_scales = pointer<const float>(w2_fp8_t_scales);
  const std::optional<ActivationRecord> r = from_python(record);
  nb::gil_scoped_release release;
  routed_experts_backward(context, args, pointer<CUstream_st>(stream), r ? &*r : nullptr);
}

// ---- virtual ranks: one address per rank in each list (Context::create_virtual_ranks) ----------

using Addresses = std::vector<uintptr_t>;

// Every list holds one address per launch rank; the C++ entry point checks the count against the
// context, this names the list that disagrees with x_TD.
void require_same_length(const Addresses& list, const char* name, size_t ranks) {
  if (list.size() != ranks) {
    throw InvalidArgument(name, "must hold one address per rank like x_TD (" + std::to_string(ranks) + "), got " +
                                    std::to_string(list.size()));
  }
}

// An optional list (expert biases and their grads): empty for none, else one address per rank.
void require_none_or_same_length(const Addresses& list, const char* name, size_t ranks) {
  if (!list.empty()) require_same_length(list, name, ranks);
}

uintptr_t address_at(const Addresses& list, size_t r) { return list.empty() ? 0 : list[r]; }

// weights_transposed and w13_layout hold for every rank; b13 / b2 are empty lists without biases.
std::vector<ForwardArgs> forward_args_per_rank(const Addresses& x_TD, const Addresses& ids_TK,
                                               const Addresses& scores_TK, const std::string& scores_dtype,
                                               const Addresses& w13, const std::string& w13_layout,
                                               const Addresses& w2, bool weights_transposed, const Addresses& b13,
                                               const Addresses& b2) {
  const size_t ranks = x_TD.size();
  require_same_length(ids_TK, "ids_TK", ranks);
  require_same_length(scores_TK, "scores_TK", ranks);
  require_same_length(w13, "w13", ranks);
  require_same_length(w2, "w2", ranks);
  require_none_or_same_length(b13, "b13", ranks);
  require_none_or_same_length(b2, "b2", ranks);
  std::vector<ForwardArgs> args;
  args.reserve(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    const Weights weights{w13[r], w13_layout, w2[r], weights_transposed, address_at(b13, r), address_at(b2, r)};
    args.push_back(forward_args(x_TD[r], ids_TK[r], scores_TK[r], scores_dtype, weights));
  }
  return args;
}

Record forward_ranks(Context& context, const Addresses& x_TD, const Addresses& ids_TK, const Addresses& scores_TK,
                     const std::string& scores_dtype, const Addresses& w13, const std::string& w13_layout,
                     const Addresses& w2, const Addresses& out_TD, uintptr_t stream, const Addresses& clip_counts_E2,
                     bool keep_for_backward, const Addresses& b13, const Addresses& b2, bool weights_transposed,
                     const Addresses& w13_fp8, const Addresses& w13_fp8_scales, const Addresses& w2_fp8,
                     const Addresses& w2_fp8_scales) {
  std::vector<ForwardArgs> args =
      forward_args_per_rank(x_TD, ids_TK, scores_TK, scores_dtype, w13, w13_layout, w2, weights_transposed, b13, b2);
  require_same_length(out_TD, "out_TD", args.size());
  require_none_or_same_length(clip_counts_E2, "clip_counts_E2", args.size());
  require_none_or_same_length(w13_fp8, "w13_fp8", args.size());
  require_none_or_same_length(w13_fp8_scales, "w13_fp8_scales", args.size());
  require_none_or_same_length(w2_fp8, "w2_fp8", args.size());
  require_none_or_same_length(w2_fp8_scales, "w2_fp8_scales", args.size());
  for (size_t r = 0; r < args.size(); ++r) {
    args[r].out_TD = pointer<void>(out_TD[r]);
    args[r].clip_counts_E2 = pointer<int64_t>(address_at(clip_counts_E2, r));
    set_prepared(args[r], {address_at(w13_fp8, r), address_at(w13_fp8_scales, r), address_at(w2_fp8, r),
                           address_at(w2_fp8_scales, r)});
  }
  nb::gil_scoped_release release;
  return to_python(routed_experts_forward(context, args, pointer<CUstream_st>(stream), keep_for_backward));
}

void backward_ranks(Context& context, const Addresses& x_TD, const Addresses& ids_TK, const Addresses& scores_TK,
                    const std::string& scores_dtype, const Addresses& w13, const std::string& w13_layout,
                    const Addresses& w2, const Addresses& grad_out_TD, const Addresses& grad_x_TD,
                    const Addresses& grad_scores_TK, const Addresses& grad_w13, const Addresses& grad_w2,
                    bool accumulate_wgrad, uintptr_t stream, const std::optional<Record>& record,
                    const std::optional<std::string>& wgrad_dtype, const Addresses& b13, const Addresses& b2,
                    bool weights_transposed, const Addresses& grad_b13, const Addresses& grad_b2) {
  std::vector<ForwardArgs> forward =
      forward_args_per_rank(x_TD, ids_TK, scores_TK, scores_dtype, w13, w13_layout, w2, weights_transposed, b13, b2);
  const size_t ranks = forward.size();
  require_same_length(grad_out_TD, "grad_out_TD", ranks);
  require_same_length(grad_x_TD, "grad_x_TD", ranks);
  require_same_length(grad_scores_TK, "grad_scores_TK", ranks);
  require_same_length(grad_w13, "grad_w13", ranks);
  require_same_length(grad_w2, "grad_w2", ranks);
  require_none_or_same_length(grad_b13, "grad_b13", ranks);
  require_none_or_same_length(grad_b2, "grad_b2", ranks);
  std::vector<BackwardArgs> args(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    args[r].forward = forward[r];
    args[r].grad_out_TD = pointer<const void>(grad_out_TD[r]);
    args[r].grad_x_TD = pointer<void>(grad_x_TD[r]);
    args[r].grad_scores_TK = pointer<void>(grad_scores_TK[r]);
    args[r].grad_w13 = pointer<void>(grad_w13[r]);
    args[r].grad_w2 = pointer<void>(grad_w2[r]);
    args[r].grad_b13 = pointer<void>(address_at(grad_b13, r));
    args[r].grad_b2 = pointer<void>(address_at(grad_b2, r));
    args[r].accumulate_wgrad = accumulate_wgrad;
    args[r].wgrad_dtype = call_wgrad_dtype(wgrad_dtype);
  }
  const std::optional<ActivationRecord> rec = from_python(record);
  nb::gil_scoped_release release;
  routed_experts_backward(context, args, pointer<CUstream_st>(stream), rec ? &*rec : nullptr);
}

void check(Context& context, uintptr_t stream) {
  nb::gil_scoped_release release;
  context.check(pointer<CUstream_st>(stream));
}

}  // namespace

W13Layout w13_layout_from_string(const std::string& s) {
  if (s == "gate_up_blocked") return W13Layout::gate_up_blocked;
  if (s == "gate_up_interleaved") return W13Layout::gate_up_interleaved;
  throw InvalidArgument("w13_layout", "must be 'gate_up_blocked' or 'gate_up_interleaved', got '" + s + "'");
}

const char* to_string(W13Layout layout) {
  return layout == W13Layout::gate_up_blocked ? "gate_up_blocked" : "gate_up_interleaved";
}

// poise::quantize_fp8_weight_blocks or its transposed twin on device addresses.
using WeightBlocks = void (*)(const void*, int64_t, int64_t, int64_t, uint8_t*, float*, Stream);
template <WeightBlocks kQuantize>
void bind_weight_blocks(nb::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](uintptr_t w, int64_t matrices, int64_t rows, int64_t cols, uintptr_t values, uintptr_t scales,
         uintptr_t stream) {
        nb::gil_scoped_release release;
        kQuantize(reinterpret_cast<const void*>(w), matrices, rows, cols, reinterpret_cast<uint8_t*>(values),
                  reinterpret_cast<float*>(scales), reinterpret_cast<Stream>(stream));
      },
      "w"_a, "matrices"_a, "rows"_a, "cols"_a, "values"_a, "scales"_a, "stream"_a,
      doc);
}

void bind_routed_experts(nb::module_& m) {
  m.def("routed_experts_forward", &forward, "context"_a, "x_TD"_a, "ids_TK"_a, "scores_TK"_a, "scores_dtype"_a,
        "w13"_a, "w13_layout"_a, "w2"_a, "out_TD"_a, "stream"_a, "clip_counts_E2"_a = 0, "keep_for_backward"_a = true,
        "b13"_a = 0, "b2"_a = 0, "weights_transposed"_a = false, "w13_fp8"_a = 0, "w13_fp8_scales"_a = 0,
        "w2_fp8"_a = 0, "w2_fp8_scales"_a = 0,
        "poise::routed_experts_forward on device addresses (integers) and a cudaStream_t (integer); "
        "clip_counts_E2: int64 [E_local, 2] for the SwiGLU clip counts, or 0; b13 / b2: the expert biases "
        "(bf16 [E_local, 2F] / [E_local, D]), or 0; weights_transposed: w13 [E_local, D, 2F] and w2 "
        "[E_local, F, D] (x @ W); w13_fp8 / w13_fp8_scales / w2_fp8 / w2_fp8_scales: prepared FP8 weights "
        "(quantize_fp8_weight_blocks' e4m3 values and fp32 block scales; gemm_precision fp8_block_scaled), all "
        "four or 0. Returns the activation record (index, generation) that holds the forward's state for its "
        "backward.");
  m.def("routed_experts_backward", &backward, "context"_a, "x_TD"_a, "ids_TK"_a, "scores_TK"_a, "scores_dtype"_a,
        "w13"_a, "w13_layout"_a, "w2"_a, "grad_out_TD"_a, "grad_x_TD"_a, "grad_scores_TK"_a, "grad_w13"_a,
        "grad_w2"_a, "accumulate_wgrad"_a, "stream"_a, "record"_a = nb::none(), "wgrad_dtype"_a = nb::none(),
        "b13"_a = 0, "b2"_a = 0, "weights_transposed"_a = false, "grad_b13"_a = 0, "grad_b2"_a = 0,
        "w13_fp8_t"_a = 0, "w13_fp8_t_scales"_a = 0, "w2_fp8_t"_a = 0, "w2_fp8_t_scales"_a = 0,
        "poise::routed_experts_backward on device addresses (integers) and a cudaStream_t (integer); record: the "
        "forward's (index, generation), None for the latest forward (recomputed when overwritten); wgrad_dtype: "
        "'bf16' or 'fp32' for the weight (and bias) grads, None for Config.wgrad_dtype; b13 / b2 / "
        "weights_transposed as for routed_experts_forward; grad_b13 / grad_b2: the bias grads ([E_local, 2F] / "
        "[E_local, D] in wgrad_dtype), required with biases, else 0; w13_fp8_t / w13_fp8_t_scales / w2_fp8_t / "
        "w2_fp8_t_scales: the weights' prepared transposed FP8 copies (quantize_fp8_weight_blocks_transposed), "
        "all four or 0.");
  m.def("routed_experts_forward_ranks", &forward_ranks, "context"_a, "x_TD"_a, "ids_TK"_a, "scores_TK"_a,
        "scores_dtype"_a, "w13"_a, "w13_layout"_a, "w2"_a, "out_TD"_a, "stream"_a,
        "clip_counts_E2"_a = Addresses{}, "keep_for_backward"_a = true, "b13"_a = Addresses{}, "b2"_a = Addresses{},
        "weights_transposed"_a = false, "w13_fp8"_a = Addresses{}, "w13_fp8_scales"_a = Addresses{},
        "w2_fp8"_a = Addresses{}, "w2_fp8_scales"_a = Addresses{},
        "poise::routed_experts_forward over the launch ranks of a virtual-ranks context: one address per rank "
        "in each list (clip_counts_E2, b13, b2, w13_fp8, w13_fp8_scales, w2_fp8, w2_fp8_scales: empty, or one "
        "per rank).");
  m.def("routed_experts_backward_ranks", &backward_ranks, "context"_a, "x_TD"_a, "ids_TK"_a, "scores_TK"_a,
        "scores_dtype"_a, "w13"_a, "w13_layout"_a, "w2"_a, "grad_out_TD"_a, "grad_x_TD"_a, "grad_scores_TK"_a,
        "grad_w13"_a, "grad_w2"_a, "accumulate_wgrad"_a, "stream"_a, "record"_a = nb::none(),
        "wgrad_dtype"_a = nb::none(), "b13"_a = Addresses{}, "b2"_a = Addresses{}, "weights_transposed"_a = false,
        "grad_b13"_a = Addresses{}, "grad_b2"_a = Addresses{},
        "poise::routed_experts_backward over the launch ranks of a virtual-ranks context: one address per rank "
        "in each list (wgrad_dtype as for routed_experts_backward; b13, b2, grad_b13, grad_b2: empty, or one "
        "per rank).");
  bind_weight_blocks<quantize_fp8_weight_blocks>(
      m, "quantize_fp8_weight_blocks",
      "poise::quantize_fp8_weight_blocks on device addresses (integers) and a cudaStream_t (integer).");
  bind_weight_blocks<quantize_fp8_weight_blocks_transposed>(
      m, "quantize_fp8_weight_blocks_transposed",
      "poise::quantize_fp8_weight_blocks_transposed on device addresses (integers) and a cudaStream_t (integer).");
  m.def("context_check", &check, "context"_a, "stream"_a,
        "Context::check: waits for the stream, then raises DeviceError for a device-side fault of the last calls.");
}

}  // namespace poise::python
