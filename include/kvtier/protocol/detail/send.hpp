#pragma once
// send_nonblocking: the one sendmsg loop of a stream socket's writers. protocol::connection
// writes its queue with it (one frame at a time, an fd beside the first byte), and the
// engine connector's threads write their calls with it (many frames in one call, outside the
// connection's queue, under the connector's send lock: engine/detail/server_link.hpp).

#include <kvtier/config.hpp>

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <span>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {
namespace detail {

/// What send_nonblocking did.
struct send_outcome {
  std::size_t sent = 0;  ///< bytes written (those of `iov` are consumed: see below)
  int error = 0;         ///< 0: all written; EAGAIN: the socket is full; else sendmsg's errno
};

/// Writes `iov` to `socket` without blocking (MSG_DONTWAIT, MSG_NOSIGNAL: a closed peer is
/// EPIPE, not SIGPIPE), sendmsg after sendmsg until every byte is written, the socket is
/// full or an error; EINTR is retried. `pass_fd` >= 0 goes with the first byte written
/// (SCM_RIGHTS; a stream socket delivers it with that byte). `iov` is advanced past what
/// was written, so a caller that gets EAGAIN holds the rest in it.
inline send_outcome send_nonblocking(int socket, std::span<iovec> iov, int pass_fd = -1) {
  constexpr std::size_t max_iov = 1024;  // Linux's UIO_MAXIOV
  send_outcome out;
  std::size_t first = 0;  // iov[first] is the first piece not fully written
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min(iov.size() - first, max_iov);
    alignas(cmsghdr) std::byte control[CMSG_SPACE(sizeof(int))];
    if (pass_fd >= 0) {
      std::memset(control, 0, sizeof control);
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &pass_fd, sizeof pass_fd);
    }
    const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      out.error = errno == EWOULDBLOCK ? EAGAIN : errno;
      return out;
    }
    pass_fd = -1;  // sent with the first byte: the peer holds its own reference now
    out.sent += static_cast<std::size_t>(n);
    for (std::size_t left = static_cast<std::size_t>(n); left > 0;) {
      const std::size_t take = std::min(left, iov[first].iov_len);
      iov[first].iov_base = static_cast<std::byte*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      left -= take;
      while (first < iov.size() && iov[first].iov_len == 0) ++first;
    }
  }
  return out;
}

}  // namespace detail
}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
