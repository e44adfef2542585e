// The launcher's hold on its rendezvous port (Note [A port held for the job]):
// real sockets on the loopback address.
#include "port_hold.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <vector>

namespace strata::tools {
namespace {

// A TCP socket, closed when it goes.
struct Socket {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

sockaddr_in address(uint32_t host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(host);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

// 0, or the errno of binding `s` to host:port, with SO_REUSEADDR when `reuse`.
int bind_to(const Socket& s, uint32_t host, int port, bool reuse) {
  const int one = 1;
  if (reuse && ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) return errno;
  const sockaddr_in a = address(host, port);
  return ::bind(s.fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
}

TEST(PortHold, OnlyAListenerThatAllowsReuseBindsTheHeldPortAndItIsReachable) {
  PortHold hold;
  ASSERT_GT(hold.port(), 0);
  ASSERT_LT(hold.port(), 65536);

  // Another process's plain bind, on loopback or on every address: refused.
  Socket plain, plain_any;
  ASSERT_GE(plain.fd, 0);
  EXPECT_EQ(bind_to(plain, INADDR_LOOPBACK, hold.port(), false), EADDRINUSE);
  EXPECT_EQ(bind_to(plain_any, INADDR_ANY, hold.port(), false), EADDRINUSE);

  // Rank 0's store: SO_REUSEADDR on every address, then listen.
  Socket store;
  ASSERT_EQ(bind_to(store, INADDR_ANY, hold.port(), true), 0);
  ASSERT_EQ(::listen(store.fd, 8), 0);

  // Once it listens, nothing else binds the port, even with SO_REUSEADDR.
  Socket second;
  EXPECT_EQ(bind_to(second, INADDR_LOOPBACK, hold.port(), true), EADDRINUSE);

  // A rank connecting to MASTER_PORT reaches the store, not the hold.
  Socket client;
  const sockaddr_in to = address(INADDR_LOOPBACK, hold.port());
  ASSERT_EQ(::connect(client.fd, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0);
  const int accepted = ::accept(store.fd, nullptr, nullptr);
  EXPECT_GE(accepted, 0);
  if (accepted >= 0) ::close(accepted);
}

TEST(PortHold, HoldsAreDistinctAndTheKernelPassesHeldPortsOver) {
  std::vector<std::unique_ptr<PortHold>> holds;
  for (int i = 0; i < 16; ++i) holds.push_back(std::make_unique<PortHold>());
  for (size_t i = 0; i < holds.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_NE(holds[i]->port(), holds[j]->port());
  }
  // Port-0 binds (a Gloo pair's listener) never get a held port.
  std::vector<std::unique_ptr<Socket>> ephemeral;
  for (int i = 0; i < 256; ++i) {
    ephemeral.push_back(std::make_unique<Socket>());
    ASSERT_EQ(bind_to(*ephemeral.back(), INADDR_LOOPBACK, 0, true), 0);
    sockaddr_in got{};
    socklen_t len = sizeof got;
    ASSERT_EQ(::getsockname(ephemeral.back()->fd, reinterpret_cast<sockaddr*>(&got), &len), 0);
    for (const auto& h : holds) EXPECT_NE(ntohs(got.sin_port), h->port());
  }
}

TEST(PortHold, ThePortIsFreeAgainWhenTheHoldEnds) {
  int port = 0;
  {
    PortHold hold;
    port = hold.port();
  }
  Socket plain;
  EXPECT_EQ(bind_to(plain, INADDR_LOOPBACK, port, false), 0);
}

}  // namespace
}  // namespace strata::tools
