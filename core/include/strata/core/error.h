#pragma once
// Error reporting, in two tiers as in c10/util/Exception.h:
//  - STRATA_CHECK(cond, ...): the user or the environment got something wrong
//    (bad option, full disk, missing device). The message says what to change.
//  - STRATA_ASSERT(cond, ...): an invariant of strata itself is broken (a bug).
// Both throw strata::Error carrying the message and the source location; a
// library never aborts the process. STRATA_CHECK_ERRNO decodes a system call's
// -errno / errno the way NCCL's checks.h decodes its results.

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace strata {

class Error : public std::runtime_error {
 public:
  Error(std::string what, const char* file, int line);
  /// The message without the source location.
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
};

namespace detail {

template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
inline std::string str_cat() { return {}; }

[[noreturn]] void throw_error(const char* file, int line, const char* kind, const char* cond,
                              const std::string& message);
[[noreturn]] void throw_errno(const char* file, int line, const char* call, int err,
                              const std::string& message);

}  // namespace detail
}  // namespace strata

#define STRATA_CHECK(cond, ...)                                                              \
  do {                                                                                      \
    if (__builtin_expect(!(cond), 0)) {                                                     \
      ::strata::detail::throw_error(__FILE__, __LINE__, "check", #cond,                     \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
  } while (0)

#define STRATA_ASSERT(cond, ...)                                                             \
  do {                                                                                      \
    if (__builtin_expect(!(cond), 0)) {                                                     \
      ::strata::detail::throw_error(__FILE__, __LINE__, "internal assertion", #cond,        \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
  } while (0)

/// Unconditional user-facing error.
#define STRATA_FAIL(...) \
  ::strata::detail::throw_error(__FILE__, __LINE__, "check", nullptr, ::strata::detail::str_cat(__VA_ARGS__))

/// For calls that return -1 and set errno; retries on EINTR.
#define STRATA_SYSCALL(call, ...)                                                            \
  [&] {                                                                                     \
    for (;;) {                                                                              \
      auto strata_rc_ = (call);                                                             \
      if (strata_rc_ != -1) return strata_rc_;                                              \
      if (errno == EINTR) continue;                                                         \
      ::strata::detail::throw_errno(__FILE__, __LINE__, #call, errno,                       \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
  }()

/// For calls that return a negative errno on failure (io_uring, hwloc-style APIs).
#define STRATA_CHECK_NEG_ERRNO(expr, ...)                                                    \
  do {                                                                                      \
    int strata_rc_ = static_cast<int>(expr);                                                \
    if (strata_rc_ < 0) {                                                                   \
      ::strata::detail::throw_errno(__FILE__, __LINE__, #expr, -strata_rc_,                 \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
  } while (0)
