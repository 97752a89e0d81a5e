// protocol::detail::send_nonblocking, the sendmsg loop of protocol::connection and of the
// engine connector's threads: many pieces in one call, a full socket (the rest left in the
// iovecs, in order), an fd with the first byte, a closed peer (EPIPE, no signal).
#include <kvtier/protocol/detail/send.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <numeric>
#include <vector>

using kvtier::protocol::detail::send_nonblocking;
using kvtier::protocol::detail::send_outcome;

namespace {

struct stream_pair {
  int fd[2] = {-1, -1};
  stream_pair() { REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd) == 0); }
  ~stream_pair() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  stream_pair(const stream_pair&) = delete;
  stream_pair& operator=(const stream_pair&) = delete;
  /// Everything readable now (non-blocking).
  [[nodiscard]] std::vector<std::byte> drain() const {
    std::vector<std::byte> out;
    std::byte buf[65536];
    for (;;) {
      const ssize_t n = ::recv(fd[1], buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) return out;
      out.insert(out.end(), buf, buf + n);
    }
  }
};

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return v;
}

}  // namespace

TEST_CASE("send_nonblocking writes many pieces whole, and a full socket leaves the rest in the iovecs in order",
          "[protocol][send]") {
  stream_pair s;
  // Three pieces (one of them empty), far more than the socket holds.
  const std::vector<std::vector<std::byte>> pieces = {pattern(3 << 20, 1), {}, pattern(2 << 20, 2)};
  std::vector<iovec> iov;
  std::vector<std::byte> all;
  for (const auto& p : pieces) {
    iov.push_back(iovec{const_cast<std::byte*>(p.data()), p.size()});
    all.insert(all.end(), p.begin(), p.end());
  }
  std::vector<std::byte> got;
  std::size_t rounds = 0;
  for (;;) {
    const send_outcome r = send_nonblocking(s.fd[0], iov);
    const std::size_t left = std::accumulate(iov.begin(), iov.end(), std::size_t{0},
                                             [](std::size_t a, const iovec& v) { return a + v.iov_len; });
    CHECK(got.size() + r.sent + left == all.size());  // what was written is consumed from the iovecs
    auto d = s.drain();
    got.insert(got.end(), d.begin(), d.end());
    ++rounds;
    if (r.error == 0) {
      CHECK(left == 0);
      break;
    }
    REQUIRE(r.error == EAGAIN);  // full: the rest waits in iov
    REQUIRE(rounds < 10000);
  }
  CHECK(rounds > 1);  // the socket was full at least once
  auto d = s.drain();
  got.insert(got.end(), d.begin(), d.end());
  CHECK(got == all);
}

TEST_CASE("send_nonblocking passes an fd with the first byte, once", "[protocol][send]") {
  stream_pair s;
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  auto bytes = pattern(100, 3);
  iovec iov{bytes.data(), bytes.size()};
  const send_outcome r = send_nonblocking(s.fd[0], std::span<iovec>(&iov, 1), pipe_fds[1]);
  CHECK(r.error == 0);
  CHECK(r.sent == 100);
  std::byte buf[200];
  iovec in{buf, sizeof buf};
  alignas(cmsghdr) std::byte control[CMSG_SPACE(sizeof(int) * 2)];
  msghdr msg{};
  msg.msg_iov = &in;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  REQUIRE(::recvmsg(s.fd[1], &msg, MSG_CMSG_CLOEXEC) == 100);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  REQUIRE(c != nullptr);
  REQUIRE(c->cmsg_type == SCM_RIGHTS);
  REQUIRE(c->cmsg_len == CMSG_LEN(sizeof(int)));  // one fd
  int passed = -1;
  std::memcpy(&passed, CMSG_DATA(c), sizeof passed);
  CHECK(std::memcmp(buf, bytes.data(), 100) == 0);
  // The passed fd is the pipe's write end: what goes in comes out of the read end.
  REQUIRE(::write(passed, "x", 1) == 1);
  char x = 0;
  CHECK(::read(pipe_fds[0], &x, 1) == 1);
  CHECK(x == 'x');
  for (int f : {passed, pipe_fds[0], pipe_fds[1]}) ::close(f);
}

TEST_CASE("send_nonblocking to a closed peer is EPIPE, not SIGPIPE, and consumes nothing", "[protocol][send]") {
  stream_pair s;
  ::close(s.fd[1]);
  s.fd[1] = -1;
  auto bytes = pattern(10, 4);
  iovec iov{bytes.data(), bytes.size()};
  const send_outcome r = send_nonblocking(s.fd[0], std::span<iovec>(&iov, 1));
  CHECK(r.error == EPIPE);
  CHECK(r.sent == 0);
  CHECK(iov.iov_len == 10);
}
