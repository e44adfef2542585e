#pragma once
// Minimal leveled logging to stderr. STRATA_LOG_LEVEL=debug|info|warn|error
// sets the threshold (default: warn). Used where throwing is not allowed
// (destructors) and for diagnostics a user may want to see.

#include <string>

#include <fmt/format.h>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool log_enabled(LogLevel level);
void log_message(LogLevel level, const std::string& message);

}  // namespace strata

#define STRATA_LOG(level, ...)                                                    \
  do {                                                                            \
    if (::strata::log_enabled(::strata::LogLevel::level)) {                       \
      ::strata::log_message(::strata::LogLevel::level, ::fmt::format(__VA_ARGS__)); \
    }                                                                             \
  } while (0)
