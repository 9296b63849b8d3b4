// What a balance plan costs, predicted (issue 37): the slowest rank's expert work (a cost per row
// and per expert group it computes) plus the replica traffic of the busiest link, as the staged
// pipeline runs them one after the other (the weight push inside the forward dispatch, the fp32
// replica gradients after the backward experts).
// __host__ __device__ like the planner it scores (balance_plan_device.cuh), so that the device can
// pick a plan from the same numbers the host simulator uses. docs/balance.md, "Cost-aware plan".
#pragma once

#include <cstdint>

#include "balance/balance_plan_device.cuh"
#include "numerics/host_device.hpp"

namespace poise::plan::shared {

struct BalanceCostRates {
  float expert_ns_per_row = 0.0f;   // forward + backward expert GEMMs per computed row
  float expert_ns_per_group = 0.0f; // and per expert group computed (own expert with rows, or replica)
  float link_bytes_per_ns = 0.0f;   // one rank's link, one direction (NVLink: ~450 bytes/ns on H200)
  float replica_bytes = 0.0f;       // one replica over a call: its weights out and its gradients back
};

// Products and sums rounded one by one on host and device alike: the device compiler would fuse
// them into FMAs, and a plan chosen on the GPU must be the one the host (the reference engine, the
// tests) chooses from the same counts.
POISE_HD inline float mul_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
POISE_HD inline float add_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// A plan's predicted forward + backward time (ns), after plan_balance_serial or the planner kernel:
// max over ranks of (computed rows x expert_ns_per_row + groups x expert_ns_per_group), plus max
// over ranks of the replicas it sends (as owner) or receives (as taker), whichever is more, x
// replica_bytes / link_bytes_per_ns. sent_R, groups_R: caller scratch [R].
POISE_HD inline float predicted_ns(const BalanceProblem& p, const BalanceScratch& s, int32_t num_pieces,
                                   const BalanceCostRates& rates, int32_t* sent_R, int32_t* groups_R) {
  const int32_t R = p.num_ranks, L = p.num_local_experts;
  for (int32_t r = 0; r < R; ++r) {
    sent_R[r] = 0;
    groups_R[r] = s.replicas_R[r];
  }
  for (int32_t i = 0; i < num_pieces; ++i) sent_R[s.pieces[i].expert / L] += 1;
  for (int32_t e = 0; e < R * L; ++e) groups_R[e / L] += kept_rows(p, s, e) > 0 ? 1 : 0;
  float slowest_experts = 0.0f;
  int32_t busiest_link = 0;
  for (int32_t r = 0; r < R; ++r) {
    const float experts = add_rounded(mul_rounded(float(s.remaining_R[r] + s.received_R[r]), rates.expert_ns_per_row),
                                      mul_rounded(float(groups_R[r]), rates.expert_ns_per_group));
    const int32_t link = sent_R[r] > s.replicas_R[r] ? sent_R[r] : s.replicas_R[r];
    slowest_experts = experts > slowest_experts ? experts : slowest_experts;
    busiest_link = link > busiest_link ? link : busiest_link;
  }
  return add_rounded(slowest_experts, mul_rounded(float(busiest_link), rates.replica_bytes / rates.link_bytes_per_ns));
}

// The row limits a cost-aware plan tries, in order: C (exact balance), C + C * 2^i / 64 for
// i = 0 .. kCostSteps - 1 (tolerances 1/64 .. 4), then max_row_limit (nothing moves when it holds
// the largest owner load: capacity mode). Each is clamped to max_row_limit.
inline constexpr int32_t kCostSteps = 9;
inline constexpr int32_t kCostCandidates = kCostSteps + 2;

POISE_HD inline int32_t candidate_row_limit(int32_t C, int32_t max_row_limit, int32_t i) {
  int64_t limit = i == 0 ? C : (i <= kCostSteps ? C + ((int64_t(C) << (i - 1)) + 63) / 64 : max_row_limit);
  return limit < max_row_limit ? int32_t(limit) : max_row_limit;
}

}  // namespace poise::plan::shared
