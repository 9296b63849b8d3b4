// Config validation: every rule rejects with an InvalidArgument naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "poise/config.hpp"
#include "poise/errors.hpp"

namespace poise {
namespace {

Config valid_config() {
  Config c;
  c.num_local_input_tokens = 128;
  c.hidden_dim = 192;
  c.intermediate_dim = 64;
  c.top_k = 2;
  c.num_experts = 8;
  return c;
}

// Applies `mutate` to a valid config and expects validate(ep_size) to name `field`.
void expect_rejected(const std::function<void(Config&)>& mutate, const std::string& field, int64_t ep_size = 4) {
  Config c = valid_config();
  mutate(c);
  try {
    c.validate(ep_size);
    FAIL() << "expected InvalidArgument naming " << field;
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), field) << e.what();
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(Config, ValidConfigPasses) {
  EXPECT_NO_THROW(valid_config().validate(1));
  EXPECT_NO_THROW(valid_config().validate(8));
}

TEST(Config, RejectsEachBrokenRule) {
  expect_rejected([](Config& c) { c.num_local_input_tokens = 0; }, "num_local_input_tokens");
  expect_rejected([](Config& c) { c.hidden_dim = 100; }, "hidden_dim");
  expect_rejected([](Config& c) { c.hidden_dim = -64; }, "hidden_dim");
  expect_rejected([](Config& c) { c.intermediate_dim = 96; }, "intermediate_dim");
  expect_rejected([](Config& c) { c.top_k = 0; }, "top_k");
  expect_rejected([](Config& c) { c.top_k = 9; }, "top_k");
  expect_rejected([](Config& c) { c.num_experts = 6; }, "num_experts");  // not divisible by 4
  expect_rejected([](Config& c) { c.num_experts = 0; }, "num_experts");
  expect_rejected([](Config& c) { c.activation = Activation::swiglu_clamped; c.swiglu_limit = 0; }, "swiglu_limit");
  expect_rejected([](Config& c) { c.activation = Activation::swiglu_clamped; c.swiglu_alpha = -1; }, "swiglu_alpha");
  expect_rejected([](Config& c) { c.balance_tolerance = -0.1; }, "balance_tolerance");
  expect_rejected([](Config& c) { c.balance = Balance::capacity; c.receive_capacity_factor = 0.5; },
                  "receive_capacity_factor");
  expect_rejected([](Config& c) { c.num_activation_slots = -1; }, "num_activation_slots");
  expect_rejected([](Config& c) { c.max_moe_layers_per_activation_slot = 0; }, "max_moe_layers_per_activation_slot");
  expect_rejected([](Config& c) { c.activation_slot_bytes = 1 << 20; c.activation_slot_capacity_factor = 1.0; },
                  "activation_slot_bytes");
  expect_rejected([](Config& c) { c.activation_slot_capacity_factor = -0.5; }, "activation_slot_capacity_factor");
  expect_rejected([](Config& c) { c.activation_slot_bytes = -1; }, "activation_slot_bytes");
  expect_rejected([](Config& c) { c.host_overflow_scratch_factor = -1; }, "host_overflow_scratch_factor");
  // The cost-aware plan: finite rates >= 0, both the row cost and the link set, exact mode only.
  expect_rejected([](Config& c) { c.balance_cost_ns_per_row = -1; }, "balance_cost_ns_per_row");
  expect_rejected([](Config& c) { c.balance_cost_ns_per_group = std::nan(""); }, "balance_cost_ns_per_group");
  expect_rejected([](Config& c) { c.balance_link_gb_per_s = 1.0 / 0.0; }, "balance_link_gb_per_s");
  expect_rejected([](Config& c) { c.balance_cost_ns_per_row = 400; }, "balance_link_gb_per_s");
  expect_rejected([](Config& c) { c.balance_link_gb_per_s = 450; }, "balance_cost_ns_per_row");
  expect_rejected([](Config& c) { c.balance_cost_ns_per_group = 4e4; c.balance_link_gb_per_s = 450; },
                  "balance_cost_ns_per_row");
  expect_rejected([](Config& c) { c.balance = Balance::capacity; c.balance_cost_ns_per_row = 400; c.balance_link_gb_per_s = 450; },
                  "balance_cost_ns_per_row");
  expect_rejected([](Config& c) { c.balance_cost_ns_per_row = 400; c.balance_link_gb_per_s = 450; c.receive_capacity_factor = 0.5; },
                  "receive_capacity_factor");
  expect_rejected([](Config& c) { c.inference = true; c.activation_slot_bytes = 4096; }, "activation_slot_bytes");
  expect_rejected([](Config&) {}, "ep_size", 0);
}

TEST(Config, CostAwareBalanceNeedsBothRatesInExactMode) {
  Config c = valid_config();
  EXPECT_FALSE(c.cost_aware_balance());
  c.balance_cost_ns_per_row = 400;
  c.balance_link_gb_per_s = 450;
  EXPECT_TRUE(c.cost_aware_balance());
  EXPECT_NO_THROW(c.validate(4));
  c.balance = Balance::capacity;
  EXPECT_FALSE(c.cost_aware_balance());
}

TEST(Config, EnumStringsRoundTrip) {
  EXPECT_EQ(activation_from_string(to_string(Activation::swiglu_clamped)), Activation::swiglu_clamped);
  EXPECT_EQ(balance_from_string(to_string(Balance::capacity)), Balance::capacity);
  EXPECT_EQ(dtype_from_string("bfloat16", "wgrad_dtype"), DType::bf16);
  EXPECT_THROW(activation_from_string("gelu"), InvalidArgument);
  try {
    dtype_from_string("fp8", "wgrad_dtype");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.name(), "wgrad_dtype");
  }
}

}  // namespace
}  // namespace poise
