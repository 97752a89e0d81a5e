#pragma once
// Shared by the tests that play a hostile or careless neighbour against the real
// kvtier-server process (tests/server/peer_test.cpp, hostile_test.cpp, l2_process_test.cpp):
// a blocking HTTP client for the metrics endpoint, the endpoint's URL from the startup line,
// a metric's value from the exposition, the server's resident memory, raw protocol frames
// over a plain socket (for a child process that plays another user), and a launcher that
// tells "refused to start" from "started".

#include "server/server_fixtures.hpp"
#include "support/other_user.hpp"

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/frame_decoder.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::test {

// --- HTTP ------------------------------------------------------------------------------

/// A TCP connection to 127.0.0.1:port (blocking); -1 when the connect fails.
inline int tcp_connect(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct http_reply {
  int status = 0;    ///< 0: no (complete) answer
  std::string head;  ///< status line and headers
  std::string body;
  std::string error;  ///< why there is no answer
};

/// Sends `request` (raw bytes) on a fresh connection and reads the answer until the server
/// closes or Content-Length bytes of body came; gives up after `timeout`.
inline http_reply http_exchange(
    std::uint16_t port, const std::string& request,
    std::chrono::milliseconds timeout = std::chrono::duration_cast<std::chrono::milliseconds>(server_deadline)) {
  http_reply r;
  const int fd = tcp_connect(port);
  if (fd < 0) {
    r.error = std::string("connect: ") + std::strerror(errno);
    return r;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (405) and close before reading a body
    sent += static_cast<std::size_t>(n);
  }
  std::string in;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.error = "timed out";
      break;
    }
    ::pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0) {
      r.error = std::string("recv: ") + std::strerror(errno);
      break;
    }
    if (n == 0) break;
    in.append(buf, static_cast<std::size_t>(n));
    const auto end = in.find("\r\n\r\n");
    if (end != std::string::npos) {
      const auto cl = in.find("Content-Length: ");
      if (cl != std::string::npos && cl < end) {
        const std::size_t len = std::stoul(in.substr(cl + 16));
        if (in.size() >= end + 4 + len) break;
      }
    }
  }
  ::close(fd);
  const auto end = in.find("\r\n\r\n");
  if (end == std::string::npos || !in.starts_with("HTTP/1.1 ")) {
    if (r.error.empty()) r.error = in.empty() ? "closed without an answer" : "not an HTTP answer: " + in.substr(0, 80);
    return r;
  }
  r.status = std::stoi(in.substr(9, 3));
  r.head = in.substr(0, end);
  r.body = in.substr(end + 4);
  return r;
}

inline http_reply http_get(std::uint16_t port, const std::string& path) {
  return http_exchange(port, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
}

/// The port of the HTTP endpoint from the server's startup line ("metrics http://a:PORT/metrics").
inline std::uint16_t wait_metrics_port(server_process& proc) {
  const auto deadline = std::chrono::steady_clock::now() + server_deadline;
  for (;;) {
    const std::string out = proc.stdout_text();
    const auto at = out.find("metrics http://");
    if (at != std::string::npos) {
      const auto colon = out.find(':', at + 15);
      const auto slash = out.find("/metrics", at + 15);
      if (colon != std::string::npos && slash != std::string::npos && slash > colon)
        return static_cast<std::uint16_t>(std::stoul(out.substr(colon + 1, slash - colon - 1)));
    }
    if (std::chrono::steady_clock::now() > deadline) FAIL("no metrics URL in the startup line\n" << proc.output());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// The metric from the server's /metrics (Catch2: fails when the endpoint does not answer).
inline double scrape(std::uint16_t port, const std::string& series) {
  const http_reply r = http_get(port, "/metrics");
  INFO(r.error);
  REQUIRE(r.status == 200);
  const auto v = metric_value(r.body, series);
  INFO(series);
  REQUIRE(v.has_value());
  return *v;
}

// --- processes -------------------------------------------------------------------------

/// VmRSS of process `pid` in bytes (0 when unknown).
inline std::uint64_t resident_bytes(::pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with("VmRSS:")) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

/// Starts kvtier-server with `args` and waits until it either listens on `socket` (returns
/// nullopt; the process is left running in `proc`) or exits (returns its wait status).
inline std::optional<int> start_or_exit(server_process& proc, const std::string& socket) {
  asio::io_context io;
  const auto deadline = std::chrono::steady_clock::now() + server_deadline;
  for (;;) {
    if (auto s = p::connect_unix(io.get_executor(), socket)) return std::nullopt;
    if (auto st = proc.try_exit()) return st;
    if (std::chrono::steady_clock::now() > deadline)
      FAIL("kvtier-server neither listened nor exited\n" << proc.output());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// Lines of `text` that contain `what`.
inline std::size_t count_lines(const std::string& text, const std::string& what) {
  std::istringstream in(text);
  std::string line;
  std::size_t n = 0;
  while (std::getline(in, line))
    if (line.find(what) != std::string::npos) ++n;
  return n;
}

// --- raw protocol over a plain socket (no Asio: usable in a forked child) ---------------

/// Connects to the Unix socket `path`; -1 with errno on failure.
inline int unix_connect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), std::min(path.size(), sizeof a.sun_path - 1));
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/// Sends one encoded message; false on a write error.
template <class Msg>
bool send_message(int fd, std::uint64_t call_id, const Msg& m) {
  auto encoded = p::encode_frame(call_id, m);
  if (!encoded) return false;
  const std::vector<std::byte>& bytes = *encoded;
  std::size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return false;
    at += static_cast<std::size_t>(n);
  }
  return true;
}

/// Reads one message (blocking, up to `timeout`); nullopt at EOF, on an error or a timeout.
inline std::optional<p::message> read_message(int fd, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  p::frame_decoder d;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto next = d.next();
    if (!next) return std::nullopt;
    if (*next) {
      auto m = p::decode_message(**next);
      if (!m) return std::nullopt;
      return std::move(*m);
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    ::pollfd pf{fd, POLLIN, 0};
    if (::poll(&pf, 1, static_cast<int>(left.count())) <= 0) continue;
    std::byte buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return std::nullopt;
    d.feed(std::span<const std::byte>(buf, static_cast<std::size_t>(n)));
  }
}

/// What a ping over a fresh connection to `path` gets: the exit codes of a child process.
enum ping_outcome : int { ping_answered = 0, ping_refused = 1, ping_closed = 2, ping_no_connect = 3 };

/// Connects to `path`, pings, and classifies the answer; with `refusal` set, an
/// error_response's message is written there.
inline int ping_over_plain_socket(const std::string& path, std::string* refusal = nullptr) {
  const int fd = unix_connect(path);
  if (fd < 0) return ping_no_connect;
  int rc = ping_closed;
  // A refusing server may have answered and closed before the ping goes out (EPIPE): read
  // its answer either way.
  (void)send_message(fd, 1, p::ping_request{7});
  if (auto m = read_message(fd)) {
    if (std::holds_alternative<p::ping_response>(*m)) rc = ping_answered;
    if (auto* e = std::get_if<p::error_response>(&*m)) {
      rc = ping_refused;
      if (refusal) *refusal = e->message;
    }
  }
  ::close(fd);
  return rc;
}

}  // namespace kvtier::test
