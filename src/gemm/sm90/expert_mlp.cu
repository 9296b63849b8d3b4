// Host launchers of the expert-MLP kernels: validate, build TMA descriptors, launch.
#include "gemm/sm90/expert_mlp.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gemm/sm90/epilogues.cuh"
#include "gemm/sm90/grouped_gemm.cuh"
#include "gemm/sm90/row_gather.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "poise/errors.hpp"

namespace poise::sm90 {
namespace {

constexpr int kBlockN = 256;
// 4 stages of 48 KiB fill shared memory next to at most one staging buffer per consumer (the
// SwiGLU epilogues stage in ring stages instead).
constexpr int kStages = 4;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw DeviceError(std::string(what) + ": " + cudaGetErrorString(err));
}

void require(bool ok, const char* name, const char* rule) {
  if (!ok) throw InvalidArgument(name, rule);
}

// The groups every kernel over grouped rows walks (the GEMMs and the streamed gather).
void validate_row_groups(const GroupedRows& rows) {
  require(rows.num_experts >= 1 && rows.num_experts <= kMaxExperts, "num_experts",
          "must be in [1, 1024]");
  require(rows.row_offsets_E != nullptr, "row_offsets_E", "must be a device pointer");
  require(rows.row_counts_E != nullptr, "row_counts_E", "must be a device pointer");
  require(rows.max_rows >= 0 && rows.max_rows < (int64_t{1} << 31), "max_rows",
          "must be in [0, 2^31)");
}

void validate(const GroupedRows& rows, const ExpertMlpShape& shape) {
  validate_row_groups(rows);
  require(shape.hidden_dim > 0 && shape.hidden_dim % 64 == 0, "hidden_dim",
          "must be a positive multiple of 64");
  require(shape.intermediate_dim > 0 && shape.intermediate_dim % 64 == 0, "intermediate_dim",
          "must be a positive multiple of 64");
  require(shape.hidden_dim < (1 << 20) && shape.intermediate_dim < (1 << 20), "hidden_dim",
          "D and F must be below 2^20");
  require(rows.num_experts * 2 * shape.intermediate_dim < (int64_t{1} << 31) &&
              rows.num_experts * shape.hidden_dim < (int64_t{1} << 31),
          "num_experts", "E*2F and E*D must fit in int32 (TMA coordinates)");
  if (shape.activation == Activation::swiglu_clamped)
    require(shape.swiglu_limit > 0.0f, "swiglu_limit", "must be positive");
  require(rows.first_replica >= -1 && rows.first_replica <= rows.num_experts, "first_replica",
          "must be -1 (no replicas) or in [0, num_experts]");
  require(reinterpret_cast<uintptr_t>(rows.tile_counters) % alignof(int32_t) == 0, "tile_counters",
          "must be null or a 4-byte aligned device pointer");
}

// POISE_SM90_TILE_ORDER=static: ignore GroupedRows::tile_counters (A/B measurements).
bool dynamic_tile_order() {
  static const bool dynamic = [] {
    const char* v = std::getenv("POISE_SM90_TILE_ORDER");
    return !(v && std::strcmp(v, "static") == 0);
  }();
  return dynamic;
}

// Experts whose weights come from the main pointers, and replica experts after them.
int64_t own_experts(const GroupedRows& rows) { return rows.first_replica < 0 ? rows.num_experts : rows.first_replica; }
int64_t replica_experts(const GroupedRows& rows) { return rows.num_experts - own_experts(rows); }

void require_ptr(const void* p, const char* name) { require(p != nullptr, name, "must not be null"); }

// The row where h13 switches buffers (max_rows: never).
int32_t h13_split_row(const GroupedRows& rows, const H13Split& split) {
  if (split.split_row < 0) return static_cast<int32_t>(rows.max_rows);
  require(split.split_row % 128 == 0 && split.split_row <= rows.max_rows, "h13_split.split_row",
          "must be -1 or a multiple of 128 in [0, max_rows]");
  require(split.hi_R2F != nullptr, "h13_split.hi_R2F", "must not be null when split_row is set");
  return static_cast<int32_t>(split.split_row);
}
// A replica-side pointer is needed only when there are replicas.
void require_replica_ptr(const GroupedRows& rows, const void* p, const char* name) {
  if (replica_experts(rows) > 0) require_ptr(p, name);
}

ActivationParams activation_params(const ExpertMlpShape& shape) {
  ActivationParams p;
  p.clamped = shape.activation == Activation::swiglu_clamped ? 1 : 0;
  p.alpha = shape.swiglu_alpha;
  p.limit = shape.swiglu_limit;
  return p;
}

int sm_count() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  return sms;
}

