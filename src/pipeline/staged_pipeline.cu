// StagedPipeline's construction: the config and options checked, the workspace layout, the rank
// buffers it lists, and the launch parameters each record's buffers and window regions give.
#include "pipeline/staged_pipeline.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/cuda_check.hpp"
#include "balance/balance_cost.hpp"
#include "comm/virtual_transport.hpp"
#include "ep/data_path.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "pipeline/expert_compute.hpp"
#include "pipeline/pipeline_checks.hpp"
#include "poise/errors.hpp"

namespace poise::ep {
namespace {

using runtime::cuda_check;

// The workspace layout (poise_core, host only) restates these sizes as plain numbers.
static_assert(layout::kSignalBytes == comm::kSignalBytes);
static_assert(layout::kReplicaPieceBytes == sizeof(plan::shared::ReplicaPiece));
static_assert(layout::kPlanStats == kPlanStats);
static_assert(layout::kTokensPerChunk == kTokensPerChunk);
static_assert(kGroupAlignment == kExpertRowAlignment);

void validate_config(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  c.validate(ep_size);
  if (c.balance == Balance::exact) {
    require(c.balance_tolerance <= 16.0, "balance_tolerance",
            "must be in [0, 16], got " + std::to_string(c.balance_tolerance));
    require(o.replica_slots >= -1 && o.replica_slots <= c.num_local_experts(ep_size), "replica_slots",
            "must be -1 (E_local) or in [0, E_local = " + std::to_string(c.num_local_experts(ep_size)) + "], got " +
                std::to_string(o.replica_slots));
  }
  require(c.top_k <= kMaxTopK, "top_k", "the EP pipeline supports top_k <= " + std::to_string(kMaxTopK));
  require(c.num_experts <= kMaxExperts, "num_experts",
          "the EP pipeline supports num_experts <= " + std::to_string(kMaxExperts));
  require(ep_size <= comm::kMaxPeers, "ep_size", "at most " + std::to_string(comm::kMaxPeers) + " ranks");
  require(o.activation_records >= 0 && (!c.inference || o.activation_records == 0), "activation_records",
          "must be >= 0, and 0 for inference");
  require(o.light_activation_records >= 0 && (!c.inference || o.light_activation_records == 0),
          "light_activation_records", "must be >= 0, and 0 for inference");
  require(o.partial_activation_records >= 0 && (!c.inference || o.partial_activation_records == 0),
          "partial_activation_records", "must be >= 0, and 0 for inference");
  if (o.partial_activation_records > 0) {
    require(o.partial_record_rows > 0 && o.partial_record_rows % kGroupAlignment == 0 &&
                o.partial_record_rows < StagedPipeline::capacity_rows(c, ep_size, o),
            "partial_record_rows", "must be a positive multiple of 128 below the receive rows");
  }
  const double rows = std::max(c.receive_capacity_factor, 1.0 + c.balance_tolerance) * c.num_local_input_tokens * c.top_k;
  require(c.num_local_input_tokens * c.top_k * ep_size < (int64_t{1} << 31) && rows < double(1 << 30),
          "num_local_input_tokens", "T*K*ep_size must fit in 31 bits");
}

// What the options keep besides one call's memory (the layout sizes it).
layout::Keep keep_of(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  return {.replica_slots = StagedPipeline::replica_slots(c, ep_size, o),
          .whole_records = o.activation_records,
          .light_records = o.light_activation_records,
          .partial_records = o.partial_activation_records,
          .partial_record_rows = o.partial_record_rows};
}

EpDims make_dims(const Config& c, int64_t ep_size, const layout::WorkspaceLayout& l) {
  EpDims d;
  d.T = static_cast<int32_t>(c.num_local_input_tokens);
  d.D = static_cast<int32_t>(c.hidden_dim);
  d.F = static_cast<int32_t>(c.intermediate_dim);
  d.K = static_cast<int32_t>(c.top_k);
  d.E = static_cast<int32_t>(c.num_experts);
  d.world = static_cast<int32_t>(ep_size);
  d.E_local = d.E / d.world;
  d.balanced = c.balance == Balance::exact;
  d.groups = static_cast<int32_t>(l.groups);
  d.replica_slots = d.groups - d.E_local;
  d.row_limit = static_cast<int32_t>(l.row_limit);
  if (c.cost_aware_balance()) {
    d.cost_aware = 1;
    d.cost_rates = plan::balance_cost_rates(c);
  }
  d.capacity_rows = static_cast<int32_t>(l.capacity_rows);
  d.num_chunks = (d.T + kTokensPerChunk - 1) / kTokensPerChunk;
  d.fp8 = c.gemm_precision == GemmPrecision::fp8_block_scaled;
  d.fp8_weights_prepared = c.prepared_fp8_weights && c.inference ? 1 : 0;
  d.fp8_wgrad = d.fp8 && c.fp8_wgrad ? 1 : 0;
  d.replica_grad_bf16 = c.replica_grad_dtype == DType::bf16 ? 1 : 0;
  d.swiglu_clamped = c.activation == Activation::swiglu_clamped;
  d.swiglu_alpha = static_cast<float>(c.swiglu_alpha);
  d.swiglu_limit = static_cast<float>(c.swiglu_limit);
  // Each call sets score_partials (set_call_dims): a biased call's DGRAD W2 writes the most.
  sm90::ExpertMlpShape biased = expert_mlp_shape(d);
  biased.biased = true;
  const int64_t most_pieces = sm90::dgrad_w2_score_partials(biased);
  if (most_pieces > l.score_partials) {
    throw std::logic_error("EP pipeline: DGRAD W2 writes " + std::to_string(most_pieces) +
                           " score pieces per row, the workspace layout holds " + std::to_string(l.score_partials));
  }
  return d;
}

// The kernels' view of the window: record 0's rows (launch_for switches them per record).
WorkspaceOffsets workspace_offsets(const layout::Window& w) {
  auto at = [](const layout::Region& r) { return static_cast<size_t>(r.offset); };
  WorkspaceOffsets o;
  o.counts_RE = at(w.counts_RE);
  o.row_origin = at(w.records[0].row_origin);
  o.row_primary = at(w.records[0].row_primary);
  o.row_score = at(w.records[0].row_score);
  o.recv_x = at(w.records[0].recv_x);
  o.recv_x_scales = at(w.records[0].recv_x_scales);
  o.recv_grad = at(w.recv_grad);
  o.combine = at(w.combine);
  o.grad_scores_TK = at(w.grad_scores_TK);
  o.clip_counts_G2 = at(w.clip_counts_G2);
  o.replica_w13 = at(w.replica_w13);
  o.replica_w2 = at(w.replica_w2);
  o.replica_grad_w13 = at(w.replica_grad_w13);
  o.replica_grad_w2 = at(w.replica_grad_w2);
  o.replica_b13 = at(w.replica_b13);
  o.replica_b2 = at(w.replica_b2);
  o.replica_grad_b13 = at(w.replica_grad_b13);
  o.replica_grad_b2 = at(w.replica_grad_b2);
  return o;
}

// A region of a rank's buffers at `base`; null where the layout has none.
template <class T>
T* at(char* base, const layout::Region& r) {
  return r.bytes > 0 ? reinterpret_cast<T*>(base + r.offset) : nullptr;
}

StagedPipeline::RecordBuffers record_pointers(char* base, const layout::RecordBuffers& r) {
  StagedPipeline::RecordBuffers b;
  b.dest_row_TK = at<int32_t>(base, r.dest_row_TK);
  b.dest_rank_TK = at<int32_t>(base, r.dest_rank_TK);
  b.group_offsets = at<int32_t>(base, r.group_offsets);
  b.group_counts = at<int32_t>(base, r.group_counts);
  b.plan_kept_E = at<int32_t>(base, r.plan_kept_E);
  b.plan_piece_first_E = at<int32_t>(base, r.plan_piece_first_E);
  b.plan_pieces = at<plan::shared::ReplicaPiece>(base, r.plan_pieces);
  b.plan_group_offsets_RG = at<int32_t>(base, r.plan_group_offsets_RG);
  b.plan_stats = at<int32_t>(base, r.plan_stats);
  b.h13_R2F = at<bf16>(base, r.h13_R2F);
  return b;
}

}  // namespace

int64_t StagedPipeline::replica_slots(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  if (c.balance != Balance::exact) return 0;
  return o.replica_slots < 0 ? c.num_local_experts(ep_size) : o.replica_slots;
}

int64_t StagedPipeline::capacity_rows(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  return layout::capacity_rows(c, ep_size, replica_slots(c, ep_size, o));
}

size_t StagedPipeline::workspace_bytes(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  validate_config(c, ep_size, o);
  return static_cast<size_t>(layout::workspace_layout(c, ep_size, keep_of(c, ep_size, o)).window.bytes);
}

size_t StagedPipeline::bytes_per_rank(const Config& c, int64_t ep_size, const PipelineOptions& o) {
  validate_config(c, ep_size, o);
  const layout::WorkspaceLayout l = layout::workspace_layout(c, ep_size, keep_of(c, ep_size, o));
  return static_cast<size_t>(l.window.bytes + l.buffers.bytes);
}

std::unique_ptr<StagedPipeline> StagedPipeline::create_virtual(const Config& config, int64_t ep_size,
                                                               const PipelineOptions& options) {
  validate_config(config, ep_size, options);
  auto transport = comm::VirtualTransport::create(static_cast<int>(ep_size), workspace_bytes(config, ep_size, options),
                                                  options.timeout_ns);
  return create(config, std::move(transport), options);
}

std::unique_ptr<StagedPipeline> StagedPipeline::create(const Config& config,
                                                       std::unique_ptr<comm::Transport> transport,
                                                       const PipelineOptions& options) {
  require(transport != nullptr, "transport", "must not be null");
  validate_config(config, transport->world_size(), options);
  require(transport->launch_ranks() <= kMaxLaunchRanks, "transport",
          "a launch carries at most " + std::to_string(kMaxLaunchRanks) + " ranks");
  require(transport->workspace_bytes() >= workspace_bytes(config, transport->world_size(), options), "transport",
          "workspace smaller than StagedPipeline::workspace_bytes()");
  return std::unique_ptr<StagedPipeline>(new StagedPipeline(config, std::move(transport), options));
}

StagedPipeline::StagedPipeline(const Config& config, std::unique_ptr<comm::Transport> transport,
                               const PipelineOptions& options)
    : config_(config),
      transport_(std::move(transport)),
      layout_(layout::workspace_layout(config, transport_->world_size(),
                                       keep_of(config, transport_->world_size(), options))) {
  launch_.tables = transport_->device_tables();
  launch_.launch_ranks = transport_->launch_ranks();
  launch_.dims = make_dims(config, transport_->world_size(), layout_);
  launch_.ws = workspace_offsets(layout_.window);
  record_order_ = {options.activation_records, options.light_activation_records, options.partial_activation_records};
  partial_rows_ = static_cast<int32_t>(options.partial_record_rows);
  // Light and partial records use the working record's rows in the window.
  record_windows_ = layout_.window.records;
  record_windows_.resize(layout_.buffers.records.size(), layout_.window.records[0]);
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&launch_.num_sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(multiprocessors)");
  try {
    for (int s = 0; s < launch_.launch_ranks; ++s) allocate_rank_buffers(s);
    allocate_fault_records();
    launch_ = launch_for(0);
    if (launch_.dims.balanced) configure_balance_plan(launch_);
  } catch (...) {
    for (void* p : allocations_) cudaFree(p);
    if (fault_records_) cudaFreeHost(fault_records_);
    throw;
  }
}

// Launch slot s's buffers: one allocation as the layout lists them, zeroed (group offsets, plan
// piece counts and the GEMM tile counters must start at zero).
void StagedPipeline::allocate_rank_buffers(int s) {
  const layout::RankBuffers& lb = layout_.buffers;
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, static_cast<size_t>(lb.bytes)), "cudaMalloc(EP rank buffers)");
  allocations_.push_back(p);
  cuda_check(cudaMemset(p, 0, static_cast<size_t>(lb.bytes)), "cudaMemset(EP rank buffers)");
  char* base = static_cast<char*>(p);
  record_buffers_.resize(lb.records.size() * launch_.launch_ranks);
  for (size_t r = 0; r < lb.records.size(); ++r)
    record_buffers_[r * launch_.launch_ranks + s] = record_pointers(base, lb.records[r]);
  RankScratch& rs = launch_.scratch.rank[s];
  rs.workspace = transport_->local_workspace(s);
  rs.error_code = &transport_->device_error(s)->code;
  rs.chunk_offsets_CE = at<int32_t>(base, lb.chunk_offsets_CE);
  rs.tail_offsets = at<int32_t>(base, lb.tail_offsets);
  rs.tail_counts = at<int32_t>(base, lb.tail_counts);
  rs.a_RF = at<bf16>(base, lb.a_RF);
  rs.grad_score_partials_RP = at<float>(base, lb.grad_score_partials_RP);
  rs.grad_h13_R2F = at<bf16>(base, lb.grad_h13_R2F);
  rs.gemm_tile_counters = at<int32_t>(base, lb.gemm_tile_counters);
  rs.gemm_fault_word = at<unsigned long long>(base, lb.gemm_fault_word);
  rs.fp8 = {at<uint8_t>(base, lb.fp8_x_TD), at<float>(base, lb.fp8_x_scales), at<uint8_t>(base, lb.fp8_a_RF),
            at<float>(base, lb.fp8_a_scales), at<uint8_t>(base, lb.fp8_w13),   at<float>(base, lb.fp8_w13_scales),
            at<uint8_t>(base, lb.fp8_w2),   at<float>(base, lb.fp8_w2_scales),
            at<uint8_t>(base, lb.fp8_grad_tiles.values), at<float>(base, lb.fp8_grad_tiles.scales),
            at<uint8_t>(base, lb.fp8_activation_tiles.values), at<float>(base, lb.fp8_activation_tiles.scales),
            at<bf16>(base, lb.wgrad_x_RD)};
}

