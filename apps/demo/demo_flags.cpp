#include "demo_flags.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <vector>

#include "poise/errors.hpp"

namespace poise::demo {

const char* const kUsage =
    "usage: poise_demo [flags]   (every flag is optional)\n"
    "  --tokens T            tokens per rank (64)\n"
    "  --hidden D            hidden size, a multiple of 64 (256)\n"
    "  --intermediate F      expert intermediate size, a multiple of 64 (128)\n"
    "  --experts E           routed experts, divisible by R (16)\n"
    "  --topk K              experts per token (4)\n"
    "  --ranks R             expert-parallel ranks (4)\n"
    "  --skew S              target peak/mean of rows per rank before balancing, >= 1 (3; 1 = uniform)\n"
    "  --balance MODE        exact | capacity (exact)\n"
    "  --capacity-factor C   capacity mode: rows a rank may receive, x T*K, >= 1\n"
    "                        (default: the routing's largest rank, rounded up to 0.01)\n"
    "  --activation A        swiglu | swiglu_clamped (swiglu)\n"
    "  --scores-dtype DT     fp32 | bf16 (fp32)\n"
    "  --wgrad-dtype DT      fp32 | bf16 (fp32; on the GPU bf16 when only bf16 weight gradients fit)\n"
    "  --padding-rows N      last N tokens of each rank are padding (zero scores) (0)\n"
    "  --seed N              random inputs (1)\n"
    "  --check MODE          full | sampled | none: what is compared with float64 (full up to 1e9\n"
    "                        expert multiply-adds R*T*K*3*F*D, else sampled)\n"
    "                          full: every output and weight gradient, dense float64 on the host\n"
    "                          sampled: out, grad_x, grad_scores of a few tokens per rank\n"
    "  --tolerance X         relative L2 error bound of the float64 check (0.01)\n"
    "  --device WHERE        auto | gpu | cpu (auto: the GPU when an SM90 GPU is present)\n";

namespace {

// `kind` names what the value must be ("an integer").
template <class Int>
Int parse_integer(const std::string& flag, const std::string& value, const char* kind) {
  Int v = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (error == std::errc::result_out_of_range) throw FlagError(flag + ": out of range: " + value);
  if (error != std::errc() || end != value.data() + value.size()) {
    throw FlagError(flag + ": not " + kind + ": " + value);
  }
  return v;
}

int64_t parse_int(const std::string& flag, const std::string& value) {
  return parse_integer<int64_t>(flag, value, "an integer");
}

uint64_t parse_unsigned(const std::string& flag, const std::string& value) {
  return parse_integer<uint64_t>(flag, value, "a non-negative integer");
}

double parse_number(const std::string& flag, const std::string& value) {
  double v = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (error != std::errc() || end != value.data() + value.size() || !std::isfinite(v)) {
    throw FlagError(flag + ": not a finite number: " + value);
  }
  return v;
}

// value must be one of choices; returns its index.
size_t parse_choice(const std::string& flag, const std::string& value, const std::vector<std::string>& choices) {
  for (size_t i = 0; i < choices.size(); ++i) {
    if (value == choices[i]) return i;
  }
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : " | ") + c;
  throw FlagError(flag + ": must be " + list + ", got " + value);
}

DType parse_dtype(const std::string& flag, const std::string& value) {
  return parse_choice(flag, value, {"fp32", "bf16"}) == 0 ? DType::fp32 : DType::bf16;
}

using Setter = std::function<void(Flags&, const std::string& flag, const std::string& value)>;

const std::map<std::string, Setter>& setters() {
  static const std::map<std::string, Setter> table = {
      {"--tokens", [](Flags& f, auto& k, auto& v) { f.config.num_local_input_tokens = parse_int(k, v); }},
      {"--hidden", [](Flags& f, auto& k, auto& v) { f.config.hidden_dim = parse_int(k, v); }},
      {"--intermediate", [](Flags& f, auto& k, auto& v) { f.config.intermediate_dim = parse_int(k, v); }},
      {"--experts", [](Flags& f, auto& k, auto& v) { f.config.num_experts = parse_int(k, v); }},
      {"--topk", [](Flags& f, auto& k, auto& v) { f.config.top_k = parse_int(k, v); }},
      {"--ranks", [](Flags& f, auto& k, auto& v) { f.ranks = parse_int(k, v); }},
      {"--skew", [](Flags& f, auto& k, auto& v) { f.skew = parse_number(k, v); }},
      {"--balance",
       [](Flags& f, auto& k, auto& v) {
         f.config.balance = parse_choice(k, v, {"exact", "capacity"}) == 0 ? Balance::exact : Balance::capacity;
       }},
      {"--capacity-factor",
       [](Flags& f, auto& k, auto& v) {
         f.config.receive_capacity_factor = parse_number(k, v);
         f.capacity_factor_given = true;
       }},
      {"--activation",
       [](Flags& f, auto& k, auto& v) {
         f.config.activation =
             parse_choice(k, v, {"swiglu", "swiglu_clamped"}) == 0 ? Activation::swiglu : Activation::swiglu_clamped;
       }},
      {"--scores-dtype", [](Flags& f, auto& k, auto& v) { f.scores_dtype = parse_dtype(k, v); }},
      {"--wgrad-dtype",
       [](Flags& f, auto& k, auto& v) {
         f.config.wgrad_dtype = parse_dtype(k, v);
         f.wgrad_dtype_given = true;
       }},
      {"--padding-rows", [](Flags& f, auto& k, auto& v) { f.padding_rows = parse_int(k, v); }},
      {"--seed", [](Flags& f, auto& k, auto& v) { f.seed = parse_unsigned(k, v); }},
      {"--check",
       [](Flags& f, auto& k, auto& v) {
         const Check modes[] = {Check::full, Check::sampled, Check::none};
         f.check = modes[parse_choice(k, v, {"full", "sampled", "none"})];
       }},
      {"--tolerance", [](Flags& f, auto& k, auto& v) { f.tolerance = parse_number(k, v); }},
      {"--device",
       [](Flags& f, auto& k, auto& v) {
         const Where places[] = {Where::automatic, Where::gpu, Where::cpu};
         f.where = places[parse_choice(k, v, {"auto", "gpu", "cpu"})];
       }},
  };
  return table;
}

}  // namespace