GroupedGemmShape base_shape(const GroupedRows& rows) {
  GroupedGemmShape s;
  s.row_offsets_E = rows.row_offsets_E;
  s.row_counts_E = rows.row_counts_E;
  s.num_experts = static_cast<int32_t>(rows.num_experts);
  s.first_replica = static_cast<int32_t>(own_experts(rows));
  s.tile_counters = dynamic_tile_order() ? rows.tile_counters : nullptr;  // used by rows-as-M GEMMs
  return s;
}

// TMA maps of a per-expert weight tensor: the own experts' and the replicas' (the same map when
// one side is empty, so the kernel always gets a valid descriptor).
struct WeightMaps {
  CUtensorMap own, replicas;
};
WeightMaps weight_maps(const GroupedRows& rows, const void* w, const char* name, const void* replica_w,
                       const char* replica_name, int64_t rows_per_expert, int64_t cols, int box_rows) {
  const int64_t own = own_experts(rows), replicas = replica_experts(rows);
  WeightMaps m;
  if (own > 0) m.own = make_bf16_tensor_map(w, own * rows_per_expert, cols, box_rows, name);
  if (replicas > 0) {
    m.replicas = make_bf16_tensor_map(replica_w, replicas * rows_per_expert, cols, box_rows, replica_name);
  }
  if (own == 0) m.own = m.replicas;
  if (replicas == 0) m.replicas = m.own;
  return m;
}

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

// CTAs per cluster where the epilogue's kernel gains from clusters (Epilogue::kPairedTiles): tile
// pairs (2, the default) sharing an operand by multicast; POISE_SM90_CLUSTER=1 or 4 (quads, rows-as-M
// GEMMs only, sharing both operands) for A/B measurements. Quads are not the default: 30 fit on the
// H200 (120 of 132 SMs), and in sustained running they were slower than pairs on every GEMM
// measured (DeepSeek-V3 fprop W13 569 vs 601 TFLOP/s, fprop W2 560 vs 579; Qwen3 fprop W13 468 vs
// 501; power probe, two interleaved rounds, performance.md v17): the quarter less L2 -> SM traffic
// per CTA does not pay for the lost SMs and the 3-CTA coupling.
int cluster_size() {
  static const int size = [] {
    const char* v = std::getenv("POISE_SM90_CLUSTER");
    for (const char* c : {"1", "4"})
      if (v && std::strcmp(v, c) == 0) return *c - '0';
    return 2;
  }();
  return size;
}

template <int kCluster, RowsAre kRows, bool kBMnMajor, class Epilogue>
void launch_clustered(const CUtensorMap& map_a, const WeightMaps& map_b, const GroupedGemmShape& shape,
                      const Epilogue& epilogue, cudaStream_t stream) {
  static_assert(Epilogue::kStagingBuffers <= 1, "4 stages leave room for one staging buffer per consumer");
  auto kernel = grouped_gemm_kernel<kBlockN, kStages, kRows, kBMnMajor, Epilogue, kCluster>;
  constexpr uint32_t smem =
      GroupedGemmSmem<kBlockN, kStages, Epilogue::kStagingBuffers, kRows == RowsAre::K ? kSideBytes : 0>::kTotalBytes;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(grouped_gemm_kernel)");
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kThreadsPerCta);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = kCluster;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1] = dependent_launch_attribute();
  config.attrs = attributes;
  config.numAttrs = 1;  // the occupancy query below sees the cluster shape only
  // Persistent: as many clusters as fit at once (one CTA per SM; pairs must share a GPC).
  int clusters = sm_count() / kCluster;
  if constexpr (kCluster > 1) {
    config.gridDim = dim3(clusters * kCluster);
    check_cuda(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), "cudaOccupancyMaxActiveClusters");
    if (clusters < 1) throw DeviceError("grouped_gemm_kernel: no cluster of " + std::to_string(kCluster) +
                                        " CTAs fits on this device");
  }
  config.gridDim = dim3(clusters * kCluster);
  if (dependent_launch_allowed()) config.numAttrs = 2;
  if (std::getenv("POISE_SM90_DEBUG")) {
    static bool printed = false;
    if (!printed) std::fprintf(stderr, "grouped_gemm_kernel: %d clusters of %d CTAs\n", clusters, kCluster);
    printed = true;
  }
  check_cuda(cudaLaunchKernelEx(&config, kernel, map_a, map_b.own, map_b.replicas, shape, epilogue),
             "grouped_gemm_kernel launch");
}

