#pragma once
// Creating the server's listening Unix-domain socket and connecting to it: listen_unix
// (never steals a live socket; the mode set with no window), connect_unix,
// async_connect_unix; who is on the other end (peer_credentials, peer_policy); the default
// socket's private directory (default_socket_directory, default_socket_path,
// prepare_private_directory). docs/protocol.md, "Listening and connecting", holds the rules;
// docs/server.md, "Trust", why.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>

#include <boost/asio/async_result.hpp>
#include <boost/asio/basic_socket_acceptor.hpp>
#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/compose.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

struct listen_options {
  /// Permission bits of the socket file.
  ::mode_t mode = 0600;
  /// listen(2) backlog.
  int backlog = SOMAXCONN;
};

namespace detail {

inline error_code errno_code(int e = errno) noexcept { return {e, boost::system::system_category()}; }

/// A pathname endpoint, or invalid_argument when the path is empty or does not fit in
/// sockaddr_un (107 bytes on Linux).
inline result<boost::asio::local::stream_protocol::endpoint> unix_endpoint(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path) || path.find('\0') != std::string::npos)
    return make_error_code(errc::invalid_argument);
  return boost::asio::local::stream_protocol::endpoint(path);
}

/// True when something accepts connections at `path` (or may: a full backlog).
inline result<bool> someone_listens(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return {boost::system::in_place_error, errno_code()};
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  const int e = errno;
  ::close(fd);
  if (rc == 0) return true;
  // A listener whose backlog is full answers EAGAIN to a non-blocking connect: alive.
  if (e == EAGAIN || e == EINPROGRESS) return true;
  if (e == ECONNREFUSED || e == ENOENT) return false;
  return {boost::system::in_place_error, errno_code(e)};
}

template <class Socket>
struct connect_op {
  std::unique_ptr<Socket> socket;
  result<boost::asio::local::stream_protocol::endpoint> ep;
  bool started = false;

  template <class Self>
  void operator()(Self& self, error_code ec = {}) {
    if (!started) {
      started = true;
      if (!ep) {
        // Fail through the executor, never inside the initiating call.
        boost::asio::post(socket->get_executor(), std::move(self));
        return;
      }
      socket->async_connect(*ep, std::move(self));
      return;
    }
    if (!ep) ec = ep.error();
    self.complete(ec, std::move(*socket));
  }
};

}  // namespace detail

/// The process at the other end of a connected Unix socket, as the kernel recorded it when
/// the connection was made (connect(2) for a client, listen(2) for a server).
struct peer_identity {
  ::pid_t pid = 0;
  ::uid_t uid = 0;
  ::gid_t gid = 0;              ///< primary group
  std::vector<::gid_t> groups;  ///< supplementary groups (SO_PEERGROUPS; empty when unknown)

  /// "uid 1000 (pid 4242)".
  [[nodiscard]] std::string describe() const {
    return "uid " + std::to_string(uid) + " (pid " + std::to_string(pid) + ")";
  }
};

/// The credentials of the peer of the connected Unix socket `fd` (SO_PEERCRED, and the
/// supplementary groups where the kernel has SO_PEERGROUPS, Linux 4.13).
[[nodiscard]] inline result<peer_identity> peer_credentials(int fd) {
  ::ucred cred{};
  ::socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return detail::errno_code();
  if (len != sizeof cred) return make_error_code(errc::unsupported);
  peer_identity p{cred.pid, cred.uid, cred.gid, {}};
#ifdef SO_PEERGROUPS
  std::vector<::gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    ::socklen_t bytes = static_cast<::socklen_t>(groups.size() * sizeof(::gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0) {
      groups.resize(bytes / sizeof(::gid_t));
      p.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;
    groups.resize(bytes / sizeof(::gid_t) + 1);
  }
#endif
  return p;
}

/// Which peers a side accepts: its own effective uid, root (which can read any process's
/// memory anyway), and the uids and groups named here.
struct peer_policy {
  std::vector<::uid_t> uids;  ///< more users
  std::vector<::gid_t> gids;  ///< members of these groups (primary or supplementary)

  [[nodiscard]] bool allows(const peer_identity& p) const {
    if (p.uid == ::geteuid() || p.uid == 0) return true;
    if (std::find(uids.begin(), uids.end(), p.uid) != uids.end()) return true;
    if (std::find(gids.begin(), gids.end(), p.gid) != gids.end()) return true;
    for (const ::gid_t g : p.groups)
      if (std::find(gids.begin(), gids.end(), g) != gids.end()) return true;
    return false;
  }
};

/// The directory of the default socket: $XDG_RUNTIME_DIR/kvtier (a per-user directory the
/// session manager creates 0700), /run/kvtier when running as root, else
/// ${TMPDIR:-/tmp}/kvtier-<uid>.
[[nodiscard]] inline std::string default_socket_directory() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg == '/') return std::string(xdg) + "/kvtier";
  const ::uid_t uid = ::geteuid();
  if (uid == 0) return "/run/kvtier";
  const char* tmp = std::getenv("TMPDIR");
  std::string base = tmp != nullptr && *tmp == '/' ? std::string(tmp) : std::string("/tmp");
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  return base + "/kvtier-" + std::to_string(uid);
}

