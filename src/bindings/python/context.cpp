// poise::Context lifecycle. create/reset/close may be collective across the EP group (virtual ranks
// are threads of one process), so they run without the GIL: other ranks' threads must get to run.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>

#include "poise/context.hpp"
#include "poise/errors.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace poise::python {

void bind_context(nb::module_& m) {
  using release_gil = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<Context>(m, "Context", "The C++ poise::Context. Use poise.create_context().")
      .def_static(
          "create",
          [](const Config& config, int64_t ep_size, int64_t rank) { return Context::create(config, ep_size, rank); },
          "config"_a, "ep_size"_a, "rank"_a, release_gil())
      .def_static(
          "create_virtual_ranks",
          [](const Config& config, int64_t ep_size) { return Context::create_virtual_ranks(config, ep_size); },
          "config"_a, "ep_size"_a, release_gil(),
          "All ep_size ranks as virtual ranks on the current CUDA device; allocates now (needs an SM90 GPU).")
      .def_prop_ro("launch_ranks", &Context::launch_ranks)
      .def_prop_ro("config", &Context::config)
      .def_prop_ro("plan", &Context::plan)
      .def_prop_ro("device_bytes", &Context::device_bytes)
      .def_prop_ro("ep_size", &Context::ep_size)
      .def_prop_ro("rank", &Context::rank)
      .def_prop_ro("closed", &Context::closed)
      .def("enable_stage_timing", &Context::enable_stage_timing, "on"_a)
      .def(
          "stage_times",
          [](Context& context, uintptr_t stream) {
            StageTimes times;
            {
              nb::gil_scoped_release release;
              times = context.stage_times(reinterpret_cast<Stream>(stream));
            }
            auto pairs = [](const std::vector<StageTime>& v) {
              std::vector<std::pair<std::string, double>> out;
              for (const StageTime& t : v) out.emplace_back(t.stage, t.ms);
              return out;
            };
            return std::make_pair(pairs(times.forward), pairs(times.backward));
          },
          "stream"_a, "(forward, backward): [(stage, ms)] of the last calls, after enable_stage_timing(True).")
      .def(
          "routing_stats",
          [](Context& context, const std::vector<uintptr_t>& pointers, uintptr_t stream) {
            // Five int32 device pointers per launch rank (RoutingStatsOut's fields, in order).
            if (pointers.size() != 5 * static_cast<size_t>(context.launch_ranks()))
              throw poise::InvalidArgument("routing_stats", "needs 5 pointers per launch rank");
            std::vector<RoutingStatsOut> outs;
            for (size_t i = 0; i < pointers.size(); i += 5) {
              auto p = [&](size_t j) { return reinterpret_cast<int32_t*>(pointers[i + j]); };
              outs.push_back({p(0), p(1), p(2), p(3), p(4)});
            }
            nb::gil_scoped_release release;
            context.routing_stats(outs, reinterpret_cast<Stream>(stream));
          },
          "pointers"_a, "stream"_a,
          "The latest forward's routing telemetry into int32 device buffers (RoutingStatsOut), no sync.")
      .def("select_activation_slot", &Context::select_activation_slot, "slot"_a, "num_moe_layers_in_slot"_a,
           "The next num_moe_layers_in_slot forwards keep their state in activation slot `slot` (as many as "
           "plan.activation_records_per_slot; the others recompute in backward).")
      .def_prop_ro("recomputed_forwards", &Context::recomputed_forwards,
                   "Backwards so far that rebuilt their forward (its activation record was overwritten).")
      .def("raise_if_faulted", &Context::raise_if_faulted,
           "Raises DeviceError for a fault of an earlier call that ended on the device, without waiting.")
      .def("reset", &Context::reset, release_gil())
      .def("close", &Context::close, release_gil());
}

}  // namespace poise::python