template <RowsAre kRows, bool kBMnMajor, class Epilogue>
void launch(const CUtensorMap& map_a, const WeightMaps& map_b, const GroupedGemmShape& shape,
            const Epilogue& epilogue, cudaStream_t stream) {
  if constexpr (Epilogue::kPairedTiles) {
    if constexpr (kRows == RowsAre::M) {
      if (cluster_size() == 4) return launch_clustered<4, kRows, kBMnMajor>(map_a, map_b, shape, epilogue, stream);
    }
    if (cluster_size() > 1) return launch_clustered<2, kRows, kBMnMajor>(map_a, map_b, shape, epilogue, stream);
  }
  launch_clustered<1, kRows, kBMnMajor>(map_a, map_b, shape, epilogue, stream);
}

__nv_bfloat16* bf16(void* p) { return static_cast<__nv_bfloat16*>(p); }

// Fprop and dgrad GEMMs run over the routed rows: A = [R][K] rows (read in 64-row boxes),
// B = E weight blocks of b_rows_per_expert rows each, N output columns in n_tile-wide tiles.
CUtensorMap rows_operand_map(const void* a_RK, const GroupedRows& rows, int64_t K, const char* name) {
  return make_bf16_tensor_map(a_RK, rows.max_rows, K, kTileM / 2, name);  // a tile's A is two 64-row boxes
}

GroupedGemmShape rows_gemm_shape(const GroupedRows& rows, int64_t K, int64_t b_rows_per_expert, int64_t N,
                                 int64_t n_tile) {
  GroupedGemmShape s = base_shape(rows);
  s.k_blocks = static_cast<int32_t>(K / kTileK);
  s.n_blocks = ceil_div(N, n_tile);
  s.b_rows_per_expert = static_cast<int32_t>(b_rows_per_expert);
  return s;
}

// Rows output [R][N] (bf16), optionally scaled by a per-row score.
RowsStoreEpilogue rows_store_epilogue(void* out_RN, const char* name, const float* scores_R,
                                      const GroupedRows& rows, int64_t N) {
  return RowsStoreEpilogue{make_store_tensor_map(out_RN, false, rows.max_rows, N, name),
                           bf16(out_RN), scores_R, static_cast<int32_t>(N)};
}

// The rows output of FPROP W2 / DGRAD W13: grouped rows, (combine.out_TD set) added by token, or
// (scatter.row_origin_R set) stored to slots.
void validate_rows_output(const void* rows_RD, const char* rows_name, const FusedCombine& combine,
                          const RowScatter& scatter, int64_t D) {
  if (scatter.row_origin_R) {
    require(rows_RD == nullptr, rows_name, "must be null when scatter.row_origin_R is set (the rows go to slots)");
    require(combine.out_TD == nullptr, "combine.out_TD", "must be null when scatter.row_origin_R is set");
    require_ptr(scatter.owner_bases, "scatter.owner_bases");
    require(scatter.slot_offset >= 0 && scatter.slot_offset % 16 == 0 && (D * 2) % 16 == 0, "scatter.slot_offset",
            "must be >= 0 and, like a row's D * 2 bytes, a multiple of 16");
    require(scatter.slots_per_owner >= 1 && scatter.slots_per_owner < (int64_t{1} << 31), "scatter.slots_per_owner",
            "must be in [1, 2^31)");
    require(scatter.owners >= 1 && scatter.owners * scatter.slots_per_owner < (int64_t{1} << 31), "scatter.owners",
            "must be >= 1 with owners * slots_per_owner < 2^31");
    return;
  }
  if (!combine.out_TD) {
    require_ptr(rows_RD, rows_name);
    return;
  }
  require(rows_RD == nullptr, rows_name, "must be null when combine.out_TD is set (the fused combine stores no rows)");
  require(reinterpret_cast<uintptr_t>(combine.out_TD) % 16 == 0, "combine.out_TD", "must be 16-byte aligned");
  require_ptr(combine.token_of_row_R, "combine.token_of_row_R");
  require(combine.tokens >= 1 && combine.tokens < (int64_t{1} << 31), "combine.tokens",
          "must be in [1, 2^31) with combine.out_TD");
}

// A rows GEMM's streamed A operand (StreamedRows), checked; null when not streamed.
uint32_t* streamed_rows_words(const StreamedRows& ready, const char* name) {
  require(reinterpret_cast<uintptr_t>(ready.words) % alignof(uint32_t) == 0, name,
          "must be null or a 4-byte aligned device pointer");
  return ready.words;
}

