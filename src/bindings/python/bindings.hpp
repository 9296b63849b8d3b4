// The nanobind module poise._poise, one file per idea; module.cpp calls each binder once.
// The Python package (python/poise) wraps these thin classes into dataclasses and friendly errors.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "poise/context.hpp"  // W13Layout

namespace poise::python {

void bind_errors(nanobind::module_& m);   // errors.cpp: C++ exceptions -> poise.errors classes
// errors.cpp: the translation alone, for poise._poise_nccl (its own copy of the library throws).
void register_error_translator();
void bind_config(nanobind::module_& m);   // config.cpp: poise::Config and validate()
void bind_plan(nanobind::module_& m);     // plan.cpp: poise::MemoryPlan and plan_memory()
void bind_context(nanobind::module_& m);  // context.cpp: poise::Context lifecycle
void bind_routed_experts(nanobind::module_& m);  // routed_experts.cpp: GPU entry points on raw pointers
void bind_reference(nanobind::module_& m);       // reference.cpp: the CPU reference engine and oracle

// "gate_up_blocked" | "gate_up_interleaved" (routed_experts.cpp); else InvalidArgument("w13_layout").
W13Layout w13_layout_from_string(const std::string& s);
const char* to_string(W13Layout layout);

}  // namespace poise::python
