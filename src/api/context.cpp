// Context lifecycle and the routed_experts entry points: host-side validation, then the staged
// GPU pipeline (src/pipeline/staged_pipeline.hpp) over virtual ranks or a communicator (context_nccl.cpp).
#include "poise/context.hpp"

#include <cstdlib>
#include <string>
#include <vector>

#include "api/context_internal.hpp"
#include "core/workspace_layout.hpp"
#include "runtime/device_info.hpp"
#include "pipeline/staged_pipeline.hpp"
#include "poise/errors.hpp"

namespace poise {

// Events at the stage boundaries of the last forward and the last backward (enable_stage_timing).
struct StageClock {
  bool on = false;
  std::vector<std::pair<ep::Stage, cudaEvent_t>> marks[2];  // [0] forward, [1] backward
  int recording = 0;
  ep::StagedPipeline* installed = nullptr;  // the pipeline whose hook records into this clock

  void clear(int which) {
    for (auto& mark : marks[which]) cudaEventDestroy(mark.second);
    marks[which].clear();
  }
  ~StageClock() { clear(0), clear(1); }
  // Before a call (the pipeline may have been created by it): hook it up once, start a record.
  void begin(ep::StagedPipeline& pipeline, int which) {
    if (!on) return;
    if (installed != &pipeline) install(pipeline);
    clear(recording = which);
  }
  void install(ep::StagedPipeline& pipeline) {
    installed = on ? &pipeline : nullptr;
    if (!on) return pipeline.set_stage_hook(nullptr);
    pipeline.set_stage_hook([this](ep::Stage stage, cudaStream_t stream) {
      cudaEvent_t event;
      if (cudaEventCreate(&event) != cudaSuccess) return;  // a diagnostic: never fail the call
      cudaEventRecord(event, stream);
      marks[recording].push_back({stage, event});
    });
  }
  std::vector<StageTime> read(int which) const {
    std::vector<StageTime> times;
    for (size_t i = 0; i + 1 < marks[which].size(); ++i) {
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, marks[which][i].second, marks[which][i + 1].second);
      times.push_back({ep::to_string(marks[which][i].first), ms});
    }
    return times;
  }
};

struct Context::State {
  MemoryPlan plan;
  ContextOptions options;
  int64_t rank = 0;
  int64_t launch_ranks = 1;
  bool closed = false;
  std::unique_ptr<ep::StagedPipeline> pipeline;  // GPU resources; created on first use for create()
  std::shared_ptr<void> release_after_pipeline;  // e.g. an owned communicator (ContextAccess)
  StageClock stage_clock;
  // Activation slots: pipeline record 0 is the working record, 1 + slot * per_slot + position a
  // slot's kept layer. A record's generation counts the forwards (and recomputes) written into it.
  int64_t selected_slot = -1, slot_layers = 0, next_position = 0;
  std::vector<uint64_t> generation;
  ActivationRecord latest;
  uint64_t next_generation() { return ++generation_counter; }
  uint64_t generation_counter = 0;
  int64_t recomputed_forwards = 0;
};

std::unique_ptr<Context> Context::create(const Config& config, int64_t ep_size, int64_t rank,
                                         const ContextOptions& options) {
  config.validate(ep_size);  // ep_size first: a rank is only meaningful within a valid group
  if (rank < 0 || rank >= ep_size) {
    throw InvalidArgument("rank", "must be in [0, ep_size=" + std::to_string(ep_size) + "), got " +
                                      std::to_string(rank));
  }
  return std::unique_ptr<Context>(new Context(config, ep_size, rank, options));
}

// The pipeline keeps what the memory plan sized: its replica slots and every activation slot's
// records (layout::keep_of: the same numbers the plan summed).
static ep::PipelineOptions pipeline_options(const Context& context) {
  const layout::Keep keep = layout::keep_of(context.plan());
  return {.timeout_ns = context.options().wait_timeout_ns,
          .replica_slots = keep.replica_slots,
          .activation_records = static_cast<int>(keep.whole_records),
          .light_activation_records = static_cast<int>(keep.light_records),
          .partial_activation_records = static_cast<int>(keep.partial_records),
          .partial_record_rows = keep.partial_record_rows};
}

