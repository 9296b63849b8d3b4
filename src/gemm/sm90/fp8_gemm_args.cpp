#include "gemm/sm90/fp8_gemm_args.hpp"

#include <string>

#include "gemm/sm90/tensor_map.hpp"
#include "poise/errors.hpp"

namespace poise::sm90 {
namespace {

void require_scales(const float* p, const char* name) {
  require_ptr(p, name);
  require(reinterpret_cast<uintptr_t>(p) % alignof(float) == 0, name, "must be 4-byte aligned");
}

}  // namespace

void require_fp8_built(bool unsupported, const char* what) {
  if (unsupported) throw NotAvailable(std::string("FP8 expert GEMMs: ") + what + " is not built yet");
}

void validate_fp8(const GroupedRows& rows, const ExpertMlpShape& shape) {
  validate(rows, shape);
  require_fp8_built(shape.biased, "shape.biased (expert biases)");
  require_fp8_built(shape.weights_transposed, "shape.weights_transposed (FP8 wgmma reads K-major weights only)");
}

void require_fp8_rows(const Fp8Rows& a, const char* values_name, const char* scales_name) {
  require_ptr(a.values_RK, values_name);
  require_scales(a.scales_RKb, scales_name);
}

void require_fp8_weights(const GroupedRows& rows, const Fp8Weights& own, const Fp8Weights& replicas,
                         const char* const names[4]) {
  require_ptr(own.values, names[0]);
  require_scales(own.scales, names[1]);
  if (replica_experts(rows) > 0) {
    require_ptr(replicas.values, names[2]);
    require_scales(replicas.scales, names[3]);
  }
}

Fp8Gemm fp8_gemm(const GroupedRows& rows, const Fp8Rows& a, const char* a_name, const Fp8Weights& w,
                 const Fp8Weights& replica_w, const char* const w_names[4], int64_t K, int64_t b_rows, int64_t N,
                 int64_t n_tile) {
  Fp8Gemm g;
  g.map_a = make_fp8_tensor_map(a.values_RK, rows.max_rows, K, kTileM / 2, a_name);
  g.map_b = weight_maps(rows, w.values, w_names[0], replica_w.values, w_names[2], b_rows, K, kBlockN / 2,
                        /*e4m3=*/true);
  g.shape = rows_gemm_shape(rows, K, b_rows, N, n_tile);
  g.shape.k_blocks = ceil_div(K, 128);
  g.shape.scales = {a.scales_RKb, w.scales, replica_w.scales, g.shape.k_blocks};
  return g;
}

}  // namespace poise::sm90
