// What the latest forward left on the device: host copies for tests and diagnostics (a slot's
// routing layout and, exact balance, its balance plan; both synchronize the device), and the
// routing telemetry users read (device buffers, no sync).
#include "pipeline/staged_pipeline.hpp"

#include <vector>

#include "ep/data_path.hpp"
#include "pipeline/pipeline_checks.hpp"
#include "runtime/cuda_check.hpp"

namespace poise::ep {

using runtime::cuda_check;

void StagedPipeline::routing_stats(std::span<const RoutingStatsOut> per_rank, cudaStream_t stream) const {
  require(static_cast<int>(per_rank.size()) == launch_.launch_ranks, "routing_stats",
          "needs one buffer set per launch rank (" + std::to_string(launch_.launch_ranks) + "), got " +
              std::to_string(per_rank.size()));
  require(forward_ran_, "context", "has run no forward yet: routing_stats describes the latest forward");
  RoutingStatsLaunch out;
  for (size_t s = 0; s < per_rank.size(); ++s) out.rank[s] = per_rank[s];
  launch_routing_stats(launch_for(latest_forward_record_), out, stream);
}

LayoutSnapshot StagedPipeline::snapshot(int slot) const {
  const EpLaunch latest = launch_for(latest_forward_record_);
  const EpDims& d = latest.dims;
  const RankScratch& rs = latest.scratch.rank[slot];
  LayoutSnapshot s;
  s.dest_row_TK.resize(static_cast<size_t>(d.T) * d.K);
  s.group_offsets.resize(d.groups + 1);
  s.group_counts.resize(d.groups);
  s.dest_rank_TK.resize(static_cast<size_t>(d.T) * d.K);
  s.row_origin.resize(d.capacity_rows);
  s.row_primary.resize(d.capacity_rows);
  auto get = [](std::vector<int32_t>& v, const void* src) {
    cuda_check(cudaMemcpy(v.data(), src, v.size() * sizeof(int32_t), cudaMemcpyDeviceToHost), "snapshot");
  };
  cuda_check(cudaDeviceSynchronize(), "snapshot: cudaDeviceSynchronize");
  get(s.dest_row_TK, rs.dest_row_TK);
  get(s.group_offsets, rs.group_offsets);
  get(s.group_counts, rs.group_counts);
  get(s.row_origin, rs.workspace + latest.ws.row_origin);
  get(s.row_primary, rs.workspace + latest.ws.row_primary);
  get(s.dest_rank_TK, rs.dest_rank_TK);
  return s;
}

PlanSnapshot StagedPipeline::plan_snapshot(int slot) const {
  const EpDims& d = launch_.dims;
  require(d.balanced, "plan_snapshot", "the pipeline does not balance (balance=capacity)");
  const EpLaunch latest = launch_for(latest_forward_record_);
  const RankScratch& rs = latest.scratch.rank[slot];
  cuda_check(cudaDeviceSynchronize(), "plan_snapshot: cudaDeviceSynchronize");
  PlanSnapshot p;
  auto get = [](auto& v, const void* src) {
    cuda_check(cudaMemcpy(v.data(), src, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost), "plan_snapshot");
  };
  std::vector<int32_t> first(d.E + 1), stats(kPlanStats);
  p.kept_E.resize(d.E);
  p.group_offsets_RG.resize(static_cast<size_t>(d.world) * (d.groups + 1));
  get(first, rs.plan_piece_first_E);
  get(stats, rs.plan_stats);
  get(p.kept_E, rs.plan_kept_E);
  get(p.group_offsets_RG, rs.plan_group_offsets_RG);
  p.pieces.resize(first[d.E]);
  if (!p.pieces.empty()) get(p.pieces, rs.plan_pieces);
  p.exact = stats[kPlanExact] != 0;
  p.moved_rows = stats[kPlanMovedRows];
  p.max_rank_rows = stats[kPlanMaxRankRows];
  p.row_limit = stats[kPlanRowLimit];
  return p;
}

}  // namespace poise::ep
