#include "gemm/sm90/gemm_args.hpp"

#include "gemm/sm90/tensor_map.hpp"
#include "poise/errors.hpp"

namespace poise::sm90 {

void require(bool ok, const char* name, const char* rule) {
  if (!ok) throw InvalidArgument(name, rule);
}

void require_ptr(const void* p, const char* name) { require(p != nullptr, name, "must not be null"); }

void validate(const GroupedRows& rows, const ExpertMlpShape& shape) {
  require(rows.num_experts >= 1 && rows.num_experts <= kMaxExperts, "num_experts", "must be in [1, 1024]");
  require(rows.row_offsets_E != nullptr, "row_offsets_E", "must be a device pointer");
  require(rows.row_counts_E != nullptr, "row_counts_E", "must be a device pointer");
  require(rows.max_rows >= 0 && rows.max_rows < (int64_t{1} << 31), "max_rows", "must be in [0, 2^31)");
  require(rows.faults.word != nullptr && reinterpret_cast<uintptr_t>(rows.faults.word) % 8 == 0, "faults.word",
          "must be an 8-byte aligned device pointer");
  require(rows.faults.wait_timeout_ns > 0, "faults.wait_timeout_ns", "must be positive");
  require(shape.hidden_dim > 0 && shape.hidden_dim % 64 == 0, "hidden_dim", "must be a positive multiple of 64");
  require(shape.intermediate_dim > 0 && shape.intermediate_dim % 64 == 0, "intermediate_dim",
          "must be a positive multiple of 64");
  require(shape.hidden_dim < (1 << 20) && shape.intermediate_dim < (1 << 20), "hidden_dim",
          "D and F must be below 2^20");
  require(rows.num_experts * 2 * shape.intermediate_dim < (int64_t{1} << 31) &&
              rows.num_experts * shape.hidden_dim < (int64_t{1} << 31),
          "num_experts", "E*2F and E*D must fit in int32 (TMA coordinates)");
  if (shape.activation == Activation::swiglu_clamped)
    require(shape.swiglu_limit > 0.0f, "swiglu_limit", "must be positive");
  require(rows.first_replica >= -1 && rows.first_replica <= rows.num_experts, "first_replica",
          "must be -1 (no replicas) or in [0, num_experts]");
  require(reinterpret_cast<uintptr_t>(rows.tile_counters) % alignof(int32_t) == 0, "tile_counters",
          "must be null or a 4-byte aligned device pointer");
}

int64_t own_experts(const GroupedRows& rows) { return rows.first_replica < 0 ? rows.num_experts : rows.first_replica; }
int64_t replica_experts(const GroupedRows& rows) { return rows.num_experts - own_experts(rows); }

void require_replica_ptr(const GroupedRows& rows, const void* p, const char* name) {
  if (replica_experts(rows) > 0) require_ptr(p, name);
}

void validate_rows_output(const void* rows_RD, const char* rows_name, const RowScatter& scatter, int64_t D) {
  if (!scatter.row_origin_R) {
    require_ptr(rows_RD, rows_name);
    return;
  }
  require(rows_RD == nullptr, rows_name, "must be null when scatter.row_origin_R is set (the rows go to slots)");
  require_ptr(scatter.owner_bases, "scatter.owner_bases");
  require(scatter.slot_offset >= 0 && scatter.slot_offset % 16 == 0 && (D * 2) % 16 == 0, "scatter.slot_offset",
          "must be >= 0 and, like a row's D * 2 bytes, a multiple of 16");
  require(scatter.slots_per_owner >= 1 && scatter.slots_per_owner < (int64_t{1} << 31), "scatter.slots_per_owner",
          "must be in [1, 2^31)");
  require(scatter.owners >= 1 && scatter.owners * scatter.slots_per_owner < (int64_t{1} << 31), "scatter.owners",
          "must be >= 1 with owners * slots_per_owner < 2^31");
}

int32_t h13_split_row(const GroupedRows& rows, const H13Split& split) {
  if (split.split_row < 0) return static_cast<int32_t>(rows.max_rows);
  require(split.split_row % 128 == 0 && split.split_row <= rows.max_rows, "h13_split.split_row",
          "must be -1 or a multiple of 128 in [0, max_rows]");
  require(split.hi_R2F != nullptr, "h13_split.hi_R2F", "must not be null when split_row is set");
  return static_cast<int32_t>(split.split_row);
}

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

ActivationParams activation_params(const ExpertMlpShape& shape) {
  ActivationParams p;
  p.clamped = shape.activation == Activation::swiglu_clamped ? 1 : 0;
  p.alpha = shape.swiglu_alpha;
  p.limit = shape.swiglu_limit;
  return p;
}

ExpertBias expert_bias(const GroupedRows& rows, const void* own_EN, const char* own_name, const void* replicas_EN,
                       const char* replicas_name, int64_t N) {
  require_ptr(own_EN, own_name);
  require_replica_ptr(rows, replicas_EN, replicas_name);
  return {static_cast<const __nv_bfloat16*>(own_EN), static_cast<const __nv_bfloat16*>(replicas_EN),
          static_cast<int32_t>(own_experts(rows)), static_cast<int32_t>(N)};
}

GroupedGemmShape base_shape(const GroupedRows& rows) {
  GroupedGemmShape s;
  s.row_offsets_E = rows.row_offsets_E;
  s.row_counts_E = rows.row_counts_E;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.first_replica = static_cast<int32_t>(own_experts(rows));
  s.tile_counters = rows.tile_counters;  // used by rows-as-M GEMMs
  s.fault_word = rows.faults.word;
  s.wait_timeout_ns = rows.faults.wait_timeout_ns;
  s.drop_first_stage = rows.faults.drop_first_stage_for_tests ? 1 : 0;
  return s;
}

GroupedGemmShape rows_gemm_shape(const GroupedRows& rows, int64_t K, int64_t b_rows_per_expert, int64_t N,
                                 int64_t n_tile) {
  GroupedGemmShape s = base_shape(rows);
  s.k_blocks = static_cast<int32_t>(K / kTileK);
  s.n_blocks = ceil_div(N, n_tile);
  s.b_rows_per_expert = static_cast<int32_t>(b_rows_per_expert);
  return s;
}

CUtensorMap rows_operand_map(const void* a_RK, const GroupedRows& rows, int64_t K, const char* name) {
  return make_bf16_tensor_map(a_RK, rows.max_rows, K, kTileM / 2, name);  // a tile's A is two 64-row boxes
}

WeightMaps weight_maps(const GroupedRows& rows, const void* w, const char* name, const void* replica_w,
                       const char* replica_name, int64_t rows_per_expert, int64_t cols, int box_rows, bool e4m3) {
  const auto map = e4m3 ? make_fp8_tensor_map : make_bf16_tensor_map;
  const int64_t own = own_experts(rows), replicas = replica_experts(rows);
  WeightMaps m;
  if (own > 0) m.own = map(w, own * rows_per_expert, cols, box_rows, name);
  if (replicas > 0) m.replicas = map(replica_w, replicas * rows_per_expert, cols, box_rows, replica_name);
  if (own == 0) m.own = m.replicas;
  if (replicas == 0) m.replicas = m.own;
  return m;
}

}  // namespace poise::sm90
