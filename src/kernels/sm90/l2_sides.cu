// The SM -> L2 side probe (l2_sides.hpp). One CTA per SM (all of shared memory), one at a time in
// ticket order, times atomics on a fixed set of lines spread over the L2 slices; the host sorts
// each SM's latencies into near and far and groups the SMs by their patterns.
#include "kernels/sm90/l2_sides.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "poise/errors.hpp"

namespace poise::sm90 {
namespace {

constexpr int kLines = 64;
constexpr int kTrials = 3;                        // minimum over trials (the first also warms the line)
constexpr size_t kLineStride = (1u << 20) + 384;  // words apart: lines over many slices (as the bench probe)
constexpr unsigned long long kTurnTimeoutNs = 2'000'000'000ull;

__global__ void l2_side_probe_kernel(unsigned int* lines, unsigned int* ticket_turn, unsigned int* latency_SL,
                                     int max_sms, int* timed_out) {
  extern __shared__ unsigned int slot[];  // sized to all of shared memory: one CTA per SM
  if (threadIdx.x != 0) return;
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned int ticket = atomicAdd(&ticket_turn[0], 1u);
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  bool late = false;
  while (*static_cast<volatile unsigned int*>(&ticket_turn[1]) != ticket) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > kTurnTimeoutNs) {
      late = true;
      atomicExch(timed_out, 1);
      break;
    }
  }
  if (!late && static_cast<int>(sm) < max_sms) {
    const unsigned int slot_address = static_cast<unsigned int>(__cvta_generic_to_shared(slot));
    for (int l = 0; l < kLines; ++l) {
      unsigned int best = ~0u;
      for (int trial = 0; trial < kTrials; ++trial) {
        long long t0, t1;
        unsigned int v;
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0)::"memory");
        asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(lines + l * kLineStride) : "memory");
        // The store issues once v has arrived; the clock is read after it.
        asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"(slot_address), "r"(v) : "memory");
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(t1)::"memory");
        best = min(best, static_cast<unsigned int>(t1 - t0));
      }
      latency_SL[sm * kLines + l] = best;
    }
  }
  __threadfence();
  atomicAdd(&ticket_turn[1], 1u);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw DeviceError(std::string("measure_l2_sides: ") + what + ": " + cudaGetErrorString(err));
}

// Near/far bits of one SM's latencies: the threshold halfway between its 10th and 90th percentile.
uint64_t far_pattern(const unsigned int* latency_L) {
  std::array<unsigned int, kLines> sorted;
  std::copy(latency_L, latency_L + kLines, sorted.begin());
  std::sort(sorted.begin(), sorted.end());
  const double threshold = 0.5 * (sorted[kLines / 10] + sorted[kLines - 1 - kLines / 10]);
  uint64_t bits = 0;
  for (int l = 0; l < kLines; ++l)
    if (latency_L[l] > threshold) bits |= uint64_t{1} << l;
  return bits;
}

L2SideMap measure(int device) {
  L2SideMap map;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  map.sms = prop.multiProcessorCount;
  if (map.sms > 32 * kL2SideWords) return map;
  unsigned int *lines = nullptr, *ticket_turn = nullptr, *latency_SL = nullptr;
  int* timed_out = nullptr;
  const size_t line_words = (kLines - 1) * kLineStride + 1;
  check(cudaMalloc(&lines, line_words * sizeof(unsigned int)), "cudaMalloc");
  check(cudaMalloc(&ticket_turn, 2 * sizeof(unsigned int)), "cudaMalloc");
  check(cudaMalloc(&latency_SL, size_t(map.sms) * kLines * sizeof(unsigned int)), "cudaMalloc");
  check(cudaMalloc(&timed_out, sizeof(int)), "cudaMalloc");
  check(cudaMemset(ticket_turn, 0, 2 * sizeof(unsigned int)), "cudaMemset");
  check(cudaMemset(latency_SL, 0, size_t(map.sms) * kLines * sizeof(unsigned int)), "cudaMemset");
  check(cudaMemset(timed_out, 0, sizeof(int)), "cudaMemset");
  const int smem = static_cast<int>(prop.sharedMemPerBlockOptin);
  check(cudaFuncSetAttribute(l2_side_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "cudaFuncSetAttribute");
  l2_side_probe_kernel<<<map.sms, 32, smem>>>(lines, ticket_turn, latency_SL, map.sms, timed_out);
  check(cudaGetLastError(), "launch");
  check(cudaDeviceSynchronize(), "probe");
  std::vector<unsigned int> latency(size_t(map.sms) * kLines);
  int late = 0;
  check(cudaMemcpy(latency.data(), latency_SL, latency.size() * sizeof(unsigned int), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaMemcpy(&late, timed_out, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(lines);
  cudaFree(ticket_turn);
  cudaFree(latency_SL);
  cudaFree(timed_out);
  if (late) return map;
  // Every SM against SM 0's pattern: equal (side 0) or complementary (side 1), nothing in between.
  const uint64_t reference = far_pattern(latency.data());
  for (int sm = 0; sm < map.sms; ++sm) {
    const unsigned int* latency_L = latency.data() + size_t(sm) * kLines;
    if (*std::min_element(latency_L, latency_L + kLines) == 0) return map;  // no CTA ran there
    const int distance = __builtin_popcountll(far_pattern(latency_L) ^ reference);
    if (distance > kLines / 8 && distance < kLines - kLines / 8) return map;
    if (distance >= kLines / 2) {
      map.bits[sm / 32] |= 1u << (sm % 32);
      ++map.side1_sms;
    }
  }
  map.valid = map.side1_sms >= map.sms / 4 && map.sms - map.side1_sms >= map.sms / 4;
  return map;
}

std::mutex g_mutex;
std::array<L2SideMap, 64> g_maps;
std::array<bool, 64> g_measured{};

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

}  // namespace

const L2SideMap& measure_l2_sides() {
  const int device = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device >= static_cast<int>(g_maps.size())) {
    static const L2SideMap invalid;
    return invalid;
  }
  if (!g_measured[device]) {
    g_maps[device] = measure(device);
    g_measured[device] = true;
  }
  return g_maps[device];
}

const L2SideMap* cached_l2_sides() {
  const int device = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device >= static_cast<int>(g_maps.size()) || !g_measured[device]) return nullptr;
  return &g_maps[device];
}

}  // namespace poise::sm90
