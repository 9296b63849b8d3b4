// Host launchers of the EP data-path kernels (route, dispatch, combine). Each enqueues on
// `stream` and returns; sizes that depend on routing stay on the device. Every launch carries
// all of this process's ranks (EpLaunch::launch_ranks) in one grid split by rank.
#pragma once

#include <cuda_runtime.h>

#include "ep/ep_params.hpp"

namespace poise::ep {

// Routing layout: per-expert counts, all-gather of counts (barrier), destination rows and the
// local expert groups; reports bad ids and capacity overflow in the error word.
void launch_route(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);

// Exact balance, between the counts exchange and route_assign (launch_route calls it): one block
// per rank computes the balance plan from the all-gathered counts (src/ep/balance_planner.cu).
void launch_balance_plan(const EpLaunch& l, cudaStream_t stream);
// Once per pipeline, outside any graph capture: the planner's shared-memory opt-in.
void configure_balance_plan(const EpLaunch& l);
size_t balance_plan_smem_bytes(const EpDims& dims);

// Exact balance, backward, after the combine-push barrier: every owner adds the fp32 weight
// gradients its replicas computed on other ranks to its own, in plan order (deterministic).
void launch_replica_grad_reduce(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);

// Forward dispatch: each token row crosses once to each destination rank, into the expert-grouped
// row of its first k there; per-row metadata (origin, primary row, score) goes with it. With exact
// balance the same launch pushes the weights of this rank's replicated experts into the replica
// slots of the ranks that host them (overlapped with the token rows). Ends in a barrier.
void launch_dispatch_forward(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);
// Backward dispatch of grad_out rows, with the forward's layout (no metadata). Ends in a barrier.
// push_replicas (exact balance): push the layer's replica weights again, as forward dispatch does,
// when the window holds another layer's (a backward from an activation record).
void launch_dispatch_backward(const EpLaunch& l, const LaunchIo& io, bool push_replicas, cudaStream_t stream);

// Backward from a partial activation record: per group, the rows at or past RankScratch::h13_split
// (offsets max(offset, split), counts what is left) into tail_offsets / tail_counts, the groups a
// W13 GEMM recomputes h13 for. Decided on the device from the kept layout: empty when every row fit.
void launch_tail_groups(const EpLaunch& l, cudaStream_t stream);

// Local, after dispatch: rows of a token's second, third... expert on a rank copied from its primary
// row, in place in the receive rows of x (forward) or of grad_out (backward).
void launch_fanout_rows(const EpLaunch& l, bool backward, cudaStream_t stream);

// After the experts, which stored each row's output (y, grad_x) straight into its owner's combine
// slot t*K+k: backward, each row's score gradient (its pieces summed in order) into the owner's
// grad_scores_TK region; then a barrier, after which every owner's slots are complete.
void launch_combine_push(const EpLaunch& l, bool backward, cudaStream_t stream);
// Owner: out[t] = bf16(sum_k w_k * combine[t*K+k]) in fp32, k in order (deterministic);
// w_k = score (forward, into out_TD) or 1 (backward, into grad_x_TD; it also copies the pushed
// score gradients into grad_scores_TK).
void launch_combine_reduce(const EpLaunch& l, const LaunchIo& io, bool backward, cudaStream_t stream);

// The last launch of every call (src/ep/call_end.cu): a rank that faulted has its fault copied to
// EpLaunch::fault_records (host-mapped) and the call's outputs (forward: out_TD; backward: grad_x,
// grad_scores, grad_w13, grad_w2) filled with NaN.
void launch_call_end(const EpLaunch& l, const LaunchIo& io, bool backward, cudaStream_t stream);

// Forward, clamped SwiGLU, when the call asks for clip counts (src/ep/clip_counts.cu): each
// rank counts its h13 rows per group into its window (before the combine-push barrier), then every
// owner adds its own group and its experts' replica pieces into RankIo::clip_counts_E2 (after it).
void launch_clip_count_groups(const EpLaunch& l, cudaStream_t stream);
void launch_clip_count_reduce(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream);

// Routing telemetry of the latest forward (src/ep/routing_telemetry.cu) into the caller's buffers
// (poise::RoutingStatsOut, types.hpp); launch rank s writes rank[s].
struct RoutingStatsLaunch {
  RoutingStatsOut rank[kMaxLaunchRanks];
};
void launch_routing_stats(const EpLaunch& l, const RoutingStatsLaunch& out, cudaStream_t stream);

// Blocks per rank for launches that end in a barrier: all of them resident at once.
int persistent_blocks_per_rank(const EpLaunch& l, const void* kernel, int threads, int work_blocks);

}  // namespace poise::ep
