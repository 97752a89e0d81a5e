#pragma once
// connection: frames over one Unix-domain stream socket, with file descriptors passed
// beside them (SCM_RIGHTS): async_read_frame, async_write_frame, async_send (encode + write).
// Asio cannot send or receive ancillary data, so reads and writes are raw recvmsg/sendmsg
// driven by the socket's readiness; everything else is Asio-shaped. docs/protocol.md,
// "Connection" and "File descriptors", holds the rules: threads, one read at a time, writes
// queued in order, errors, cancellation, the fds received, close().

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/detail/send.hpp>
#include <kvtier/protocol/frame.hpp>
#include <kvtier/protocol/frame_decoder.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>

#include <boost/asio/any_completion_executor.hpp>
#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/basic_stream_socket.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/compose.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/execution/outstanding_work.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/prefer.hpp>

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// Most fds one recvmsg accepts; more in one message is MSG_CTRUNC, a protocol error (the
/// protocol sends one).
inline constexpr std::size_t max_fds_per_read = 8;

/// Used from one thread at a time, like an Asio socket: its executor is a single-threaded
/// io_context or a strand. Every completion handler runs on its associated executor, never
/// inside the initiating call. Destroying a connection with operations in flight is safe.
template <class Executor = boost::asio::any_io_executor>
class basic_connection {
 public:
  using executor_type = Executor;
  using protocol_type = boost::asio::local::stream_protocol;
  using socket_type = boost::asio::basic_stream_socket<protocol_type, Executor>;

  /// Takes a connected socket. `lim` bounds the frames read and written.
  explicit basic_connection(socket_type socket, const limits& lim = {})
      : state_(std::make_shared<state>(std::move(socket), lim)) {}