RowsScatterEpilogue rows_scatter_epilogue(const RowScatter& scatter, const float* scores_R, int64_t N) {
  RowsScatterEpilogue epi{};
  epi.scores_R = scores_R;  // the base's rows pointer and TMA map are not used
  epi.N = static_cast<int32_t>(N);
  epi.row_origin_R = scatter.row_origin_R;
  epi.owner_bases = scatter.owner_bases;
  epi.slot_offset = scatter.slot_offset;
  epi.slots_per_owner = static_cast<int32_t>(scatter.slots_per_owner);
  epi.origins = static_cast<int32_t>(scatter.owners * scatter.slots_per_owner);
  return epi;
}

RowsCombineEpilogue rows_combine_epilogue(const FusedCombine& combine, const float* scores_R, int64_t N) {
  RowsCombineEpilogue epi{};
  epi.out_RN = bf16(combine.out_TD);  // token rows; the base's TMA map is not used
  epi.scores_R = scores_R;
  epi.N = static_cast<int32_t>(N);
  epi.token_of_row_R = combine.token_of_row_R;
  epi.tokens = static_cast<int32_t>(combine.tokens);
  return epi;
}

}  // namespace

void expert_mlp_fprop_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const FpropW13Args& args, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.x_RD, "x_RD");
  require_ptr(args.w13_E2FD, "w13_E2FD");
  require_ptr(args.a_RF, "a_RF");
  require_replica_ptr(rows, args.replica_w13_E2FD, "replica_w13_E2FD");
  uint32_t* const x_streamed = streamed_rows_words(args.x_ready, "x_ready.words");
  if (rows.max_rows == 0) return;
  const int32_t split = h13_split_row(rows, args.h13_split);  // checked before any descriptor
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const bool blocked = shape.w13_layout == W13Layout::gate_up_blocked;
  const CUtensorMap map_a = rows_operand_map(args.x_RD, rows, D, "x_RD");
  const WeightMaps map_b = weight_maps(rows, args.w13_E2FD, "w13_E2FD", args.replica_w13_E2FD, "replica_w13_E2FD",
                                       2 * F, D, kBlockN / 2);
  GroupedGemmShape s = rows_gemm_shape(rows, D, 2 * F, F, kBlockN / 2);
  s.b_split_rows = blocked ? static_cast<int32_t>(F) : 0;
  s.streamed_rows = x_streamed;
  const CUtensorMap a_map = make_store_tensor_map(args.a_RF, false, rows.max_rows, F, "a_RF");
  // The low buffer holds rows [0, split) only: its map must not reach past them.
  const CUtensorMap h13_map =
      split > 0 ? make_store_tensor_map(args.h13_R2F, false, split, 2 * F, "h13_R2F") : CUtensorMap{};
  const CUtensorMap h13_hi_map =
      split < rows.max_rows
          ? make_store_tensor_map(args.h13_split.hi_R2F, false, rows.max_rows, 2 * F, "h13_split.hi_R2F")
          : CUtensorMap{};
  auto run = [&](auto epi) {
    epi.a_map = a_map;
    epi.h13_map = h13_map;
    epi.h13_hi_map = h13_hi_map;
    epi.a_RF = bf16(args.a_RF);
    epi.h13_R2F = bf16(args.h13_R2F);
    epi.h13_hi_R2F = static_cast<__nv_bfloat16*>(const_cast<void*>(args.h13_split.hi_R2F));
    epi.h13_split = split;
    epi.F = static_cast<int32_t>(F);
    epi.act = activation_params(shape);
    launch<RowsAre::M, false>(map_a, map_b, s, epi, stream);
  };
  if (blocked) run(SwigluFpropEpilogue<false>{});
  else run(SwigluFpropEpilogue<true>{});
}

void expert_mlp_fprop_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const FpropW2Args& args, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.a_RF, "a_RF");
  require_ptr(args.w2_EDF, "w2_EDF");
  validate_rows_output(args.y_RD, "y_RD", args.combine, args.scatter, shape.hidden_dim);
  require_replica_ptr(rows, args.replica_w2_EDF, "replica_w2_EDF");
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.a_RF, rows, F, "a_RF");
  const WeightMaps map_b =
      weight_maps(rows, args.w2_EDF, "w2_EDF", args.replica_w2_EDF, "replica_w2_EDF", D, F, kBlockN / 2);
  const GroupedGemmShape s = rows_gemm_shape(rows, F, D, D, kBlockN);
  if (args.scatter.row_origin_R) {
    launch<RowsAre::M, false>(map_a, map_b, s, rows_scatter_epilogue(args.scatter, args.scores_R, D), stream);
  } else if (args.combine.out_TD) {
    launch<RowsAre::M, false>(map_a, map_b, s, rows_combine_epilogue(args.combine, args.scores_R, D), stream);
  } else {
    launch<RowsAre::M, false>(map_a, map_b, s, rows_store_epilogue(args.y_RD, "y_RD", args.scores_R, rows, D), stream);
  }
}