/// The default socket of the server and of every program that connects to it.
[[nodiscard]] inline std::string default_socket_path() { return default_socket_directory() + "/kvtier.sock"; }

/// Creates `dir` with mode 0700 when it does not exist (its parent must), then checks that
/// it is a directory (not a symlink), owned by this process's effective uid and writable by
/// nobody else. Empty when it may hold the socket; otherwise what is wrong and what to do.
[[nodiscard]] inline std::string prepare_private_directory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return "cannot create the socket directory " + dir + " (" + std::strerror(errno) +
           "): create it (mode 0700) or choose another --socket";
  struct ::stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    return "cannot inspect the socket directory " + dir + " (" + std::strerror(errno) + ")";
  if (!S_ISDIR(st.st_mode))
    return "the socket directory " + dir +
           " is not a directory (a symlink or a file someone put there): remove it or choose another --socket";
  if (st.st_uid != ::geteuid())
    return "the socket directory " + dir + " is owned by uid " + std::to_string(st.st_uid) +
           ", not by this user (uid " + std::to_string(::geteuid()) +
           "): another user may have made it to catch the socket; remove it or choose another --socket";
  if ((st.st_mode & 022) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return "the socket directory " + dir + " has mode " + mode + ": group or others may write there; chmod 700 " + dir +
           " or choose another --socket";
  }
  return {};
}

/// Listens on the Unix-domain socket `path` (the rules: docs/protocol.md, "Listening and connecting").
template <class Executor>
[[nodiscard]] result<boost::asio::basic_socket_acceptor<boost::asio::local::stream_protocol, Executor>> listen_unix(
    const Executor& ex, const std::string& path, const listen_options& options = {}) {
  using acceptor_type = boost::asio::basic_socket_acceptor<boost::asio::local::stream_protocol, Executor>;
  auto ep = detail::unix_endpoint(path);
  if (!ep) return ep.error();

  struct ::stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) return make_error_code(boost::system::errc::file_exists);
    auto live = detail::someone_listens(path);
    if (!live) return live.error();
    if (*live) return make_error_code(boost::asio::error::address_in_use);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return detail::errno_code();
  } else if (errno != ENOENT) {
    return detail::errno_code();
  }

  acceptor_type acceptor(ex);
  error_code ec;
  acceptor.open(ep->protocol(), ec);
  if (ec) return ec;
  if (::fchmod(acceptor.native_handle(), options.mode) != 0) return detail::errno_code();
  acceptor.bind(*ep, ec);
  if (ec) return ec;
  if (::chmod(path.c_str(), options.mode) != 0) {
    const error_code e = detail::errno_code();
    ::unlink(path.c_str());
    return e;
  }
  acceptor.listen(options.backlog, ec);
  if (ec) {
    ::unlink(path.c_str());
    return ec;
  }
  return acceptor;
}

/// Connects to the Unix-domain socket `path` (a local connect completes at once, or fails:
/// ECONNREFUSED when nothing listens, ENOENT when there is no such file).
template <class Executor>
[[nodiscard]] result<boost::asio::basic_stream_socket<boost::asio::local::stream_protocol, Executor>> connect_unix(
    const Executor& ex, const std::string& path) {
  auto ep = detail::unix_endpoint(path);
  if (!ep) return ep.error();
  boost::asio::basic_stream_socket<boost::asio::local::stream_protocol, Executor> socket(ex);
  error_code ec;
  socket.connect(*ep, ec);
  if (ec) return ec;
  return socket;
}

/// Connects asynchronously. Completion: void(error_code, socket), on the handler's
/// associated executor; cancellation as Asio's socket::async_connect (terminal: the socket
/// is closed and operation_aborted reported).
template <class Executor, class Token>
auto async_connect_unix(const Executor& ex, const std::string& path, Token&& token) {
  using socket_type = boost::asio::basic_stream_socket<boost::asio::local::stream_protocol, Executor>;
  auto socket = std::make_unique<socket_type>(ex);
  auto& io = *socket;
  return boost::asio::async_compose<Token, void(error_code, socket_type)>(
      detail::connect_op<socket_type>{std::move(socket), detail::unix_endpoint(path)}, token, io);
}

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
