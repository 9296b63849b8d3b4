// The pipeline's host argument checks: InvalidArgument naming what is wrong (shared by its
// construction, its stages and its snapshots).
#pragma once

#include <string>

#include "poise/errors.hpp"

namespace poise::ep {

inline void require(bool ok, const std::string& name, const std::string& rule) {
  if (!ok) throw InvalidArgument(name, rule);
}

}  // namespace poise::ep
