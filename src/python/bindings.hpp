// The nanobind module poise._poise, one file per idea; module.cpp calls each binder once.
// The Python package (python/poise) wraps these thin classes into dataclasses and friendly errors.
#pragma once

#include <nanobind/nanobind.h>

namespace poise::python {

void bind_errors(nanobind::module_& m);   // errors.cpp: C++ exceptions -> poise.errors classes
void bind_config(nanobind::module_& m);   // config.cpp: poise::Config and validate()
void bind_plan(nanobind::module_& m);     // plan.cpp: poise::MemoryPlan and plan_memory()
void bind_context(nanobind::module_& m);  // context.cpp: poise::Context lifecycle

}  // namespace poise::python
