#include "strata/core/error.h"

#include <cstring>

namespace strata {

namespace {
std::string with_location(const std::string& what, const char* file, int line) {
  return what + " (" + file + ":" + std::to_string(line) + ")";
}
}  // namespace

Error::Error(std::string what, const char* file, int line)
    : std::runtime_error(with_location(what, file, line)),
      message_(std::move(what)),
      file_(file),
      line_(line) {}

namespace detail {

void throw_error(const char* file, int line, const char* kind, const char* cond,
                 const std::string& message) {
  std::string what = message;
  if (cond != nullptr && std::strcmp(kind, "check") != 0) {
    what = std::string("strata ") + kind + " failed: " + cond + (message.empty() ? "" : ": ") + message;
  } else if (what.empty()) {
    what = std::string("strata check failed: ") + (cond ? cond : "");
  }
  throw Error(std::move(what), file, line);
}

void throw_errno(const char* file, int line, const char* call, int err, const std::string& message) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  std::string what = message.empty() ? std::string() : message + ": ";
  what += std::string(call) + " failed with errno " + std::to_string(err) + " (" + text + ")";
  throw Error(std::move(what), file, line);
}

}  // namespace detail
}  // namespace strata
