#pragma once
// admin_client: the `kvtier` program's connection to a kvtier-server, one request at a time,
// blocking, each answer awaited up to a timeout (poll(2) on a plain Unix socket: a command
// line needs no event loop). Frames are encoded and decoded by kvtier::protocol (codec.hpp,
// frame_decoder.hpp), as the server does.
//
//   admin_client c(path);                         // throws cli_error (exit 3) when nobody listens
//   auto r = c.call(protocol::ping_request{}, 5s);   // the response, or cli_error:
//                                                 //   refused (error_response, exit 1),
//                                                 //   no answer in time / closed (exit 3)

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/frame_decoder.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace kvtier_cli {

namespace p = kvtier::protocol;

/// Exit statuses of the program (docs/server.md, "Administration").
enum exit_status : int {
  exit_ok = 0,
  exit_refused = 1,     ///< the server refused, or did not do all of it, or the user did not confirm
  exit_usage = 2,       ///< a bad command line
  exit_no_server = 3,   ///< nobody listens on the socket, or no answer in time
};

/// A failure the program reports in one line and exits with `status`.
struct cli_error : std::runtime_error {
  cli_error(int status, const std::string& what) : std::runtime_error(what), status(status) {}
  int status;
};

class admin_client {
 public:
  /// Connects to the server's socket at `path`.
  explicit admin_client(std::string path) : path_(std::move(path)) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw cli_error(exit_no_server, "cannot create a socket: " + std::string(std::strerror(errno)));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    if (path_.empty() || path_.size() >= sizeof a.sun_path)
      throw cli_error(exit_usage, "'" + path_ + "' cannot be a Unix socket path (empty, or longer than " +
                                      std::to_string(sizeof a.sun_path - 1) + " bytes)");
    std::memcpy(a.sun_path, path_.data(), path_.size());
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
      const int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw cli_error(exit_no_server,
                      "cannot connect to " + path_ + " (" + std::strerror(e) +
                          "): is kvtier-server running there? (--socket names another socket; the default is " +
                          p::default_socket_path() + ")");
    }
  }
  admin_client(const admin_client&) = delete;
  admin_client& operator=(const admin_client&) = delete;
  ~admin_client() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Sends `req` and waits up to `timeout` for its response. An error_response (with this
  /// call's id, or id 0: the server refused the connection at accept) throws cli_error
  /// (exit_refused) with the server's message.
  template <class Req>
  typename Req::response_type call(const Req& req, std::chrono::milliseconds timeout) {
    const std::uint64_t id = next_call_++;
    auto frame = p::encode_frame(id, req);
    if (!frame) throw cli_error(exit_usage, std::string(p::name(Req::type)) + ": " + frame.error().message());
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    send_all(*frame, Req::type);
    for (;;) {
      p::frame f = read_frame(deadline, Req::type);
      if (f.header.call_id != id && f.header.call_id != 0) continue;  // not ours (nothing else is in flight)
      auto m = p::decode_message(f);
      if (!m) throw cli_error(exit_no_server, "an answer that does not decode: " + m.error().reason);
      if (auto* e = std::get_if<p::error_response>(&*m))
        throw cli_error(exit_refused, "the server refused " + std::string(p::name(Req::type)) + ": " + e->message +
                                          " (" + e->error().message() + ")");
      if (auto* r = std::get_if<typename Req::response_type>(&*m)) return std::move(*r);
      throw cli_error(exit_no_server, "an unexpected answer to " + std::string(p::name(Req::type)) + ": " +
                                          std::string(p::name(p::type_of(*m))));
    }
  }

  /// Who the server is (SO_PEERCRED at connect), or nullopt.
  [[nodiscard]] std::optional<p::peer_identity> server_identity() const {
    auto id = p::peer_credentials(fd_);
    if (!id) return std::nullopt;
    return *id;
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  void send_all(const std::vector<std::byte>& bytes, p::message_type what) {
    std::size_t at = 0;
    while (at < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        // The server may have refused the connection and closed it: its reason is waiting.
        if (auto why = pending_refusal()) throw cli_error(exit_refused, "the server refused the connection: " + *why);
        throw cli_error(exit_no_server,
                        "cannot send " + std::string(p::name(what)) + " to " + path_ + ": " + std::strerror(errno));
      }
      at += static_cast<std::size_t>(n);
    }
  }

  /// The message of an error_response already received (a refusal at accept), if any.
  std::optional<std::string> pending_refusal() {
    try {
      p::frame f = read_frame(std::chrono::steady_clock::now() + std::chrono::milliseconds(100), p::message_type{});
      auto m = p::decode_message(f);
      if (m)
        if (auto* e = std::get_if<p::error_response>(&*m)) return e->message;
    } catch (const cli_error&) {
    }
    return std::nullopt;
  }

  p::frame read_frame(std::chrono::steady_clock::time_point deadline, p::message_type what) {
    for (;;) {
      auto next = decoder_.next();
      if (!next) throw cli_error(exit_no_server, "a malformed answer: " + next.error().reason);
      if (*next) return std::move(**next);
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        throw cli_error(exit_no_server, "no answer to " + std::string(p::name(what)) + " from " + path_ +
                                            " in time (--timeout): the server is busy or hung");
      ::pollfd pf{fd_, POLLIN, 0};
      const int r = ::poll(&pf, 1, static_cast<int>(left.count()));
      if (r < 0 && errno != EINTR) throw cli_error(exit_no_server, std::string("poll: ") + std::strerror(errno));
      if (r <= 0) continue;
      std::byte buf[64 * 1024];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw cli_error(exit_no_server, "the server closed the connection (" +
                                            std::string(n == 0 ? "end of stream" : std::strerror(errno)) + ")");
      decoder_.feed(std::span<const std::byte>(buf, static_cast<std::size_t>(n)));
    }
  }

  std::string path_;
  int fd_ = -1;
  p::frame_decoder decoder_;
  std::uint64_t next_call_ = 1;
};

}  // namespace kvtier_cli
