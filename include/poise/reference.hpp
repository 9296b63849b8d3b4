// The CPU reference engine: the complete semantics of one routed-experts MoE layer across R
// virtual ranks (a thread per rank, each with its own buffers, exchanging through an in-process
// transport). Every GPU path is tested against it; docs/reference_engine.md states the semantics.
//
// bf16 representation: a bf16 tensor is a std::vector<float> whose values are all exactly
// representable in bf16 (the low 16 bits of every float are zero). Inputs are checked for that;
// outputs are produced that way. round_to_bf16 (round to nearest even) and the bits helpers below
// convert to and from the 16-bit storage a device buffer uses.
#pragma once

#include <bit>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "poise/config.hpp"
#include "poise/context.hpp"  // W13Layout
#include "poise/errors.hpp"

namespace poise::reference {

// ---- bf16 helpers ------------------------------------------------------------------------------

// Rounds to the nearest bf16 value, ties to even (what a GPU's cvt.rn.bf16.f32 does).
// NaN stays a quiet NaN; values beyond the bf16 range round to +-infinity.
inline float round_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return std::bit_cast<float>((bits | 0x00400000u) & 0xffff0000u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return std::bit_cast<float>(bits & 0xffff0000u);
}

inline bool is_bf16_value(float value) { return (std::bit_cast<uint32_t>(value) & 0xffffu) == 0; }

inline uint16_t bf16_bits(float value) {
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(round_to_bf16(value)) >> 16);
}

