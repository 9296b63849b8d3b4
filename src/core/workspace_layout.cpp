#include "core/workspace_layout.hpp"

#include <algorithm>
#include <cmath>

#include "numerics/block_scaling.hpp"

namespace poise::layout {
namespace {

constexpr int64_t kBf16 = 2, kFp32 = 4, kInt32 = 4, kU64 = 8, kE4m3 = 1;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
bool fp8_gemms(const Config& c) { return c.gemm_precision == GemmPrecision::fp8_block_scaled; }

// Regions one after another, each aligned and padded to kRegionAlignment.
class Block {
 public:
  Region add(int64_t bytes) {
    if (bytes <= 0) return {};
    const Region r{end_, round_up(bytes, kRegionAlignment)};
    end_ += r.bytes;
    return r;
  }
  int64_t end() const { return end_; }

 private:
  int64_t end_ = 0;
};

// The numbers every region is sized by.
struct Dims {
  int64_t T, K, D, F, E, R, TK, groups, B, capacity, score_partials;
  int64_t fp8_weight_groups;  // groups whose weights are quantized into the rank's scratch
  int64_t replica_grad_bytes; // per element of a replica's weight gradients (Config::replica_grad_dtype)
  bool exact, training, fp8, fp8_wgrad;
};

Dims dims_of(const Config& c, int64_t ep_size, int64_t replica_slots) {
  Dims d{};
  d.T = c.num_local_input_tokens, d.K = c.top_k, d.D = c.hidden_dim, d.F = c.intermediate_dim;
  d.E = c.num_experts, d.R = ep_size, d.TK = d.T * d.K;
  d.B = replica_slots;
  d.groups = c.num_local_experts(ep_size) + replica_slots;
  d.capacity = capacity_rows(c, ep_size, replica_slots);
  d.score_partials = (d.F + kScorePieceColumns - 1) / kScorePieceColumns + 1;  // + the expert biases' piece
  d.exact = c.balance == Balance::exact;
  d.training = !c.inference;
  d.fp8 = fp8_gemms(c);
  d.fp8_wgrad = c.fp8_wgrad;
  d.replica_grad_bytes = c.replica_grad_dtype == DType::bf16 ? kBf16 : kFp32;
  // Prepared weights (inference): the replica slots only. Training keeps every group: the backward
  // writes the transposed copies of the weights it reads there (docs/fp8.md).
  d.fp8_weight_groups = c.prepared_fp8_weights && c.inference ? d.B : d.groups;
  return d;
}

RecordRows record_rows(Block& b, int64_t D, bool fp8, int64_t rows) {
  RecordRows r;
  r.row_origin = b.add(kInt32 * rows);
  r.row_primary = b.add(kInt32 * rows);
  r.row_score = b.add(kFp32 * rows);
  r.recv_x = b.add((fp8 ? kE4m3 : kBf16) * rows * D);
  if (fp8) r.recv_x_scales = b.add(kFp32 * rows * numerics::scale_blocks(D));
  return r;
}

Region h13_region(Block& b, int64_t F, int64_t rows) { return b.add(kBf16 * rows * 2 * F); }

Window window(const Dims& d, const Keep& k) {
  Window w;
  Block b;
  w.signals = b.add(kSignalBytes);
  w.counts_RE = b.add(kInt32 * d.R * d.E);
  for (int64_t r = 0; r <= k.whole_records; ++r) w.records.push_back(record_rows(b, d.D, d.fp8, d.capacity));
  if (d.training) w.recv_grad = b.add(kBf16 * d.capacity * d.D);
  w.combine = b.add(kBf16 * d.TK * d.D);
  if (d.training) w.grad_scores_TK = b.add(kFp32 * d.TK);
  w.clip_counts_G2 = b.add(kU64 * 2 * d.groups);
  if (d.exact) {
    const int64_t w13 = 2 * d.F * d.D, w2 = d.D * d.F;
    w.replica_w13 = b.add(kBf16 * d.B * w13);
    w.replica_w2 = b.add(kBf16 * d.B * w2);
    if (d.training) w.replica_grad_w13 = b.add(d.replica_grad_bytes * d.B * w13);
    if (d.training) w.replica_grad_w2 = b.add(d.replica_grad_bytes * d.B * w2);
    // Expert biases travel with their weights (a call may pass them or not).
    w.replica_b13 = b.add(kBf16 * d.B * 2 * d.F);
    w.replica_b2 = b.add(kBf16 * d.B * d.D);
    if (d.training) w.replica_grad_b13 = b.add(kFp32 * d.B * 2 * d.F);
    if (d.training) w.replica_grad_b2 = b.add(kFp32 * d.B * d.D);
  }
  w.bytes = b.end();
  return w;
}

RecordBuffers record_buffers(Block& b, const Dims& d, int64_t h13_rows) {
  RecordBuffers r;
  r.dest_row_TK = b.add(kInt32 * d.TK);
  r.dest_rank_TK = b.add(kInt32 * d.TK);
  r.group_offsets = b.add(kInt32 * (d.groups + 1));
  r.group_counts = b.add(kInt32 * d.groups);
  if (d.exact) {
    r.plan_kept_E = b.add(kInt32 * d.E);
    r.plan_piece_first_E = b.add(kInt32 * (d.E + 1));
    r.plan_pieces = b.add(kReplicaPieceBytes * std::max<int64_t>(1, d.R * d.B));
    r.plan_group_offsets_RG = b.add(kInt32 * d.R * (d.groups + 1));
    r.plan_stats = b.add(kInt32 * kPlanStats);
  }
  r.h13_R2F = h13_region(b, d.F, h13_rows);
  return r;
}

// FP8 tiles of `rows` x up to `cols` values: 1 x 128 row tiles ([rows][cols], scales
// [rows][cols/128]) or 128 x 1 column tiles ([cols][rows], scales [rows/128][cols]), one at a time.
Fp8Tiles fp8_tiles(Block& b, int64_t rows, int64_t cols) {
  using numerics::scale_blocks;
  Fp8Tiles t;
  t.values = b.add(kE4m3 * rows * cols);
  t.scales = b.add(kFp32 * std::max(rows * scale_blocks(cols), rows / kExpertRowAlignment * cols));
  return t;
}

RankBuffers rank_buffers(const Dims& d, const Keep& k) {
  RankBuffers r;
  Block b;
  const int64_t full = 1 + k.whole_records + k.light_records;
  for (int64_t i = 0; i < full + k.partial_records; ++i)
    r.records.push_back(record_buffers(b, d, i < full ? d.capacity : k.partial_record_rows));
  const int64_t chunks = (d.T + kTokensPerChunk - 1) / kTokensPerChunk;
  r.chunk_offsets_CE = b.add(kInt32 * chunks * d.E);
  r.tail_offsets = b.add(kInt32 * d.groups);
  r.tail_counts = b.add(kInt32 * d.groups);
  r.a_RF = b.add(kBf16 * d.capacity * d.F);
  if (d.training) r.grad_score_partials_RP = b.add(kFp32 * d.capacity * d.score_partials);
  if (d.training) r.grad_h13_R2F = b.add(kBf16 * d.capacity * 2 * d.F);
  r.gemm_tile_counters = b.add(kInt32 * 2);
  r.gemm_fault_word = b.add(8);
  if (d.fp8) {
    using numerics::scale_blocks;  // of 128 (a last block of 64 when a dimension is 64 mod 128)
    r.fp8_x_TD = b.add(kE4m3 * d.T * d.D);
    r.fp8_x_scales = b.add(kFp32 * d.T * scale_blocks(d.D));
    r.fp8_a_RF = b.add(kE4m3 * d.capacity * d.F);
    r.fp8_a_scales = b.add(kFp32 * d.capacity * scale_blocks(d.F));
    r.fp8_w13 = b.add(kE4m3 * d.fp8_weight_groups * 2 * d.F * d.D);
    r.fp8_w13_scales = b.add(kFp32 * d.fp8_weight_groups * scale_blocks(2 * d.F) * scale_blocks(d.D));
    r.fp8_w2 = b.add(kE4m3 * d.fp8_weight_groups * d.D * d.F);
    r.fp8_w2_scales = b.add(kFp32 * d.fp8_weight_groups * scale_blocks(d.D) * scale_blocks(d.F));
    if (d.training) {
      r.fp8_grad_tiles = fp8_tiles(b, d.capacity, std::max(d.D, 2 * d.F));
      if (d.fp8_wgrad) r.fp8_activation_tiles = fp8_tiles(b, d.capacity, std::max(d.F, d.D));
      else r.wgrad_x_RD = b.add(kBf16 * d.capacity * d.D);
    }
  }
  r.bytes = b.end();
  return r;
}

}  // namespace

int64_t RecordBuffers::layout_bytes() const {
  return dest_row_TK.bytes + dest_rank_TK.bytes + group_offsets.bytes + group_counts.bytes + plan_kept_E.bytes +
         plan_piece_first_E.bytes + plan_pieces.bytes + plan_group_offsets_RG.bytes + plan_stats.bytes;
}

int64_t row_limit(const Config& c) {
  const int64_t routed = c.num_local_input_tokens * c.top_k;
  const int64_t tolerated = routed + static_cast<int64_t>(std::floor(c.balance_tolerance * static_cast<double>(routed)));
  if (!c.cost_aware_balance()) return tolerated;
  // The cost-aware plan may leave up to capacity mode's rows on a rank.
  return std::max(tolerated, static_cast<int64_t>(std::ceil(c.receive_capacity_factor * static_cast<double>(routed))));
}

int64_t padded_rows(int64_t routed, int64_t groups) {
  return round_up(routed + groups * (kExpertRowAlignment - 1), kExpertRowAlignment);
}

int64_t capacity_rows(const Config& c, int64_t ep_size, int64_t replica_slots) {
  if (c.balance == Balance::exact) return padded_rows(row_limit(c), c.num_local_experts(ep_size) + replica_slots);
  const double routed = c.receive_capacity_factor * static_cast<double>(c.num_local_input_tokens * c.top_k);
  return padded_rows(static_cast<int64_t>(std::ceil(routed)), c.num_local_experts(ep_size));
}

int64_t x_row_wire_bytes(const Config& c) {
  const int64_t D = c.hidden_dim;
  return fp8_gemms(c) ? kE4m3 * D + kFp32 * numerics::scale_blocks(D) : kBf16 * D;
}

int64_t record_rows_bytes(const Config& c, int64_t rows) {
  Block b;
  record_rows(b, c.hidden_dim, fp8_gemms(c), rows);
  return b.end();
}

int64_t h13_bytes(const Config& c, int64_t rows) {
  Block b;
  h13_region(b, c.intermediate_dim, rows);
  return b.end();
}

WorkspaceLayout workspace_layout(const Config& c, int64_t ep_size, const Keep& keep) {
  const Dims d = dims_of(c, ep_size, keep.replica_slots);
  WorkspaceLayout l;
  l.groups = d.groups;
  l.row_limit = d.exact ? row_limit(c) : d.TK;
  l.capacity_rows = d.capacity;
  l.score_partials = d.score_partials;
  l.window = window(d, keep);
  l.buffers = rank_buffers(d, keep);
  return l;
}

Keep keep_of(const MemoryPlan& p) {
  const int64_t slots = p.config.inference ? 0 : p.config.num_activation_slots;
  Keep k;
  k.replica_slots = p.num_replica_slots;
  k.whole_records = slots * p.activation_records_per_slot;
  k.light_records = slots * p.activation_light_records_per_slot;
  k.partial_records = p.activation_partial_record_rows > 0 ? slots : 0;
  k.partial_record_rows = p.activation_partial_record_rows;
  return k;
}

}  // namespace poise::layout
