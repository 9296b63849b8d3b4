// The demo's flags: parsed and checked before anything is printed. Every error names its flag.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "poise/config.hpp"
#include "poise/memory_plan.hpp"

namespace poise::demo {

enum class Where { automatic, gpu, cpu };
enum class Check { automatic, full, sampled, none };

struct Flags {
  Config config;
  int64_t ranks = 4;
  double skew = 3.0;
  uint64_t seed = 1;
  int64_t padding_rows = 0;
  DType scores_dtype = DType::fp32;
  double tolerance = 1e-2;
  Where where = Where::automatic;
  Check check = Check::automatic;
  bool capacity_factor_given = false;  // else capacity mode sizes it from the routing
  bool wgrad_dtype_given = false;      // else the GPU path may pick bf16 when fp32 does not fit
  bool help = false;
};

// A bad flag or value (exit code 2). The message starts with the flag.
class FlagError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

extern const char* const kUsage;

// Syntax only: every value has its flag's type. Throws FlagError.
Flags parse_flags(int argc, char** argv);

// The rules across flags: the Config (through plan_memory, with Config fields named by their flags),
// skew, padding rows, tolerance. Returns the plan. Throws FlagError.
MemoryPlan check_flags(const Flags& flags);

// The flag that sets a Config field ("num_local_input_tokens" -> "--tokens"); the field when none does.
std::string flag_of_field(const std::string& field);

const char* to_string(Check check);

}  // namespace poise::demo
