// Host side of every grouped-GEMM launch: argument checks (poise::InvalidArgument naming the
// argument) and the kernel parameters built from the API's structs.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "gemm/sm90/expert_mlp.hpp"
#include "gemm/sm90/kernel_params.hpp"

namespace poise::sm90 {

void require(bool ok, const char* name, const char* rule);
void require_ptr(const void* p, const char* name);
// The row groups, the shape and the fault word every launch takes.
void validate(const GroupedRows& rows, const ExpertMlpShape& shape);
// A replica-side pointer is needed only when there are replicas.
void require_replica_ptr(const GroupedRows& rows, const void* p, const char* name);
// The rows output of FPROP W2 / DGRAD W13: grouped rows, or (scatter.row_origin_R set) slots.
void validate_rows_output(const void* rows_RD, const char* rows_name, const RowScatter& scatter, int64_t D);
// The row where h13 switches buffers (max_rows: never).
int32_t h13_split_row(const GroupedRows& rows, const H13Split& split);

// Experts whose weights come from the main pointers, and replica experts after them.
int64_t own_experts(const GroupedRows& rows);
int64_t replica_experts(const GroupedRows& rows);
int32_t ceil_div(int64_t a, int64_t b);
inline __nv_bfloat16* bf16(void* p) { return static_cast<__nv_bfloat16*>(p); }

ActivationParams activation_params(const ExpertMlpShape& shape);
// A launch's expert biases, bf16 [E_own, N] and the replica experts' [E - first_replica, N]: the
// own pointer required, the replicas' when there are replicas.
ExpertBias expert_bias(const GroupedRows& rows, const void* own_EN, const char* own_name, const void* replicas_EN,
                       const char* replicas_name, int64_t N);
// What every launch shares: the row groups, tile counters, fault word.
GroupedGemmShape base_shape(const GroupedRows& rows);
// Fprop and dgrad GEMMs over the routed rows: A = [R][K] rows (read in 64-row boxes), B = E weight
// blocks of b_rows_per_expert rows each, N output columns in n_tile-wide tiles.
GroupedGemmShape rows_gemm_shape(const GroupedRows& rows, int64_t K, int64_t b_rows_per_expert, int64_t N,
                                 int64_t n_tile);
CUtensorMap rows_operand_map(const void* a_RK, const GroupedRows& rows, int64_t K, const char* name);

// TMA maps of a per-expert weight tensor: the own experts' and the replicas' (the same map when
// one side is empty, so the kernel always gets a valid descriptor); e4m3: FP8 values (tensor_map.hpp).
struct WeightMaps {
  CUtensorMap own, replicas;
};
WeightMaps weight_maps(const GroupedRows& rows, const void* w, const char* name, const void* replica_w,
                       const char* replica_name, int64_t rows_per_expert, int64_t cols, int box_rows,
                       bool e4m3 = false);

}  // namespace poise::sm90
