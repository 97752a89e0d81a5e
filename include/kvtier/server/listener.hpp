#pragma once
// listener: the server's listening socket and who may connect (server.hpp owns one).
//
//   listen()   creates the socket at config.socket_path (mode socket_mode; the default
//              socket's directory created 0700 and trusted only when it is ours:
//              protocol/unix_socket.hpp); a live server's socket is never taken over. One of
//              the start-up checks (docs/server.md, "Start-up"): a connection made before
//              start() waits in the backlog. Throws std::runtime_error saying what to change;
//   start(f)   the accept loop: every accepted connection is checked before a byte of it is
//              read, its peer's uid (SO_PEERCRED) and the connection caps
//              (session/client_budget.hpp); a refused peer gets one error_response saying
//              why and is closed (docs/server.md, "Trust"); an admitted one goes to f with
//              its new client id;
//   close()    stops accepting (shutdown);
//   remove_socket()  removes the socket file if it is still the one listen() made (a
//              restart's new server keeps its socket); the destructor does it too.
//
// On the server's I/O thread (the executor given at construction), like everything it calls.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/session/client_budget.hpp>
#include <kvtier/telemetry/log_escaped.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/basic_socket_acceptor.hpp>
#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

class listener {
 public:
  using acceptor_type =
      boost::asio::basic_socket_acceptor<boost::asio::local::stream_protocol, boost::asio::any_io_executor>;
  using socket_type =
      boost::asio::basic_stream_socket<boost::asio::local::stream_protocol, boost::asio::any_io_executor>;
  /// Called on the I/O thread with each admitted connection and its new client id.
  using accept_handler = std::function<void(std::uint64_t client_id, socket_type socket)>;

  /// `config`, `budget` and `log` must outlive the listener.
  listener(boost::asio::any_io_executor ex, const server_config& config, client_budget& budget, telemetry::logger& log)
      : ex_(std::move(ex)), config_(config), budget_(budget), log_(log), peers_(config.peer_policy()) {}

  listener(const listener&) = delete;
  listener& operator=(const listener&) = delete;
  ~listener() {
    close();
    remove_socket();
  }

  /// Listens on config.socket_path (see the header comment). Throws std::runtime_error with
  /// what to change when the socket cannot be created.
  void listen() {
    // The default socket's directory: created 0700, and only used when it is ours and
    // nobody else may write in it (another user could otherwise put their socket there).
    if (const auto dir = protocol::default_socket_directory(); config_.socket_path == dir + "/kvtier.sock") {
      if (std::string why = protocol::prepare_private_directory(dir); !why.empty()) throw std::runtime_error(why);
    }
    protocol::listen_options lo;
    lo.mode = static_cast<::mode_t>(config_.socket_mode);
    auto acc = protocol::listen_unix(ex_, config_.socket_path, lo);
    if (!acc) throw std::runtime_error(listen_error(acc.error()));
    acceptor_.emplace(std::move(*acc));
    struct ::stat st {};
    if (::lstat(config_.socket_path.c_str(), &st) == 0) socket_file_ = file_identity{st.st_dev, st.st_ino};
  }

  /// Whether listen() succeeded and the socket is not closed.
  [[nodiscard]] bool listening() const noexcept { return acceptor_ && acceptor_->is_open(); }

  /// Starts the accept loop (after listen()): each admitted connection goes to on_accept.
  void start(accept_handler on_accept) {
    on_accept_ = std::move(on_accept);
    boost::asio::co_spawn(ex_, accept_loop(), telemetry::log_escaped{&log_, "accept loop"});
  }

  /// Stops accepting: the accept loop ends, no connection is handed over after this call.
  void close() {
    closed_ = true;
    error_code ignored;
    if (acceptor_) acceptor_->close(ignored);
  }

  /// Removes the socket file when it is still the one listen() made (see the header
  /// comment). Idempotent.
  void remove_socket() noexcept {
    if (!socket_file_) return;
    struct ::stat st {};
    if (::lstat(config_.socket_path.c_str(), &st) == 0 && st.st_dev == socket_file_->dev &&
        st.st_ino == socket_file_->ino)
      ::unlink(config_.socket_path.c_str());
    socket_file_.reset();
  }

