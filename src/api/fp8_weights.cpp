// poise::quantize_fp8_weight_blocks (poise/fp8.hpp): host checks, then the quantization kernel.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "poise/errors.hpp"
#include "poise/fp8.hpp"
#include "quant/weight_blocks.hpp"
#include "reference/fp8_checks.hpp"

namespace poise {

void quantize_fp8_weight_blocks(const void* w_MRC, int64_t matrices, int64_t rows, int64_t cols, uint8_t* values_MRC,
                                float* scales, Stream stream) {
  reference::check_fp8_weight_dims(matrices, rows, cols);
  for (const auto& [pointer, name] : {std::pair<const void*, const char*>{w_MRC, "w"}, {values_MRC, "values"},
                                      {scales, "scales"}}) {
    if (pointer == nullptr) throw InvalidArgument(name, "is null");
  }
  quant::launch_weight_blocks(static_cast<const __nv_bfloat16*>(w_MRC), matrices, rows, cols, values_MRC, scales,
                              reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace poise
