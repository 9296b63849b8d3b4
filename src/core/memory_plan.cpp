// The memory planner: pure host arithmetic, no CUDA. It sums the regions of the workspace layout
// (core/workspace_layout.hpp), the one description of what the pipeline allocates; docs/memory_plan.md
// states the formulas.
#include "poise/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/workspace_layout.hpp"
#include "poise/errors.hpp"

namespace poise {
namespace {

constexpr int64_t kWindowGranularity = 2 << 20;  // VMM / NCCL window granularity (2 MiB)

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t ceil_times(double factor, int64_t v) { return static_cast<int64_t>(std::ceil(factor * double(v))); }

std::string human_bytes(int64_t bytes) {
  char buf[32];
  const double b = double(bytes);
  if (b >= double(1 << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1 << 30));
  else if (b >= double(1 << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

// One layer kept with `rows` received rows: its routing layout, and per row the x row with its
// metadata (window) and h13.
int64_t kept_layer_bytes(const Config& c, int64_t layout_bytes, int64_t rows) {
  return layout_bytes + layout::record_rows_bytes(c, rows) + layout::h13_bytes(c, rows);
}

// The bytes an activation slot may use, before they are spent on whole, light and partial records.
int64_t slot_room(const MemoryPlan& p, int64_t layout_bytes) {
  const Config& c = p.config;
  const int64_t layers = c.max_moe_layers_per_activation_slot;
  if (c.activation_slot_bytes) {
    if (*c.activation_slot_bytes < p.activation_slot_min_bytes) {
      throw InvalidArgument("activation_slot_bytes",
                            "must be >= the slot minimum (routing layout of " + std::to_string(layers) +
                                " layer(s)) of " + std::to_string(p.activation_slot_min_bytes) + " bytes, got " +
                                std::to_string(*c.activation_slot_bytes));
    }
    return std::min(*c.activation_slot_bytes, p.activation_slot_max_useful_bytes);
  }
  if (c.activation_slot_capacity_factor) {
    // Factor 0: keep nothing (the layouts' room is not spent on a partial layer's rows either).
    const int64_t rows = std::min(p.device_rows, ceil_times(*c.activation_slot_capacity_factor, p.balanced_rows));
    return rows == 0 ? 0 : layers * kept_layer_bytes(c, layout_bytes, rows);
  }
  return p.activation_slot_max_useful_bytes;  // every layer's forward kept whole
}

// Activation slot, per layer: the routing layout (destination row and rank of each (t, k), group
// offsets and counts; with exact balance the plan) and, per received row, x (D) with its metadata
// and h13 (2F). `a` is recomputed from h13 in the backward epilogue, y is not needed (the score
// gradients come from the experts), so neither is saved. A slot keeps whole layers (every received
// row), so what it holds does not depend on the routing: as many layers as fit whole, then as many
// as fit light (layout and h13: backward sends their x rows again), then the first rows of one more
// (partial); the rest recompute their forward in backward.
void plan_activation_slots(MemoryPlan& p, const layout::WorkspaceLayout& working) {
  const Config& c = p.config;
  const int64_t layers = c.max_moe_layers_per_activation_slot;
  const layout::RecordBuffers& buffers = working.buffers.records[0];
  const int64_t layout_bytes = buffers.layout_bytes();
  p.activation_record_bytes = working.window.records[0].bytes() + buffers.bytes();
  p.activation_light_record_bytes = buffers.bytes();
  p.activation_slot_min_bytes = layers * layout_bytes;
  p.activation_slot_full_save_bytes = layers * kept_layer_bytes(c, layout_bytes, p.balanced_rows);
  p.activation_slot_max_useful_bytes = layers * p.activation_record_bytes;
  const int64_t room = slot_room(p, layout_bytes);
  p.activation_records_per_slot = std::min(layers, room / p.activation_record_bytes);
  p.activation_light_records_per_slot =
      std::min(layers - p.activation_records_per_slot,
               (room - p.activation_records_per_slot * p.activation_record_bytes) / p.activation_light_record_bytes);
  p.activation_slot_bytes = p.activation_records_per_slot * p.activation_record_bytes +
                            p.activation_light_records_per_slot * p.activation_light_record_bytes;
  // What is left may keep one more layer's first rows (whole 128-row blocks of h13).
  const int64_t left = room - p.activation_slot_bytes, block = layout::h13_bytes(c, kExpertRowAlignment);
  if (p.activation_records_per_slot + p.activation_light_records_per_slot < layers && left > layout_bytes) {
    const int64_t rows = std::min((left - layout_bytes) / block * kExpertRowAlignment,
                                  p.device_rows - kExpertRowAlignment);
    if (rows > 0) {
      p.activation_partial_record_rows = rows;
      p.activation_partial_record_bytes = layout_bytes + layout::h13_bytes(c, rows);
      p.activation_slot_bytes += p.activation_partial_record_bytes;
    }
  }
}

// The regions of the layout the pipeline will allocate, summed by what they hold. The
// communication window is the workspace less the replica and kept records' regions, in whole
// granules; device scratch is the rank's buffers less the kept records'.
void sum_regions(MemoryPlan& p, const layout::WorkspaceLayout& l) {
  int64_t kept_rows = 0, kept_buffers = 0;
  for (size_t r = 1; r < l.window.records.size(); ++r) kept_rows += l.window.records[r].bytes();
  for (size_t r = 1; r < l.buffers.records.size(); ++r) kept_buffers += l.buffers.records[r].bytes();
  p.replica_weight_bytes = l.window.replica_bytes();
  p.communication_bytes = round_up(l.window.bytes - p.replica_weight_bytes - kept_rows, kWindowGranularity);
  p.activation_slots_total_bytes = kept_rows + kept_buffers;
  p.device_scratch_bytes = l.buffers.bytes - kept_buffers;
  p.fp8_operand_bytes = l.buffers.fp8_bytes();
  p.host_overflow_scratch_bytes = 0;  // not built (plan_memory)
  p.total_device_bytes =
      p.communication_bytes + p.replica_weight_bytes + p.activation_slots_total_bytes + p.device_scratch_bytes;
  p.total_virtual_bytes = p.total_device_bytes + p.host_overflow_scratch_bytes;
}

}  // namespace

MemoryPlan plan_memory(const Config& c, int64_t ep_size) {
  c.validate(ep_size);
  // Host-backed (VMM) overflow rows are not built: the pipeline keeps the scratch of every row the
  // dispatch accepts on the device, so that is what the plan counts (bench/memory_accounting.py
  // compares the plan with what a context holds).
  if (c.host_overflow_scratch_factor > 0) {
    throw NotAvailable("host_overflow_scratch_factor: host-backed (VMM) overflow scratch is not built yet; every "
                       "received row's scratch is on the device (leave it 0)");
  }
  MemoryPlan p;
  p.config = c;
  p.ep_size = ep_size;
  p.num_local_experts = c.num_local_experts(ep_size);
  // One rank has nobody to lend rows to: exact balance needs no replica slots at EP=1.
  p.num_replica_slots = c.balance == Balance::exact && ep_size > 1 ? p.num_local_experts : 0;
  // Exact balance computes at most the row limit per rank, capacity mode T*K when balanced.
  const int64_t computed_rows = c.balance == Balance::exact ? layout::row_limit(c) : c.num_local_input_tokens * c.top_k;
  p.balanced_rows = layout::padded_rows(computed_rows, p.num_local_experts + p.num_replica_slots);
  // The working call alone sizes the rows and every kind of activation record.
  const layout::WorkspaceLayout working = layout::workspace_layout(c, ep_size, {.replica_slots = p.num_replica_slots});
  p.device_rows = working.capacity_rows;  // every row the dispatch accepts; more is an overflow
  p.total_rows = p.device_rows;
  p.x_row_wire_bytes = layout::x_row_wire_bytes(c);
  if (!c.inference) plan_activation_slots(p, working);
  sum_regions(p, layout::workspace_layout(c, ep_size, layout::keep_of(p)));
  return p;
}

std::string MemoryPlan::explain() const {
  const Config& c = config;
  std::ostringstream os;
  char line[256];
  auto row = [&](const char* name, int64_t bytes, const std::string& rule) {
    std::snprintf(line, sizeof line, "  %-26s %12s   %s\n", name, human_bytes(bytes).c_str(), rule.c_str());
    os << line;
  };
  os << "Poise memory plan (per rank): EP=" << ep_size << ", T=" << c.num_local_input_tokens
     << ", D=" << c.hidden_dim << ", F=" << c.intermediate_dim << ", E=" << c.num_experts << " ("
     << num_local_experts << " local + " << num_replica_slots << " replica slots), K=" << c.top_k
     << ", balance=" << to_string(c.balance) << ", " << (c.inference ? "inference" : "training") << "\n";
  os << "  rows: balanced " << balanced_rows << " (T*K=" << c.num_local_input_tokens * c.top_k
     << " + expert padding to " << kExpertRowAlignment << "), device " << device_rows
     << " (every row the dispatch accepts), total " << total_rows
     << "\n";
  if (c.cost_aware_balance()) {
    std::snprintf(line, sizeof line,
                  "  balance plan: cost-aware, row limits %lld (exact) to %lld (capacity mode), each call the least "
                  "predicted: rows x %g ns + expert groups x %g ns + replica bytes / %g GB/s\n",
                  static_cast<long long>(c.num_local_input_tokens * c.top_k),
                  static_cast<long long>(layout::row_limit(c)), c.balance_cost_ns_per_row, c.balance_cost_ns_per_group,
                  c.balance_link_gb_per_s);
    os << line;
  }
  const bool fp8 = c.gemm_precision == GemmPrecision::fp8_block_scaled;
  os << "  x rows on the wire: " << x_row_wire_bytes << " bytes each ("
     << (fp8 ? "e4m3 values + fp32 scales per 128, each token quantized once before dispatch" : "bf16") << ")\n";
  const char* window_rule =
      fp8 ? (c.inference ? "received rows x (D+D/32+12, x in FP8) + T*K x 2D combine + counts + signals, 2 MiB granules"
                         : "received rows x (3D+D/32+12, x in FP8) + T*K x (2D+4) combine + counts + signals, 2 MiB granules")
          : (c.inference ? "received rows x (2D+12) + T*K x 2D combine + counts + signals, 2 MiB granules"
                         : "received rows x (4D+12) + T*K x (2D+4) combine + counts + signals, 2 MiB granules");
  row("communication window", communication_bytes, window_rule);
  row("replica experts", replica_weight_bytes,
      c.inference ? "B x 3FD bf16 weights"
                  : std::string("B x 3FD x (bf16 weights + ") + to_string(c.replica_grad_dtype) + " grads)");
  if (!c.inference) {
    std::snprintf(line, sizeof line, "%lld slot(s) x %lld layer(s); min %s, full save %s, max useful %s",
                  static_cast<long long>(c.num_activation_slots),
                  static_cast<long long>(c.max_moe_layers_per_activation_slot),
                  human_bytes(activation_slot_min_bytes).c_str(), human_bytes(activation_slot_full_save_bytes).c_str(),
                  human_bytes(activation_slot_max_useful_bytes).c_str());
    row("activation slot (each)", activation_slot_bytes, line);
    std::snprintf(line, sizeof line,
                  "per slot %lld layer(s) whole (%s: layout + x rows + h13), %lld light (%s: layout + h13), %s; "
                  "the rest recompute",
                  static_cast<long long>(activation_records_per_slot), human_bytes(activation_record_bytes).c_str(),
                  static_cast<long long>(activation_light_records_per_slot),
                  human_bytes(activation_light_record_bytes).c_str(),
                  activation_partial_record_rows > 0
                      ? ("1 partial (h13 of " + std::to_string(activation_partial_record_rows) + " rows)").c_str()
                      : "no partial");
    row("activation slots (all)", activation_slots_total_bytes, line);
  }
  row("device scratch", device_scratch_bytes,
      c.inference ? "device rows x 3F x 2 (h13, a) + routing layout"
                  : "device rows x (5F x 2 + F/16) (h13, a, grad_h13, score pieces) + routing layout");
  row("host overflow scratch", host_overflow_scratch_bytes, "host-backed (VMM) rows: not built yet");
  if (fp8) {
    row("  of which FP8 operands", fp8_operand_bytes,
        std::string("e4m3 tokens (T x D), a rows (device rows x F), ") +
            (c.prepared_fp8_weights && c.inference ? "the replica slots' weights (3 F D; the own experts' come prepared)"
                                                   : "every group's weights (3 F D; the backward's transposed copies too)") +
            (c.inference ? ""
                         : c.fp8_wgrad ? ", the backward's tiles (device rows x (max(D, 2F) + max(F, D)))"
                                       : ", the backward's row tiles (device rows x max(D, 2F)) and x rows in bf16 for "
                                         "the BF16 WGRAD (device rows x 2D)") +
            ", fp32 scales per 128; quantized per call (docs/fp8.md)");
  }
  row("total device", total_device_bytes, "");
  row("total virtual", total_virtual_bytes, "device + host overflow");
  return os.str();
}

}  // namespace poise
