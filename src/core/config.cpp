#include "poise/config.hpp"

#include <cmath>
#include <sstream>
#include <utility>

#include "poise/errors.hpp"

namespace poise {

const char* to_string(Activation a) {
  return a == Activation::swiglu ? "swiglu" : "swiglu_clamped";
}
const char* to_string(Balance b) { return b == Balance::exact ? "exact" : "capacity"; }
const char* to_string(DType d) { return d == DType::bf16 ? "bf16" : "fp32"; }
const char* to_string(GemmPrecision p) { return p == GemmPrecision::bf16 ? "bf16" : "fp8_block_scaled"; }

Activation activation_from_string(const std::string& s) {
  if (s == "swiglu") return Activation::swiglu;
  if (s == "swiglu_clamped") return Activation::swiglu_clamped;
  throw InvalidArgument("activation", "must be 'swiglu' or 'swiglu_clamped', got '" + s + "'");
}

Balance balance_from_string(const std::string& s) {
  if (s == "exact") return Balance::exact;
  if (s == "capacity") return Balance::capacity;
  throw InvalidArgument("balance", "must be 'exact' or 'capacity', got '" + s + "'");
}

DType dtype_from_string(const std::string& s, const std::string& field) {
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "fp32" || s == "float32") return DType::fp32;
  throw InvalidArgument(field, "must be 'bf16' or 'fp32', got '" + s + "'");
}

GemmPrecision gemm_precision_from_string(const std::string& s) {
  if (s == "bf16") return GemmPrecision::bf16;
  if (s == "fp8_block_scaled") return GemmPrecision::fp8_block_scaled;
  throw InvalidArgument("gemm_precision", "must be 'bf16' or 'fp8_block_scaled', got '" + s + "'");
}

namespace {

template <typename V>
std::string show(V v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

void require(bool ok, const char* field, const std::string& rule) {
  if (!ok) throw InvalidArgument(field, rule);
}

void require_positive(int64_t v, const char* field) {
  require(v > 0, field, "must be > 0, got " + show(v));
}

void require_multiple_of_64(int64_t v, const char* field) {
  require_positive(v, field);
  require(v % 64 == 0, field, "must be a multiple of 64, got " + show(v));
}

void require_finite_positive(double v, const char* field) {
  require(std::isfinite(v) && v > 0, field, "must be a finite number > 0, got " + show(v));
}

// The cost-aware plan's rates: finite and >= 0; set, they need exact mode, the row cost and the link.
void validate_balance_cost(const Config& c) {
  const std::pair<const char*, double> rates[] = {{"balance_cost_ns_per_row", c.balance_cost_ns_per_row},
                                                  {"balance_cost_ns_per_group", c.balance_cost_ns_per_group},
                                                  {"balance_link_gb_per_s", c.balance_link_gb_per_s}};
  for (const auto& [field, value] : rates) {
    require(std::isfinite(value) && value >= 0, field, "must be a finite number >= 0, got " + show(value));
  }
  const bool any = c.balance_cost_ns_per_row > 0 || c.balance_cost_ns_per_group > 0 || c.balance_link_gb_per_s > 0;
  if (!any) return;
  require(c.balance == Balance::exact, "balance_cost_ns_per_row",
          "the cost-aware plan chooses among exact-balance plans: set balance='exact' or leave the rates at 0");
  require(c.balance_cost_ns_per_row > 0, "balance_cost_ns_per_row",
          "must be > 0 when balance_link_gb_per_s or balance_cost_ns_per_group is set (the cost-aware plan needs "
          "the expert work per row)");
  require(c.balance_link_gb_per_s > 0, "balance_link_gb_per_s",
          "must be > 0 when balance_cost_ns_per_row is set (the cost-aware plan weighs replica bytes by it)");
}

}  // namespace

bool Config::cost_aware_balance() const {
  return balance == Balance::exact && balance_cost_ns_per_row > 0 && balance_link_gb_per_s > 0;
}

void Config::validate(int64_t ep_size) const {
  require(ep_size > 0, "ep_size", "must be > 0, got " + show(ep_size));
  require_positive(num_local_input_tokens, "num_local_input_tokens");
  require_multiple_of_64(hidden_dim, "hidden_dim");
  require_multiple_of_64(intermediate_dim, "intermediate_dim");
  require_positive(num_experts, "num_experts");
  require_positive(top_k, "top_k");
  require(top_k <= num_experts, "top_k",
          "must be <= num_experts (" + show(num_experts) + "), got " + show(top_k));
  require(num_experts % ep_size == 0, "num_experts",
          "must be divisible by the EP size " + show(ep_size) + ", got " + show(num_experts));
  if (activation == Activation::swiglu_clamped) {
    require_finite_positive(swiglu_alpha, "swiglu_alpha");
    require_finite_positive(swiglu_limit, "swiglu_limit");
  }
  require(std::isfinite(balance_tolerance) && balance_tolerance >= 0, "balance_tolerance",
          "must be a finite number >= 0, got " + show(balance_tolerance));
  validate_balance_cost(*this);
  if (balance == Balance::capacity || cost_aware_balance()) {
    require(std::isfinite(receive_capacity_factor) && receive_capacity_factor >= 1.0,
            "receive_capacity_factor", "must be >= 1, got " + show(receive_capacity_factor));
  }
  require(num_activation_slots >= 0, "num_activation_slots",
          "must be >= 0, got " + show(num_activation_slots));
  require_positive(max_moe_layers_per_activation_slot, "max_moe_layers_per_activation_slot");
  require(!(activation_slot_capacity_factor && activation_slot_bytes), "activation_slot_bytes",
          "is mutually exclusive with activation_slot_capacity_factor: set one of them");
  if (activation_slot_capacity_factor) {
    require(std::isfinite(*activation_slot_capacity_factor) && *activation_slot_capacity_factor >= 0,
            "activation_slot_capacity_factor",
            "must be a finite number >= 0, got " + show(*activation_slot_capacity_factor));
  }
  if (activation_slot_bytes) {
    require(*activation_slot_bytes >= 0, "activation_slot_bytes",
            "must be >= 0, got " + show(*activation_slot_bytes));
  }
  require(std::isfinite(host_overflow_scratch_factor) && host_overflow_scratch_factor >= 0,
          "host_overflow_scratch_factor",
          "must be >= 0, got " + show(host_overflow_scratch_factor));
  require(!prepared_fp8_weights || gemm_precision == GemmPrecision::fp8_block_scaled, "prepared_fp8_weights",
          "needs gemm_precision fp8_block_scaled (only FP8 GEMMs read prepared weights)");
  require(!fp8_wgrad || gemm_precision == GemmPrecision::fp8_block_scaled, "fp8_wgrad",
          "needs gemm_precision fp8_block_scaled (BF16 GEMMs have no FP8 WGRAD)");
  if (inference) {
    require(!activation_slot_capacity_factor && !activation_slot_bytes, "activation_slot_bytes",
            "must be unset when inference=true (inference saves nothing for backward)");
  }
}

}  // namespace poise
