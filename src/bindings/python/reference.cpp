// poise::reference (the CPU engine and the float64 oracle) on numpy arrays, for poise.reference and
// the CPU path of the torch ops. Arrays cross as C-contiguous float32 (bf16 values) and int32; the
// engine validates sizes and values itself (InvalidArgument naming x_TD, ids_TK, ...). The engine's
// rank threads run without the GIL, after the inputs were copied in.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "poise/reference.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {
namespace {

using reference::Engine;
using reference::Options;
using reference::RankGradients;
using reference::RankInputs;
using reference::RoutingStats;

template <typename T>
using HostArray = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

template <typename T>
std::vector<T> to_vector(const HostArray<T>& array) {
  return std::vector<T>(array.data(), array.data() + array.size());
}

// Hands a vector to numpy without a copy: the capsule owns it.
template <typename T>
NumpyArray<T> to_numpy(std::vector<T>&& values, std::vector<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(owned->data(), shape.size(), shape.data(), owner);
}

Options make_options(const std::string& scores_dtype, const std::string& w13_layout, int64_t replica_slots) {
  Options options;
  options.scores_dtype = dtype_from_string(scores_dtype, "scores_TK");
  options.w13_layout = w13_layout_from_string(w13_layout);
  options.replica_slots = replica_slots;
  return options;
}

using Arrays = std::vector<HostArray<float>>;

// The per-rank lists of one call, copied into RankInputs (the engine checks their sizes). b13 / b2:
// one array per rank, or empty lists for a layer without expert biases.
std::vector<RankInputs> rank_inputs(const Arrays& x_TD, const std::vector<HostArray<int32_t>>& ids_TK,
                                    const Arrays& scores_TK, const Arrays& w13, const Arrays& w2,
                                    const Arrays& b13 = {}, const Arrays& b2 = {}) {
  const size_t ranks = x_TD.size(), biased = b13.empty() && b2.empty() ? 0 : ranks;
  struct List {
    const char* name;
    size_t size, want;
  };
  const List lists[] = {{"ids_TK", ids_TK.size(), ranks}, {"scores_TK", scores_TK.size(), ranks},
                        {"w13", w13.size(), ranks},       {"w2", w2.size(), ranks},
                        {"b13", b13.size(), biased},      {"b2", b2.size(), biased}};
  for (const auto& [name, size, want] : lists) {
    if (size != want) {
      throw InvalidArgument(name, "expected one array per rank like x_TD (" + std::to_string(want) + "), got " +
                                      std::to_string(size));
    }
  }
  std::vector<RankInputs> inputs(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    inputs[r] = {to_vector(x_TD[r]), to_vector(ids_TK[r]), to_vector(scores_TK[r]), to_vector(w13[r]),
                 to_vector(w2[r]), biased ? to_vector(b13[r]) : std::vector<float>{},
                 biased ? to_vector(b2[r]) : std::vector<float>{}};
  }
  return inputs;
}

std::vector<std::vector<float>> to_vectors(const std::vector<HostArray<float>>& arrays) {
  std::vector<std::vector<float>> vectors;
  vectors.reserve(arrays.size());
  for (const HostArray<float>& a : arrays) vectors.push_back(to_vector(a));
  return vectors;
}

struct Shapes {
  size_t T, D, F, K, local;
  Shapes(const Config& c, int64_t ep_size)
      : T(c.num_local_input_tokens), D(c.hidden_dim), F(c.intermediate_dim), K(c.top_k),
        local(c.num_local_experts(ep_size)) {}
};

std::vector<NumpyArray<float>> forward(Engine& engine, const Arrays& x_TD, const std::vector<HostArray<int32_t>>& ids_TK,
                                       const Arrays& scores_TK, const Arrays& w13, const Arrays& w2, const Arrays& b13,
                                       const Arrays& b2) {
  std::vector<RankInputs> inputs = rank_inputs(x_TD, ids_TK, scores_TK, w13, w2, b13, b2);
  std::vector<std::vector<float>> out_TD;
  {
    nb::gil_scoped_release release;
    out_TD = engine.forward(inputs);
  }
  const Shapes s(engine.config(), engine.ep_size());
  std::vector<NumpyArray<float>> result;
  for (std::vector<float>& out : out_TD) result.push_back(to_numpy(std::move(out), {s.T, s.D}));
  return result;
}

// grad_x, grad_scores, grad_w13, grad_w2, grad_b13, grad_b2 (the last two empty without biases).
using GradArrays = std::tuple<NumpyArray<float>, NumpyArray<float>, NumpyArray<float>, NumpyArray<float>,
                              NumpyArray<float>, NumpyArray<float>>;

// The existing grads of every rank that accumulate_wgrad adds to: grad_w13 / grad_w2, and with
// biases grad_b13 / grad_b2 (the engine checks their sizes). Empty lists without accumulate_wgrad.
std::vector<RankGradients> accumulated_grads(bool accumulate_wgrad, bool biased, const Arrays& grad_w13_acc,
                                             const Arrays& grad_w2_acc, const Arrays& grad_b13_acc,
                                             const Arrays& grad_b2_acc) {
  if (!accumulate_wgrad) {
    if (!grad_w13_acc.empty() || !grad_w2_acc.empty() || !grad_b13_acc.empty() || !grad_b2_acc.empty()) {
      throw InvalidArgument("accumulate_wgrad", "is false, so the *_acc lists must be empty");
    }
    return {};
  }
  const size_t ranks = grad_w13_acc.size();
  for (const auto& [name, list, wanted] : {std::tuple{"grad_w2_acc", &grad_w2_acc, ranks},
                                           std::tuple{"grad_b13_acc", &grad_b13_acc, biased ? ranks : 0},
                                           std::tuple{"grad_b2_acc", &grad_b2_acc, biased ? ranks : 0}}) {
    if (list->size() != wanted) {
      throw InvalidArgument(name, "expected " + std::to_string(wanted) + " arrays (one per rank like grad_w13_acc" +
                                      std::string(biased ? "" : ", none without biases") + "), got " +
                                      std::to_string(list->size()));
    }
  }
  std::vector<RankGradients> grads(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    grads[r].grad_w13 = to_vector(grad_w13_acc[r]);
    grads[r].grad_w2 = to_vector(grad_w2_acc[r]);
    if (biased) {
      grads[r].grad_b13 = to_vector(grad_b13_acc[r]);
      grads[r].grad_b2 = to_vector(grad_b2_acc[r]);
    }
  }
  return grads;
}

std::vector<GradArrays> backward(Engine& engine, const Arrays& x_TD, const std::vector<HostArray<int32_t>>& ids_TK,
                                 const Arrays& scores_TK, const Arrays& w13, const Arrays& w2, const Arrays& b13,
                                 const Arrays& b2, const Arrays& grad_out_TD, bool accumulate_wgrad,
                                 const Arrays& grad_w13_acc, const Arrays& grad_w2_acc, const Arrays& grad_b13_acc,
                                 const Arrays& grad_b2_acc) {
  std::vector<RankInputs> inputs = rank_inputs(x_TD, ids_TK, scores_TK, w13, w2, b13, b2);
  std::vector<std::vector<float>> grad_out = to_vectors(grad_out_TD);
  std::vector<RankGradients> grads = accumulated_grads(accumulate_wgrad, !b13.empty(), grad_w13_acc, grad_w2_acc,
                                                       grad_b13_acc, grad_b2_acc);
  {
    nb::gil_scoped_release release;
    engine.backward(inputs, grad_out, grads, accumulate_wgrad);
  }
  const Shapes s(engine.config(), engine.ep_size());
  std::vector<GradArrays> result;
  for (RankGradients& g : grads) {
    const size_t b13_rows = g.grad_b13.empty() ? 0 : s.local, b2_rows = g.grad_b2.empty() ? 0 : s.local;
    result.emplace_back(to_numpy(std::move(g.grad_x_TD), {s.T, s.D}), to_numpy(std::move(g.grad_scores_TK), {s.T, s.K}),
                        to_numpy(std::move(g.grad_w13), {s.local, 2 * s.F, s.D}),
                        to_numpy(std::move(g.grad_w2), {s.local, s.D, s.F}),
                        to_numpy(std::move(g.grad_b13), {b13_rows, 2 * s.F}), to_numpy(std::move(g.grad_b2), {b2_rows, s.D}));
  }
  return result;
}

std::vector<NumpyArray<double>> per_rank_float64(std::vector<std::vector<double>>&& per_rank,
                                                 const std::vector<size_t>& shape) {
  std::vector<NumpyArray<double>> arrays;
  for (std::vector<double>& values : per_rank) arrays.push_back(to_numpy(std::move(values), shape));
  return arrays;
}

// The float64 oracle; returns {"out_TD": [...], and with grad_out_TD also "grad_x_TD", ...}.
nb::dict dense_float64(const Config& config, int64_t ep_size, const std::string& scores_dtype,
                       const std::string& w13_layout, const std::vector<HostArray<float>>& x_TD,
                       const std::vector<HostArray<int32_t>>& ids_TK, const std::vector<HostArray<float>>& scores_TK,
                       const std::vector<HostArray<float>>& w13, const std::vector<HostArray<float>>& w2,
                       const std::vector<HostArray<float>>& grad_out_TD, const Arrays& b13, const Arrays& b2) {
  const Options options = make_options(scores_dtype, w13_layout, -1);
  config.validate(ep_size);
  std::vector<RankInputs> inputs = rank_inputs(x_TD, ids_TK, scores_TK, w13, w2, b13, b2);
  std::vector<std::vector<float>> grad_out = to_vectors(grad_out_TD);
  reference::DenseFloat64Result r;
  {
    nb::gil_scoped_release release;
    r = reference::dense_float64(config, ep_size, inputs, grad_out, options);
  }
  const Shapes s(config, ep_size);
  nb::dict result;
  result["out_TD"] = per_rank_float64(std::move(r.out_TD), {s.T, s.D});
  if (!grad_out.empty()) {
    result["grad_x_TD"] = per_rank_float64(std::move(r.grad_x_TD), {s.T, s.D});
    result["grad_scores_TK"] = per_rank_float64(std::move(r.grad_scores_TK), {s.T, s.K});
    result["grad_w13"] = per_rank_float64(std::move(r.grad_w13), {s.local, 2 * s.F, s.D});
    result["grad_w2"] = per_rank_float64(std::move(r.grad_w2), {s.local, s.D, s.F});
    if (!b13.empty()) {
      result["grad_b13"] = per_rank_float64(std::move(r.grad_b13), {s.local, 2 * s.F});
      result["grad_b2"] = per_rank_float64(std::move(r.grad_b2), {s.local, s.D});
    }
  }
  return result;
}

}  // namespace

