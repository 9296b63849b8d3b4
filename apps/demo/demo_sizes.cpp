#include "demo_sizes.hpp"

#include <unistd.h>

#include <cstdio>

#include "demo_check.hpp"

namespace poise::demo {

double expert_macs(const Config& c, int64_t ranks) {
  return double(ranks) * double(c.num_local_input_tokens) * double(c.top_k) * 3.0 * double(c.intermediate_dim) *
         double(c.hidden_dim);
}

Check default_check(const Config& config, int64_t ranks) {
  return expert_macs(config, ranks) <= kFullCheckMacs ? Check::full : Check::sampled;
}

double host_bytes(const Flags& f, const MemoryPlan& plan, const HostWork& work) {
  const Config& c = f.config;
  const double R = double(f.ranks), T = double(c.num_local_input_tokens), D = double(c.hidden_dim);
  const double F = double(c.intermediate_dim), K = double(c.top_k);
  const double expert = 3.0 * F * D, local = double(plan.num_local_experts), replicas = double(plan.num_replica_slots);
  const double G = double(plan.total_rows);
  // ids, scores and the dispatch layouts routing_stats builds.
  double floats = R * T * K * 10.0;
  if (work.inputs) floats += R * (2.0 * T * D + local * expert);
  // Per rank: grouped x, h13, a, y and their gradients; y of every (t, k); out, grad_x and the copies
  // the demo keeps; replica weights and gradients; weight gradients and their copies.
  if (work.engine) floats += R * (G * (3.0 * D + 5.0 * F) + T * K * D + 3.0 * T * D + 2.0 * (local + replicas) * expert);
  if (work.gpu_results) floats += R * (2.0 * T * D + T * K + local * expert);
  double bytes = 4.0 * floats;
  if (work.dense) bytes += 8.0 * R * (2.0 * T * D + T * K + local * expert);
  if (work.sampled) bytes += sampled_check_host_bytes(c);
  return bytes;
}

double physical_memory_bytes() {
  return double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
}

double layer_tensor_bytes(const Flags& f, const MemoryPlan& plan) {
  const Config& c = f.config;
  const double T = double(c.num_local_input_tokens), D = double(c.hidden_dim), K = double(c.top_k);
  const double weights = double(plan.num_local_experts) * 3.0 * double(c.intermediate_dim) * D;
  const double scores = f.scores_dtype == DType::bf16 ? 2.0 : 4.0, wgrad = c.wgrad_dtype == DType::bf16 ? 2.0 : 4.0;
  // x, out, grad_out, grad_x; ids, scores, grad_scores; w13 + w2 and their gradients.
  return 8.0 * T * D + T * K * (4.0 + 2.0 * scores) + weights * (2.0 + wgrad);
}

double device_bytes(const Flags& f, const MemoryPlan& plan) {
  const double planned = plan.total_device_bytes < 0 ? 1e300 : double(plan.total_device_bytes);  // int64 overflow
  return double(f.ranks) * (planned + layer_tensor_bytes(f, plan)) + kDeviceReserveBytes;
}

std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", bytes / double(1 << 30));
  return text;
}

}  // namespace poise::demo
