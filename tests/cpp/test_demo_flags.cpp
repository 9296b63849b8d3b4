// The demo binary's argument handling, on the CPU: a bad value names its flag and exits 2 before
// anything is printed; a layer too large for the host is refused before it is allocated; capacity
// balance works with the default flags; every --check mode runs.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace {

struct DemoRun {
  int exit_code = -1;
  std::string out, err;
};

// Runs the demo with `args` on the CPU reference engine.
DemoRun demo(const std::string& args) {
  char err_path[] = "/tmp/poise_demo_stderr_XXXXXX";
  const int fd = mkstemp(err_path);
  EXPECT_GE(fd, 0);
  close(fd);
  const std::string command = std::string(POISE_DEMO_PATH) + " --device cpu " + args + " 2>" + err_path;
  DemoRun run;
  FILE* pipe = popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::array<char, 4096> buffer;
  for (size_t n; (n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0;) run.out.append(buffer.data(), n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream file(err_path);
  std::stringstream text;
  text << file.rdbuf();
  run.err = text.str();
  std::remove(err_path);
  return run;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(DemoFlags, ABadValueNamesItsFlagAndExits2BeforePrinting) {
  const struct {
    const char* args;
    const char* message;
  } cases[] = {
      {"--tokens abc", "--tokens: not an integer: abc"},
      {"--tokens", "--tokens: missing value"},
      {"--tokens 0", "--tokens: num_local_input_tokens: must be > 0"},
      {"--hidden 100", "--hidden: hidden_dim: must be a multiple of 64"},
      {"--experts 15", "--experts: num_experts: must be divisible by the EP size 4"},
      {"--ranks 0", "--ranks: ep_size: must be > 0"},
      {"--topk 17", "--topk: top_k: must be <= num_experts"},
      {"--skew 0.5", "--skew: must be >= 1"},
      {"--skew inf", "--skew: not a finite number: inf"},
      {"--padding-rows 65", "--padding-rows: must be in [0, T = 64]"},
      {"--balance bogus", "--balance: must be exact | capacity, got bogus"},
      {"--balance capacity --capacity-factor 0.5", "--capacity-factor: receive_capacity_factor: must be >= 1"},
      {"--activation relu", "--activation: must be swiglu | swiglu_clamped"},
      {"--scores-dtype fp16", "--scores-dtype: must be fp32 | bf16"},
      {"--check maybe", "--check: must be full | sampled | none, got maybe"},
      {"--device tpu", "--device: must be auto | gpu | cpu"},
      {"--seed -1", "--seed: not a non-negative integer: -1"},
      {"--tolerance 0", "--tolerance: must be > 0"},
      {"--frobnicate 1", "unknown flag --frobnicate"},
      {"extra", "unexpected argument extra"},
  };
  for (const auto& c : cases) {
    const DemoRun run = demo(c.args);
    EXPECT_EQ(run.exit_code, 2) << c.args;
    EXPECT_TRUE(has(run.err, c.message)) << c.args << " said: " << run.err;
    EXPECT_EQ(run.out, "") << c.args;
  }
}

TEST(DemoFlags, ALayerTooLargeForTheHostIsRefusedBeforeItIsAllocated) {
  const DemoRun run = demo("--tokens 1000000000000");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_TRUE(has(run.err, "does not fit in host memory")) << run.err;
  EXPECT_TRUE(has(run.err, "--tokens (1000000000000)")) << run.err;
  EXPECT_EQ(run.out, "");
}

TEST(DemoFlags, CapacityBalanceWorksWithTheDefaultFlags) {
  const DemoRun run = demo("--balance capacity");
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_TRUE(has(run.out, "set from this routing")) << run.out;
  EXPECT_TRUE(has(run.out, "result: PASS")) << run.out;
}

TEST(DemoFlags, AnExplicitCapacityFactorTheRoutingExceedsFails) {
  const DemoRun run = demo("--balance capacity --capacity-factor 1");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_TRUE(has(run.out, "more than its receive capacity")) << run.out;
  EXPECT_TRUE(has(run.out, "result: FAIL")) << run.out;
}

TEST(DemoFlags, EveryCheckModeRuns) {
  const DemoRun full = demo("--check full");
  EXPECT_EQ(full.exit_code, 0) << full.out << full.err;
  EXPECT_TRUE(has(full.out, "Check: full:")) << full.out;
  EXPECT_TRUE(has(full.out, "grad_w2 ")) << full.out;
  EXPECT_TRUE(has(full.out, "result: PASS")) << full.out;

  const DemoRun sampled = demo("--check=sampled --padding-rows 3");
  EXPECT_EQ(sampled.exit_code, 0) << sampled.out << sampled.err;
  EXPECT_TRUE(has(sampled.out, "Check: sampled:")) << sampled.out;
  EXPECT_TRUE(has(sampled.out, "grad_w13, grad_w2: not checked")) << sampled.out;
  EXPECT_TRUE(has(sampled.out, "result: PASS")) << sampled.out;

  const DemoRun none = demo("--check none");
  EXPECT_EQ(none.exit_code, 0) << none.out << none.err;
  EXPECT_TRUE(has(none.out, "result: not checked")) << none.out;
}

TEST(DemoFlags, TheDefaultCheckIsSampledAboveTheFullCheckBound) {
  // 4 ranks x 1024 tokens x K=4 x 3 x F=128 x D=256 = 1.6e9 expert multiply-adds, above 1e9.
  const DemoRun run = demo("--tokens 1024");
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_TRUE(has(run.out, "Check: sampled:")) << run.out;
  EXPECT_TRUE(has(run.out, "(default:")) << run.out;
  EXPECT_TRUE(has(run.out, "result: PASS")) << run.out;
}

TEST(DemoFlags, HelpListsEveryFlag) {
  const DemoRun run = demo("--help");
  EXPECT_EQ(run.exit_code, 0);
  for (const char* flag : {"--tokens", "--check", "--capacity-factor", "--device", "--wgrad-dtype"}) {
    EXPECT_TRUE(has(run.out, flag)) << flag;
  }
}

}  // namespace