void expert_mlp_dgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const DgradW2Args& args, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.grad_y_RD, "grad_y_RD");
  require_ptr(args.w2_EDF, "w2_EDF");
  require_ptr(args.h13_R2F, "h13_R2F");
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  require_replica_ptr(rows, args.replica_w2_EDF, "replica_w2_EDF");
  uint32_t* const grad_y_streamed = streamed_rows_words(args.grad_y_ready, "grad_y_ready.words");
  if (rows.max_rows == 0) return;
  const int32_t split = h13_split_row(rows, args.h13_split);  // checked before any descriptor
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.grad_y_RD, rows, D, "grad_y_RD");
  // W2[e] is [D][F]: K = D rows, N = F contiguous -> MN-major B, 64 x 64 boxes.
  const WeightMaps map_b = weight_maps(rows, args.w2_EDF, "w2_EDF", args.replica_w2_EDF, "replica_w2_EDF", D, F, 64);
  GroupedGemmShape s = rows_gemm_shape(rows, D, D, F, kBlockN);
  s.streamed_rows = grad_y_streamed;
  auto run = [&](auto epi) {
    // h13 is read by the producer in 64 x 64 boxes; the low buffer's map must not reach past its rows.
    if (split > 0) epi.h13_map = make_bf16_tensor_map(args.h13_R2F, split, 2 * F, 64, "h13_R2F");
    if (split < rows.max_rows)
      epi.h13_hi_map = make_bf16_tensor_map(args.h13_split.hi_R2F, rows.max_rows, 2 * F, 64, "h13_split.hi_R2F");
    epi.grad_h13_map = make_store_tensor_map(args.grad_h13_R2F, false, rows.max_rows, 2 * F, "grad_h13_R2F");
    epi.a_map = make_store_tensor_map(args.a_RF, false, rows.max_rows, F, "a_RF");
    epi.h13_split = split;
    epi.grad_h13_R2F = bf16(args.grad_h13_R2F);
    epi.a_RF = bf16(args.a_RF);
    epi.scores_R = args.scores_R;
    epi.grad_score_partials_RP = args.grad_score_partials_RP;
    epi.score_partials = static_cast<int32_t>(dgrad_w2_score_partials(shape));
    epi.F = static_cast<int32_t>(F);
    epi.act = activation_params(shape);
    launch<RowsAre::M, true>(map_a, map_b, s, epi, stream);
  };
  if (shape.w13_layout == W13Layout::gate_up_blocked) run(SwigluDgradEpilogue<false>{});
  else run(SwigluDgradEpilogue<true>{});
}

int64_t dgrad_w2_score_partials(const ExpertMlpShape& shape) {
  return ceil_div(shape.intermediate_dim, kBlockN);
}

void expert_mlp_dgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const DgradW13Args& args, cudaStream_t stream) {
  validate(rows, shape);
  require_ptr(args.grad_h13_R2F, "grad_h13_R2F");
  require_ptr(args.w13_E2FD, "w13_E2FD");
  validate_rows_output(args.grad_x_RD, "grad_x_RD", args.combine, args.scatter, shape.hidden_dim);
  require_replica_ptr(rows, args.replica_w13_E2FD, "replica_w13_E2FD");
  if (rows.max_rows == 0) return;
  const int64_t D = shape.hidden_dim, F = shape.intermediate_dim;
  const CUtensorMap map_a = rows_operand_map(args.grad_h13_R2F, rows, 2 * F, "grad_h13_R2F");
  // W13[e] is [2F][D]: K = 2F rows, N = D contiguous -> MN-major B.
  const WeightMaps map_b =
      weight_maps(rows, args.w13_E2FD, "w13_E2FD", args.replica_w13_E2FD, "replica_w13_E2FD", 2 * F, D, 64);
  const GroupedGemmShape s = rows_gemm_shape(rows, 2 * F, 2 * F, D, kBlockN);
  if (args.scatter.row_origin_R) {
    launch<RowsAre::M, true>(map_a, map_b, s, rows_scatter_epilogue(args.scatter, nullptr, D), stream);
  } else if (args.combine.out_TD) {
    launch<RowsAre::M, true>(map_a, map_b, s, rows_combine_epilogue(args.combine, nullptr, D), stream);
  } else {
    launch<RowsAre::M, true>(map_a, map_b, s, rows_store_epilogue(args.grad_x_RD, "grad_x_RD", nullptr, rows, D), stream);
  }
}

