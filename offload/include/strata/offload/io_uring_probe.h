#pragma once
// Whether this kernel and sandbox let strata use io_uring, which the NVMe tier
// is built on. Containers often forbid io_uring_setup (EPERM / ENOSYS).

#include <string>

namespace strata::offload {

struct IoUringSupport {
  bool available = false;
  std::string detail;          // "ok: 58 opcodes" or the decoded error
  std::string kernel_release;  // uname -r
  std::string liburing_version;
};

IoUringSupport probe_io_uring();

}  // namespace strata::offload
