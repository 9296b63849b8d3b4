// Umbrella header of the Poise C++ API.
#pragma once

#include "poise/config.hpp"
#include "poise/context.hpp"
#include "poise/errors.hpp"
#include "poise/fp8.hpp"
#include "poise/memory_plan.hpp"
#include "poise/types.hpp"

