// NB_MODULE does no CUDA work: `import poise` must work (and stay cheap) on a machine without a GPU.
#include "runtime/device_info.hpp"
#include "bindings/python/bindings.hpp"

namespace nb = nanobind;

NB_MODULE(_poise, m) {
  m.doc() = "Poise C++ bindings (use the `poise` package, not this module directly).";
  poise::python::bind_errors(m);
  poise::python::bind_config(m);
  poise::python::bind_plan(m);
  poise::python::bind_context(m);
  poise::python::bind_routed_experts(m);
  poise::python::bind_reference(m);

  m.def("cuda_device_count", &poise::cuda_device_count,
        "Number of usable CUDA devices (0 without a driver or device). Initializes the CUDA runtime.");
}
