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

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be buf.
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

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
  const std::string text = errno_text(err);
  // The call's name, not its arguments: "::pwrite(fd, p, n, off)" reads "pwrite".
  std::string name(call);
  name = name.substr(0, name.find('('));
  const size_t colons = name.rfind("::");
  if (colons != std::string::npos) name = name.substr(colons + 2);
  const size_t space = name.find_last_of(" =");
  if (space != std::string::npos) name = name.substr(space + 1);
  std::string what = message.empty() ? std::string() : message + ": ";
  what += text + " (" + name + ", errno " + std::to_string(err) + ")";
  throw Error(std::move(what), file, line);
}

}  // namespace detail
}  // namespace strata
