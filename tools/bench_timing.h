#pragma once
// Timing helpers shared by the `strata bench` verbs.

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace strata::tools {

/// Wall seconds `fn` took.
inline double seconds(const std::function<void()>& fn) {
  const auto a = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
}

/// The median of `t` (the upper one for an even count); `t` must not be empty.
inline double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace strata::tools
