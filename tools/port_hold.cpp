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
  const char* call = "bind";  // the call that failed, for the message
  int err = STRATA_SYSCALL_ERRNO(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a));
  if (err == 0) {
    call = "getsockname";
    err = STRATA_SYSCALL_ERRNO(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len));
  }
  if (err == 0) {
    call = "setsockopt(SO_REUSEADDR)";
    err = STRATA_SYSCALL_ERRNO(::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
  }
  if (err != 0) {
    ::close(fd_);
    STRATA_FAIL_ERRNO(err, call, "cannot find a free TCP port (give --master-port)");
  }
  port_ = ntohs(a.sin_port);
}

PortHold::~PortHold() { ::close(fd_); }

}  // namespace strata::tools
