// Host-side support for the expert-MLP GPU tests: bf16 bits, random data, device buffers,
// expert-grouped row layouts, float64 references and error norms.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace poise::test {

inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// ---- bf16 on the host (round to nearest even) ----
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline constexpr uint16_t kBf16Poison = 0x7fc0;      // NaN
inline constexpr uint32_t kFp32PoisonBits = 0x7fc00000u;
inline float fp32_poison() { float f; std::memcpy(&f, &kFp32PoisonBits, 4); return f; }

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) { cuda_ok(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc"); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) {
    cuda_ok(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    cuda_ok(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
};

// ---- expert-grouped row layout ----
struct RowLayout {
  std::vector<int32_t> counts, offsets;
  int64_t rows = 0;  // R: padded groups + one spare 128-row block that nobody owns
  bool is_row_valid(int64_t r) const {
    for (size_t e = 0; e < counts.size(); ++e)
      if (r >= offsets[e] && r < offsets[e] + counts[e]) return true;
    return false;
  }
};
inline RowLayout make_layout(const std::vector<int32_t>& counts) {
  RowLayout l;
  l.counts = counts;
  int64_t off = 0;
  for (int32_t c : counts) {
    l.offsets.push_back(static_cast<int32_t>(off));
    off += (c + 127) / 128 * 128;
  }
  l.rows = off + 128;
  return l;
}

// ---- random data ----
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  std::vector<uint16_t> bf16_normal(size_t n, float stddev) {
    std::normal_distribution<float> d(0.0f, stddev);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = to_bf16(d(gen));
    return v;
  }
  std::vector<float> uniform(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(gen);
    return v;
  }
};

// Rows that no expert owns (padding, spare) are set to NaN: they must never reach a result.
inline void poison_padding_rows(std::vector<uint16_t>& rows_RC, const RowLayout& l, int64_t cols) {
  for (int64_t r = 0; r < l.rows; ++r)
    if (!l.is_row_valid(r))
      for (int64_t c = 0; c < cols; ++c) rows_RC[r * cols + c] = kBf16Poison;
}

inline void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] { for (int64_t i = w; i < n; i += workers) fn(i); });
  for (auto& t : pool) t.join();
}

// ---- float64 activation semantics (must match src/reference) ----
struct Act {
  bool clamped = false;
  double alpha = 1.702, limit = 7.0;
};
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double act_forward(double g, double u, const Act& p) {
  if (p.clamped) {
    const double gc = std::min(g, p.limit), uc = std::min(std::max(u, -p.limit), p.limit);
    return gc * sigmoid(p.alpha * gc) * (uc + 1.0);
  }
  return g * sigmoid(g) * u;
}
inline void act_backward(double g, double u, double ga, const Act& p, double& dg, double& du) {
  if (p.clamped) {
    const double gc = std::min(g, p.limit), uc = std::min(std::max(u, -p.limit), p.limit);
    const double s = sigmoid(p.alpha * gc);
    dg = g <= p.limit ? ga * (uc + 1.0) * (s + p.alpha * gc * s * (1.0 - s)) : 0.0;
    du = (u >= -p.limit && u <= p.limit) ? ga * gc * s : 0.0;
    return;
  }
  const double s = sigmoid(g);
  dg = ga * u * (s + g * s * (1.0 - s));
  du = ga * g * s;
}

// ---- comparison ----
struct Comparison {
  double rel_error = 0.0;   // ||out - ref|| / ||ref|| over the compared elements
  int64_t non_finite = 0;   // compared elements that are NaN/Inf
  int64_t compared = 0;
  int64_t poison_lost = 0;  // elements that had to keep the poison but were written
  std::string describe() const {
    return "rel_error=" + std::to_string(rel_error) + " non_finite=" + std::to_string(non_finite) +
           " compared=" + std::to_string(compared) + " poison_lost=" + std::to_string(poison_lost);
  }
};
struct ErrorAccumulator {
  double diff2 = 0, ref2 = 0;
  Comparison c;
  void add(double out, double ref) {
    ++c.compared;
    if (!std::isfinite(out)) { ++c.non_finite; return; }
    diff2 += (out - ref) * (out - ref);
    ref2 += ref * ref;
  }
  Comparison finish() {
    c.rel_error = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    return c;
  }
};

}  // namespace poise::test
