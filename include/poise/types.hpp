// What every layer shares: the enumerations (dtypes, activations, balance modes, the W13 layout),
// kNoExpert, and the routing telemetry's output buffers.
#pragma once

#include <cstdint>
#include <string>

namespace poise {

enum class Activation {
  swiglu,          // silu(g) * u
  swiglu_clamped,  // min(g,limit) * sigmoid(alpha*min(g,limit)) * (clamp(u,-limit,limit) + 1)
};

enum class Balance {
  exact,     // every rank computes exactly T*K rows, hot experts replicated on underloaded ranks
  capacity,  // dropless; each rank receives up to receive_capacity_factor * T*K rows
};

enum class DType { bf16, fp32 };

// An ids_TK entry naming no expert (DeepEP's convention): the entry (t, k) is not dispatched or
// computed, adds nothing to out_TD[t] whatever its score, and gets zero gradients. A context sized
// for T tokens then serves fewer real tokens at the cost of their rows only (padding is free).
inline constexpr int kNoExpert = -1;

// The expert GEMMs' operands (docs/fp8.md).
enum class GemmPrecision {
  bf16,              // bf16 operands, fp32 accumulation
  fp8_block_scaled,  // E4M3 operands with DeepSeek-V3 block scales (1x128 activations, 128x128 weights)
};

const char* to_string(Activation a);
const char* to_string(Balance b);
const char* to_string(DType d);
const char* to_string(GemmPrecision p);
Activation activation_from_string(const std::string& s);  // throws InvalidArgument("activation")
Balance balance_from_string(const std::string& s);        // throws InvalidArgument("balance")
DType dtype_from_string(const std::string& s, const std::string& field);
GemmPrecision gemm_precision_from_string(const std::string& s);  // throws InvalidArgument("gemm_precision")

// How W13 is stored. Its shapes share one memory order per layout:
// [E_local, 2, F, D] == [E_local, 2F, D] == [E_local*2F, D] (gate rows, then up rows, per expert).
enum class W13Layout {
  gate_up_blocked,      // rows [0,F) gate, [F,2F) up
  gate_up_interleaved,  // row 2f gate, row 2f+1 up (gpt-oss checkpoints)
};

// Routing telemetry (Context::routing_stats): where the latest forward's rows went, written as int32
// into caller-owned device buffers. Every pointer is nullable (not written). A rank whose call
// faulted writes -1 everywhere (the fault itself raises at the next call or check()).
struct RoutingStatsOut {
  int32_t* expert_rows_E = nullptr;        // [E] rows routed to each expert by every rank (free entries excluded)
  int32_t* owner_rows_R = nullptr;         // [ep_size] rows of each rank's own experts: its load before balancing
  int32_t* computed_rows_R = nullptr;      // [ep_size] rows each rank computes under the balance plan: after
  int32_t* replicas_R = nullptr;           // [ep_size] replica slots each rank fills (exact balance; else 0)
  int32_t* received_token_rows = nullptr;  // [1] token rows dispatched to this rank, once per token (its own too)
};

}  // namespace poise
