// poise::quantize_fp8_weight_blocks and its transposed twin (poise/fp8.hpp): host checks, then the
// quantization kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "poise/errors.hpp"
#include "poise/fp8.hpp"
#include "quant/weight_blocks.hpp"
#include "reference/fp8_checks.hpp"

namespace poise {

namespace {

void check_weight_block_args(const void* w, int64_t matrices, int64_t rows, int64_t cols, const uint8_t* values,
                             const float* scales) {
  reference::check_fp8_weight_dims(matrices, rows, cols);
  for (const auto& [pointer, name] : {std::pair<const void*, const char*>{w, "w"}, {values, "values"},
                                      {scales, "scales"}}) {
    if (pointer == nullptr) throw InvalidArgument(name, "is null");
  }
}

}  // namespace

void quantize_fp8_weight_blocks(const void* w_MRC, int64_t matrices, int64_t rows, int64_t cols, uint8_t* values_MRC,
                                float* scales, Stream stream) {
  check_weight_block_args(w_MRC, matrices, rows, cols, values_MRC, scales);
  quant::launch_weight_blocks(static_cast<const __nv_bfloat16*>(w_MRC), matrices, rows, cols, values_MRC, scales,
                              reinterpret_cast<cudaStream_t>(stream));
}

void quantize_fp8_weight_blocks_transposed(const void* w_MRC, int64_t matrices, int64_t rows, int64_t cols,
                                           uint8_t* values_MCR, float* scales, Stream stream) {
  check_weight_block_args(w_MRC, matrices, rows, cols, values_MCR, scales);
  quant::launch_weight_blocks_transposed(static_cast<const __nv_bfloat16*>(w_MRC), matrices, rows, cols, values_MCR,
                                         scales, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace poise
