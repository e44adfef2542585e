#include "strata/core/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace strata {

namespace {
LogLevel threshold_from_env() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kWarn;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(env, "info") == 0) return LogLevel::kInfo;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  return LogLevel::kWarn;
}
}  // namespace

bool log_enabled(LogLevel level) {
  static const LogLevel threshold = threshold_from_env();
  return static_cast<int>(level) >= static_cast<int>(threshold);
}

void log_message(LogLevel level, const std::string& message) {
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  std::fprintf(stderr, "[strata %s] %s\n", kNames[static_cast<int>(level)], message.c_str());
}

}  // namespace strata
