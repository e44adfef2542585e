#pragma once
// The message of the strata::Error `fn` throws, or "no error".
#include <functional>
#include <string>

#include "strata/core/error.h"

namespace strata {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace strata