std::unique_ptr<Context> Context::create_virtual_ranks(const Config& config, int64_t ep_size,
                                                       const ContextOptions& options) {
  config.validate(ep_size);
  std::unique_ptr<Context> context(new Context(config, ep_size, 0, options));
  context->state_->launch_ranks = ep_size;
  if (cuda_device_count() == 0) {
    throw DeviceError("create_virtual_ranks: no CUDA device; virtual ranks run on one SM90 GPU "
                      "(poise::reference runs the same semantics on the CPU)");
  }
  context->state_->pipeline = ep::StagedPipeline::create_virtual(config, ep_size, pipeline_options(*context));
  return context;
}

std::unique_ptr<Context> ContextAccess::with_pipeline(const Config& config, int64_t ep_size, int64_t rank,
                                                      const ContextOptions& options,
                                                      const MakePipeline& make_pipeline) {
  std::unique_ptr<Context> context = Context::create(config, ep_size, rank, options);
  context->state_->pipeline = make_pipeline(pipeline_options(*context));
  if (!context->state_->pipeline) throw DeviceError("Context: the pipeline factory returned no pipeline");
  return context;
}

void ContextAccess::release_after_pipeline(Context& context, std::shared_ptr<void> resource) {
  context.state_->release_after_pipeline = std::move(resource);
}

