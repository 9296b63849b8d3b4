// extern "C" surface of the expert-MLP kernels for the Python benchmark (ctypes), plus the
// glue a full expert block needs around them: gathering token rows into expert-grouped order and
// the top-k combine. The glue kernels here are simple bench stand-ins for the dispatch/combine
// kernels of the EP data path; they are timed with the rest so the comparison covers the same work.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <string>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/ptx/grid_dependency.cuh"

namespace {

std::string g_last_error;
poise::sm90::GroupedRows g_rows;
poise::sm90::ExpertMlpShape g_shape;
poise::sm90::StreamedRows g_streamed;  // pb_set_problem's workspace for the streamed GEMMs

template <class Fn>
int guarded(Fn&& fn) {
  try {
    fn();
    return 0;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return -1;
  }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// The glue kernels launch as the GEMMs do (sm90::dependent_launch_allowed): each waits for its
// predecessor first thing and lets its successor be scheduled at once, so the successor's launch
// and setup overlap this kernel's last blocks.
template <class... Params, class... Args>
void launch_glue(void (*kernel)(Params...), unsigned grid, unsigned block, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.stream = stream;
  cudaLaunchAttribute attribute = poise::sm90::dependent_launch_attribute();
  config.attrs = &attribute;
  config.numAttrs = poise::sm90::dependent_launch_allowed() ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);  // errors: launch_check()
}

__device__ __forceinline__ void glue_kernel_begin() {
  poise::sm90::ptx::wait_for_prerequisite_grids();
  poise::sm90::ptx::allow_dependent_grids();
}

// Routing layout (the bench's stand-in for Poise's route stage): per-expert counts, offsets padded
// to 128 rows, the grouped row of every (token, k) and the score of every row, in two kernels over
// chunks of (token, k) entries (one CTA for all of them took ~50 us at Qwen3's 65536 entries).
// Rows of one expert are placed in atomic order (any order is a valid grouping).
constexpr int kLayoutThreads = 1024;
constexpr int kLayoutChunk = 4096;  // (token, k) entries per CTA
using LayoutScan = cub::BlockScan<int32_t, kLayoutThreads>;

// This CTA's chunk of (token, k) entries, [begin, end).
struct LayoutChunk {
  int64_t begin, end;
  __device__ explicit LayoutChunk(int64_t tk)
      : begin(blockIdx.x * int64_t(kLayoutChunk)), end(min(tk, blockIdx.x * int64_t(kLayoutChunk) + kLayoutChunk)) {}
};

// hist[e] = entries of expert e in the chunk (one shared-memory slot per thread; the CTA syncs).
__device__ void chunk_histogram(const int64_t* ids_TK, const LayoutChunk& chunk, int32_t* hist) {
  hist[threadIdx.x] = 0;
  __syncthreads();
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kLayoutThreads) atomicAdd(&hist[ids_TK[i]], 1);
  __syncthreads();
}

// counts_E[e] += entries of expert e in this CTA's chunk (counts_E zeroed before).
__global__ void __launch_bounds__(kLayoutThreads) expert_histogram_kernel(const int64_t* ids_TK, int64_t tk,
                                                                         int num_experts, int32_t* counts_E) {
  __shared__ int32_t hist[kLayoutThreads];
  glue_kernel_begin();
  chunk_histogram(ids_TK, LayoutChunk(tk), hist);
  if (threadIdx.x < num_experts && hist[threadIdx.x] > 0) atomicAdd(&counts_E[threadIdx.x], hist[threadIdx.x]);
}

// Every CTA scans the counts into padded offsets (CTA 0 writes them), claims a range of each
// expert's rows for its chunk (cursor_E zeroed before) and places its entries there; with
// token_of_row_R set it also writes each row's token (entry / top_k), for the fused combine.
__global__ void __launch_bounds__(kLayoutThreads) routing_rows_kernel(const int64_t* ids_TK, const float* scores_TK,
                                                                     int64_t tk, int num_experts,
                                                                     const int32_t* counts_E, int32_t* cursor_E,
                                                                     int32_t* offsets_E, int32_t* row_of_tk,
                                                                     float* scores_R, int64_t top_k,
                                                                     int32_t* token_of_row_R) {
  __shared__ int32_t hist[kLayoutThreads];
  glue_kernel_begin();
  __shared__ int32_t base[kLayoutThreads];
  __shared__ typename LayoutScan::TempStorage scan_storage;
  const int e = threadIdx.x;
  const int32_t count = e < num_experts ? counts_E[e] : 0;
  int32_t offset = 0;
  LayoutScan(scan_storage).ExclusiveSum((count + 127) / 128 * 128, offset);
  if (blockIdx.x == 0 && e < num_experts) offsets_E[e] = offset;
  const LayoutChunk chunk(tk);
  chunk_histogram(ids_TK, chunk, hist);
  if (e < num_experts) base[e] = offset + (hist[e] > 0 ? atomicAdd(&cursor_E[e], hist[e]) : 0);
  __syncthreads();
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += kLayoutThreads) {
    const int32_t row = atomicAdd(&base[ids_TK[i]], 1);
    row_of_tk[i] = row;
    scores_R[row] = scores_TK[i];
    if (token_of_row_R) token_of_row_R[row] = static_cast<int32_t>(i / top_k);
  }
}

