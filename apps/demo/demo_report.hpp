// What the demo prints before the run: the layer, the memory plan, the routing balance, and
// (capacity mode) the rank that overflows its receive capacity.
#pragma once

#include "demo_setup.hpp"

namespace poise::demo {

void print_header(const Setup& s);
void print_balance(const Setup& s);
// Capacity mode: a rank routed more rows than it may receive fails the run, before it starts.
// Prints the failure and returns true then.
bool capacity_overflows(const Setup& s);

}  // namespace poise::demo
