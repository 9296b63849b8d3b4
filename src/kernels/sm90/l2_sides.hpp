// Which of the two L2 partitions each SM is near (host side of l2_sides.cu).
//
// The H200's L2 is two partitions joined by a fabric. A partition keeps its own copy of each line
// its SMs read that lives in the other (measured by bench/l2_partition: a far line's second load
// is as fast as a near one), so an operand read from both sides takes L2 capacity twice and crosses
// the fabric once per side. The fprop / dgrad GEMMs on the dynamic tile order can split an expert's
// tiles between the sides (tile_scheduler.cuh) once they know each SM's side. No API gives it; a
// probe kernel measures it: atomics are performed where a line lives, so the near/far latency
// pattern of one set of lines splits the SMs into two groups with complementary patterns.
#pragma once

#include <cstdint>

#include "kernels/sm90/tile_scheduler.cuh"

namespace poise::sm90 {

struct L2SideMap {
  bool valid = false;  // a clean split into two groups of at least a quarter of the SMs each
  int sms = 0;
  int side1_sms = 0;
  uint32_t bits[kL2SideWords] = {};  // bit s: SM s is on side 1
};

// The map of the current device, measured on first use (synchronous, ~10 ms and a 64 MiB scratch
// buffer, then cached for the process); not capturable. Invalid (sides not used) when the device has
// more than 32 * kL2SideWords SMs or the latencies do not split cleanly.
const L2SideMap& measure_l2_sides();
// The cached map of the current device, or null before measure_l2_sides ran on it.
const L2SideMap* cached_l2_sides();

}  // namespace poise::sm90
