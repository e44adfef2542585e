#include "strata/offload/io_uring_probe.h"

#include <liburing.h>
#include <sys/utsname.h>

#include <cstring>

namespace strata::offload {

IoUringSupport probe_io_uring() {
  IoUringSupport s;
  utsname u{};
  if (uname(&u) == 0) s.kernel_release = u.release;
#if defined(IO_URING_VERSION_MAJOR)
  s.liburing_version = std::to_string(IO_URING_VERSION_MAJOR) + "." + std::to_string(IO_URING_VERSION_MINOR);
#else
  s.liburing_version = "< 2.4 (exports no version)";
#endif
  io_uring ring{};
  const int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) {
    s.detail = std::string("io_uring_queue_init failed: ") + std::strerror(-rc);
    return s;
  }
  int opcodes = 0;
  if (io_uring_probe* probe = io_uring_get_probe_ring(&ring)) {
    for (int op = 0; op <= probe->last_op; ++op) opcodes += io_uring_opcode_supported(probe, op) ? 1 : 0;
    io_uring_free_probe(probe);
  }
  io_uring_queue_exit(&ring);
  s.available = true;
  s.detail = "ok, " + std::to_string(opcodes) + " opcodes supported";
  return s;
}

}  // namespace strata::offload
