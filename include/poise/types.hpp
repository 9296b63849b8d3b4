// The enumerations shared by every layer: dtypes, activations, balance modes, the W13 layout.
#pragma once

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

}  // namespace poise
