// The dimensions FP8 weight blocks take (poise/fp8.hpp, reference::quantize_fp8_weight_blocks).
#pragma once

#include <cstdint>
#include <string>

#include "poise/errors.hpp"

namespace poise::reference {

inline void check_fp8_weight_dims(int64_t matrices, int64_t rows, int64_t cols) {
  if (matrices < 1) throw InvalidArgument("matrices", "must be >= 1, got " + std::to_string(matrices));
  for (const auto& [value, name] : {std::pair<int64_t, const char*>{rows, "rows"}, {cols, "cols"}}) {
    if (value < 64 || value % 64 != 0) {
      throw InvalidArgument(name, "must be a positive multiple of 64, got " + std::to_string(value));
    }
  }
}

}  // namespace poise::reference
