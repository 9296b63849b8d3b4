// Context lifecycle and the routed_experts entry points: host-side validation, then the launch sequence.
#include "poise/context.hpp"

#include <string>

#include "poise/errors.hpp"

namespace poise {

struct Context::State {
  MemoryPlan plan;
  int64_t rank = 0;
  bool closed = false;
};

std::unique_ptr<Context> Context::create(const Config& config, int64_t ep_size, int64_t rank) {
  config.validate(ep_size);  // ep_size first: a rank is only meaningful within a valid group
  if (rank < 0 || rank >= ep_size) {
    throw InvalidArgument("rank", "must be in [0, ep_size=" + std::to_string(ep_size) + "), got " +
                                      std::to_string(rank));
  }
  return std::unique_ptr<Context>(new Context(config, ep_size, rank));
}

Context::Context(const Config& config, int64_t ep_size, int64_t rank) : state_(std::make_unique<State>()) {
  state_->plan = plan_memory(config, ep_size);  // validates config
  state_->rank = rank;
}

Context::~Context() {
  if (state_ && !state_->closed) close();
}

const Config& Context::config() const { return state_->plan.config; }
const MemoryPlan& Context::plan() const { return state_->plan; }
int64_t Context::ep_size() const { return state_->plan.ep_size; }
int64_t Context::rank() const { return state_->rank; }
bool Context::closed() const { return state_->closed; }

void Context::reset() {
  if (state_->closed) throw InvalidArgument("context", "was closed; create a new one");
}

void Context::close() { state_->closed = true; }

namespace {

void require_pointer(const void* p, const char* name) {
  if (p == nullptr) throw InvalidArgument(name, "must be a device pointer, got null");
}

// Backward passes its forward's inputs in BackwardArgs::forward but no out_TD (it writes grads).
void validate_forward(const Context& context, const ForwardArgs& a, bool requires_out = true) {
  if (context.closed()) throw InvalidArgument("context", "was closed; create a new one");
  require_pointer(a.x_TD, "x_TD");
  require_pointer(a.ids_TK, "ids_TK");
  require_pointer(a.scores_TK, "scores_TK");
  require_pointer(a.w13, "w13");
  require_pointer(a.w2, "w2");
  if (requires_out) require_pointer(a.out_TD, "out_TD");
}

[[noreturn]] void gpu_path_not_available(const char* entry) {
  throw NotAvailable(std::string(entry) +
                     ": the GPU pipeline is not available in this build yet; "
                     "poise::reference runs the same semantics on the CPU");
}

}  // namespace

void routed_experts_forward(Context& context, const ForwardArgs& args, Stream /*stream*/) {
  validate_forward(context, args);
  if (context.config().inference == false && context.config().num_activation_slots == 0) {
    throw InvalidArgument("num_activation_slots", "must be >= 1 for a training forward (backward needs a slot)");
  }
  gpu_path_not_available("routed_experts_forward");
}

void routed_experts_backward(Context& context, const BackwardArgs& args, Stream /*stream*/) {
  validate_forward(context, args.forward, /*requires_out=*/false);
  if (context.config().inference) {
    throw InvalidArgument("context", "was created with inference=true; backward needs a training context");
  }
  require_pointer(args.grad_out_TD, "grad_out_TD");
  require_pointer(args.grad_x_TD, "grad_x_TD");
  require_pointer(args.grad_scores_TK, "grad_scores_TK");
  require_pointer(args.grad_w13, "grad_w13");
  require_pointer(args.grad_w2, "grad_w2");
  gpu_path_not_available("routed_experts_backward");
}

}  // namespace poise
