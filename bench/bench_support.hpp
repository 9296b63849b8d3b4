// Shared by the single-file benchmarks (ep_bench, balance_bench): CUDA error exit, device buffers
// of random bf16, medians, the layer Config. Each benchmark is one translation unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <map>
#include <string>

#include "pipeline/staged_pipeline.hpp"
#include "poise/config.hpp"
#include "testing/layer_config.hpp"

#define CHECK(expr)                                                                                       \
  do {                                                                                                    \
    cudaError_t s_ = (expr);                                                                              \
    if (s_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(s_), __FILE__, __LINE__); \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)

namespace poise::bench {

// Uniform in [-scale, scale) from a hash of (index, seed): no host copy of the data.
static __global__ void fill_random_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = float(z >> 40) / float(1ull << 24);  // [0, 1)
    p[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

inline void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  return p;
}

inline void random_fill(void* p, size_t n, uint64_t seed, float scale) {
  fill_random_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CHECK(cudaGetLastError());
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

using testing::layer_config;

// Records an event at every stage boundary of one pass; durations per stage after a sync.
struct StageClock {
  std::vector<std::pair<ep::Stage, cudaEvent_t>> marks;
  void hook(ep::Stage s, cudaStream_t stream) {
    cudaEvent_t e;
    CHECK(cudaEventCreate(&e));
    CHECK(cudaEventRecord(e, stream));
    marks.push_back({s, e});
  }
  // stage -> ms, plus "total"
  std::map<std::string, double> read() {
    std::map<std::string, double> ms;
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, marks[i].second, marks[i + 1].second));
      ms[ep::to_string(marks[i].first)] += t;
    }
    float total = 0;
    CHECK(cudaEventElapsedTime(&total, marks.front().second, marks.back().second));
    ms["total"] = total;
    for (auto& m : marks) cudaEventDestroy(m.second);
    marks.clear();
    return ms;
  }
};

}  // namespace poise::bench
