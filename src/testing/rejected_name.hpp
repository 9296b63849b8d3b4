// What the "errors name their argument" tests compare: the name of the InvalidArgument a call
// throws, "(accepted)" when it throws none.
#pragma once

#include <string>

#include "poise/errors.hpp"

namespace poise::testing {

template <class Call>
std::string rejected_name(Call&& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.name();
  }
  return "(accepted)";
}

}  // namespace poise::testing