 private:
  std::string listen_error(error_code ec) const {
    std::string fix;
    if (ec == boost::asio::error::address_in_use)
      fix = "another server is listening there: stop it or choose another --socket";
    else if (ec == boost::system::errc::file_exists)
      fix = "a file that is not a socket is in the way: remove it or choose another --socket";
    else if (ec == errc::invalid_argument)
      fix = "the path is empty or too long for a Unix socket: choose a shorter --socket";
    else
      fix = "check that the directory exists and that this user may create files there, or choose another --socket";
    return "cannot listen on " + config_.socket_path + " (" + ec.message() + "): " + fix;
  }

  boost::asio::awaitable<void> accept_loop() {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    telemetry::log_throttle throttle(std::chrono::seconds(10));
    for (;;) {
      auto [ec, socket] = co_await acceptor_->async_accept(as_tuple(use_awaitable));
      if (closed_ || ec == boost::asio::error::operation_aborted) co_return;
      if (ec) {
        if (auto hidden = throttle.allow()) log_.warn("accept failed: {} ({} more since)", ec.message(), *hidden);
        // Out of fds (EMFILE) and the like: back off instead of spinning on the error.
        boost::asio::steady_timer t(ex_, std::chrono::milliseconds(100));
        co_await t.async_wait(as_tuple(use_awaitable));
        continue;
      }
      const std::uint64_t id = next_client_id_++;
      if (!admit(id, socket)) continue;
      on_accept_(id, std::move(socket));
    }
  }

  /// The checks of a new connection before anything of it is read: its peer's uid (SO_PEERCRED)
  /// and the connection caps. A refused connection gets one error_response and is closed.
  template <class Socket>
  bool admit(std::uint64_t id, Socket& socket) {
    auto peer = protocol::peer_credentials(socket.native_handle());
    std::optional<client_budget::refusal> refusal;
    ::uid_t uid = static_cast<::uid_t>(-1);
    if (!peer) {
      refusal = client_budget::refusal::peer_uid;  // unknown credentials: not served
    } else {
      uid = peer->uid;
      if (!peers_.allows(*peer))
        refusal = client_budget::refusal::peer_uid;
      else
        refusal = budget_.admit(id, peer->uid);
    }
    if (!refusal) return true;
    budget_.count(*refusal);
    const errc code = *refusal == client_budget::refusal::peer_uid ? errc::permission_denied : errc::over_budget;
    const std::string why = peer ? budget_.refusal_message(*refusal, uid)
                                 : "cannot read the peer's credentials (" + peer.error().message() + ")";
    // A small frame into an empty socket buffer: never blocks, and the peer can read why.
    if (auto frame = protocol::encode_frame(0, protocol::error_response::make(code, why)))
      (void)::send(socket.native_handle(), frame->data(), frame->size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    error_code ignored;
    socket.close(ignored);
    auto& throttle = refusal_log_[static_cast<std::size_t>(*refusal)];
    if (auto hidden = throttle.allow())
      log_.warn("refused a connection from {}: {}{}", peer ? peer->describe() : std::string("an unknown peer"), why,
                *hidden ? fmt::format(" ({} more refused since)", *hidden) : std::string());
    return false;
  }

  boost::asio::any_io_executor ex_;
  const server_config& config_;
  client_budget& budget_;
  telemetry::logger& log_;
  protocol::peer_policy peers_;
  /// One throttle per refusal reason: each refusal is a line, but a peer that reconnects in a
  /// loop makes at most 20 lines per 10 s, the next one with the count of those held back.
  std::array<telemetry::log_throttle, client_budget::refusal_count> refusal_log_{
      telemetry::log_throttle(std::chrono::seconds(10), 20), telemetry::log_throttle(std::chrono::seconds(10), 20),
      telemetry::log_throttle(std::chrono::seconds(10), 20)};
  struct file_identity {
    ::dev_t dev;
    ::ino_t ino;
  };
  std::optional<acceptor_type> acceptor_;
  std::optional<file_identity> socket_file_;  ///< the socket file listen() made, until removed
  accept_handler on_accept_;
  std::uint64_t next_client_id_ = 1;
  bool closed_ = false;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