void bind_reference(nb::module_& m) {
  nb::class_<RoutingStats>(m, "RoutingStats", "Routing balance of the reference engine's last forward.")
      .def_ro("expert_rows", &RoutingStats::expert_rows)
      .def_ro("owner_rows", &RoutingStats::owner_rows)
      .def_ro("computed_rows", &RoutingStats::computed_rows)
      .def_ro("grouped_rows", &RoutingStats::grouped_rows)
      .def_ro("received_token_rows", &RoutingStats::received_token_rows)
      .def_ro("replicas", &RoutingStats::replicas)
      .def_ro("unplaced_surplus_rows", &RoutingStats::unplaced_surplus_rows)
      .def("owner_peak_over_mean", &RoutingStats::owner_peak_over_mean)
      .def("computed_peak_over_mean", &RoutingStats::computed_peak_over_mean);

  nb::class_<Engine>(m, "ReferenceEngine",
                     "poise::reference::Engine: one MoE layer across ep_size virtual ranks on the CPU.")
      .def(
          "__init__",
          [](Engine* self, const Config& config, int64_t ep_size, const std::string& scores_dtype,
             const std::string& w13_layout, int64_t replica_slots) {
            new (self) Engine(config, ep_size, make_options(scores_dtype, w13_layout, replica_slots));
          },
          "config"_a, "ep_size"_a, "scores_dtype"_a = "fp32", "w13_layout"_a = "gate_up_blocked",
          "replica_slots"_a = -1)
      .def_prop_ro("config", &Engine::config)
      .def_prop_ro("ep_size", &Engine::ep_size)
      .def_prop_ro("scores_dtype", [](const Engine& e) { return std::string(poise::to_string(e.options().scores_dtype)); })
      .def_prop_ro("w13_layout", [](const Engine& e) { return std::string(python::to_string(e.options().w13_layout)); })
      .def_prop_ro("routing_stats", &Engine::routing_stats)
      .def_prop_ro("clip_counts", &Engine::clip_counts,
                   "Per rank, [E_local][2] SwiGLU clip counts of the last forward (gate > limit, |up| > limit).")
      .def("forward", &forward, "x_TD"_a, "ids_TK"_a, "scores_TK"_a, "w13"_a, "w2"_a, "b13"_a = Arrays{},
           "b2"_a = Arrays{},
           "Per-rank lists in (b13 / b2: expert biases, or empty lists), per-rank out_TD [T, D] float32 "
           "(bf16 values) out. Keeps what backward needs.")
      .def("backward", &backward, "x_TD"_a, "ids_TK"_a, "scores_TK"_a, "w13"_a, "w2"_a, "b13"_a, "b2"_a,
           "grad_out_TD"_a, "accumulate_wgrad"_a, "grad_w13_acc"_a, "grad_w2_acc"_a, "grad_b13_acc"_a = Arrays{},
           "grad_b2_acc"_a = Arrays{},
           "Differentiates the preceding forward (same inputs); with accumulate_wgrad adds to the *_acc arrays "
           "(the biases' with b13 / b2). Per rank: (grad_x_TD, grad_scores_TK, "
           "grad_w13 [E_local, 2F, D], grad_w2 [E_local, D, F], grad_b13 [E_local or 0, 2F], grad_b2 "
           "[E_local or 0, D]).");

  m.def(
      "reference_quantize_fp8_weight_blocks",
      [](const HostArray<float>& w, int64_t matrices, int64_t rows, int64_t cols) {
        reference::Fp8WeightBlocks q = reference::quantize_fp8_weight_blocks(
            std::span<const float>(w.data(), w.size()), matrices, rows, cols);
        const size_t scales = q.scales.size();
        return std::make_pair(to_numpy(std::move(q.values_MRC), {size_t(matrices * rows * cols)}),
                              to_numpy(std::move(q.scales), {scales}));
      },
      "w"_a, "matrices"_a, "rows"_a, "cols"_a,
      "reference::quantize_fp8_weight_blocks: float32 bf16 values in; (e4m3 bits uint8, fp32 scales) out, flat.");
  m.def("reference_dense_float64", &dense_float64, "config"_a, "ep_size"_a, "scores_dtype"_a, "w13_layout"_a,
        "x_TD"_a, "ids_TK"_a, "scores_TK"_a, "w13"_a, "w2"_a, "grad_out_TD"_a, "b13"_a = Arrays{}, "b2"_a = Arrays{},
        "The float64 oracle (dense loops, no ranks, no rounding); backward when grad_out_TD is not empty.");
}

}  // namespace poise::python
