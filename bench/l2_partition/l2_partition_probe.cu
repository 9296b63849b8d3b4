// Which L2 partition is near which SM, and does a partition keep copies of lines homed in the other?
//
// The H100/H200 L2 is two partitions joined by a fabric; ncu shows the expert GEMMs keeping that
// fabric 45-96% busy (performance.md, session 15). Whether placing the tiles that share an operand on
// one partition's SMs could cut that traffic depends on two facts this probe measures:
//   1. the SM -> partition map: one CTA per SM, one at a time, times an atomic on each of a fixed set
//      of lines (atomics are performed where a line lives, so the near/far pattern over the set
//      splits the SMs into two groups with complementary patterns);
//   2. copies: each SM then loads lines of its own (warmed by atomics from another SM) twice; if the
//      second load of a far line is as fast as a near one, the near partition kept a copy;
//   3. the test the placement idea needs: SMs all reading one buffer (as the tiles sharing an
//      operand do), as many SMs either from one group or half from each, buffers from 8 to 40 MB.
//      If one group's SMs read it faster, same-partition placement saves fabric traffic.
// Writes one CSV row per SM for 1 and 2 (smid, the atomic latencies in cycles over the shared
// lines, the first and the second load latencies over its own lines; analyze.py reads it) and
// prints the groups' sizes and the GB/s of 3.
//
//   l2_partition_probe OUT.csv
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kSharedLines = 64;   // the pattern that sorts SMs by partition
constexpr int kOwnLines = 32;      // per SM: first vs second load
constexpr int kTrials = 3;         // minimum over trials (atomics)
constexpr size_t kLineStride = (1u << 20) + 384;  // spread lines over slices

__device__ unsigned int g_turn = 0;
// Set by a CTA that waited longer than kTurnTimeoutNs for its turn (the grid was not resident at
// once, so a CTA before it may never run): the host reports it instead of the launch hanging.
__device__ unsigned int g_turn_timed_out = 0;
constexpr unsigned long long kTurnTimeoutNs = 10'000'000'000ull;

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int smid() {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
  return t;
}
// The clock after `v` has arrived: a volatile shared-memory store of v issues only once v is there,
// and the clock read is issued after it.
__device__ __forceinline__ long long clock_after(unsigned int v, unsigned int slot) {
  asm volatile("st.volatile.shared.u32 [%0], %1;" ::"r"(slot), "r"(v) : "memory");
  return clock_now();
}

__device__ __forceinline__ long long timed_atomic(unsigned int* p, unsigned int slot) {
  const long long t0 = clock_now();
  unsigned int v;
  asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(p) : "memory");
  return clock_after(v, slot) - t0;
}

__device__ __forceinline__ long long timed_load(const unsigned int* p, unsigned int slot) {
  const long long t0 = clock_now();
  unsigned int v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return clock_after(v, slot) - t0;
}

// Warms every SM's own lines by atomics from block 0's SM, so they are in L2 at home and, if atomics
// leave no copies, nowhere else.
__global__ void warm(unsigned char* buf, int ctas) {
  for (int i = threadIdx.x; i < ctas * kOwnLines; i += blockDim.x)
    atomicAdd(reinterpret_cast<unsigned int*>(buf + (kSharedLines + i) * kLineStride), 1u);
}

__global__ void probe(unsigned char* buf, long long* out) {
  extern __shared__ unsigned int one_cta_per_sm[];  // its first word: the timing stores' slot
  if (threadIdx.x != 0) return;
  const unsigned int slot = static_cast<unsigned int>(__cvta_generic_to_shared(one_cta_per_sm));
  // One CTA at a time: the others poll (slowly) for their turn, for at most kTurnTimeoutNs.
  const unsigned long long wait_start = global_timer_ns();
  while (*reinterpret_cast<volatile unsigned int*>(&g_turn) != blockIdx.x) {
    if (global_timer_ns() - wait_start > kTurnTimeoutNs) {
      atomicExch(&g_turn_timed_out, 1u);
      return;
    }
    __nanosleep(2000);
  }
  __threadfence();
  long long* row = out + blockIdx.x * (1 + kSharedLines + 2 * kOwnLines);
  row[0] = smid();
  for (int i = 0; i < kSharedLines; ++i) {
    unsigned int* p = reinterpret_cast<unsigned int*>(buf + i * kLineStride);
    long long best = 1ll << 40;
    for (int t = 0; t < kTrials; ++t) {
      const long long c = timed_atomic(p, slot);
      best = c < best ? c : best;
    }
    row[1 + i] = best;
  }
  for (int i = 0; i < kOwnLines; ++i) {
    const unsigned int* p =
        reinterpret_cast<const unsigned int*>(buf + (kSharedLines + blockIdx.x * kOwnLines + i) * kLineStride);
    row[1 + kSharedLines + i] = timed_load(p, slot);
    row[1 + kSharedLines + kOwnLines + i] = timed_load(p, slot);
  }
  __threadfence();
  atomicAdd(&g_turn, 1u);
}