StagedPipeline::~StagedPipeline() {
  cudaDeviceSynchronize();  // kernels may still read these buffers
  for (void* p : allocations_) cudaFree(p);
  cudaFreeHost(fault_records_);
}

EpLaunch StagedPipeline::launch_for(int record) const {
  EpLaunch l = launch_;
  for (int s = 0; s < l.launch_ranks; ++s) {
    const RecordBuffers& b = record_buffers_[size_t(record) * l.launch_ranks + s];
    RankScratch& rs = l.scratch.rank[s];
    rs.dest_row_TK = b.dest_row_TK;
    rs.dest_rank_TK = b.dest_rank_TK;
    rs.group_offsets = b.group_offsets;
    rs.group_counts = b.group_counts;
    rs.plan_kept_E = b.plan_kept_E;
    rs.plan_piece_first_E = b.plan_piece_first_E;
    rs.plan_pieces = b.plan_pieces;
    rs.plan_group_offsets_RG = b.plan_group_offsets_RG;
    rs.plan_stats = b.plan_stats;
    rs.h13_R2F = b.h13_R2F;
    rs.h13_hi_R2F = record_buffers_[s].h13_R2F;  // the working record's (rows past a partial record's)
    rs.h13_split = record_order_.partial_kind(record) ? partial_rows_ : l.dims.capacity_rows;
  }
  const layout::RecordRows& w = record_windows_[record];
  l.ws.row_origin = static_cast<size_t>(w.row_origin.offset);
  l.ws.row_primary = static_cast<size_t>(w.row_primary.offset);
  l.ws.row_score = static_cast<size_t>(w.row_score.offset);
  l.ws.recv_x = static_cast<size_t>(w.recv_x.offset);
  l.ws.recv_x_scales = static_cast<size_t>(w.recv_x_scales.offset);
  return l;
}

}  // namespace poise::ep
