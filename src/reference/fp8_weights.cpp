// reference::quantize_fp8_weight_blocks: the host's FP8 weight blocks (the GPU kernel's oracle).
#include <string>

#include "numerics/block_scaling.hpp"
#include "poise/reference.hpp"
#include "reference/fp8_checks.hpp"

namespace poise::reference {

Fp8WeightBlocks quantize_fp8_weight_blocks(std::span<const float> w_MRC, int64_t matrices, int64_t rows, int64_t cols) {
  check_fp8_weight_dims(matrices, rows, cols);
  if (static_cast<int64_t>(w_MRC.size()) != matrices * rows * cols) {
    throw InvalidArgument("w", "expected matrices*rows*cols = " + std::to_string(matrices * rows * cols) +
                                   " values, got " + std::to_string(w_MRC.size()));
  }
  for (size_t i = 0; i < w_MRC.size(); ++i) {
    if (!is_bf16_value(w_MRC[i])) {
      throw InvalidArgument("w", "value " + std::to_string(w_MRC[i]) + " at index " + std::to_string(i) +
                                     " is not a bf16 value (use round_to_bf16)");
    }
  }
  numerics::BlockScaled blocks = numerics::quantize_weight_blocks(w_MRC.data(), matrices, rows, cols);
  return {std::move(blocks.values), std::move(blocks.scales)};
}

}  // namespace poise::reference