inline float bf16_from_bits(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

std::vector<uint16_t> to_bf16_bits(std::span<const float> values);
std::vector<float> from_bf16_bits(std::span<const uint16_t> bits);

// ---- inputs, options, outputs ------------------------------------------------------------------

// What one rank brings to a call. Sizes: T = num_local_input_tokens, E_local = E / ep_size.
// Rows whose scores are all zero are padding rows: still routed, contributing nothing to out_TD.
// Entries of ids_TK equal to kNoExpert (-1) are free: not routed, contributing nothing, whatever
// their score.
struct RankInputs {
  std::vector<float> x_TD;       // bf16 [T, D]
  std::vector<int32_t> ids_TK;   // [T, K] global expert ids (or kNoExpert), distinct within a token; e lives on rank e / E_local
  std::vector<float> scores_TK;  // [T, K] in Options::scores_dtype (bf16 values when bf16)
  std::vector<float> w13;        // bf16 [E_local, 2F, D] (== [E_local, 2, F, D] == [E_local*2F, D]), W13Layout
  std::vector<float> w2;         // bf16 [E_local, D, F] (== [E_local*D, F])
  // Expert biases (gpt-oss), every rank or none: h13 = x W13^T + b13 before the activation,
  // y = a W2^T + b2 before the score. Empty: no bias.
  std::vector<float> b13;        // bf16 [E_local, 2F] in W13's row order (W13Layout), or empty
  std::vector<float> b2;         // bf16 [E_local, D], or empty
};

// What one rank gets back from backward. grad_w13 / grad_w2 have w13's / w2's shape and layout.
struct RankGradients {
  std::vector<float> grad_x_TD;       // bf16 [T, D]
  std::vector<float> grad_scores_TK;  // [T, K] in Options::scores_dtype
  std::vector<float> grad_w13;        // Config::wgrad_dtype [E_local, 2F, D]
  std::vector<float> grad_w2;         // Config::wgrad_dtype [E_local, D, F]
  std::vector<float> grad_b13;        // Config::wgrad_dtype [E_local, 2F] when b13 was given, else empty
  std::vector<float> grad_b2;         // Config::wgrad_dtype [E_local, D] when b2 was given, else empty
};

struct Options {
  DType scores_dtype = DType::fp32;
  W13Layout w13_layout = W13Layout::gate_up_blocked;
  // B: replica expert slots per rank in exact balance (MemoryPlan::num_replica_slots).
  // A negative value means E_local, the training default.
  int64_t replica_slots = -1;
};

// Routing balance of the last forward call: how many (token, k) rows each rank computes.
struct RoutingStats {
  std::vector<int64_t> expert_rows;          // [E] rows routed to each expert, all ranks together
  std::vector<int64_t> owner_rows;           // [R] rows of each rank's own experts (no balancing)
  std::vector<int64_t> computed_rows;        // [R] rows each rank computes (after the balance plan)
  std::vector<int64_t> grouped_rows;         // [R] computed rows + per-expert padding to kExpertRowAlignment
  std::vector<int64_t> received_token_rows;  // [R] token rows dispatched to each rank (a token once per rank)
  std::vector<int64_t> replicas;             // [R] replica slots each rank fills
  int64_t moved_rows = 0;                    // rows computed away from their owner (exact mode)
  int64_t surplus_rows = 0;                  // sum over ranks of max(0, owner rows - T*K): the least that can move
  int64_t unplaced_surplus_rows = 0;         // exact mode, B < E_local: surplus that found no slot (stays on its owner)

  // max / mean of a per-rank row vector (1.0 = perfectly balanced; 0 when all are empty).
  static double peak_over_mean(const std::vector<int64_t>& rows_per_rank);
  double owner_peak_over_mean() const { return peak_over_mean(owner_rows); }
  double computed_peak_over_mean() const { return peak_over_mean(computed_rows); }
};

// Capacity balance: a rank was routed more rows than receive_capacity_factor * T*K.
// The GPU engine reports the same condition through its device error word (a DeviceError).
class CapacityExceeded : public DeviceError {
 public:
  CapacityExceeded(int64_t rank, int64_t rows, int64_t capacity_rows);
  int64_t rank() const noexcept { return rank_; }
  int64_t rows() const noexcept { return rows_; }
  int64_t capacity_rows() const noexcept { return capacity_rows_; }

 private:
  int64_t rank_, rows_, capacity_rows_;
};

struct EngineState;  // src/reference/engine_state.hpp

// ---- the engine --------------------------------------------------------------------------------

// One MoE layer across ep_size virtual ranks. forward() keeps the routing layout and the
// activations backward() needs, like a Context keeps them in an activation slot.
// Every argument is validated before any rank thread starts (InvalidArgument naming it).
class Engine {
 public:
  Engine(const Config& config, int64_t ep_size, Options options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Returns out_TD (bf16 [T, D]) for every rank.
  std::vector<std::vector<float>> forward(const std::vector<RankInputs>& inputs_per_rank);

  // Differentiates the preceding forward; inputs_per_rank must be the same inputs.
  // grads_per_rank is resized to ep_size. grad_x_TD and grad_scores_TK are overwritten; grad_w13 and
  // grad_w2 are overwritten, or, with accumulate_wgrad, added to (they must then have their sizes).
  void backward(const std::vector<RankInputs>& inputs_per_rank,
                const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                std::vector<RankGradients>& grads_per_rank, bool accumulate_wgrad = false);

  const RoutingStats& routing_stats() const;  // of the last forward
  // Of the last forward, per rank: int64 [E_local][2], the gate inputs above swiglu_limit and the up
  // inputs outside [-limit, limit] over every row of each local expert, counted on h13 as saved
  // (bf16); zeros for plain SwiGLU. (ForwardArgs::clip_counts_E2 on the GPU.)
  std::vector<std::vector<int64_t>> clip_counts() const;
  const Config& config() const;
  int64_t ep_size() const;
  const Options& options() const;

 private:
  std::unique_ptr<EngineState> state_;
};

// ---- the float64 oracle ------------------------------------------------------------------------

// The same layer written densely in float64: loops over ranks, tokens and k, no layout, no ranks,
// no intermediate rounding. Tests and the demo measure the engine (and the GPU) against it.
struct DenseFloat64Result {
  std::vector<std::vector<double>> out_TD, grad_x_TD, grad_scores_TK, grad_w13, grad_w2;  // per rank
  std::vector<std::vector<double>> grad_b13, grad_b2;  // per rank, layers with biases (else empty)
  // Per rank [T, K]: sum_d |grad_out[t,d] y[t,k,d]|, the magnitude of the terms of each score's
  // gradient (a dot product): what its rounding errors are relative to where it cancels.
  std::vector<std::vector<double>> grad_score_terms_TK;
};

// Backward is computed when grad_out_TD_per_rank is not empty.
DenseFloat64Result dense_float64(const Config& config, int64_t ep_size,
                                 const std::vector<RankInputs>& inputs_per_rank,
                                 const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                                 const Options& options);

// ||got - want|| / ||want|| over all elements (NaN when got holds a NaN; 0 when both are zero).
double relative_error(std::span<const float> got, std::span<const double> want);
double relative_error(const std::vector<std::vector<float>>& got,
                      const std::vector<std::vector<double>>& want);

// ---- random inputs -----------------------------------------------------------------------------

struct RandomInputsSpec {
  uint64_t seed = 1;
  // Target peak/mean of owner rows per rank: rank 0's experts are drawn more often. 1 = uniform.
  double skew = 1.0;
  int64_t padding_rows = 0;  // the last padding_rows tokens of every rank get all-zero scores
  double free_fraction = 0.0;  // each entry (t, k) is kNoExpert with this probability (its score kept)
  bool biases = false;         // random b13 and b2 (bf16, N(0, 0.1^2)) as well
};

// x ~ N(0,1), W13 ~ N(0,1/D), W2 ~ N(0,1/F) (bf16), scores a softmax over the K picks (fp32 or
// bf16 per options.scores_dtype), K distinct experts per token drawn by the skewed popularity.
std::vector<RankInputs> random_inputs(const Config& config, int64_t ep_size,
                                      const RandomInputsSpec& spec, const Options& options);

// bf16 N(0,1) grad_out_TD for every rank.
std::vector<std::vector<float>> random_grad_out(const Config& config, int64_t ep_size, uint64_t seed);

// Routing alone (ids and scores per rank), drawn as random_inputs draws it but from its own random
// stream: for layers whose x and weights are generated elsewhere (on a GPU).
struct RandomRouting {
  std::vector<std::vector<int32_t>> ids_TK;   // [R][T*K]
  std::vector<std::vector<float>> scores_TK;  // [R][T*K] in options.scores_dtype
};
RandomRouting random_routing(const Config& config, int64_t ep_size, const RandomInputsSpec& spec,
                             const Options& options);

// ---- FP8 weights ---------------------------------------------------------------------------------

// poise::quantize_fp8_weight_blocks on the host (poise/fp8.hpp, docs/fp8.md): `matrices` row-major
// [rows, cols] matrices of bf16 values into E4M3 in 128 x 128 blocks. The GPU's bits.
struct Fp8WeightBlocks {
  std::vector<uint8_t> values_MRC;  // e4m3 bits, w's layout
  std::vector<float> scales;        // [matrices][ceil(rows/128)][ceil(cols/128)]
};
// Throws InvalidArgument naming matrices / rows / cols (positive multiples of 64) or w (its size,
// a value that is not bf16).
Fp8WeightBlocks quantize_fp8_weight_blocks(std::span<const float> w_MRC, int64_t matrices, int64_t rows, int64_t cols);

// ---- without running the layer -----------------------------------------------------------------

// The RoutingStats a forward with these ids reports (same balance plan, same layout), computed from
// the ids alone: for layers too large to run on the engine. ids_TK_per_rank: [R][T*K], validated.
RoutingStats routing_stats(const Config& config, int64_t ep_size,
                           const std::vector<std::vector<int32_t>>& ids_TK_per_rank, const Options& options);

// The float64 oracle for a sample of tokens: out, grad_x and grad_scores of a token depend only on
// its own inputs and on the weights of the K experts it visits, so they can be computed for a few
// tokens of a layer too large for dense_float64. (Weight gradients sum over every token: not here.)
struct SampledToken {
  int64_t rank = 0, token = 0;    // where the token lives (for reports)
  std::vector<float> x_D;         // bf16 [D]
  std::vector<int32_t> ids_K;     // [K] global expert ids, distinct
  std::vector<float> scores_K;    // [K] in options.scores_dtype
  std::vector<float> grad_out_D;  // bf16 [D]
};

struct SampledFloat64Result {
  std::vector<std::vector<double>> out_D, grad_x_D, grad_scores_K;  // per sampled token
};

// Fills the bf16 weights of one global expert: w13_2FD [2F, D] (options.w13_layout), w2_DF [D, F].
using ExpertWeightsFn = std::function<void(int64_t expert, std::vector<float>& w13_2FD, std::vector<float>& w2_DF)>;

// Calls expert_weights once per distinct expert the tokens visit, never two calls at once; the
// arithmetic runs on up to `threads` threads (0: the hardware's).
SampledFloat64Result sampled_float64(const Config& config, int64_t ep_size, const std::vector<SampledToken>& tokens,
                                     const ExpertWeightsFn& expert_weights, const Options& options, int threads = 0);

// The tokens tokens_per_rank[r] of rank r, taken from full inputs (what sampled_float64 reads).
std::vector<SampledToken> sample_tokens(const Config& config, int64_t ep_size,
                                        const std::vector<RankInputs>& inputs_per_rank,
                                        const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                                        const std::vector<std::vector<int64_t>>& tokens_per_rank);
// Reads an expert's weights from its owner's RankInputs (the inputs must outlive the function).
ExpertWeightsFn expert_weights_from(const Config& config, int64_t ep_size,
                                    const std::vector<RankInputs>& inputs_per_rank);

}  // namespace poise::reference
