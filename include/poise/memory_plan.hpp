// plan_memory: a pure host function (no CUDA) that sizes every region a Context will own.
// The formulas are written down in docs/memory_plan.md; explain() prints them with the numbers.
#pragma once

#include <cstdint>
#include <string>

#include "poise/config.hpp"

namespace poise {

struct MemoryPlan {
  Config config;
  int64_t ep_size = 1;
  int64_t num_local_experts = 0;    // E / ep_size
  int64_t num_replica_slots = 0;    // B: replica expert slots per rank (exact balance)

  // Rows a rank computes per call.
  int64_t balanced_rows = 0;  // T*K + per-expert padding (what exact balance guarantees)
  int64_t device_rows = 0;    // rows the device receive buffers and scratch hold
  int64_t total_rows = 0;     // device rows + host-backed overflow rows

  // Bytes per region.
  int64_t communication_bytes = 0;             // symmetric window: dispatch receive, combine, signals
  int64_t replica_weight_bytes = 0;            // B replica experts' weights (+ fp32 grads in training)
  int64_t activation_slot_min_bytes = 0;       // per slot: routing layout only, everything recomputed
  int64_t activation_slot_full_save_bytes = 0; // per slot: saves all of backward's inputs at balance
  int64_t activation_slot_max_useful_bytes = 0;// per slot: full save when every row is on the device
  int64_t activation_slot_bytes = 0;           // per slot, as configured: records_per_slot whole records
  int64_t activation_record_bytes = 0;         // one layer kept whole (layout, x rows, h13 of every received row)
  int64_t activation_records_per_slot = 0;     // layers a slot keeps whole
  int64_t activation_light_record_bytes = 0;   // one layer kept without its x rows (layout, h13)
  int64_t activation_light_records_per_slot = 0;  // layers a slot keeps light (backward re-sends x)
  // One more layer per slot kept partly: layout and h13 of its first rows (backward re-sends x and
  // recomputes h13 for the rest, decided on the device). 0 rows: none.
  int64_t activation_partial_record_rows = 0;
  int64_t activation_partial_record_bytes = 0;
  int64_t activation_slots_total_bytes = 0;    // num_activation_slots * activation_slot_bytes
  int64_t device_scratch_bytes = 0;            // per-call intermediates (h13, a, grads) on the device
  // Of device scratch, gemm_precision fp8_block_scaled: the call's FP8 operands (e4m3 tokens and a rows,
  // every group's weights, and their fp32 scales). 0 in bf16.
  int64_t fp8_operand_bytes = 0;
  // Bytes one x row carries to an expert's rank: 2D in bf16; D e4m3 values + 4 ceil(D/128) bytes of
  // fp32 scales in fp8_block_scaled, where tokens are quantized once, before dispatch.
  int64_t x_row_wire_bytes = 0;
  int64_t host_overflow_scratch_bytes = 0;     // host-backed virtual memory for overflow rows
  int64_t total_device_bytes = 0;
  int64_t total_virtual_bytes = 0;

  // Human-readable summary: one line per region, sizes in MiB/GiB, with the rule that sized it.
  std::string explain() const;
};

// Validates config for ep_size (throws InvalidArgument) and sizes the regions.
MemoryPlan plan_memory(const Config& config, int64_t ep_size);

}  // namespace poise
