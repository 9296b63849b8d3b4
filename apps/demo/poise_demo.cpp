// poise_demo: the main job in one command. One MoE layer (routed experts) forward + backward across
// R expert-parallel ranks: prints the memory plan, the routing balance, the time, and a check against
// float64. Exit code 0 = PASS (or nothing checked: --check none), 1 = FAIL, 2 = bad arguments or a
// layer that does not fit in memory.
//
// Where: with an SM90 GPU (and --device auto|gpu) the layer runs through the public entry points
// (Context + routed_experts) with R virtual ranks on that GPU; without one, on the CPU reference
// engine (R threads). Every argument, and whether the layer fits, is checked before anything is
// printed. The routing is drawn on the host and its balance computed from the ids alone. With a full
// check the inputs come from reference::random_inputs on the host; otherwise the GPU generates them,
// so a layer of any size that fits on the GPU starts within seconds.
#include <cstdio>

#include "demo_flags.hpp"
#include "demo_gpu.hpp"
#include "demo_report.hpp"
#include "demo_verify.hpp"
#include "poise/errors.hpp"

namespace {

using namespace poise::demo;

int run_cpu(const Setup& s) {
  const HostInputs h = make_host_inputs(s);
  return check_host_results(s, "CPU reference", run_engine(s, h), h);
}

int run(const Setup& s) {
  print_header(s);
  print_balance(s);
  if (capacity_overflows(s)) return 1;
  if (!s.gpu) return run_cpu(s);
  return s.check == Check::full ? run_gpu_full(s) : run_gpu_generated(s);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is printed, also into a pipe
  Flags flags;
  try {
    flags = parse_flags(argc, argv);
  } catch (const FlagError& e) {
    std::fprintf(stderr, "poise_demo: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (flags.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  // One set of handlers for the setup and the run: only the setup throws FlagError.
  try {
    return run(prepare(flags));
  } catch (const FlagError& e) {
    std::fprintf(stderr, "poise_demo: %s\n", e.what());
    return 2;
  } catch (const poise::InvalidArgument& e) {
    std::fprintf(stderr, "poise_demo: invalid argument: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "poise_demo: error: %s\n", e.what());
    return 1;
  }
}
