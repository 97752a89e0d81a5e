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

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

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

  /// A connection over `socket` (connected and its peer checked), with the pid and pidfd
  /// of the process at the other end.
  static std::shared_ptr<server_connection> open(const boost::asio::any_io_executor& ex,
                                                 protocol::connection::socket_type socket) {
    auto c = std::make_shared<server_connection>();
    c->pid = peer_pid(socket.native_handle());
    const int fd = open_pidfd(c->pid);
    c->conn = std::make_shared<protocol::connection>(std::move(socket));
    if (fd >= 0) c->pidfd.emplace(ex, fd);
    return c;
  }

  /// Closes the socket and the pidfd (pending operations complete with operation_aborted).
  void close() {
    conn->close();
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