  basic_connection(basic_connection&&) noexcept = default;
  basic_connection& operator=(basic_connection&& other) noexcept {
    if (this != &other) {
      close();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  basic_connection(const basic_connection&) = delete;
  basic_connection& operator=(const basic_connection&) = delete;
  ~basic_connection() { close(); }

  [[nodiscard]] executor_type get_executor() const noexcept { return state_->socket.get_executor(); }
  /// The socket (peer credentials, buffer sizes, ...). Do not read or write it directly.
  [[nodiscard]] socket_type& socket() noexcept { return state_->socket; }
  [[nodiscard]] bool is_open() const noexcept { return state_ && state_->socket.is_open(); }
  [[nodiscard]] const limits& frame_limits() const noexcept { return state_->lim; }

  /// Closes the socket; pending operations complete with operation_aborted.
  void close() noexcept {
    if (!state_) return;
    error_code ignored;
    state_->socket.close(ignored);
  }

  /// The reason of the fatal read error (stream malformed or control data truncated), with
  /// the call id to answer; null when reads have not failed that way.
  [[nodiscard]] const decode_error* last_read_error() const noexcept {
    return state_->read_error ? &*state_->read_error : nullptr;
  }

  /// Writes queued behind the one in flight, plus that one.
  [[nodiscard]] std::size_t queued_writes() const noexcept { return state_->writes.size(); }

  /// Reads the next frame. Completion: void(error_code, frame).
  template <class Token>
  auto async_read_frame(Token&& token) {
    return boost::asio::async_compose<Token, void(error_code, frame)>(read_op{state_}, token, state_->socket);
  }

  /// Writes one encoded frame (`bytes`, taken), without an fd. Completion: void(error_code).
  template <class Token>
  auto async_write_frame(std::vector<std::byte> bytes, Token&& token) {
    return initiate_write(result<std::vector<std::byte>>(std::move(bytes)), -1, std::forward<Token>(token));
  }

  /// Writes one encoded frame with a duplicate of `fd` passed beside it (fd < 0: none). Any
  /// frame type is sent as given; the receiver keeps fds of register_kv_request only.
  template <class Token>
  auto async_write_frame(std::vector<std::byte> bytes, int fd, Token&& token) {
    return initiate_write(result<std::vector<std::byte>>(std::move(bytes)), fd, std::forward<Token>(token));
  }

  /// Encodes `msg` with `call_id` (codec.hpp; encode errors complete the operation) and
  /// writes it. Completion: void(error_code).
  template <wire_message T, class Token>
  auto async_send(std::uint64_t call_id, const T& msg, Token&& token) {
    return initiate_write(encode_frame(call_id, msg, state_->lim), -1, std::forward<Token>(token));
  }

  /// The same for a message held in the variant.
  template <class Token>
  auto async_send(std::uint64_t call_id, const message& msg, Token&& token) {
    return initiate_write(encode_frame(call_id, msg, state_->lim), -1, std::forward<Token>(token));
  }

  /// The same with an fd passed beside the frame: only for a type that carries one
  /// (register_kv_request), else the operation fails with errc::invalid_argument.
  template <wire_message T, class Token>
  auto async_send(std::uint64_t call_id, const T& msg, int fd, Token&& token) {
    if (!carries_fd(T::type) && fd >= 0)
      return initiate_write(result<std::vector<std::byte>>(make_error_code(errc::invalid_argument)), -1,
                            std::forward<Token>(token));
    return initiate_write(encode_frame(call_id, msg, state_->lim), fd, std::forward<Token>(token));
  }

 private:
  struct pending_write {
    std::vector<std::byte> bytes;
    std::size_t sent = 0;
    unique_fd fd;  ///< our duplicate; sent with the first byte, then closed
    boost::asio::any_completion_handler<void(error_code)> handler;
    boost::asio::any_completion_executor handler_work;  ///< keeps the handler's executor busy
  };

  struct state : std::enable_shared_from_this<state> {
    state(socket_type s, const limits& l) : socket(std::move(s)), lim(l), decoder(l) {}

    socket_type socket;
    limits lim;
    // Read side.
    frame_decoder decoder;
    bool reading = false;
    error_code read_ec;                     ///< sticky: eof, socket error, fatal stream error
    std::optional<decode_error> read_error; ///< reason of a fatal stream error
    // Write side.
    std::deque<pending_write> writes;
    bool writing = false;
    error_code write_ec;  ///< sticky: the stream is broken for writing

    void fail_read(decode_error e) {
      read_ec = e.code;
      read_error = std::move(e);
    }

    // Sends queued frames until the queue is empty or the socket is full (then waits for
    // writability and resumes). Runs on the socket's executor.
    void pump() {
      while (!writes.empty()) {
        pending_write& w = writes.front();
        if (write_ec) {
          complete_front(write_ec);
          continue;
        }
        iovec iov{w.bytes.data() + w.sent, w.bytes.size() - w.sent};
        const detail::send_outcome r =
            detail::send_nonblocking(socket.native_handle(), std::span<iovec>(&iov, 1), w.fd ? w.fd.get() : -1);
        if (r.sent > 0) w.fd.reset();  // sent with the first byte: the peer holds its own reference now
        w.sent += r.sent;
        if (r.error == EAGAIN) {
          socket.async_wait(socket_type::wait_write, [self = this->shared_from_this()](error_code ec) {
            if (ec && !self->write_ec) self->write_ec = ec;
            self->pump();
          });
          return;  // still writing
        }
        if (r.error != 0) {
          write_ec = error_code(r.error, boost::system::system_category());
          continue;
        }
        complete_front({});
      }
      writing = false;
    }

    void complete_front(error_code ec) {
      pending_write w = std::move(writes.front());
      writes.pop_front();
      post_completion(std::move(w.handler), std::move(w.handler_work), ec);
    }

    // Never inside the initiating call: post to the socket's executor, then dispatch to the
    // handler's own executor (Asio's rule for operations that finish at once).
    void post_completion(boost::asio::any_completion_handler<void(error_code)> h,
                         boost::asio::any_completion_executor work, error_code ec) {
      boost::asio::post(socket.get_executor(), [h = std::move(h), work = std::move(work), ec]() mutable {
        auto ex = std::move(work);
        boost::asio::dispatch(ex, [h = std::move(h), ec]() mutable { std::move(h)(ec); });
      });
    }
  };

  struct read_op {
    std::shared_ptr<state> st;
    enum class phase : std::uint8_t { start, running, completing } at = phase::start;
    error_code result_ec{};
    frame result{};

    template <class Self>
    void operator()(Self& self, error_code ec = {}) {
      state& s = *st;
      switch (at) {
        case phase::start:
          if (s.reading) {
            // A concurrent read: refuse it without touching the one in flight.
            result_ec = boost::asio::error::already_started;
            at = phase::completing;
            boost::asio::post(s.socket.get_executor(), std::move(self));
            return;
          }
          s.reading = true;
          self.reset_cancellation_state(boost::asio::enable_total_cancellation());
          step(self, true);
          return;
        case phase::running:
          if (ec) return finish(self, ec, frame{}, false);  // cancelled or closed: not sticky
          step(self, false);
          return;
        case phase::completing:
          if (result_ec != boost::asio::error::already_started) s.reading = false;
          self.complete(result_ec, std::move(result));
          return;
      }
    }

    template <class Self>
    void step(Self& self, bool first_call) {
      state& s = *st;
      for (;;) {
        auto next = s.decoder.next();
        if (!next) {
          s.fail_read(next.error());
          return finish(self, s.read_ec, frame{}, first_call);
        }
        if (*next) return finish(self, {}, std::move(**next), first_call);
        if (s.read_ec) return finish(self, s.read_ec, frame{}, first_call);

        const std::size_t want = std::max<std::size_t>(s.decoder.bytes_needed(), std::size_t{64} << 10);
        const std::span<std::byte> space = s.decoder.prepare(want);
        iovec iov{space.data(), space.size()};
        alignas(cmsghdr) std::byte control[CMSG_SPACE(sizeof(int) * max_fds_per_read)];
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        const ssize_t n = ::recvmsg(s.socket.native_handle(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) {
            at = phase::running;
            s.socket.async_wait(socket_type::wait_read, std::move(self));
            return;
          }
          s.read_ec = error_code(errno, boost::system::system_category());
          continue;  // reports the error (after any frame already buffered: none here)
        }
        std::vector<unique_fd> fds = take_fds(msg);  // owned from here on, whatever happens
        if ((msg.msg_flags & MSG_CTRUNC) != 0) {
          s.fail_read(detail::make_error(errc::protocol_error,
                                         "control data truncated (more than " + std::to_string(max_fds_per_read) +
                                             " fds in one message)"));
          continue;
        }
        if (n == 0) {
          s.read_ec = boost::asio::error::eof;
          continue;
        }
        s.decoder.commit(static_cast<std::size_t>(n), std::move(fds));
      }
    }

    static std::vector<unique_fd> take_fds(msghdr& msg) {
      std::vector<unique_fd> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          fds.emplace_back(fd);
        }
      }
      return fds;
    }

    template <class Self>
    void finish(Self& self, error_code ec, frame f, bool first_call) {
      if (first_call) {
        // Still inside async_read_frame: complete through the executor.
        result_ec = ec;
        result = std::move(f);
        at = phase::completing;
        boost::asio::post(st->socket.get_executor(), std::move(self));
        return;
      }
      st->reading = false;
      self.complete(ec, std::move(f));
    }
  };

