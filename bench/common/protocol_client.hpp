#pragma once
// A blocking kvtier protocol client for benchmarks: plain POSIX socket calls on the calling
// thread (connect, sendmsg with SCM_RIGHTS for a file descriptor, read), the protocol's
// codec for the frames. No event loop, so a round trip measured with it is the server's and
// the codec's cost over the transport's, the same way a raw ping-pong is measured. Throws on
// a transport error, an undecodable reply or an error reply.
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/frame.hpp>
#include <kvtier/protocol/limits.hpp>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <variant>
#include <vector>

namespace kvtier::bench {

/// Writes all of `bytes` to `fd` (blocking, MSG_NOSIGNAL); false when the peer went away.
inline bool send_all(int fd, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t w = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    bytes = bytes.subspan(static_cast<std::size_t>(w));
  }
  return true;
}

/// Reads exactly `out.size()` bytes from `fd` (blocking); false on EOF or an error.
inline bool read_all(int fd, std::span<std::byte> out) {
  while (!out.empty()) {
    const ssize_t r = ::read(fd, out.data(), out.size());
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    out = out.subspan(static_cast<std::size_t>(r));
  }
  return true;
}

class protocol_client {
 public:
  explicit protocol_client(const std::string& socket_path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) fail("socket");
    ::sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (socket_path.size() >= sizeof(addr.sun_path)) throw std::invalid_argument("socket path too long");
    std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
    if (::connect(fd_, reinterpret_cast<const ::sockaddr*>(&addr), sizeof(addr)) != 0) fail("connect " + socket_path);
  }
  protocol_client(const protocol_client&) = delete;
  protocol_client& operator=(const protocol_client&) = delete;
  ~protocol_client() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Sends `req` (with `fd` passed by SCM_RIGHTS when >= 0) and returns its reply.
  template <class Req>
  typename Req::response_type call(const Req& req, int fd = -1) {
    const std::uint64_t id = next_++;
    auto bytes = protocol::encode_frame(id, req);
    if (!bytes) throw std::runtime_error("encode: " + bytes.error().message());
    send(*bytes, fd);
    protocol::message m = read_reply(id);
    if (auto* e = std::get_if<protocol::error_response>(&m)) throw std::runtime_error(e->message);
    return std::get<typename Req::response_type>(m);
  }

 private:
  [[noreturn]] static void fail(const std::string& what) {
    throw std::system_error(errno, std::generic_category(), what);
  }

  void send(std::span<const std::byte> bytes, int fd) {
    if (fd >= 0) {  // the first byte carries the descriptor
      ::iovec iov{const_cast<std::byte*>(bytes.data()), 1};
      alignas(::cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      ::msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ::cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
      if (::sendmsg(fd_, &msg, MSG_NOSIGNAL) != 1) fail("sendmsg");
      bytes = bytes.subspan(1);
    }
    if (!send_all(fd_, bytes)) fail("send");
  }

  void read_exact(std::span<std::byte> out) {
    errno = 0;
    if (read_all(fd_, out)) return;
    if (errno == 0) throw std::runtime_error("the server closed the connection");
    fail("read");
  }

  protocol::message read_reply(std::uint64_t id) {
    std::byte head[protocol::frame_header_size];
    read_exact(head);
    if (auto e = protocol::check_header(std::span<const std::byte>(head, sizeof(head))))
      throw std::runtime_error("bad reply header: " + e->reason);
    const protocol::frame_header h = protocol::read_header(std::span<const std::byte, protocol::frame_header_size>(head));
    if (h.call_id != id) throw std::runtime_error("a reply with another call id");
    body_.resize(h.body_bytes);
    read_exact(body_);
    auto m = protocol::decode_message(h, body_);
    if (!m) throw std::runtime_error("undecodable reply: " + m.error().reason);
    return std::move(*m);
  }

  int fd_ = -1;
  std::uint64_t next_ = 1;
  std::vector<std::byte> body_;
};

}  // namespace kvtier::bench