// x_RD[row_of_tk[t*K + k]] = x_TD[t]: token rows into expert-grouped order (padding rows untouched).
// One block per token: its row is read once and written to its K rows (a block per (token, k)
// re-read the row K times and ran at ~2.4 TB/s, launch-bound at 16-byte-per-thread blocks).
constexpr int kMaxTopK = 64;
__global__ void scatter_rows_kernel(const int32_t* row_of_tk, int64_t K, int64_t D, const uint4* x_TD, uint4* x_RD) {
  __shared__ int32_t rows[kMaxTopK];
  glue_kernel_begin();
  const int64_t token = blockIdx.x;
  if (threadIdx.x < K) rows[threadIdx.x] = row_of_tk[token * K + threadIdx.x];
  __syncthreads();
  const int64_t vecs = D / 8;
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    const uint4 value = x_TD[token * vecs + v];
    for (int64_t k = 0; k < K; ++k) x_RD[rows[k] * vecs + v] = value;
  }
}

// out_TD[t] = sum_k y_RD[row_of_tk[t*K + k]] (weights were applied by the W2 epilogue), fp32 sum in
// k order. The K row loads of a column are issued together (unrolled by 8) for memory parallelism.
__global__ void combine_rows_kernel(const int32_t* row_of_tk, int64_t K, int64_t D, const uint4* y_RD, uint4* out_TD) {
  __shared__ int32_t rows[kMaxTopK];
  glue_kernel_begin();
  const int64_t t = blockIdx.x;
  if (threadIdx.x < K) rows[threadIdx.x] = row_of_tk[t * K + threadIdx.x];
  __syncthreads();
  const int64_t vecs = D / 8;
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k0 = 0; k0 < K; k0 += 8) {
      uint4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (k0 + k < K) v[k] = y_RD[static_cast<int64_t>(rows[k0 + k]) * vecs + i];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (k0 + k >= K) break;
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[2 * j] += __low2float(p[j]);
          acc[2 * j + 1] += __high2float(p[j]);
        }
      }
    }
    uint4 o;
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    out_TD[t * vecs + i] = o;
  }
}

// dst[i] = sum_p src[index[i]][p], p in order: the routing score's gradient of (token, k) from
// DGRAD W2's per-tile pieces of its row.
__global__ void gather_scalars_kernel(const int32_t* index, int64_t n, const float* src_RP, int64_t P, float* dst) {
  glue_kernel_begin();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  float sum = 0.0f;
  for (int64_t p = 0; p < P; ++p) sum += src_RP[index[i] * P + p];
  dst[i] = sum;
}

// slot = a new zeroed device buffer of `count` elements, the old one (if any) freed once the device
// is idle; false (slot unchanged, g_last_error set) on a CUDA error.
template <class T>
bool replace_with_zeroed(T*& slot, int64_t count, const char* what) {
  T* fresh = nullptr;
  cudaError_t e = slot ? cudaDeviceSynchronize() : cudaSuccess;
  if (e == cudaSuccess) e = cudaMalloc(&fresh, count * sizeof(T));
  if (e == cudaSuccess) e = cudaMemset(fresh, 0, count * sizeof(T));
  if (e != cudaSuccess) {
    if (fresh) cudaFree(fresh);
    g_last_error = std::string(what) + ": " + cudaGetErrorString(e);
    return false;
  }
  if (slot) cudaFree(slot);
  slot = fresh;
  return true;
}

int launch_check() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    g_last_error = cudaGetErrorString(e);
    return -1;
  }
  return 0;
}

}  // namespace