namespace {

bool sync_check_from_environment() {
  const char* v = std::getenv("POISE_SYNC_CHECK");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

Context::Context(const Config& config, int64_t ep_size, int64_t rank, const ContextOptions& options)
    : state_(std::make_unique<State>()) {
  state_->plan = plan_memory(config, ep_size);  // validates config
  state_->options = options;
  state_->options.sync_check = options.sync_check || sync_check_from_environment();
  state_->rank = rank;
}

Context::~Context() {
  if (state_ && !state_->closed) close();
}

const Config& Context::config() const { return state_->plan.config; }
const MemoryPlan& Context::plan() const { return state_->plan; }
int64_t Context::device_bytes() const {
  return state_->pipeline ? static_cast<int64_t>(state_->pipeline->device_bytes_per_rank()) : 0;
}
int64_t Context::ep_size() const { return state_->plan.ep_size; }
int64_t Context::rank() const { return state_->rank; }
const ContextOptions& Context::options() const { return state_->options; }
int64_t Context::launch_ranks() const { return state_->launch_ranks; }
bool Context::closed() const { return state_->closed; }

namespace {

void require_open(const Context& context) {
  if (context.closed()) throw InvalidArgument("context", "was closed; create a new one");
}

}  // namespace

void Context::reset() {
  require_open(*this);
  if (state_->pipeline) state_->pipeline->reset();
  state_->generation.assign(state_->generation.size(), 0);  // nothing kept survives a failed call
  state_->latest = {};
}

int64_t Context::recomputed_forwards() const { return state_->recomputed_forwards; }

void Context::select_activation_slot(int64_t slot, int64_t num_moe_layers_in_slot) {
  require_open(*this);
  const Config& c = config();
  if (c.inference) throw InvalidArgument("context", "was created with inference=true: it has no activation slots");
  if (slot < 0 || slot >= c.num_activation_slots) {
    throw InvalidArgument("slot", "must be in [0, num_activation_slots=" + std::to_string(c.num_activation_slots) +
                                      "), got " + std::to_string(slot));
  }
  if (num_moe_layers_in_slot < 1 || num_moe_layers_in_slot > c.max_moe_layers_per_activation_slot) {
    throw InvalidArgument("num_moe_layers_in_slot",
                          "must be in [1, max_moe_layers_per_activation_slot=" +
                              std::to_string(c.max_moe_layers_per_activation_slot) + "], got " +
                              std::to_string(num_moe_layers_in_slot));
  }
  state_->selected_slot = slot;
  state_->slot_layers = num_moe_layers_in_slot;
  state_->next_position = 0;
}

void Context::enable_stage_timing(bool on) {
  require_open(*this);
  state_->stage_clock.on = on;
  if (state_->pipeline) state_->stage_clock.install(*state_->pipeline);
}

StageTimes Context::stage_times(Stream stream) {
  require_open(*this);
  if (!state_->pipeline) return {};  // no GPU call yet
  if (cudaStreamSynchronize(stream) != cudaSuccess) throw DeviceError("stage_times: cudaStreamSynchronize failed");
  return {state_->stage_clock.read(0), state_->stage_clock.read(1)};
}

void Context::routing_stats(std::span<const RoutingStatsOut> per_launch_rank, Stream stream) {
  require_open(*this);
  if (!state_->pipeline) throw InvalidArgument("context", "has run no forward yet: routing_stats describes the latest forward");
  state_->pipeline->routing_stats(per_launch_rank, stream);
}

void Context::check(Stream stream) {
  require_open(*this);
  if (state_->pipeline) state_->pipeline->check(stream);
}

void Context::raise_if_faulted() const {
  require_open(*this);
  if (state_->pipeline) state_->pipeline->raise_if_faulted();
}

void Context::close() {
  state_->pipeline.reset();
  state_->release_after_pipeline.reset();  // after the pipeline: it may hold a window on it
  state_->closed = true;
}

namespace {

void require_pointer(const void* p, const char* name) {
  if (p == nullptr) throw InvalidArgument(name, "must be a device pointer, got null");
}

// The inputs a forward and its backward share (backward never writes the forward's out_TD).
void validate_inputs(const ForwardArgs& a) {
  require_pointer(a.x_TD, "x_TD");
  require_pointer(a.ids_TK, "ids_TK");
  require_pointer(a.scores_TK, "scores_TK");
  require_pointer(a.w13, "w13");
  require_pointer(a.w2, "w2");
}

void validate_forward(const ForwardArgs& a) {
  validate_inputs(a);
  require_pointer(a.out_TD, "out_TD");
}

void validate_backward(const BackwardArgs& b) {
  validate_inputs(b.forward);
  require_pointer(b.grad_out_TD, "grad_out_TD");
  require_pointer(b.grad_x_TD, "grad_x_TD");
  require_pointer(b.grad_scores_TK, "grad_scores_TK");
  require_pointer(b.grad_w13, "grad_w13");
  require_pointer(b.grad_w2, "grad_w2");
}

template <typename Args>
void require_one_set_per_launch_rank(const Context& context, std::span<const Args> args) {
  if (int64_t(args.size()) != context.launch_ranks()) {
    throw InvalidArgument("args_per_rank", "must hold one argument set per launch rank (" +
                                               std::to_string(context.launch_ranks()) + "), got " +
                                               std::to_string(args.size()));
  }
}

}  // namespace

// The GPU pipeline of a one-rank context, created by its first call.
static ep::StagedPipeline& pipeline_of(Context& context, std::unique_ptr<ep::StagedPipeline>& pipeline) {
  if (pipeline) return *pipeline;
  if (context.ep_size() != 1) {
    throw NotAvailable("routed_experts on a Context::create context with ep_size > 1 needs a communicator "
                       "(multi-GPU, not in this build yet); use Context::create_virtual_ranks on one GPU");
  }
  if (cuda_device_count() == 0) {
    throw DeviceError("routed_experts: no CUDA device; the CPU semantics are in poise::reference");
  }
  pipeline = ep::StagedPipeline::create_virtual(context.config(), 1, pipeline_options(context));
  return *pipeline;
}

// The pipeline, with one generation counter per activation record (both created on first use).
static ep::StagedPipeline& pipeline_with_records(Context& context, std::unique_ptr<ep::StagedPipeline>& owned,
                                                 std::vector<uint64_t>& generation) {
  ep::StagedPipeline& pipeline = pipeline_of(context, owned);
  if (generation.size() != size_t(pipeline.records())) generation.assign(pipeline.records(), 0);
  return pipeline;
}

// ContextOptions::sync_check: the call's faults raise in the call (not while a graph is captured).
static void sync_check(Context& context, Stream stream) {
  if (!context.options().sync_check) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture != cudaStreamCaptureStatusNone) return;
  context.check(stream);
}

ActivationRecord routed_experts_forward(Context& context, std::span<const ForwardArgs> args_per_rank, Stream stream,
                                        bool keep_for_backward) {
  require_open(context);
  require_one_set_per_launch_rank(context, args_per_rank);
  for (const ForwardArgs& a : args_per_rank) validate_forward(a);
  // A fault of an earlier call raises here, at the entry of a later one (no sync; context.hpp).
  if (context.state_->pipeline) context.state_->pipeline->raise_if_faulted();
  if (!context.config().inference && context.config().num_activation_slots == 0) {
    throw InvalidArgument("num_activation_slots", "must be >= 1 for a training forward (backward needs a slot)");
  }
  Context::State& st = *context.state_;
  ep::StagedPipeline& pipeline = pipeline_with_records(context, st.pipeline, st.generation);
  const ep::RecordOrder& order = pipeline.record_order();
  // The record this forward writes: a kept layer of the selected slot, else the working record.
  // A slot's positions take its whole records, then its light ones, then its partial one (the
  // pipeline holds every slot's records of one kind together: pipeline_options).
  int64_t record = 0;
  // Forwards past the selected layer count (say, recomputed by activation checkpointing inside
  // backward) run from the working record like layers the slot has no room for.
  const bool takes_position = keep_for_backward && !context.config().inference && st.selected_slot >= 0 &&
                              st.next_position < st.slot_layers;
  if (takes_position) {
    const int64_t whole = context.plan().activation_records_per_slot;
    const int64_t light = context.plan().activation_light_records_per_slot;
    const int64_t p = st.next_position;
    if (p < whole) record = order.whole_record(st.selected_slot * whole + p);
    else if (p < whole + light) record = order.light_record(st.selected_slot * light + (p - whole));
    else if (p == whole + light && order.partial > 0) record = order.partial_record(st.selected_slot);
  }
  st.stage_clock.begin(pipeline, 0);
  st.generation[record] = 0;  // being overwritten: valid again only once the launch was enqueued
  if (order.shares_working_rows(static_cast<int>(record))) st.generation[0] = 0;  // the working x rows
  pipeline.forward(args_per_rank, stream, static_cast<int>(record));
  if (takes_position) ++st.next_position;
  st.generation[record] = st.next_generation();
  st.latest = {record, st.generation[record]};
  sync_check(context, stream);
  return st.latest;
}

void routed_experts_backward(Context& context, std::span<const BackwardArgs> args_per_rank, Stream stream,
                             const ActivationRecord* record) {
  require_open(context);
  require_one_set_per_launch_rank(context, args_per_rank);
  if (context.config().inference) {
    throw InvalidArgument("context", "was created with inference=true; backward needs a training context");
  }
  for (const BackwardArgs& b : args_per_rank) validate_backward(b);
  if (context.state_->pipeline) context.state_->pipeline->raise_if_faulted();
  Context::State& st = *context.state_;
  ep::StagedPipeline& pipeline = pipeline_with_records(context, st.pipeline, st.generation);
  const ActivationRecord want = record ? *record : st.latest;
  if (want.index < -1 || want.index >= pipeline.records()) {
    throw InvalidArgument("record", "index must be in [-1, " + std::to_string(pipeline.records()) + "), got " +
                                        std::to_string(want.index));
  }
  // Kept and not overwritten since: run from it. Otherwise rebuild it in the working record.
  const bool kept = want.index >= 0 && want.generation != 0 && st.generation[want.index] == want.generation;
  const int64_t index = kept ? want.index : 0;
  st.stage_clock.begin(pipeline, 1);
  // Rebuilding, or re-sending a light record's x rows, overwrites the working record's.
  if (!kept || pipeline.record_order().shares_working_rows(static_cast<int>(index))) st.generation[0] = 0;
  pipeline.backward(args_per_rank, stream, static_cast<int>(index), /*recompute=*/!kept);
  if (!kept) {
    ++st.recomputed_forwards;
    st.generation[0] = st.next_generation();  // a token naming the working record is now stale
  }
  sync_check(context, stream);
}

}  // namespace poise