namespace {

// The side job's device form (validated: the names are TokenCombine's fields).
TokenCombineJob combine_job(const GroupedRows& rows, const ExpertMlpShape& shape, const TokenCombine& c) {
  TokenCombineJob job;
  if (c.out_TD == nullptr) return job;
  require_ptr(c.row_of_tk, "combine.row_of_tk");
  require_ptr(c.rows_RD, "combine.rows_RD");
  require(c.top_k >= 1 && c.top_k <= 16, "combine.top_k", "must be in [1, 16]");
  const int64_t row_bytes = 2 * shape.hidden_dim;
  // A slot holds K pieces of a chunk: multiples of 128 bytes (rows are), at least one.
  const int64_t chunk = std::min<int64_t>(row_bytes, kSideSlotBytes / c.top_k / 128 * 128);
  const int64_t chunks = ceil_div(row_bytes, chunk);
  require(c.tokens >= 0 && c.tokens * std::max<int64_t>(c.top_k, chunks) < (int64_t{1} << 31), "combine.tokens",
          "must be in [0, 2^31 / max(top_k, row chunks))");
  require(c.tokens == 0 || rows.max_rows > 0, "combine.tokens", "must be 0 when there are no rows");
  if (c.partials_RP != nullptr) {
    require(c.partials >= 1 && c.partials < 1024, "combine.partials", "must be in [1, 1024) with partials_RP");
    require_ptr(c.sums_TK, "combine.sums_TK");
  }
  job.row_of_tk = c.row_of_tk;
  job.rows_RD = static_cast<const uint8_t*>(c.rows_RD);
  job.out_TD = static_cast<uint8_t*>(c.out_TD);
  job.partials_RP = c.partials_RP;
  job.sums_TK = c.sums_TK;
  job.tokens = static_cast<int32_t>(c.tokens);
  job.top_k = static_cast<int32_t>(c.top_k);
  job.row_bytes = static_cast<int32_t>(row_bytes);
  job.partials = static_cast<int32_t>(c.partials);
  job.chunk_bytes = static_cast<int32_t>(chunk);
  job.chunks = static_cast<int32_t>(chunks);
  job.rows = static_cast<int32_t>(rows.max_rows);
  return job;
}

// grad_W[e] (M x N) = A[e]^T . B[e], A = [R][M] rows, B = [R][N] rows, K = the expert's rows.
void wgrad(const GroupedRows& rows, const ExpertMlpShape& shape, const void* a_RM, const char* a_name, int64_t M,
           const void* b_RN, const char* b_name, int64_t N, const WgradOutput& out, const TokenCombine& combine,
           cudaStream_t stream) {
  require_ptr(a_RM, a_name);
  require_ptr(b_RN, b_name);
  require_ptr(out.grad_w, "grad_w");
  const TokenCombineJob side = combine_job(rows, shape, combine);
  const int64_t own = own_experts(rows), replicas = replica_experts(rows);
  require_replica_ptr(rows, out.replica_grad_w, "replica_grad_w");
  if (rows.max_rows == 0) {  // no rows anywhere: own experts get zeros (or keep theirs), replicas nothing
    if (!out.accumulate && own > 0) {
      const size_t bytes = own * M * N * (out.dtype == DType::fp32 ? 4 : 2);
      check_cuda(cudaMemsetAsync(out.grad_w, 0, bytes, stream), "cudaMemsetAsync(grad_w)");
    }
    return;
  }
  const CUtensorMap map_a = make_bf16_tensor_map(a_RM, rows.max_rows, M, 64, a_name);
  const CUtensorMap map_b = make_bf16_tensor_map(b_RN, rows.max_rows, N, 64, b_name);
  GroupedGemmShape s = base_shape(rows);
  s.m_blocks = ceil_div(M, kTileM);
  s.n_blocks = ceil_div(N, kBlockN);
  s.combine = side;
  const bool fp32 = out.dtype == DType::fp32, replica_fp32 = out.replica_dtype == DType::fp32;
  auto run = [&](auto epi) {
    epi.out_map = make_store_tensor_map(own > 0 ? out.grad_w : nullptr, fp32, own * M, N, "grad_w");
    epi.replica_map = make_store_tensor_map(replicas > 0 ? out.replica_grad_w : nullptr, replica_fp32, replicas * M,
                                            N, "replica_grad_w");
    epi.out_EMN = out.grad_w;
    epi.M = static_cast<int32_t>(M);
    epi.N = static_cast<int32_t>(N);
    epi.out_fp32 = fp32 ? 1 : 0;
    epi.accumulate = out.accumulate ? 1 : 0;
    epi.replica_out_EMN = out.replica_grad_w;
    epi.replica_fp32 = replica_fp32 ? 1 : 0;
    epi.first_replica = s.first_replica;
    launch<RowsAre::K, true>(map_a, WeightMaps{map_b, map_b}, s, epi, stream);
  };
  // Every target bf16 and overwritten: the kernel compiled for that case alone.
  const bool bf16_overwrite = (own == 0 || (!fp32 && !out.accumulate)) && (replicas == 0 || !replica_fp32);
  if (bf16_overwrite && POISE_DIRECT_STORES) run(WgradStoreEpilogue<true>{});
  else run(WgradStoreEpilogue<false>{});
}

}  // namespace

