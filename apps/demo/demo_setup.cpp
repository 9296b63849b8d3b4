#include "demo_setup.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "demo_check.hpp"
#include "demo_sizes.hpp"
#include "poise/errors.hpp"
#include "runtime/device_info.hpp"

namespace poise::demo {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void choose_device(Setup& s) {
  const int devices = poise::cuda_device_count();
  const bool sm90 = devices > 0 && poise::is_sm90_device(0);
  if (s.flags.where == Where::gpu && !sm90) {
    throw FlagError(std::string("--device gpu: ") + (devices > 0 ? "device 0 is not an SM90 GPU" : "no CUDA device"));
  }
  s.gpu = s.flags.where == Where::gpu || (s.flags.where == Where::automatic && sm90);
  const std::string R = str(s.ranks());
  if (s.gpu) {
    s.device_line = "SM90 GPU; the layer runs through Context + routed_experts with " + R + " virtual ranks on it.";
  } else {
    s.device_line = std::string(s.flags.where == Where::cpu ? "--device cpu"
                                : devices > 0             ? "a CUDA device that is not SM90"
                                                          : "no CUDA device") +
                    "; running the CPU reference engine with " + R + " virtual ranks (threads).";
  }
}

void choose_check(Setup& s) {
  const double macs = expert_macs(s.config(), s.ranks());
  const bool by_default = s.flags.check == Check::automatic;
  s.check = by_default ? default_check(s.config(), s.ranks()) : s.flags.check;
  char why[160];
  std::snprintf(why, sizeof why, " (%s: the layer has %.1e expert multiply-adds, full up to %.0e)",
                by_default ? "default" : "--check", macs, kFullCheckMacs);
  if (s.check == Check::full) {
    s.check_line = "full: every output and weight gradient against a dense float64 computation on the host" +
                   std::string(why);
  } else if (s.check == Check::sampled) {
    s.sampled_tokens = pick_sampled_tokens(s.config(), s.ranks(), s.flags.seed);
    s.check_line = "sampled: out, grad_x and grad_scores of " + str(int64_t(s.sampled_tokens[0].size())) +
                   " token(s) per rank against float64; weight gradients are not checked" + why;
  } else {
    s.check_line = "none (--check none): nothing is compared with float64";
  }
}

std::string sizes_hint(const Flags& f) {
  return "lower --tokens (" + str(f.config.num_local_input_tokens) + ") or the layer (--hidden " +
         str(f.config.hidden_dim) + ", --intermediate " + str(f.config.intermediate_dim) + ", --experts " +
         str(f.config.num_experts) + ", --ranks " + str(f.ranks) + ")";
}

// The GPU's part of the memory line; FlagError when the layer does not fit. Without --wgrad-dtype,
// takes bf16 weight gradients when only they fit (the DeepSeek-V3 EP8 layer on one H200).
void fit_device_memory(Setup& s) {
  Flags& f = s.flags;
  size_t free = 0, total = 0;
  cuda_ok(cudaMemGetInfo(&free, &total));
  double need = device_bytes(f, s.plan);
  if (need > double(free) && !f.wgrad_dtype_given && f.config.wgrad_dtype == DType::fp32) {
    Flags bf16 = f;
    bf16.config.wgrad_dtype = DType::bf16;
    if (device_bytes(bf16, s.plan) <= double(free)) {
      s.wgrad_note = " (chosen: with fp32 weight gradients the GPU would need " + gib(need) + ", " + gib(double(free)) +
                     " free; --wgrad-dtype sets it)";
      f.config.wgrad_dtype = DType::bf16;
      need = device_bytes(f, s.plan);
    }
  }
  const std::string breakdown = str(f.ranks) + " virtual ranks x (" + gib(double(s.plan.total_device_bytes)) +
                                " plan + " + gib(layer_tensor_bytes(f, s.plan)) + " layer tensors) + " +
                                gib(kDeviceReserveBytes) + " reserve";
  if (need > double(free)) {
    throw FlagError("the layer does not fit on the GPU: it needs " + gib(need) + " (" + breakdown + "), " +
                    gib(double(free)) + " are free; " + sizes_hint(f) +
                    (f.config.wgrad_dtype == DType::fp32 ? ", or pass --wgrad-dtype bf16" : ""));
  }
  s.memory_line = "GPU " + gib(need) + " of " + gib(double(free)) + " free (" + breakdown + "); ";
}

// The host's part of the memory line; FlagError when the host work does not fit.
void fit_host_memory(Setup& s) {
  const Flags& f = s.flags;
  const HostWork work{.inputs = !s.gpu || s.check == Check::full,
                      .engine = !s.gpu,
                      .gpu_results = s.gpu && s.check == Check::full,
                      .dense = s.check == Check::full,
                      .sampled = s.check == Check::sampled};
  const double need = host_bytes(f, s.plan, work), physical = physical_memory_bytes();
  if (need > physical) {
    std::string what = work.engine ? "the CPU reference engine (the whole layer in fp32 on the host)" : "the inputs";
    if (work.dense) what += " and the full float64 check";
    throw FlagError("the layer does not fit in host memory: about " + gib(need) + " for " + what + ", the machine has " +
                    gib(physical) + "; " + sizes_hint(f) + (work.dense ? ", or use --check sampled" : "") +
                    (work.engine ? " (an SM90 GPU runs large layers)" : ""));
  }
  s.memory_line += "host about " + gib(need) + " of " + gib(physical);
}

// Refuses a layer whose buffers do not fit (FlagError).
void fit_memory(Setup& s) {
  s.memory_line.clear();
  if (s.gpu) fit_device_memory(s);
  fit_host_memory(s);
}

// Capacity mode without --capacity-factor: the smallest factor (in hundredths) this routing fits.
void size_capacity_from_routing(Setup& s) {
  Config& c = s.flags.config;
  if (c.balance != Balance::capacity || s.flags.capacity_factor_given) return;
  const int64_t rows_per_rank = c.num_local_input_tokens * c.top_k;
  const int64_t peak = *std::max_element(s.stats.computed_rows.begin(), s.stats.computed_rows.end());
  double factor = std::max(1.0, std::ceil(100.0 * double(peak) / double(rows_per_rank)) / 100.0);
  while (std::floor(factor * double(rows_per_rank)) < double(peak)) factor += 0.01;  // a rank takes floor(factor*T*K)
  c.receive_capacity_factor = factor;
  char note[200];
  std::snprintf(note, sizeof note,
                " (set from this routing: the busiest rank receives %lld rows = %.3f x T*K; --capacity-factor sets it)",
                static_cast<long long>(peak), double(peak) / double(rows_per_rank));
  s.capacity_note = note;
  s.plan = poise::plan_memory(c, s.ranks());
}

}  // namespace

void cuda_ok(cudaError_t status) {
  if (status != cudaSuccess) throw poise::DeviceError(cudaGetErrorString(status));
}

ref::RandomInputsSpec inputs_spec(const Flags& f) {
  return {.seed = f.seed, .skew = f.skew, .padding_rows = f.padding_rows};
}

Setup prepare(const Flags& flags) {
  Setup s;
  s.flags = flags;
  s.plan = check_flags(s.flags);
  choose_device(s);
  choose_check(s);
  fit_memory(s);  // before the routing is drawn: its arrays grow with T too
  s.routing = ref::random_routing(s.config(), s.ranks(), inputs_spec(s.flags), s.options());
  s.stats = ref::routing_stats(s.config(), s.ranks(), s.routing.ids_TK, s.options());
  size_capacity_from_routing(s);
  fit_memory(s);  // the plan's receive rows may have grown
  return s;
}

}  // namespace poise::demo
