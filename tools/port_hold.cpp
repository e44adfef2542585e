// The launcher's hold on the rendezvous port (Note [A port held for the job] in port_hold.h).
#include "port_hold.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "strata/core/error.h"

namespace strata::tools {

PortHold::PortHold() {
  fd_ = STRATA_SYSCALL(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), "cannot open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const int one = 1;
  // Each failure closes the socket and names its call.
  const auto check = [&](int err, const char* call) {
    if (err == 0) return;
    ::close(fd_);
    STRATA_FAIL_ERRNO(err, call, "cannot find a free TCP port (give --master-port)");
  };
  check(STRATA_SYSCALL_ERRNO(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a)), "bind");
  check(STRATA_SYSCALL_ERRNO(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len)), "getsockname");
  check(STRATA_SYSCALL_ERRNO(::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one)),
        "setsockopt(SO_REUSEADDR)");
  port_ = ntohs(a.sin_port);
}

PortHold::~PortHold() { ::close(fd_); }

}  // namespace strata::tools
