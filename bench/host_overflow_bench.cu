// What a row costs when it spills to host memory (issue 39): rows of x (bf16, D = 7168: DeepSeek-V3's
// hidden size) copied by a kernel out of and into a runtime::HostBackedRange, its device part against
// its host part, as dispatch writes received rows and the W13 GEMM reads them.
//
//   host_overflow_bench [--out results.json] [--rows 16384] [--hidden 7168] [--iters 10]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/host_backed_range.hpp"

namespace {

__global__ void copy_rows(const int4* src, int4* dst, int64_t rows, int64_t row_vectors) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    for (int64_t v = threadIdx.x; v < row_vectors; v += blockDim.x) dst[r * row_vectors + v] = src[r * row_vectors + v];
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median milliseconds of `iters` copies of `rows` rows from src to dst.
double median_ms(const void* src, void* dst, int64_t rows, int64_t row_bytes, int iters) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> ms(iters);
  for (int i = -2; i < iters; ++i) {  // two warm-up copies
    check(cudaEventRecord(start), "record");
    copy_rows<<<264, 512>>>(static_cast<const int4*>(src), static_cast<int4*>(dst), rows, row_bytes / 16);
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    if (i >= 0) check(cudaEventElapsedTime(&ms[i], start, stop), "elapsed");
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = "host_overflow_h200.json";
  int64_t rows = 16384, hidden = 7168;
  int iters = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--out") out = argv[i + 1];
    else if (arg == "--rows") rows = std::atoll(argv[i + 1]);
    else if (arg == "--hidden") hidden = std::atoll(argv[i + 1]);
    else if (arg == "--iters") iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--out results.json] [--rows 16384] [--hidden 7168] [--iters 10]\n", argv[0]);
      return 2;
    }
  }
  const int64_t row_bytes = hidden * 2;
  const size_t part = size_t(rows * row_bytes);
  poise::runtime::HostBackedRange range(0, part, part);
  void* device_rows = nullptr;  // a plain allocation: the other end of every copy
  check(cudaMalloc(&device_rows, part), "cudaMalloc");
  auto* base = static_cast<char*>(range.data());
  char* host_part = base + range.device_part_bytes();
  check(cudaMemset(base, 1, range.device_part_bytes() + range.host_part_bytes()), "memset");
  struct Case { const char* name; const void* src; void* dst; } cases[] = {
      {"read_device_part", base, device_rows},  {"read_host_part", host_part, device_rows},
      {"write_device_part", device_rows, base}, {"write_host_part", device_rows, host_part}};
  std::string json = "{\"benchmark\": \"host_overflow\", \"commit\": \"" +
                     std::string(std::getenv("POISE_COMMIT") ? std::getenv("POISE_COMMIT") : "unknown") +
                     "\", \"rows\": " + std::to_string(rows) + ", \"row_bytes\": " + std::to_string(row_bytes) +
                     ", \"host_location\": \"" +
                     (range.host_location() == poise::runtime::HostLocation::host ? "host" : "host_numa") +
                     "\", \"results\": {";
  for (size_t c = 0; c < 4; ++c) {
    const double ms = median_ms(cases[c].src, cases[c].dst, rows, row_bytes, iters);
    const double gb_per_s = double(part) / (ms * 1e-3) / 1e9, us_per_row = ms * 1e3 / double(rows);
    std::printf("%-18s %8.3f ms  %8.1f GB/s  %8.4f us per row of %lld bytes\n", cases[c].name, ms, gb_per_s,
                us_per_row, static_cast<long long>(row_bytes));
    json += std::string(c ? ", " : "") + "\"" + cases[c].name + "\": {\"ms\": " + std::to_string(ms) +
            ", \"gb_per_s\": " + std::to_string(gb_per_s) + ", \"us_per_row\": " + std::to_string(us_per_row) + "}";
  }
  json += "}}\n";
  std::ofstream(out) << json;
  std::printf("wrote %s\n", out.c_str());
  cudaFree(device_rows);
  return 0;
}
