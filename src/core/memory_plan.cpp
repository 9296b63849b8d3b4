// The memory planner: pure host arithmetic, no CUDA. docs/memory_plan.md states every formula used here.
#include "poise/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "poise/errors.hpp"

namespace poise {
namespace {

constexpr int64_t kBf16Bytes = 2;
constexpr int64_t kFp32Bytes = 4;
constexpr int64_t kRegionAlignment = 256;              // every region starts on a 256 B boundary
constexpr int64_t kWindowGranularity = 2 << 20;        // VMM / NCCL window granularity (2 MiB)
constexpr int64_t kRowMetadataBytes = 12;  // per received row: source (t, k), primary row (int32), score (fp32)
constexpr int64_t kSignalBytesPerPeer = 256;           // readiness counters and barrier words per peer

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

}  // namespace

MemoryPlan plan_memory(const Config& c, int64_t ep_size) {
  c.validate(ep_size);
  MemoryPlan p;
  p.config = c;
  p.ep_size = ep_size;
  p.num_local_experts = c.num_local_experts(ep_size);
  // One rank has nobody to lend rows to: exact balance needs no replica slots at EP=1.
  p.num_replica_slots = c.balance == Balance::exact && ep_size > 1 ? p.num_local_experts : 0;

  const int64_t T = c.num_local_input_tokens, K = c.top_k, D = c.hidden_dim, F = c.intermediate_dim;
  const int64_t routed_rows = T * K;
  const int64_t expert_slots = p.num_local_experts + p.num_replica_slots;
  // Each expert group is padded to the tile height, so padding adds at most (alignment - 1) per slot.
  const int64_t max_padding = expert_slots * (kExpertRowAlignment - 1);

  // Exact mode computes at most (1 + balance_tolerance) * T*K rows per rank.
  const int64_t computed_rows =
      c.balance == Balance::exact ? ceil_times(1.0 + c.balance_tolerance, routed_rows) : routed_rows;
  p.balanced_rows = round_up(computed_rows + max_padding, kExpertRowAlignment);
  // Rows the dispatch receive buffer accepts; more is an overflow the host reports.
  const int64_t receive_rows =
      c.balance == Balance::exact
          ? p.balanced_rows
          : round_up(ceil_times(c.receive_capacity_factor, routed_rows) + max_padding, kExpertRowAlignment);
  // Host-backed (VMM) overflow rows are not built: the pipeline keeps the scratch of every row the
  // dispatch accepts on the device, so that is what the plan counts (device_scratch_capacity_factor,
  // which would move the rows past it to the host, has no effect until then; bench/memory_accounting.py
  // compares the plan with what a context holds).
  if (c.host_overflow_scratch_factor > 0) {
    throw NotAvailable("host_overflow_scratch_factor: host-backed (VMM) overflow scratch is not built yet; every "
                       "received row's scratch is on the device (leave it 0)");
  }
  p.device_rows = receive_rows;
  p.total_rows = p.device_rows;

  // Communication window: received rows (+ metadata) of the working call, in training the received
  // grad_out rows and this rank's score gradients, the combine buffer of this rank's T*K outputs,
  // the all-gathered counts, clip counters, signals. (Activation slots' x rows live in the window
  // too, remote ranks write them: counted under the slots.)
  const int64_t training_window =
      c.inference ? 0 : receive_rows * D * kBf16Bytes + routed_rows * kFp32Bytes;
  p.communication_bytes =
      round_up(receive_rows * (D * kBf16Bytes + kRowMetadataBytes) + training_window + routed_rows * D * kBf16Bytes +
                   ep_size * c.num_experts * kFp32Bytes + expert_slots * 2 * 8 + ep_size * kSignalBytesPerPeer,
               kWindowGranularity);

  // Replica experts: weights always; an fp32 gradient each in training, reduced back to the owner.
  const int64_t expert_params = 3 * F * D;  // W13 (2F x D) + W2 (D x F)
  p.replica_weight_bytes = round_up(
      p.num_replica_slots * expert_params * (kBf16Bytes + (c.inference ? 0 : kFp32Bytes)), kRegionAlignment);

  // Activation slot, per layer: the routing layout (destination row and rank of each (t, k), each
  // received row's source, primary row and score, group offsets; with exact balance the plan) and,
  // per received row, x (D) and h13 (2F) in bf16. `a` is recomputed from h13 in the backward
  // epilogue, y is not needed (the score gradients come from the experts), so neither is saved.
  const int64_t layers = c.max_moe_layers_per_activation_slot;
  const int64_t plan_bytes =
      p.num_replica_slots > 0 ? (2 * c.num_experts + 1 + ep_size * (expert_slots + 1) + 4) * kFp32Bytes +
                                    ep_size * p.num_replica_slots * 5 * kFp32Bytes
                              : 0;
  const int64_t layout_bytes =
      round_up(routed_rows * 2 * kFp32Bytes + receive_rows * 3 * kFp32Bytes + 2 * (expert_slots + 1) * kFp32Bytes +
                   plan_bytes,
               kRegionAlignment);
  const int64_t saved_row_bytes = (D + 2 * F) * kBf16Bytes;
  if (!c.inference) {
    p.activation_record_bytes = layout_bytes + receive_rows * saved_row_bytes;
    p.activation_light_record_bytes = layout_bytes + receive_rows * 2 * F * kBf16Bytes;
    p.activation_slot_min_bytes = layers * layout_bytes;
    p.activation_slot_full_save_bytes = layers * (layout_bytes + p.balanced_rows * saved_row_bytes);
    p.activation_slot_max_useful_bytes = layers * p.activation_record_bytes;
    if (c.activation_slot_bytes) {
      if (*c.activation_slot_bytes < p.activation_slot_min_bytes) {
        throw InvalidArgument("activation_slot_bytes",
                              "must be >= the slot minimum (routing layout of " + std::to_string(layers) +
                                  " layer(s)) of " + std::to_string(p.activation_slot_min_bytes) + " bytes, got " +
                                  std::to_string(*c.activation_slot_bytes));
      }
      p.activation_slot_bytes = std::min(*c.activation_slot_bytes, p.activation_slot_max_useful_bytes);
    } else if (c.activation_slot_capacity_factor) {
      // Factor 0: keep nothing (the layouts' room is not spent on a partial layer's rows either).
      const int64_t rows_saved = std::min(receive_rows, ceil_times(*c.activation_slot_capacity_factor, p.balanced_rows));
      p.activation_slot_bytes = rows_saved == 0 ? 0 : layers * (layout_bytes + rows_saved * saved_row_bytes);
    } else {
      p.activation_slot_bytes = p.activation_slot_max_useful_bytes;  // every layer's forward kept whole
    }
    // A slot keeps whole layers (every received row), so what it holds does not depend on the
    // routing: as many layers as fit whole, then as many as fit light (layout and h13: backward
    // sends their x rows again), the rest recompute their forward in backward.
    const int64_t room = p.activation_slot_bytes;
    p.activation_records_per_slot = std::min(layers, room / p.activation_record_bytes);
    p.activation_light_records_per_slot =
        std::min(layers - p.activation_records_per_slot,
                 (room - p.activation_records_per_slot * p.activation_record_bytes) / p.activation_light_record_bytes);
    p.activation_slot_bytes = p.activation_records_per_slot * p.activation_record_bytes +
                              p.activation_light_records_per_slot * p.activation_light_record_bytes;
    // What is left may keep one more layer's first rows (whole 128-row blocks of h13).
    const int64_t left = room - p.activation_slot_bytes, h13_row_bytes = 2 * F * kBf16Bytes;
    if (p.activation_records_per_slot + p.activation_light_records_per_slot < layers && left > layout_bytes) {
      const int64_t rows = std::min((left - layout_bytes) / h13_row_bytes / kExpertRowAlignment * kExpertRowAlignment,
                                    receive_rows - kExpertRowAlignment);
      if (rows > 0) {
        p.activation_partial_record_rows = rows;
        p.activation_partial_record_bytes = layout_bytes + rows * h13_row_bytes;
        p.activation_slot_bytes += p.activation_partial_record_bytes;
      }
    }
    p.activation_slots_total_bytes = c.num_activation_slots * p.activation_slot_bytes;
  }

  // Per-row bf16 intermediates of one call, the larger of the two passes. Forward: h13 (2F) + a (F).
  // Backward: recomputed h13 (2F) + a (F), grad_h13 (2F). The y and grad_x rows go straight into the
  // owners' combine slots (the window's combine buffer; docs/ep_data_path.md, direct combine).
  const int64_t forward_row_bytes = 3 * F * kBf16Bytes;
  const int64_t backward_row_bytes = 5 * F * kBf16Bytes;
  const int64_t scratch_row_bytes = c.inference ? forward_row_bytes : std::max(forward_row_bytes, backward_row_bytes);
  p.device_scratch_bytes = round_up(p.device_rows * scratch_row_bytes, kRegionAlignment);
  p.host_overflow_scratch_bytes = 0;  // not built (above)

  p.total_device_bytes =
      p.communication_bytes + p.replica_weight_bytes + p.activation_slots_total_bytes + p.device_scratch_bytes;
  p.total_virtual_bytes = p.total_device_bytes + p.host_overflow_scratch_bytes;
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
  row("communication window", communication_bytes,
      c.inference ? "received rows x (2D+12) + T*K x 2D combine + counts + signals, 2 MiB granules"
                  : "received rows x (4D+12) + T*K x (2D+4) combine + counts + signals, 2 MiB granules");
  row("replica experts", replica_weight_bytes,
      c.inference ? "B x 3FD bf16 weights" : "B x 3FD x (bf16 weights + fp32 grads)");
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
  row("device scratch", device_scratch_bytes, c.inference ? "device rows x 3F x 2" : "device rows x 5F x 2");
  row("host overflow scratch", host_overflow_scratch_bytes, "host-backed (VMM) rows: not built yet");
  row("total device", total_device_bytes, "");
  row("total virtual", total_virtual_bytes, "device + host overflow");
  return os.str();
}

}  // namespace poise
