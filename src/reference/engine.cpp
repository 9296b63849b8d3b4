// Engine: validates, runs forward_rank / backward_rank on a thread per virtual rank, gathers stats.
#include <algorithm>
#include <stdexcept>

#include "reference/engine_state.hpp"
#include "reference/routing_stats.hpp"
#include "reference/validate.hpp"

namespace poise::reference {

CapacityExceeded::CapacityExceeded(int64_t rank, int64_t rows, int64_t capacity_rows)
    : DeviceError("capacity balance: rank " + std::to_string(rank) + " was routed " + std::to_string(rows) +
                  " rows, more than its receive capacity of " + std::to_string(capacity_rows) +
                  " rows (receive_capacity_factor * T*K); no row was dropped"),
      rank_(rank),
      rows_(rows),
      capacity_rows_(capacity_rows) {}

double RoutingStats::peak_over_mean(const std::vector<int64_t>& rows_per_rank) {
  if (rows_per_rank.empty()) return 0.0;
  int64_t total = 0, peak = 0;
  for (int64_t rows : rows_per_rank) {
    total += rows;
    peak = std::max(peak, rows);
  }
  if (total == 0) return 0.0;
  return static_cast<double>(peak) * static_cast<double>(rows_per_rank.size()) / static_cast<double>(total);
}

Engine::Engine(const Config& config, int64_t ep_size, Options options) : state_(std::make_unique<EngineState>()) {
  validate_setup(config, ep_size, options);
  EngineState& s = *state_;
  s.config = config;
  s.ep_size = ep_size;
  s.options = options;
  s.replica_slots = options.replica_slots < 0 ? config.num_local_experts(ep_size) : options.replica_slots;
  s.shape = {config.hidden_dim, config.intermediate_dim, options.w13_layout};
  s.act = {config.activation, static_cast<float>(config.swiglu_alpha), static_cast<float>(config.swiglu_limit)};
}

Engine::~Engine() = default;

const RoutingStats& Engine::routing_stats() const { return state_->stats; }

std::vector<std::vector<int64_t>> Engine::clip_counts() const {
  if (!state_->has_forward) throw InvalidArgument("clip_counts", "needs a forward first");
  std::vector<std::vector<int64_t>> counts;
  for (const RankState& st : state_->ranks) counts.push_back(st.clip_counts_E2);
  return counts;
}
const Config& Engine::config() const { return state_->config; }
int64_t Engine::ep_size() const { return state_->ep_size; }
const Options& Engine::options() const { return state_->options; }

std::vector<std::vector<float>> Engine::forward(const std::vector<RankInputs>& inputs_per_rank) {
  EngineState& s = *state_;
  validate_inputs(s.config, s.ep_size, s.options, inputs_per_rank);
  s.has_forward = false;
  s.biased = !inputs_per_rank[0].b13.empty();
  s.ranks.assign(s.ep_size, RankState{});
  std::vector<std::vector<float>> out_TD(s.ep_size);
  run_ranks(static_cast<int>(s.ep_size), [&](int rank, InProcessTransport& transport) {
    forward_rank(s, rank, transport, inputs_per_rank[rank], out_TD[rank]);
  });

  // Every rank derived the same plan; rank 0's copy describes the call.
  const RankState& first = s.ranks[0];
  std::vector<int64_t> expert_rows(s.E(), 0);
  for (const plan::ExpertPiece& piece : first.plan.pieces) expert_rows[piece.expert] += piece.rows();
  RoutingStats stats = plan_stats(first.plan, first.grouped, std::move(expert_rows), s.T() * s.K(), s.ep_size);
  for (const RankState& st : s.ranks) count_received(stats, st.dispatch);
  s.stats = std::move(stats);
  s.forward_ids_TK.clear();
  for (const RankInputs& in : inputs_per_rank) s.forward_ids_TK.push_back(in.ids_TK);
  s.has_forward = true;
  return out_TD;
}

void Engine::backward(const std::vector<RankInputs>& inputs_per_rank,
                      const std::vector<std::vector<float>>& grad_out_TD_per_rank,
                      std::vector<RankGradients>& grads_per_rank, bool accumulate_wgrad) {
  EngineState& s = *state_;
  if (s.config.inference) {
    throw InvalidArgument("inference", "backward needs a Config with inference=false");
  }
  if (!s.has_forward) {
    throw std::logic_error("Engine::backward: no successful forward to differentiate");
  }
  validate_inputs(s.config, s.ep_size, s.options, inputs_per_rank);
  if (inputs_per_rank[0].b13.empty() == s.biased) {
    throw InvalidArgument("b13", "backward must get the inputs of the preceding forward (biases or none, as it had)");
  }
  for (int64_t r = 0; r < s.ep_size; ++r) {
    if (inputs_per_rank[r].ids_TK != s.forward_ids_TK[r]) {
      throw InvalidArgument("ids_TK", "rank " + std::to_string(r) +
                                          ": backward must get the inputs of the preceding forward");
    }
  }
  validate_grad_out(s.config, s.ep_size, grad_out_TD_per_rank);
  if (accumulate_wgrad) {
    validate_accumulated_grads(s.config, s.ep_size, grads_per_rank, s.biased);
  } else {
    grads_per_rank.resize(s.ep_size);
  }
  run_ranks(static_cast<int>(s.ep_size), [&](int rank, InProcessTransport& transport) {
    backward_rank(s, rank, transport, inputs_per_rank[rank], grad_out_TD_per_rank[rank], grads_per_rank[rank],
                  accumulate_wgrad);
  });
}

std::vector<uint16_t> to_bf16_bits(std::span<const float> values) {
  std::vector<uint16_t> bits(values.size());
  std::transform(values.begin(), values.end(), bits.begin(), [](float v) { return bf16_bits(v); });
  return bits;
}

std::vector<float> from_bf16_bits(std::span<const uint16_t> bits) {
  std::vector<float> values(bits.size());
  std::transform(bits.begin(), bits.end(), values.begin(), [](uint16_t b) { return bf16_from_bits(b); });
  return values;
}

}  // namespace poise::reference
