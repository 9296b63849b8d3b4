// poise::Config as a plain mutable struct. Enum fields travel as strings, parsed by the C++
// *_from_string functions, so the accepted spellings and their errors live in C++ only.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <string>

#include "poise/config.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {

void bind_config(nb::module_& m) {
  nb::class_<Config>(m, "Config", "The C++ poise::Config. Build it with poise.Config, not directly.")
      .def(nb::init<>())
      .def_rw("num_local_input_tokens", &Config::num_local_input_tokens)
      .def_rw("hidden_dim", &Config::hidden_dim)
      .def_rw("intermediate_dim", &Config::intermediate_dim)
      .def_rw("top_k", &Config::top_k)
      .def_rw("num_experts", &Config::num_experts)
      .def_prop_rw(
          "activation", [](const Config& c) { return std::string(to_string(c.activation)); },
          [](Config& c, const std::string& s) { c.activation = activation_from_string(s); })
      .def_rw("swiglu_alpha", &Config::swiglu_alpha)
      .def_rw("swiglu_limit", &Config::swiglu_limit)
      .def_prop_rw(
          "balance", [](const Config& c) { return std::string(to_string(c.balance)); },
          [](Config& c, const std::string& s) { c.balance = balance_from_string(s); })
      .def_rw("balance_tolerance", &Config::balance_tolerance)
      .def_rw("receive_capacity_factor", &Config::receive_capacity_factor)
      .def_rw("balance_cost_ns_per_row", &Config::balance_cost_ns_per_row)
      .def_rw("balance_cost_ns_per_group", &Config::balance_cost_ns_per_group)
      .def_rw("balance_link_gb_per_s", &Config::balance_link_gb_per_s)
      .def_rw("num_activation_slots", &Config::num_activation_slots)
      .def_rw("max_moe_layers_per_activation_slot", &Config::max_moe_layers_per_activation_slot)
      .def_rw("activation_slot_capacity_factor", &Config::activation_slot_capacity_factor)
      .def_rw("activation_slot_bytes", &Config::activation_slot_bytes)
      .def_rw("host_overflow_scratch_factor", &Config::host_overflow_scratch_factor)
      .def_prop_rw(
          "gemm_precision", [](const Config& c) { return std::string(to_string(c.gemm_precision)); },
          [](Config& c, const std::string& s) { c.gemm_precision = gemm_precision_from_string(s); })
      .def_rw("prepared_fp8_weights", &Config::prepared_fp8_weights)
      .def_rw("fp8_wgrad", &Config::fp8_wgrad)
      .def_prop_rw(
          "wgrad_dtype", [](const Config& c) { return std::string(to_string(c.wgrad_dtype)); },
          [](Config& c, const std::string& s) { c.wgrad_dtype = dtype_from_string(s, "wgrad_dtype"); })
      .def_prop_rw(
          "replica_grad_dtype", [](const Config& c) { return std::string(to_string(c.replica_grad_dtype)); },
          [](Config& c, const std::string& s) { c.replica_grad_dtype = dtype_from_string(s, "replica_grad_dtype"); })
      .def_rw("inference", &Config::inference)
      .def("validate", &Config::validate, "ep_size"_a,
           "Raises poise.InvalidArgument naming the first field that breaks a rule.")
      .def("num_local_experts", &Config::num_local_experts, "ep_size"_a);
}

}  // namespace poise::python
