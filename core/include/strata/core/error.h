#pragma once
// Error reporting, in two tiers as in c10/util/Exception.h:
//  - STRATA_CHECK(cond, ...): the user or the environment got something wrong
//    (bad option, full disk, missing device). The message says what to change.
//  - STRATA_ASSERT(cond, ...): an invariant of strata itself is broken (a bug).
// Both throw strata::Error carrying the message and the source location; a
// library never aborts the process. STRATA_SYSCALL and friends (Note [System
// calls]) check system calls the way NCCL's checks.h checks its results.

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
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

/// strerror_r's text for `err`, for messages that do not throw (logs).
std::string errno_text(int err);

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

// Note [System calls]
// Every system call in the libraries goes through one of these, so that none
// forgets EINTR and every failure reads the same: "<what was being done>:
// <strerror> (<call>, errno N)". A call is retried while it fails with EINTR
// (a signal arrived; the call did nothing), which is right for every call
// here: open, read, write, fsync, fallocate, rename, ... all either did
// nothing or report partial progress by their return value.
//  - STRATA_SYSCALL(call, what...): throws on failure, else returns the result.
//  - STRATA_SYSCALL_ERRNO(call): 0 on success, else errno, for the callers
//    that handle some failures (ENOENT, EEXIST, EINVAL) themselves; assign
//    the result inside `call` when it is needed: ERRNO(fd = ::open(...)).
//  - STRATA_CHECK_NEG_ERRNO(expr, what...): for APIs that return -errno
//    (liburing); retried on -EINTR, throws on any other negative result.
//  - STRATA_FAIL_ERRNO(err, "call", what...): throws that error for a
//    failure STRATA_SYSCALL_ERRNO returned and the caller does not handle.
//  - STRATA_CLOSE(fd, what...): close() is the one call never retried: Linux
//    releases the descriptor even when close reports EINTR, and a retry
//    could close another thread's new file. Throws on any other failure;
//    for the close of a file just written, which can report a lost write.
//    Cleanup paths that already fail ignore close's result, as do the
//    deleters that munmap: nothing could act on their failure.
// Failure is -1 for integer results and null or MAP_FAILED for pointers
// (fopen, opendir, mmap).
namespace strata::detail {

template <typename T>
inline bool syscall_failed(T rc) noexcept {
  if constexpr (std::is_pointer_v<T>) {
    return rc == nullptr || reinterpret_cast<const volatile void*>(rc) == reinterpret_cast<void*>(-1);
  } else {
    return rc == -1;
  }
}

template <typename F>
auto retry_eintr(F&& call) {
  for (;;) {
    auto rc = call();
    if (!syscall_failed(rc) || errno != EINTR) return rc;
  }
}

}  // namespace strata::detail

#define STRATA_SYSCALL(call, ...)                                                            \
  [&] {                                                                                     \
    auto strata_rc_ = ::strata::detail::retry_eintr([&] { return (call); });                \
    if (__builtin_expect(::strata::detail::syscall_failed(strata_rc_), 0)) {               \
      ::strata::detail::throw_errno(__FILE__, __LINE__, #call, errno,                       \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
    return strata_rc_;                                                                      \
  }()

#define STRATA_SYSCALL_ERRNO(call)                                                           \
  [&]() -> int {                                                                            \
    const auto strata_rc_ = ::strata::detail::retry_eintr([&] { return (call); });          \
    return ::strata::detail::syscall_failed(strata_rc_) ? errno : 0;                        \
  }()

#define STRATA_CHECK_NEG_ERRNO(expr, ...)                                                    \
  [&] {                                                                                     \
    for (;;) {                                                                              \
      const auto strata_rc_ = (expr);                                                       \
      if (strata_rc_ == -EINTR) continue;                                                   \
      if (__builtin_expect(strata_rc_ < 0, 0)) {                                            \
        ::strata::detail::throw_errno(__FILE__, __LINE__, #expr, -static_cast<int>(strata_rc_), \
                                      ::strata::detail::str_cat(__VA_ARGS__));              \
      }                                                                                     \
      return strata_rc_;                                                                    \
    }                                                                                       \
  }()

#define STRATA_CLOSE(fd, ...)                                                                \
  do {                                                                                      \
    if (::close(fd) != 0 && errno != EINTR) {                                               \
      ::strata::detail::throw_errno(__FILE__, __LINE__, "close", errno,                     \
                                    ::strata::detail::str_cat(__VA_ARGS__));                \
    }                                                                                       \
  } while (0)

#define STRATA_FAIL_ERRNO(err, call, ...) \
  ::strata::detail::throw_errno(__FILE__, __LINE__, call, err, ::strata::detail::str_cat(__VA_ARGS__))