void expert_mlp_wgrad_w2(const GroupedRows& rows, const ExpertMlpShape& shape,
                         const void* grad_y_RD, const void* a_RF, const WgradOutput& out,
                         cudaStream_t stream, const TokenCombine& combine) {
  validate(rows, shape);
  wgrad(rows, shape, grad_y_RD, "grad_y_RD", shape.hidden_dim, a_RF, "a_RF", shape.intermediate_dim, out, combine,
        stream);
}

void expert_mlp_wgrad_w13(const GroupedRows& rows, const ExpertMlpShape& shape,
                          const void* grad_h13_R2F, const void* x_RD, const WgradOutput& out,
                          cudaStream_t stream, const TokenCombine& combine) {
  validate(rows, shape);
  wgrad(rows, shape, grad_h13_R2F, "grad_h13_R2F", 2 * shape.intermediate_dim, x_RD, "x_RD", shape.hidden_dim, out,
        combine, stream);
}

int64_t streamed_rows_words(int64_t max_rows) { return StreamedRowsWords::count(max_rows); }

void gather_rows_streamed(const GroupedRows& rows, const RowGather& g, const StreamedRows& ready,
                          cudaStream_t stream) {
  validate_row_groups(rows);
  require_ptr(g.token_of_row_R, "token_of_row_R");
  require(g.tokens >= 1 && g.tokens < (int64_t{1} << 31), "tokens", "must be in [1, 2^31)");
  require(g.dim > 0 && g.dim % 8 == 0 && g.dim < (int64_t{1} << 24), "dim", "must be a positive multiple of 8 below 2^24");
  require(g.src_TD != nullptr && reinterpret_cast<uintptr_t>(g.src_TD) % 16 == 0, "src_TD",
          "must be a 16-byte aligned device pointer");
  require(g.dst_RD != nullptr && reinterpret_cast<uintptr_t>(g.dst_RD) % 16 == 0, "dst_RD",
          "must be a 16-byte aligned device pointer");
  require(ready.words != nullptr && reinterpret_cast<uintptr_t>(ready.words) % alignof(uint32_t) == 0,
          "ready.words", "must be a 4-byte aligned device pointer");
  // More CTAs than SMs stay correct: the GEMM then starts once they all run (no overlap).
  require(g.ctas >= 1 && g.ctas <= 1024, "ctas", "must be in [1, 1024]");
  if (rows.max_rows == 0) return;
  RowGatherParams p{};
  p.row_offsets_E = rows.row_offsets_E;
  p.row_counts_E = rows.row_counts_E;
  p.num_experts = static_cast<int32_t>(rows.num_experts);
  p.blocks = static_cast<int32_t>(StreamedRowsWords::blocks(rows.max_rows));
  p.token_of_row_R = g.token_of_row_R;
  p.tokens = static_cast<int32_t>(g.tokens);
  p.vecs = static_cast<int32_t>(g.dim / 8);
  p.src_TD = static_cast<const uint4*>(g.src_TD);
  p.dst_RD = static_cast<uint4*>(g.dst_RD);
  p.words = ready.words;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(g.ctas);
  config.blockDim = dim3(kGatherThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute = dependent_launch_attribute();
  config.attrs = &attribute;
  config.numAttrs = dependent_launch_allowed() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, streamed_row_gather_kernel, p), "streamed_row_gather_kernel launch");
}

bool dependent_launch_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("POISE_SM90_PDL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return allowed;
}

cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

