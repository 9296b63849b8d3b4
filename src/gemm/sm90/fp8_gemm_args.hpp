// Host side of the FP8 GEMM launches (expert_mlp_fp8.hpp): argument checks by name, and the TMA
// maps and kernel shape of a rows-as-M FP8 GEMM.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gemm/sm90/expert_mlp_fp8.hpp"
#include "gemm/sm90/gemm_args.hpp"

namespace poise::sm90 {

// validate(), then NotAvailable for what the FP8 GEMMs do not take (biases, transposed weights).
void validate_fp8(const GroupedRows& rows, const ExpertMlpShape& shape);
// NotAvailable naming `what` when `unsupported`.
void require_fp8_built(bool unsupported, const char* what);
// An operand's values and scales, named as the caller passed them.
void require_fp8_rows(const Fp8Rows& a, const char* values_name, const char* scales_name);
// names: own values, own scales, replica values, replica scales (the replicas' only with replicas).
void require_fp8_weights(const GroupedRows& rows, const Fp8Weights& own, const Fp8Weights& replicas,
                         const char* const names[4]);

// A rows-as-M FP8 GEMM: A = rows [R][K], B = weights [E][b_rows][K] with their scales, N columns in
// n_tile-wide tiles (kBlockN / 2 activation columns of the blocked W13, else kBlockN).
struct Fp8Gemm {
  CUtensorMap map_a;
  WeightMaps map_b;
  GroupedGemmShape shape;
};
Fp8Gemm fp8_gemm(const GroupedRows& rows, const Fp8Rows& a, const char* a_name, const Fp8Weights& w,
                 const Fp8Weights& replica_w, const char* const w_names[4], int64_t K, int64_t b_rows, int64_t N,
                 int64_t n_tile);

}  // namespace poise::sm90
