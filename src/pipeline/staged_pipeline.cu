#include "pipeline/staged_pipeline.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/cuda_check.hpp"
#include "comm/virtual_transport.hpp"
#include "ep/data_path.hpp"
#include "gemm/sm90/expert_mlp.hpp"
#include "pipeline/expert_compute.hpp"
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

void require(bool ok, const std::string& name, const std::string& rule) {
  if (!ok) throw InvalidArgument(name, rule);
}

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
  sm90::ExpertMlpShape shape;
  shape.intermediate_dim = c.intermediate_dim;
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
  d.capacity_rows = static_cast<int32_t>(l.capacity_rows);
  d.num_chunks = (d.T + kTokensPerChunk - 1) / kTokensPerChunk;
  d.swiglu_clamped = c.activation == Activation::swiglu_clamped;
  d.swiglu_alpha = static_cast<float>(c.swiglu_alpha);
  d.swiglu_limit = static_cast<float>(c.swiglu_limit);
  d.score_partials = static_cast<int32_t>(sm90::dgrad_w2_score_partials(shape));
  if (d.score_partials > l.score_partials) {
    throw std::logic_error("EP pipeline: DGRAD W2 writes " + std::to_string(d.score_partials) +
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
  o.recv_grad = at(w.recv_grad);
  o.combine = at(w.combine);
  o.grad_scores_TK = at(w.grad_scores_TK);
  o.clip_counts_G2 = at(w.clip_counts_G2);
  o.replica_w13 = at(w.replica_w13);
  o.replica_w2 = at(w.replica_w2);
  o.replica_grad_w13 = at(w.replica_grad_w13);
  o.replica_grad_w2 = at(w.replica_grad_w2);
  return o;
}

std::string arg_name(int slot, const char* field) { return "args[" + std::to_string(slot) + "]." + field; }

void require_pointer(const void* p, int slot, const char* field, size_t alignment) {
  require(p != nullptr, arg_name(slot, field), "must not be null");
  require(reinterpret_cast<uintptr_t>(p) % alignment == 0, arg_name(slot, field),
          "must be " + std::to_string(alignment) + "-byte aligned");
}

// `backward`: the forward's inputs of a backward call (its out_TD is never used and may be null).
void validate_forward_args(const ForwardArgs& a, int slot, const ForwardArgs& first, bool backward) {
  require_pointer(a.x_TD, slot, "x_TD", 16);
  require_pointer(a.ids_TK, slot, "ids_TK", 4);
  require_pointer(a.scores_TK, slot, "scores_TK", a.scores_dtype == DType::fp32 ? 4 : 2);
  require_pointer(a.w13, slot, "w13", 16);
  require_pointer(a.w2, slot, "w2", 16);
  if (!backward) require_pointer(a.out_TD, slot, "out_TD", 16);
  require(a.scores_dtype == first.scores_dtype, arg_name(slot, "scores_dtype"),
          "must be the same on every rank of one call");
  require(a.w13_layout == first.w13_layout, arg_name(slot, "w13_layout"), "must be the same on every rank of one call");
  require((a.clip_counts_E2 == nullptr) == (first.clip_counts_E2 == nullptr), arg_name(slot, "clip_counts_E2"),
          "must be set on every rank of one call or on none");
  if (a.clip_counts_E2) require_pointer(a.clip_counts_E2, slot, "clip_counts_E2", 8);
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

const char* to_string(Stage s) {
  switch (s) {
    case Stage::route: return "route";
    case Stage::dispatch: return "dispatch";
    case Stage::fanout: return "fanout";
    case Stage::experts: return "experts";
    case Stage::combine_push: return "combine_push";
    case Stage::combine_reduce: return "combine_reduce";
    case Stage::replica_grads: return "replica_grads";
    case Stage::recompute: return "recompute";
    case Stage::redispatch: return "redispatch";
    case Stage::recompute_rows: return "recompute_rows";
    case Stage::end: return "end";
  }
  return "?";
}

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

// Host-mapped, so the host reads a fault without synchronizing the stream (raise_if_faulted).
void StagedPipeline::allocate_fault_records() {
  const size_t bytes = sizeof(FaultRecord) * static_cast<size_t>(launch_.launch_ranks);
  void* host = nullptr;
  cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc(fault records)");
  fault_records_ = static_cast<FaultRecord*>(host);
  for (int s = 0; s < launch_.launch_ranks; ++s) new (&fault_records_[s]) FaultRecord();
  void* device = nullptr;
  cuda_check(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer(fault records)");
  launch_.fault_records = static_cast<FaultRecord*>(device);
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
}

StagedPipeline::~StagedPipeline() {
  cudaDeviceSynchronize();  // kernels may still read these buffers
  for (void* p : allocations_) cudaFree(p);
  cudaFreeHost(fault_records_);
}

LaunchIo StagedPipeline::forward_io(std::span<const ForwardArgs> args, bool backward) const {
  require(static_cast<int>(args.size()) == launch_.launch_ranks, "args",
          "needs one entry per launch slot (" + std::to_string(launch_.launch_ranks) + "), got " +
              std::to_string(args.size()));
  LaunchIo io;
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const ForwardArgs& a = args[s];
    validate_forward_args(a, s, args[0], backward);
    RankIo& r = io.rank[s];
    r.x_TD = static_cast<const bf16*>(a.x_TD);
    r.ids_TK = a.ids_TK;
    r.scores_TK = a.scores_TK;
    r.w13_E2FD = static_cast<const bf16*>(a.w13);
    r.w2_EDF = static_cast<const bf16*>(a.w2);
    r.out_TD = static_cast<bf16*>(a.out_TD);
    r.clip_counts_E2 = backward ? nullptr : a.clip_counts_E2;
  }
  return io;
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
  return l;
}

void StagedPipeline::check_record(int record) const {
  require(record >= 0 && record < records(), "record",
          "must be in [0, " + std::to_string(records()) + "), got " + std::to_string(record));
}

void StagedPipeline::dispatch_x_rows(const EpLaunch& l, const LaunchIo& io, cudaStream_t stream) {
  launch_dispatch_forward(l, io, stream);
  launch_fanout_rows(l, /*backward=*/false, stream);
}

void StagedPipeline::forward(std::span<const ForwardArgs> args, cudaStream_t stream, int record) {
  check_record(record);
  const LaunchIo io = forward_io(args, /*backward=*/false);
  EpLaunch l = launch_for(record);
  l.dims.scores_bf16 = args[0].scores_dtype == DType::bf16;
  l.dims.w13_interleaved = args[0].w13_layout == W13Layout::gate_up_interleaved;
  stage(Stage::route, stream);
  launch_route(l, io, stream);
  stage(Stage::dispatch, stream);
  launch_dispatch_forward(l, io, stream);
  replicas_in_window_ = record;
  latest_forward_record_ = record;
  stage(Stage::fanout, stream);
  launch_fanout_rows(l, /*backward=*/false, stream);
  stage(Stage::experts, stream);
  expert_forward(l, io, stream);
  const bool clip_counts = io.rank[0].clip_counts_E2 != nullptr;
  if (clip_counts) launch_clip_count_groups(l, stream);
  stage(Stage::combine_push, stream);
  launch_combine_push(l, /*backward=*/false, stream);
  stage(Stage::combine_reduce, stream);
  if (clip_counts) launch_clip_count_reduce(l, io, stream);
  launch_combine_reduce(l, io, /*backward=*/false, stream);
  launch_call_end(l, io, /*backward=*/false, stream);
  stage(Stage::end, stream);
}

void StagedPipeline::backward(std::span<const BackwardArgs> args, cudaStream_t stream, int record, bool recompute) {
  if (config_.inference) throw InvalidArgument("inference", "the pipeline was created for inference: no backward");
  check_record(record);
  std::vector<ForwardArgs> fwd;
  for (const BackwardArgs& a : args) fwd.push_back(a.forward);
  LaunchIo io = forward_io(fwd, /*backward=*/true);
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const BackwardArgs& a = args[s];
    require_pointer(a.grad_out_TD, s, "grad_out_TD", 16);
    require_pointer(a.grad_x_TD, s, "grad_x_TD", 16);
    require_pointer(a.grad_scores_TK, s, "grad_scores_TK", a.forward.scores_dtype == DType::fp32 ? 4 : 2);
    require_pointer(a.grad_w13, s, "grad_w13", 16);
    require_pointer(a.grad_w2, s, "grad_w2", 16);
    require(a.accumulate_wgrad == args[0].accumulate_wgrad, arg_name(s, "accumulate_wgrad"),
            "must be the same for every slot of one call");
    require(a.wgrad_dtype == args[0].wgrad_dtype, arg_name(s, "wgrad_dtype"),
            "must be the same for every slot of one call");
    RankIo& r = io.rank[s];
    r.grad_out_TD = static_cast<const bf16*>(a.grad_out_TD);
    r.grad_x_TD = static_cast<bf16*>(a.grad_x_TD);
    r.grad_scores_TK = a.grad_scores_TK;
    r.grad_w13_E2FD = a.grad_w13;
    r.grad_w2_EDF = a.grad_w2;
  }
  const DType wgrad_dtype = args[0].wgrad_dtype.value_or(config_.wgrad_dtype);
  EpLaunch l = launch_for(record);
  l.dims.scores_bf16 = args[0].forward.scores_dtype == DType::bf16;
  l.dims.w13_interleaved = args[0].forward.w13_layout == W13Layout::gate_up_interleaved;
  l.dims.wgrad_bf16 = wgrad_dtype == DType::bf16 ? 1 : 0;
  if (recompute) {
    // Only what backward reads: the layout, the received x rows, h13 (and the replica weights).
    stage(Stage::recompute, stream);
    launch_route(l, io, stream);
    dispatch_x_rows(l, io, stream);
    expert_forward_h13(l, io, /*tail_only=*/false, stream);
    replicas_in_window_ = record;
  }
  if (!recompute && record_order_.shares_working_rows(record)) {
    // The layout and h13 were kept, the x rows were not: send them again (and the replica weights).
    stage(Stage::redispatch, stream);
    dispatch_x_rows(l, io, stream);
    replicas_in_window_ = record;
    if (record_order_.partial_kind(record)) {  // h13 of the rows past what the record kept
      stage(Stage::recompute_rows, stream);
      launch_tail_groups(l, stream);
      expert_forward_h13(l, io, /*tail_only=*/true, stream);
    }
  }
  // Exact balance: the window's replica weights are those of the latest forward (or recompute).
  const bool push_replicas = l.dims.balanced && replicas_in_window_ != record;
  replicas_in_window_ = record;
  stage(Stage::dispatch, stream);
  launch_dispatch_backward(l, io, push_replicas, stream);
  stage(Stage::fanout, stream);
  launch_fanout_rows(l, /*backward=*/true, stream);  // the experts read grad_out rows in place, unscaled
  stage(Stage::experts, stream);
  expert_backward(l, io, args[0].accumulate_wgrad, stream);
  stage(Stage::combine_push, stream);
  launch_combine_push(l, /*backward=*/true, stream);
  if (l.dims.balanced) {
    // After the combine barrier every rank's replica weight gradients are complete.
    stage(Stage::replica_grads, stream);
    launch_replica_grad_reduce(l, io, stream);
  }
  stage(Stage::combine_reduce, stream);
  launch_combine_reduce(l, io, /*backward=*/true, stream);
  launch_call_end(l, io, /*backward=*/true, stream);
  stage(Stage::end, stream);
}

void StagedPipeline::check(cudaStream_t stream) {
  cuda_check(cudaStreamSynchronize(stream), "EP pipeline: cudaStreamSynchronize");
  std::vector<comm::ErrorWord> faults;
  for (const comm::ErrorWord& e : transport_->read_errors()) {
    if (e.code != 0) faults.push_back(e);
  }
  // A grouped-GEMM pipeline wait past its bound (the launch drained instead of hanging).
  std::string gemm_fault;
  for (int s = 0; s < launch_.launch_ranks && gemm_fault.empty(); ++s) {
    const sm90::PipelineFault f = sm90::read_pipeline_fault({launch_.scratch.rank[s].gemm_fault_word}, stream);
    if (f.occurred) gemm_fault = "SM90 expert GEMM: " + sm90::describe(f) + " (launch slot " + std::to_string(s) + ")";
  }
  if (faults.empty() && gemm_fault.empty()) return;
  std::string message = "EP device error: " + describe_faults(faults);
  if (!gemm_fault.empty()) message += (faults.empty() ? "" : "; ") + gemm_fault;
  throw DeviceError(message + " (call reset() before the next call)");
}

std::vector<comm::ErrorWord> StagedPipeline::recorded_faults() const {
  std::vector<comm::ErrorWord> faults;
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    const volatile FaultRecord& r = fault_records_[s];
    if (r.error.code == 0) continue;
    comm::ErrorWord e;
    e.code = r.error.code;
    e.phase = r.error.phase;
    e.rank = r.error.rank;
    e.peer = r.error.peer;
    e.value = r.error.value;
    e.token = r.error.token;
    faults.push_back(e);
  }
  return faults;
}