#if POISE_PHASE_PROFILE
namespace poise::sm90 {
void read_phase_profile(unsigned long long out[8]);
}
#endif
#if POISE_TILE_TIMELINE
namespace poise::sm90 {
void read_tile_timeline(unsigned long long* start_ns, unsigned long long* end_ns, unsigned int* what,
                        unsigned int* sm, int n);
}
#endif

extern "C" {

// Profiling builds (-DPOISE_PHASE_PROFILE=1): the kernels' cycle sums since the last call; else -1.
int pb_phase_profile(unsigned long long* out8) {
#if POISE_PHASE_PROFILE
  return guarded([&] { poise::sm90::read_phase_profile(out8); });
#else
  (void)out8;
  return -1;
#endif
}

// Timeline builds (-DPOISE_TILE_TIMELINE=1): the last launches' per-tile start / end / what / SM; else -1.
int pb_tile_timeline(unsigned long long* start_ns, unsigned long long* end_ns, unsigned int* what,
                     unsigned int* sm, int n) {
#if POISE_TILE_TIMELINE
  return guarded([&] { poise::sm90::read_tile_timeline(start_ns, end_ns, what, sm, n); });
#else
  (void)start_ns, (void)end_ns, (void)what, (void)sm, (void)n;
  return -1;
#endif
}

const char* pb_last_error() { return g_last_error.c_str(); }

int pb_set_problem(const int32_t* row_offsets_E, const int32_t* row_counts_E, int64_t num_experts,
                   int64_t max_rows, int64_t hidden_dim, int64_t intermediate_dim, int interleaved,
                   int clamped, float alpha, float limit) {
  // The GEMMs' tile counters (GroupedRows::tile_counters), as a Context's pipeline passes them;
  // without them the GEMMs would fall back to the static tile order, so a failure is an error.
  static int32_t* tile_counters = nullptr;
  if (!tile_counters && !replace_with_zeroed(tile_counters, 2, "pb_set_problem: tile counters")) return -1;
  // The streamed rows' words (sm90::StreamedRows), zero-initialised, grown with max_rows: one
  // workspace for the forward's x and the backward's grad_y, whose (gather, GEMM) pairs run in turn.
  static uint32_t* streamed_words = nullptr;
  static int64_t streamed_capacity = 0;
  const int64_t words = poise::sm90::streamed_rows_words(max_rows);
  if (words > streamed_capacity) {
    if (!replace_with_zeroed(streamed_words, words, "pb_set_problem: streamed rows words")) return -1;
    streamed_capacity = words;
  }
  g_streamed = {streamed_words};
  g_rows = {row_offsets_E, row_counts_E, num_experts, max_rows};
  g_rows.tile_counters = tile_counters;
  g_shape.hidden_dim = hidden_dim;
  g_shape.intermediate_dim = intermediate_dim;
  g_shape.w13_layout = interleaved ? poise::W13Layout::gate_up_interleaved : poise::W13Layout::gate_up_blocked;
  g_shape.activation = clamped ? poise::Activation::swiglu_clamped : poise::Activation::swiglu;
  g_shape.swiglu_alpha = alpha;
  g_shape.swiglu_limit = limit;
  return 0;
}

int pb_fprop_w13(const void* x, const void* w13, void* a, void* h13, void* stream) {
  return guarded([&] { poise::sm90::expert_mlp_fprop_w13(g_rows, g_shape, {x, w13, a, h13}, as_stream(stream)); });
}
// The streamed pair (sm90::gather_rows_streamed, then the GEMM over its rows while they arrive):
// dst_RD[r] = src_TD[token_of_row[r]] by `ctas` CTAs, then FPROP W13 (x) or DGRAD W2 (grad_y) next.
int pb_gather_rows_streamed(const int32_t* token_of_row, int64_t tokens, int64_t dim, const void* src_TD,
                            void* dst_RD, int ctas, void* stream) {
  return guarded([&] {
    poise::sm90::gather_rows_streamed(g_rows, {token_of_row, tokens, dim, src_TD, dst_RD, ctas}, g_streamed,
                                      as_stream(stream));
  });
}
int pb_fprop_w13_streamed(const void* x, const void* w13, void* a, void* h13, void* stream) {
  return guarded([&] {
    poise::sm90::FpropW13Args args{x, w13, a, h13};
    args.x_ready = g_streamed;
    poise::sm90::expert_mlp_fprop_w13(g_rows, g_shape, args, as_stream(stream));
  });
}
int pb_dgrad_w2_streamed(const void* grad_y, const void* w2, const void* h13, const float* scores, void* grad_h13,
                         void* a, float* grad_score_partials, void* stream) {
  return guarded([&] {
    poise::sm90::DgradW2Args args{grad_y, w2, h13, scores, grad_h13, a, grad_score_partials};
    args.grad_y_ready = g_streamed;
    poise::sm90::expert_mlp_dgrad_w2(g_rows, g_shape, args, as_stream(stream));
  });
}
int pb_fprop_w2(const void* a, const void* w2, const float* scores, void* y, void* stream) {
  return guarded([&] { poise::sm90::expert_mlp_fprop_w2(g_rows, g_shape, {a, w2, scores, y}, as_stream(stream)); });
}
// FPROP W2 / DGRAD W13 with the top-k combine fused: out_TD += the rows' results, added by token
// (sm90::FusedCombine).
int pb_fprop_w2_combine(const void* a, const void* w2, const float* scores, const int32_t* token_of_row,
                        int64_t tokens, void* out_TD, void* stream) {
  return guarded([&] {
    poise::sm90::FpropW2Args args{a, w2, scores, nullptr};
    args.combine = {out_TD, token_of_row, tokens};
    poise::sm90::expert_mlp_fprop_w2(g_rows, g_shape, args, as_stream(stream));
  });
}
int pb_dgrad_w13_combine(const void* grad_h13, const void* w13, const int32_t* token_of_row, int64_t tokens,
                         void* grad_x_TD, void* stream) {
  return guarded([&] {
    poise::sm90::DgradW13Args args{grad_h13, w13, nullptr};
    args.combine = {grad_x_TD, token_of_row, tokens};
    poise::sm90::expert_mlp_dgrad_w13(g_rows, g_shape, args, as_stream(stream));
  });
}
int pb_dgrad_w2(const void* grad_y, const void* w2, const void* h13, const float* scores, void* grad_h13,
                void* a, float* grad_score_partials, void* stream) {
  return guarded([&] {
    poise::sm90::expert_mlp_dgrad_w2(g_rows, g_shape, {grad_y, w2, h13, scores, grad_h13, a, grad_score_partials},
                                     as_stream(stream));
  });
}
int pb_dgrad_w13(const void* grad_h13, const void* w13, void* grad_x, void* stream) {
  return guarded([&] { poise::sm90::expert_mlp_dgrad_w13(g_rows, g_shape, {grad_h13, w13, grad_x}, as_stream(stream)); });
}
int pb_wgrad_w2(const void* grad_y, const void* a, void* grad_w2, int fp32, int accumulate, void* stream) {
  return guarded([&] {
    poise::sm90::expert_mlp_wgrad_w2(g_rows, g_shape, grad_y, a,
                                     {grad_w2, fp32 ? poise::DType::fp32 : poise::DType::bf16, accumulate != 0},
                                     as_stream(stream));
  });
}
int pb_wgrad_w13(const void* grad_h13, const void* x, void* grad_w13, int fp32, int accumulate, void* stream) {
  return guarded([&] {
    poise::sm90::expert_mlp_wgrad_w13(g_rows, g_shape, grad_h13, x,
                                      {grad_w13, fp32 ? poise::DType::fp32 : poise::DType::bf16, accumulate != 0},
                                      as_stream(stream));
  });
}

// WGRAD W2 / W13 with (part of) the backward's last glue as their side job (sm90::TokenCombine):
// grad_x = the top-k combine of DGRAD W13's rows, grad_scores = the sums of DGRAD W2's score pieces.
using WgradCall = void (*)(const poise::sm90::GroupedRows&, const poise::sm90::ExpertMlpShape&, const void*,
                          const void*, const poise::sm90::WgradOutput&, cudaStream_t,
                          const poise::sm90::TokenCombine&);
static int wgrad_with_combine(WgradCall wgrad, const void* a, const void* b, void* grad_w, int fp32, int accumulate,
                              const poise::sm90::TokenCombine& combine, void* stream) {
  return guarded([&] {
    wgrad(g_rows, g_shape, a, b, {grad_w, fp32 ? poise::DType::fp32 : poise::DType::bf16, accumulate != 0},
          as_stream(stream), combine);
  });
}
int pb_wgrad_w2_combine(const void* grad_y, const void* a, void* grad_w2, int fp32, int accumulate,
                        const int32_t* row_of_tk, int64_t tokens, int64_t top_k, const void* rows_RD, void* out_TD,
                        const float* partials_RP, int64_t partials, float* sums_TK, void* stream) {
  return wgrad_with_combine(poise::sm90::expert_mlp_wgrad_w2, grad_y, a, grad_w2, fp32, accumulate,
                            {row_of_tk, tokens, top_k, rows_RD, out_TD, partials_RP, partials, sums_TK}, stream);
}
int pb_wgrad_w13_combine(const void* grad_h13, const void* x, void* grad_w13, int fp32, int accumulate,
                         const int32_t* row_of_tk, int64_t tokens, int64_t top_k, const void* rows_RD, void* out_TD,
                         const float* partials_RP, int64_t partials, float* sums_TK, void* stream) {
  return wgrad_with_combine(poise::sm90::expert_mlp_wgrad_w13, grad_h13, x, grad_w13, fp32, accumulate,
                            {row_of_tk, tokens, top_k, rows_RD, out_TD, partials_RP, partials, sums_TK}, stream);
}

// token_of_row_R: nullable, int32 [R] (rows no entry lands on are not written).
int pb_routing_layout(const int64_t* ids_TK, const float* scores_TK, int64_t tk, int64_t num_experts,
                      int32_t* counts_E, int32_t* offsets_E, int32_t* row_of_tk, float* scores_R, int64_t top_k,
                      int32_t* token_of_row_R, void* stream) {
  if (num_experts > kLayoutThreads) {
    g_last_error = "pb_routing_layout: at most 1024 experts";
    return -1;
  }
  if (top_k < 1 || tk % top_k != 0) {
    g_last_error = "pb_routing_layout: top_k must be positive and divide tk";
    return -1;
  }
  static int32_t* cursor_E = nullptr;  // scratch, kLayoutThreads entries, allocated once
  if (!cursor_E && cudaMalloc(&cursor_E, kLayoutThreads * sizeof(int32_t)) != cudaSuccess) return launch_check();
  cudaStream_t s = as_stream(stream);
  const unsigned chunks = static_cast<unsigned>((tk + kLayoutChunk - 1) / kLayoutChunk);
  const int experts = static_cast<int>(num_experts);
  cudaMemsetAsync(counts_E, 0, num_experts * sizeof(int32_t), s);
  cudaMemsetAsync(cursor_E, 0, num_experts * sizeof(int32_t), s);
  if (chunks > 0) {
    launch_glue(expert_histogram_kernel, chunks, kLayoutThreads, s, ids_TK, tk, experts, counts_E);
    launch_glue(routing_rows_kernel, chunks, kLayoutThreads, s, ids_TK, scores_TK, tk, experts, counts_E, cursor_E,
                offsets_E, row_of_tk, scores_R, top_k, token_of_row_R);
  } else {
    cudaMemsetAsync(offsets_E, 0, num_experts * sizeof(int32_t), s);
  }
  return launch_check();
}
int pb_scatter_rows(const int32_t* row_of_tk, int64_t tk, int64_t K, int64_t D, const void* x_TD, void* x_RD,
                    void* stream) {
  if (K < 1 || K > kMaxTopK || tk % K != 0) {
    g_last_error = "scatter_rows: K must be in [1, 64] and divide tk";
    return -1;
  }
  launch_glue(scatter_rows_kernel, static_cast<unsigned>(tk / K), 256, as_stream(stream), row_of_tk, K, D,
              static_cast<const uint4*>(x_TD), static_cast<uint4*>(x_RD));
  return launch_check();
}
int pb_combine_rows(const int32_t* row_of_tk, int64_t T, int64_t K, int64_t D, const void* y_RD, void* out_TD,
                    void* stream) {
  if (K < 1 || K > kMaxTopK) {
    g_last_error = "combine_rows: K must be in [1, 64]";
    return -1;
  }
  launch_glue(combine_rows_kernel, static_cast<unsigned>(T), 256, as_stream(stream), row_of_tk, K, D,
              static_cast<const uint4*>(y_RD), static_cast<uint4*>(out_TD));
  return launch_check();
}
int64_t pb_score_partials(int64_t intermediate_dim) {
  poise::sm90::ExpertMlpShape shape;
  shape.intermediate_dim = intermediate_dim;
  return poise::sm90::dgrad_w2_score_partials(shape);
}

int pb_gather_scalars(const int32_t* index, int64_t n, const float* src_RP, int64_t P, float* dst, void* stream) {
  launch_glue(gather_scalars_kernel, static_cast<unsigned>((n + 255) / 256), 256, as_stream(stream), index, n,
              src_RP, P, dst);
  return launch_check();
}

}  // extern "C"