  template <class Token>
  auto initiate_write(result<std::vector<std::byte>> bytes, int fd, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code)>(
        [](auto handler, std::shared_ptr<state> st, result<std::vector<std::byte>> frame_bytes, int frame_fd) {
          auto io_ex = st->socket.get_executor();
          boost::asio::any_completion_executor work = boost::asio::prefer(
              boost::asio::any_completion_executor(boost::asio::get_associated_executor(handler, io_ex)),
              boost::asio::execution::outstanding_work.tracked);
          boost::asio::any_completion_handler<void(error_code)> h(std::move(handler));
          error_code ec;
          if (!frame_bytes) ec = frame_bytes.error();
          else if (frame_bytes->empty()) ec = make_error_code(errc::invalid_argument);
          unique_fd dup;
          if (!ec && frame_fd >= 0) {
            dup = unique_fd::duplicate(frame_fd);
            if (!dup) ec = error_code(errno, boost::system::system_category());
          }
          if (ec) return st->post_completion(std::move(h), std::move(work), ec);
          st->writes.push_back(pending_write{std::move(*frame_bytes), 0, std::move(dup), std::move(h), std::move(work)});
          if (!st->writing) {
            st->writing = true;
            st->pump();
          }
        },
        token, state_, std::move(bytes), fd);
  }

  std::shared_ptr<state> state_;
};

/// The connection over the default executor.
using connection = basic_connection<>;

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