PipelineFault take_pipeline_fault(cudaStream_t stream) {
  unsigned long long word = 0;
  check_cuda(cudaMemcpyFromSymbolAsync(&word, ptx::g_pipeline_fault, sizeof(word), 0, cudaMemcpyDeviceToHost, stream),
             "take_pipeline_fault");
  check_cuda(cudaStreamSynchronize(stream), "take_pipeline_fault: cudaStreamSynchronize");
  PipelineFault f;
  if (word == 0) return f;
  const unsigned long long zero = 0;
  check_cuda(cudaMemcpyToSymbol(ptx::g_pipeline_fault, &zero, sizeof(zero)), "take_pipeline_fault");
  using Word = ptx::PipelineFaultWord;
  f.occurred = true;
  f.block = static_cast<int32_t>(Word::block(word));
  f.thread = static_cast<int32_t>(Word::thread(word));
  f.bad_token = Word::barrier(word) == Word::kBadToken;
  f.bad_row = Word::barrier(word) == Word::kBadRow;
  f.streamed_rows = Word::barrier(word) == Word::kStreamedRows;
  const bool wait = !f.bad_token && !f.bad_row && !f.streamed_rows;
  f.barrier = wait ? Word::barrier(word) : 0;
  f.parity = wait ? Word::parity(word) : 0;
  return f;
}

std::string describe(const PipelineFault& f) {
  if (!f.occurred) return "";
  const std::string where = "block " + std::to_string(f.block) + ", thread " + std::to_string(f.thread);
  if (f.bad_token)
    return "a row's token_of_row_R entry was outside [0, tokens) or its row_origin_R entry outside the owners' "
           "slots (" + where + "): a fused combine added that row nowhere, a row scatter stored it nowhere, a "
           "streamed gather wrote it as zeros";
  if (f.streamed_rows)
    return "a wait for a streamed row block timed out (" + where +
           "): its writer did not publish it (StreamedRows); that launch's outputs are invalid";
  if (f.bad_row)
    return "a side combine's row_of_tk named a row outside [0, R) (" + where + "): that piece was read as zeros";
  return "a pipeline wait timed out (" + where + ", barrier at shared offset " + std::to_string(f.barrier) +
         ", parity " + std::to_string(f.parity) + "); that launch's outputs are invalid";
}

static_assert(kPipelineWaitTimeoutNs == ptx::kDefaultWaitTimeoutNs, "the host API states the kernels' bound");

void set_pipeline_wait_timeout_for_tests(uint32_t timeout_ns) {
  check_cuda(cudaMemcpyToSymbol(ptx::g_mbarrier_timeout_ns, &timeout_ns, sizeof(timeout_ns)),
             "set_pipeline_wait_timeout_for_tests");
}

void drop_first_stage_for_tests(bool drop) {
  const int32_t v = drop ? 1 : 0;
  check_cuda(cudaMemcpyToSymbol(g_drop_first_stage_for_tests, &v, sizeof(v)), "drop_first_stage_for_tests");
}

#if POISE_PHASE_PROFILE
// Profiling builds: copies out and resets the consumer / producer cycle sums (grouped_gemm.cuh).
void read_phase_profile(unsigned long long out[8]) {
  check_cuda(cudaMemcpyFromSymbol(out, g_phase_cycles, sizeof(g_phase_cycles)), "read_phase_profile");
  const unsigned long long zero[8] = {};
  check_cuda(cudaMemcpyToSymbol(g_phase_cycles, zero, sizeof(zero)), "read_phase_profile");
}
#endif
#if POISE_TILE_TIMELINE
// Profiling builds: copies out the last launches' tile timeline (phase_profile.cuh), n entries each
// (at most kTimelineTiles), then clears it.
void read_tile_timeline(unsigned long long* start_ns, unsigned long long* end_ns, unsigned int* what,
                        unsigned int* sm, int n) {
  n = n < kTimelineTiles ? n : kTimelineTiles;
  check_cuda(cudaMemcpyFromSymbol(start_ns, g_tile_start_ns, n * sizeof(*start_ns)), "read_tile_timeline");
  check_cuda(cudaMemcpyFromSymbol(end_ns, g_tile_end_ns, n * sizeof(*end_ns)), "read_tile_timeline");
  check_cuda(cudaMemcpyFromSymbol(what, g_tile_what, n * sizeof(*what)), "read_tile_timeline");
  check_cuda(cudaMemcpyFromSymbol(sm, g_tile_sm, n * sizeof(*sm)), "read_tile_timeline");
  void* p = nullptr;
  check_cuda(cudaGetSymbolAddress(&p, g_tile_start_ns), "read_tile_timeline");
  check_cuda(cudaMemset(p, 0, sizeof(g_tile_start_ns)), "read_tile_timeline");
}
#endif

}  // namespace poise::sm90