void StagedPipeline::raise_if_faulted() const {
  std::vector<comm::ErrorWord> faults = recorded_faults();
  if (faults.empty()) return;
  throw DeviceError("an earlier call faulted on the device: " + describe_faults(faults) +
                    "; its outputs were filled with NaN, and every call fails until reset()");
}

std::string StagedPipeline::describe_faults(std::vector<comm::ErrorWord> faults) const {
  // Root causes first: a timeout or a stop is usually the echo of another rank's failure.
  auto echo = [](const comm::ErrorWord& e) {
    return e.code == static_cast<int32_t>(comm::ErrorCode::timeout) ||
           e.code == static_cast<int32_t>(comm::ErrorCode::peer_failed);
  };
  std::stable_sort(faults.begin(), faults.end(),
                   [&](const comm::ErrorWord& a, const comm::ErrorWord& b) { return !echo(a) && echo(b); });
  std::string message;
  for (const comm::ErrorWord& e : faults) {
    message += (message.empty() ? "" : "; ") + comm::describe(e, transport_->timeout_ns());
    if (e.code == static_cast<int32_t>(comm::ErrorCode::expert_gemm_fault))
      message += ": " + sm90::describe(sm90::unpack_pipeline_fault(static_cast<unsigned long long>(e.value)));
  }
  return message;
}

void StagedPipeline::reset() {
  cuda_check(cudaDeviceSynchronize(), "reset: cudaDeviceSynchronize");
  transport_->reset();
  for (int s = 0; s < launch_.launch_ranks; ++s) {
    cuda_check(cudaMemset(launch_.scratch.rank[s].gemm_fault_word, 0, sizeof(unsigned long long)), "reset: GEMM fault word");
    fault_records_[s] = FaultRecord();
  }
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
  return p;
}

}  // namespace poise::ep