Flags parse_flags(int argc, char** argv) {
  Flags f;
  Config& c = f.config;
  c.num_local_input_tokens = 64;
  c.hidden_dim = 256;
  c.intermediate_dim = 128;
  c.num_experts = 16;
  c.top_k = 4;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "--help" || flag == "-h") {
      f.help = true;
      return f;
    }
    if (flag.rfind("--", 0) != 0) throw FlagError("unexpected argument " + flag + " (flags start with --)");
    const size_t eq = flag.find('=');
    if (eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    const auto setter = setters().find(flag);
    if (setter == setters().end()) throw FlagError("unknown flag " + flag);
    if (eq == std::string::npos) {
      if (i + 1 >= argc) throw FlagError(flag + ": missing value");
      value = argv[++i];
    }
    if (value.empty()) throw FlagError(flag + ": missing value");
    setter->second(f, flag, value);
  }
  return f;
}

std::string flag_of_field(const std::string& field) {
  static const std::map<std::string, std::string> flags = {
      {"num_local_input_tokens", "--tokens"}, {"hidden_dim", "--hidden"},
      {"intermediate_dim", "--intermediate"}, {"num_experts", "--experts"},
      {"top_k", "--topk"},                    {"ep_size", "--ranks"},
      {"receive_capacity_factor", "--capacity-factor"}, {"activation", "--activation"},
      {"balance", "--balance"},               {"wgrad_dtype", "--wgrad-dtype"},
  };
  const auto it = flags.find(field);
  return it == flags.end() ? field : it->second;
}

namespace {

std::string show(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

}  // namespace

MemoryPlan check_flags(const Flags& f) {
  MemoryPlan plan;
  try {
    plan = plan_memory(f.config, f.ranks);
  } catch (const InvalidArgument& e) {
    const std::string flag = flag_of_field(e.name());
    throw FlagError(flag == e.name() ? e.what() : flag + ": " + e.what());
  }
  if (!(f.skew >= 1.0)) throw FlagError("--skew: must be >= 1 (1 = uniform), got " + show(f.skew));
  if (f.padding_rows < 0 || f.padding_rows > f.config.num_local_input_tokens) {
    throw FlagError("--padding-rows: must be in [0, T = " + std::to_string(f.config.num_local_input_tokens) +
                    "], got " + std::to_string(f.padding_rows));
  }
  if (!(f.tolerance > 0.0)) throw FlagError("--tolerance: must be > 0, got " + show(f.tolerance));
  return plan;
}

const char* to_string(Check check) {
  switch (check) {
    case Check::full: return "full";
    case Check::sampled: return "sampled";
    case Check::none: return "none";
    case Check::automatic: break;
  }
  return "auto";
}

}  // namespace poise::demo
