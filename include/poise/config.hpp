// Config: the static description of one MoE layer's routed experts across an EP group.
// Field names are shared with the Python dataclass `poise.Config`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "poise/types.hpp"

namespace poise {

struct Config {
  int64_t num_local_input_tokens = 0;  // T: physical rows per rank and call (padding rows carry zero scores)
  int64_t hidden_dim = 0;              // D: multiple of 64
  int64_t intermediate_dim = 0;        // F: multiple of 64
  int64_t top_k = 0;                   // K
  int64_t num_experts = 0;             // E: divisible by the EP size

  Activation activation = Activation::swiglu;
  double swiglu_alpha = 1.702;  // used by swiglu_clamped
  double swiglu_limit = 7.0;    // used by swiglu_clamped

  Balance balance = Balance::exact;
  // Exact mode: a rank may compute up to (1 + balance_tolerance) * T*K rows; only rows beyond that
  // move to replicas, which cuts replica traffic under mild skew. 0 = exact balance.
  double balance_tolerance = 0.0;
  double receive_capacity_factor = 2.0;  // capacity mode: receive rows = factor * T*K
  // Exact mode, cost-aware plan (issue 37, docs/balance.md "Cost-aware plan"): with both rates set
  // (> 0), every call's planner tries row limits from T*K (exact balance) up to
  // max(receive_capacity_factor, 1 + balance_tolerance) * T*K (where nothing moves: capacity mode)
  // and keeps the plan of least predicted time: the slowest rank's rows x ns_per_row (+ expert groups
  // x ns_per_group) plus the busiest link's replica bytes (weights out, gradients back) / its rate.
  // The receive buffers are sized for the largest limit. 0 (default): plain exact balance.
  double balance_cost_ns_per_row = 0.0;    // forward + backward expert work per computed row
  double balance_cost_ns_per_group = 0.0;  // and per expert group computed (own with rows, or replica)
  double balance_link_gb_per_s = 0.0;      // one rank's link, one direction (NVLink on H200: ~450)

  // Activation slots: where forward keeps what backward needs. A slot serves up to
  // max_moe_layers_per_activation_slot layers; what does not fit is recomputed in backward.
  int64_t num_activation_slots = 1;
  int64_t max_moe_layers_per_activation_slot = 1;
  std::optional<double> activation_slot_capacity_factor;  // x the balanced full-save bytes
  std::optional<int64_t> activation_slot_bytes;           // or an absolute size per slot

  double host_overflow_scratch_factor = 0.0;  // host-backed (VMM) rows = factor * balanced rows

  // fp8_block_scaled (docs/fp8.md): E4M3 operands with DeepSeek-V3 block scales in every GEMM of
  // forward and backward (DGRAD and WGRAD), on the GPU and in the CPU reference engine.
  GemmPrecision gemm_precision = GemmPrecision::bf16;
  // fp8_block_scaled only: every forward passes the own experts' prepared FP8 weights
  // (ForwardArgs::w13_fp8 ..., Python prepared=) and a forward without them is refused naming
  // w13_fp8. An inference context then holds no scratch to quantize them into (3 F D bytes and their
  // scales per local expert; replica slots keep theirs); a training context keeps it for the
  // backward's transposed copies.
  bool prepared_fp8_weights = false;
  // fp8_block_scaled only: the weight gradients' GEMMs in FP8 too (DeepSeek-V3's recipe: grad_y,
  // score * a, grad_h13 and x in 128 x 1 column tiles). Off: WGRAD in BF16 on the bf16 rows backward
  // has (grad_y, score * a, grad_h13) and x's FP8 rows dequantized to bf16: faster on the H200 (its
  // FP8 WGRAD GEMMs ran at 0.89x / 0.85x the BF16 ones before their four quantization passes,
  // docs/performance.md) and closer to BF16.
  bool fp8_wgrad = false;

  DType wgrad_dtype = DType::fp32;
  // Exact balance, training: the dtype in which a replica's weight gradients travel back to their
  // owner (issue 37): bf16 halves the bytes on the link (a DeepSeek-V3 replica: 88 instead of 176 MB);
  // the owner adds them to its own in fp32. fp32: the replica's sums exactly as computed.
  DType replica_grad_dtype = DType::bf16;
  bool inference = false;  // no backward: no activation slots, no weight-grad buffers

  // Throws InvalidArgument naming the field and the rule.
  void validate(int64_t ep_size) const;

  int64_t num_local_experts(int64_t ep_size) const { return num_experts / ep_size; }
  // Exact balance with the cost-aware plan (both rates set).
  bool cost_aware_balance() const;
};

// Rows of one expert group are padded to this height so GEMM tiles never straddle experts.
inline constexpr int64_t kExpertRowAlignment = 128;

}  // namespace poise
