// A layer's Config from its shape, balance mode and receive capacity factor: what the tests, the
// benchmarks and the demo fixtures build (header only, so a target that does not link
// poise_testing can use it too).
#pragma once

#include <cstdint>

#include "poise/config.hpp"

namespace poise::testing {

inline Config layer_config(int64_t T, int64_t D, int64_t F, int64_t E, int64_t K, Balance balance,
                           double receive_capacity_factor) {
  Config c;
  c.num_local_input_tokens = T;
  c.hidden_dim = D;
  c.intermediate_dim = F;
  c.top_k = K;
  c.num_experts = E;
  c.balance = balance;
  c.receive_capacity_factor = receive_capacity_factor;
  return c;
}

}  // namespace poise::testing
