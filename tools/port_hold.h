#pragma once
// The TCP port `strata run` gives its ranks as MASTER_PORT, held from the
// moment it is picked until the job ends.

namespace strata::tools {

// Note [A port held for the job]
// Rank 0's store binds MASTER_PORT a second or more after the launcher picks
// it (the ranks start, load LibTorch, connect). A port found free and let go
// can be taken in that time: the kernel hands it to another process's
// outgoing connection or port-0 bind (the Gloo pairs of a job running beside
// this one), and rank 0 fails to listen, or worse, another launcher picks it
// too and two jobs' ranks meet at one store. So the launcher holds the port
// for the whole job: a socket bound to it without SO_REUSEADDR (the kernel
// picks a port no socket holds), then marked SO_REUSEADDR and never put to
// listen. The store's own listening socket (SO_REUSEADDR, as c10d's TCPStore
// and libuv both set it) may then bind beside it, while every other bind
// fails and the kernel's ephemeral choices pass it over.
// tests/tools/port_hold_test.cpp checks those rules.
class PortHold {
 public:
  /// Binds a free port on the loopback address and holds it; throws strata::Error when none can be bound.
  PortHold();
  ~PortHold();
  PortHold(const PortHold&) = delete;
  PortHold& operator=(const PortHold&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace strata::tools
