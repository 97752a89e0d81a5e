#pragma once
// One connection of the connector to its server, numbered by an epoch (1, 2, ... in the
// order the connector opened them). The current one carries the calls; an older one stays
// open, read-only, while the server may still answer a call whose blocks are quarantined
// (engine/quarantine.hpp), until that answer, the server's close or its process's exit.

#include <kvtier/config.hpp>
#include <kvtier/engine/detail/server_process.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/connection.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {
namespace detail {

/// EOF, or its forms on the write side and after a crash: the server closed its end.
[[nodiscard]] inline bool closed_by_peer(const boost::system::error_code& ec) noexcept {
  return ec == boost::asio::error::eof || ec == boost::asio::error::broken_pipe ||
         ec == boost::asio::error::connection_reset;
}

struct server_connection {
  std::uint64_t epoch = 0;
  std::shared_ptr<protocol::connection> conn;
  ::pid_t pid = 0;  ///< the server's process (SO_PEERCRED), 0 when unknown
  /// Readable once that process has exited; empty when no pidfd could be opened.
  std::optional<boost::asio::posix::stream_descriptor> pidfd;
  bool broken = false;        ///< EOF, socket or stream error seen
  bool process_gone = false;  ///< the pidfd fired
  /// The server closed its end (EOF, EPIPE, ECONNRESET): it had ended every copy it started
  /// for this connection, and starts none after (docs/protocol.md), so nothing handed
  /// over on it can be written any more.
  bool closed_by_server = false;
  /// The text of an error_response with call id 0 (the server refusing this connection:
  /// a peer check or a connection cap), kept for last_error() over the EOF that follows.
  std::string refusal;

  // --- the socket's writers (server_link: "who writes") ---------------------------------
  /// Taken by every writer of the socket and by its close: an engine's thread writes frames
  /// itself (server_link::send_issued) when nothing of the link's thread is queued.
  std::mutex send_mu;
  /// Guarded by send_mu: the socket's descriptor for an engine thread's writes, -1 once
  /// closed (close_socket waits for a write in progress).
  int send_fd = -1;
  /// Guarded by send_mu: frames handed to conn's write queue whose completion has not run.
  std::size_t link_writes = 0;
  /// Guarded by send_mu: the bytes an engine thread's write left unsent (the socket was
  /// full); the link's thread writes them before anything else.
  std::vector<std::byte> unsent;

  /// A connection over `socket` (connected and its peer checked), with the pid and pidfd
  /// of the process at the other end.
  static std::shared_ptr<server_connection> open(const boost::asio::any_io_executor& ex,
                                                 protocol::connection::socket_type socket) {
    auto c = std::make_shared<server_connection>();
    c->pid = peer_pid(socket.native_handle());
    const int fd = open_pidfd(c->pid);
    c->send_fd = socket.native_handle();
    c->conn = std::make_shared<protocol::connection>(std::move(socket));
    if (fd >= 0) c->pidfd.emplace(ex, fd);
    return c;
  }

  /// Closes the socket (pending operations complete with operation_aborted), after an
  /// engine thread's write in progress.
  void close_socket() {
    std::lock_guard g(send_mu);
    send_fd = -1;
    conn->close();
  }

  /// Closes the socket and the pidfd.
  void close() {
    close_socket();
    if (pidfd) {
      error_code ignored;
      pidfd->close(ignored);
    }
  }
};

}  // namespace detail
}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