// Every active CTA (its SM's bit set in active_sm) reads the whole buffer `passes` times by 16-byte
// L2 loads, starting at its own offset; returns a sum so the loads stay.
__global__ void shared_stream(const uint4* buf, size_t n, int passes, const unsigned char* active_sm,
                              unsigned int* sum_out) {
  extern __shared__ unsigned int one_cta_per_sm[];
  if (!active_sm[smid()]) return;
  if (threadIdx.x == 0) one_cta_per_sm[0] = 0;
  unsigned int acc = 0;
  const size_t start = (static_cast<size_t>(blockIdx.x) * 7919 * blockDim.x) % n;
  for (int pass = 0; pass < passes; ++pass) {
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
      size_t j = start + i;
      if (j >= n) j -= n;
      uint4 v;
      asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(buf + j));
      acc += v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  atomicAdd(sum_out, acc);
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.csv\n", argv[0]);
    return 2;
  }
  int sms = 0;
  if (!ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute")) return 1;
  const size_t bytes = (kSharedLines + size_t(sms) * kOwnLines + 1) * kLineStride;
  unsigned char* buf = nullptr;
  long long* out = nullptr;
  const int row = 1 + kSharedLines + 2 * kOwnLines;
  if (!ok(cudaMalloc(&buf, bytes), "cudaMalloc") || !ok(cudaMalloc(&out, sizeof(long long) * sms * row), "cudaMalloc") ||
      !ok(cudaMemset(buf, 0, bytes), "memset"))
    return 1;
  // Enough shared memory per CTA that two cannot share an SM: the grid covers every SM once.
  const int smem = 120 * 1024;
  if (!ok(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem attribute")) return 1;
  warm<<<1, 256>>>(buf, sms);
  probe<<<sms, 32, smem>>>(buf, out);
  if (!ok(cudaDeviceSynchronize(), "probe")) return 1;
  unsigned int timed_out = 0;
  if (!ok(cudaMemcpyFromSymbol(&timed_out, g_turn_timed_out, sizeof(timed_out)), "copy")) return 1;
  if (timed_out) {
    std::fprintf(stderr, "probe: a CTA waited over %llu s for its turn: the %d CTAs were not resident at once "
                 "(another process on the GPU?); no map written\n", kTurnTimeoutNs / 1'000'000'000ull, sms);
    return 1;
  }
  std::vector<long long> host(size_t(sms) * row);
  if (!ok(cudaMemcpy(host.data(), out, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost), "copy")) return 1;
  FILE* f = std::fopen(argv[1], "w");
  if (!f) return 1;
  for (int b = 0; b < sms; ++b) {
    for (int j = 0; j < row; ++j) std::fprintf(f, "%lld%c", host[size_t(b) * row + j], j + 1 < row ? ',' : '\n');
  }
  std::fclose(f);
  std::printf("%d SMs probed: %s\n", sms, argv[1]);

  // Groups: an SM's pattern of atomics slower than the midpoint of its 10th and 90th percentiles,
  // against the first SM's (analyze.py prints the full split and the latencies).
  std::vector<int> group(sms), smid_of(sms);
  std::vector<std::vector<bool>> far(sms, std::vector<bool>(kSharedLines));
  for (int b = 0; b < sms; ++b) {
    const long long* r = &host[size_t(b) * row];
    std::vector<long long> lat(r + 1, r + 1 + kSharedLines);
    std::vector<long long> sorted = lat;
    std::sort(sorted.begin(), sorted.end());
    const long long mid = (sorted[kSharedLines / 10] + sorted[9 * kSharedLines / 10]) / 2;
    for (int i = 0; i < kSharedLines; ++i) far[b][i] = lat[i] > mid;
    smid_of[b] = static_cast<int>(r[0]);
  }
  for (int b = 0; b < sms; ++b) {
    int d = 0;
    for (int i = 0; i < kSharedLines; ++i) d += far[b][i] != far[0][i];
    group[b] = d < kSharedLines / 2 ? 0 : 1;
  }
  std::vector<int> members[2];
  for (int b = 0; b < sms; ++b) members[group[b]].push_back(smid_of[b]);
  std::printf("groups: %zu and %zu SMs\n", members[0].size(), members[1].size());
  const size_t half = std::min(members[0].size(), members[1].size());
  if (half < 8) return 0;
  // Active sets of `half` SMs each: one group's, and half from each.
  const int max_smid = *std::max_element(smid_of.begin(), smid_of.end()) + 1;
  std::vector<unsigned char> one_group(max_smid, 0), mixed(max_smid, 0);
  for (size_t i = 0; i < half; ++i) one_group[members[0][i]] = 1;
  for (size_t i = 0; i < half; ++i) mixed[members[i % 2][i / 2]] = 1;
  unsigned char* active = nullptr;
  unsigned int* sum = nullptr;
  if (!ok(cudaMalloc(&active, max_smid), "cudaMalloc") || !ok(cudaMalloc(&sum, sizeof(unsigned int)), "cudaMalloc"))
    return 1;
  if (!ok(cudaFuncSetAttribute(shared_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem attribute"))
    return 1;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::printf("%zu SMs reading one buffer, L2 -> SM GB/s (all of them together):\n", half);
  std::printf("%8s %12s %12s\n", "MB", "one group", "both groups");
  for (size_t mb : {8, 16, 24, 32, 40}) {
    const size_t n = mb * (1u << 20) / sizeof(uint4);
    const int passes = 8;
    double gbs[2];
    for (int mode = 0; mode < 2; ++mode) {
      cudaMemcpy(active, mode == 0 ? one_group.data() : mixed.data(), max_smid, cudaMemcpyHostToDevice);
      shared_stream<<<sms, 512, smem>>>(reinterpret_cast<const uint4*>(buf), n, 1, active, sum);  // warm L2
      cudaEventRecord(e0);
      shared_stream<<<sms, 512, smem>>>(reinterpret_cast<const uint4*>(buf), n, passes, active, sum);
      cudaEventRecord(e1);
      if (!ok(cudaEventSynchronize(e1), "shared_stream")) return 1;
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      gbs[mode] = double(half) * passes * n * sizeof(uint4) / (ms * 1e-3) / 1e9;
    }
    std::printf("%8zu %12.0f %12.0f\n", mb, gbs[0], gbs[1]);
  }
  return 0;
}
