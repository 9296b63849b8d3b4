// poise::MemoryPlan (read-only numbers) and plan_memory, a pure host function: no CUDA.
#include <nanobind/stl/string.h>

#include "poise/memory_plan.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {

void bind_plan(nb::module_& m) {
  nb::class_<MemoryPlan>(m, "MemoryPlan", "The C++ poise::MemoryPlan. Use poise.plan_memory().")
      .def_ro("config", &MemoryPlan::config)
      .def_ro("ep_size", &MemoryPlan::ep_size)
      .def_ro("num_local_experts", &MemoryPlan::num_local_experts)
      .def_ro("num_replica_slots", &MemoryPlan::num_replica_slots)
      .def_ro("balanced_rows", &MemoryPlan::balanced_rows)
      .def_ro("device_rows", &MemoryPlan::device_rows)
      .def_ro("total_rows", &MemoryPlan::total_rows)
      .def_ro("communication_bytes", &MemoryPlan::communication_bytes)
      .def_ro("replica_weight_bytes", &MemoryPlan::replica_weight_bytes)
      .def_ro("activation_slot_min_bytes", &MemoryPlan::activation_slot_min_bytes)
      .def_ro("activation_slot_full_save_bytes", &MemoryPlan::activation_slot_full_save_bytes)
      .def_ro("activation_slot_max_useful_bytes", &MemoryPlan::activation_slot_max_useful_bytes)
      .def_ro("activation_slot_bytes", &MemoryPlan::activation_slot_bytes)
      .def_ro("activation_record_bytes", &MemoryPlan::activation_record_bytes)
      .def_ro("activation_records_per_slot", &MemoryPlan::activation_records_per_slot)
      .def_ro("activation_light_record_bytes", &MemoryPlan::activation_light_record_bytes)
      .def_ro("activation_light_records_per_slot", &MemoryPlan::activation_light_records_per_slot)
      .def_ro("activation_partial_record_rows", &MemoryPlan::activation_partial_record_rows)
      .def_ro("activation_partial_record_bytes", &MemoryPlan::activation_partial_record_bytes)
      .def_ro("activation_slots_total_bytes", &MemoryPlan::activation_slots_total_bytes)
      .def_ro("device_scratch_bytes", &MemoryPlan::device_scratch_bytes)
      .def_ro("fp8_operand_bytes", &MemoryPlan::fp8_operand_bytes)
      .def_ro("x_row_wire_bytes", &MemoryPlan::x_row_wire_bytes)
      .def_ro("host_overflow_scratch_bytes", &MemoryPlan::host_overflow_scratch_bytes)
      .def_ro("total_device_bytes", &MemoryPlan::total_device_bytes)
      .def_ro("total_virtual_bytes", &MemoryPlan::total_virtual_bytes)
      .def("explain", &MemoryPlan::explain);

  m.def("plan_memory", &plan_memory, "config"_a, "ep_size"_a,
        "Validates config for ep_size (InvalidArgument) and sizes every region a Context will own.");
}

}  // namespace poise::python
