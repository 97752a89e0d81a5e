#pragma once
// session: one per accepted connection, on the server's one I/O thread: its frames read,
// queued, handed to their handler and answered in order, and how it closes. A frame goes:
//
//   run() (the reader: answers pings at once) -> lane() (the other frames, in order)
//     -> handle_frame() (request events) -> dispatch() (decode) -> handle()
//     -> on(request, call): the handler of its kind, in impl/ (registration_requests,
//        lookup_requests, copy_requests, control_requests, admin_requests, describe_requests,
//        with the checks they share in request_checks), answering a reply or `deferred`
//        (reply_or_deferred.hpp)
//     -> one call of the cache (any_cache.hpp -> cache::tiered_cache).
//
// docs/server.md has the contract it keeps ("Requests", "Errors and broken streams") and how
// ("Inside a session": the lane and its backpressure, the closing promise about copies in
// flight, who owns a session). Each impl/ file defines members of this class; the state they
// share is the members at the end of the class.

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/cache/copy.hpp>
#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>
#include <kvtier/server/session/any_cache.hpp>
#include <kvtier/server/session/lookup_table.hpp>
#include <kvtier/server/session/region_registry.hpp>
#include <kvtier/server/session/reply_or_deferred.hpp>
#include <kvtier/server/session/request_kinds.hpp>
#include <kvtier/server/session/server_context.hpp>
#include <kvtier/telemetry/log_escaped.hpp>
#include <kvtier/telemetry/logging_subscriber.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

namespace detail {
template <class T>
inline constexpr bool is_awaitable = false;
template <class T>
inline constexpr bool is_awaitable<boost::asio::awaitable<T>> = true;
struct tier_removal;  // impl/admin_requests.hpp

/// One in a session's count of waiting requests while it lives (I/O thread). Movable, so
/// that a coroutine's frame may own it (answer_when_decided).
class waiting_request {
 public:
  explicit waiting_request(std::size_t& n) noexcept : n_(&n) { ++*n_; }
  waiting_request(waiting_request&& o) noexcept : n_(std::exchange(o.n_, nullptr)) {}
  waiting_request(const waiting_request&) = delete;
  waiting_request& operator=(const waiting_request&) = delete;
  waiting_request& operator=(waiting_request&&) = delete;
  ~waiting_request() {
    if (n_) --*n_;
  }

 private:
  std::size_t* n_;
};
}  // namespace detail

class session : public std::enable_shared_from_this<session> {
 public:
  /// Most keys (chunks x world size) one lookup may take: 2^20, e.g. the protocol's 65536
  /// chunks at world size 16; bounds the memory (40 MiB of keys) and time of one request.
  static constexpr std::size_t max_lookup_keys = std::size_t{1} << 20;

  using connection_type = protocol::basic_connection<boost::asio::any_io_executor>;
  using clock = std::chrono::steady_clock;

  session(std::uint64_t client_id, connection_type conn, server_context& ctx, session_host& host)
      : id_(client_id),
        scope_(client_id),
        conn_(std::move(conn)),
        ctx_(ctx),
        host_(host),
        last_activity_(clock::now()) {}

  session(const session&) = delete;
  session& operator=(const session&) = delete;

  /// Starts the read loop on the connection's executor.
  void start() {
    boost::asio::co_spawn(conn_.get_executor(), run(shared_from_this()),
                          telemetry::log_escaped{&ctx_.log, "session reader"});
  }

  /// Closes the connection; the loop ends and the host reaps it. `reason` goes to the log.
  /// On the I/O thread. With a copy of this session in flight the socket closes when it
  /// ended (the closing promise: docs/server.md, "Inside a session"); none starts after this call.
  void close(std::string reason) {
    if (close_reason_.empty()) close_reason_ = std::move(reason);
    closing_ = true;
    if (copies_ == 0) conn_.close();
  }

  /// Copy operations of this session in flight (I/O thread).
  [[nodiscard]] std::size_t copies_in_flight() const noexcept { return copies_; }
  /// Requests of this connection received and not answered yet (I/O thread): queued for the
  /// lane, awaiting in their handler (the copies, the worker pool, the L2 backends), or
  /// answered once decided (a held lookup answer, a query of a lookup still deciding). A
  /// handler that answers without awaiting is never seen here: nothing else runs on the I/O
  /// thread meanwhile (so the status request being answered does not count itself).
  [[nodiscard]] std::size_t requests_in_flight() const noexcept {
    return lane_.size() + waiting_ + held_lookups_.size();
  }

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// When the last complete frame arrived (or the connection was accepted).
  [[nodiscard]] clock::time_point last_activity() const noexcept { return last_activity_; }
  /// Why the session ended ("disconnected", "idle for ...", "protocol error: ...").
  [[nodiscard]] const std::string& close_reason() const noexcept { return close_reason_; }
  [[nodiscard]] std::uint64_t requests() const noexcept { return requests_; }

 private:
  // --- the loop ------------------------------------------------------------------------
  // Two coroutines per connection on the I/O thread: the reader answers each ping at once and
  // queues every other frame; the lane handles the queued frames in order, one at a time (a
  // retrieve or a store awaits its copies there). So a ping never waits behind a copy (the
  // connector judges the server's health by its pings), and every other request keeps the
  // order the client sent it in. The reader stays at most max_lane_frames / max_lane_bytes
  // ahead of the lane (then it stops reading: backpressure on the client).
  static constexpr std::size_t max_lane_frames = 64;
  static constexpr std::size_t max_lane_bytes = std::size_t{64} << 20;

  boost::asio::awaitable<void> run(std::shared_ptr<session> self) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    boost::asio::co_spawn(conn_.get_executor(), lane(self), telemetry::log_escaped{&ctx_.log, "session lane"});
    bool drain = false;  // EOF: the frames the client sent before closing are still handled
    for (;;) {
      auto [ec, f] = co_await conn_.async_read_frame(as_tuple(use_awaitable));
      if (ec) {
        if (const protocol::decode_error* e = conn_.last_read_error()) {
          // The stream is broken: say why (with the call id when the header was readable),
          // then close.
          const errc code =
              e->code.category() == kvtier_category() ? static_cast<errc>(e->code.value()) : errc::protocol_error;
          set_reason("protocol error: " + e->reason);
          const auto reply = protocol::error_response::make(code, e->reason + "; closing the connection");
          const std::uint64_t call_id = e->call_id;
          co_await conn_.async_send(call_id, reply, as_tuple(use_awaitable));
        } else if (ec == boost::asio::error::eof) {
          set_reason("disconnected");
          drain = true;
        } else if (ec != boost::asio::error::operation_aborted) {
          set_reason("socket error: " + ec.message());
        } else {
          set_reason("closed");
        }
        break;
      }
      // Closed meanwhile (reaped, shutting down): a frame read before the close is dropped,
      // so no copy starts after it (the closing promise).
      if (closing_ || lane_done_) {
        set_reason("closed");
        break;
      }
      last_activity_ = clock::now();
      if (f.header.type == protocol::message_type::ping_request) {
        reply_or_deferred reply = co_await handle_frame(f);  // never awaits a copy, never deferred
        if (!reply.is_deferred()) {
          auto [wec] = co_await conn_.async_send(f.header.call_id, reply.reply(), as_tuple(use_awaitable));
          if (wec) {
            set_reason(closing_ ? "closed" : "write failed: " + wec.message());
            break;
          }
        }
        continue;
      }
      lane_bytes_ += f.body.size();
      lane_.push_back(std::move(f));
      lane_wake_.cancel();
      while (!closing_ && !lane_done_ && (lane_.size() >= max_lane_frames || lane_bytes_ >= max_lane_bytes))
        co_await reader_wake_.async_wait(as_tuple(use_awaitable));
    }
    if (!drain || closing_) {
      lane_.clear();
      lane_bytes_ = 0;
    }
    reader_done_ = true;
    lane_wake_.cancel();
    while (!lane_done_) co_await reader_wake_.async_wait(as_tuple(use_awaitable));
    conn_.close();
    drop_held_lookup_answers();
    host_.session_closed(id_);
  }

  boost::asio::awaitable<void> lane(std::shared_ptr<session> self) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    (void)self;  // keeps the session alive while the lane runs
    for (;;) {
      while (lane_.empty() && !reader_done_) co_await lane_wake_.async_wait(as_tuple(use_awaitable));
      if (lane_.empty() || closing_) break;
      protocol::frame f = std::move(lane_.front());
      lane_.pop_front();
      lane_bytes_ -= f.body.size();
      reader_wake_.cancel();
      reply_or_deferred reply = co_await handle_frame(f);
      if (closing_) {  // closed while a copy ran: the socket closes now, unanswered
        set_reason("closed");
        break;
      }
      if (reply.is_deferred()) continue;  // answered when decided (a held lookup, a query)
      auto [wec] = co_await conn_.async_send(f.header.call_id, reply.reply(), as_tuple(use_awaitable));
      if (wec) {
        set_reason(closing_ ? "closed" : "write failed: " + wec.message());
        break;
      }
      if (closing_) break;
    }
    lane_.clear();
    lane_bytes_ = 0;
    lane_done_ = true;
    // Between requests, no copy of this session runs: a reader still waiting for a frame is
    // woken by the close (the lane ended on a failed write or a close).
    if (!reader_done_ && copies_ == 0) conn_.close();
    reader_wake_.cancel();
  }

  void set_reason(std::string r) {
    if (close_reason_.empty()) close_reason_ = std::move(r);
  }

  // --- one call: decode, the handler of its kind, its answer ------------------------------
  /// One call being answered: what its handler may need beside the request.
  struct call {
    std::uint64_t id = 0;         ///< the frame's call id: the answer and progress frames carry it
    clock::time_point started{};  ///< when its handling began (server_request_finished)
    protocol::unique_fd fd;       ///< the fd the frame carried (register_kv's region), else empty
  };

  static protocol::error_response error(errc e, std::string_view text) {
    return protocol::error_response::make(e, text);
  }

  /// Publishes server_request_finished of a `kind` request whose handling began at `started`
  /// (answered now, deferred and answered now, or dropped unanswered: `ok` false).
  void finish_request(bus::request_kind kind, bool ok, clock::time_point started) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - started).count();
    ctx_.bus.publish(bus::server_request_finished{kind, id_, ok, static_cast<std::uint64_t>(ns)});
  }

  /// The answer to one frame (publishes server_request_started, and server_request_finished
  /// unless deferred: a deferred answer publishes it when it goes out). Never throws.
  boost::asio::awaitable<reply_or_deferred> handle_frame(protocol::frame& f) {
    ++requests_;
    const bus::request_kind kind = request_kind_of(f.header.type);
    call c{f.header.call_id, clock::now(), std::move(f.fd)};
    ctx_.bus.publish(bus::server_request_started{kind, id_});
    reply_or_deferred reply = co_await dispatch(f, c);
    if (reply.is_deferred()) co_return reply;
    finish_request(kind, !std::holds_alternative<protocol::error_response>(reply.reply()), c.started);
    co_return reply;
  }

  /// Decodes the frame and hands the message to handle(): every kind of request the same
  /// way. A frame that does not decode, and a message the server sends (a response), are
  /// answered error_response; so is a handler that throws.
  boost::asio::awaitable<reply_or_deferred> dispatch(const protocol::frame& f, call& c) {
    auto decoded = protocol::decode_message(f, conn_.frame_limits());
    if (!decoded) {
      const auto& e = decoded.error();
      const errc code =
          e.code.category() == kvtier_category() ? static_cast<errc>(e.code.value()) : errc::protocol_error;
      co_return error(code, e.reason);
    }
    std::string failure;
    errc failure_code = errc::invalid_argument;
    try {
      co_return co_await std::visit([&](const auto& m) { return handle(m, c); }, *decoded);
    } catch (const std::bad_alloc&) {
      ctx_.log.error("client {}: out of memory handling {}", id_, protocol::name(f.header.type));
      failure_code = errc::out_of_memory;
      failure = "the server ran out of memory handling this request";
    } catch (const std::exception& e) {
      ctx_.log.error("client {}: {} failed: {}", id_, protocol::name(f.header.type), e.what());
      failure = e.what();
    }
    co_return error(failure_code, failure);
  }

  /// The answer of the handler of `m`'s kind, on(m, c): awaited when it is a coroutine (it
  /// awaits the copies, the worker pool or the L2 backends), taken as it is otherwise.
  template <class Message>
  boost::asio::awaitable<reply_or_deferred> handle(const Message& m, call& c) {
    if constexpr (!protocol::wire_request<Message>) {
      co_return error(errc::protocol_error, std::string(protocol::name(Message::type)) +
                                                " is the server's to send: a client sends requests only");
    } else if constexpr (detail::is_awaitable<decltype(on(m, c))>) {
      const detail::waiting_request waiting(waiting_);
      co_return reply_or_deferred(co_await on(m, c));
    } else {
      co_return reply_or_deferred(on(m, c));
    }
  }

  // --- the checks every handler shares (impl/request_checks.hpp) ---------------------
  request_result<registration*> registered(std::string_view what);
  request_result<registration*> registered_with_region(std::string_view what);
  request_result<registration*> copy_target(std::string_view what, std::uint16_t rank, std::size_t chunks,
                                            std::span<const std::uint32_t> block_ids);
  static std::uint64_t request_id_of(const std::string& request_key) noexcept;
  std::uint64_t request_model_id(const registration& reg, const std::string& salt);

  // --- the handlers: on(request, call), one overload per kind of request ----------------
  // Each answers a request_result (its response or its refusal), a reply_or_deferred (a
  // lookup, a query: deferred when answered once decided), or an awaitable of one (a handler
  // that awaits the worker pool, the copies or the L2 backends). dispatch() reaches all of
  // them the same way (handle()).

  // registration (impl/registration_requests.hpp)
  boost::asio::awaitable<request_result<protocol::register_kv_response>> on(const protocol::register_kv_request& r,
                                                                            call& c);
  request_result<protocol::unregister_kv_response> on(const protocol::unregister_kv_request&, call&);
  template <class F>
  boost::asio::awaitable<std::invoke_result_t<F&>> on_worker_pool(F f);
  void prefault_region(registration& g);

  // lookups (impl/lookup_requests.hpp)
  reply_or_deferred on(const protocol::lookup_request& r, call& c);
  reply_or_deferred on(const protocol::query_prefetch_request& r, call& c);
  request_result<protocol::free_lookup_locks_response> on(const protocol::free_lookup_locks_request& r, call&);
  request_result<protocol::end_request_response> on(const protocol::end_request_request& r, call&);
  static protocol::query_prefetch_response done_response(const cache::lookup_status& st);
  static protocol::lookup_response lookup_done(const cache::lookup_status& st);
  void hold_lookup_answer(std::uint64_t call_id, std::string key, std::uint64_t cache_id, clock::time_point t0);
  void answer_held_lookup(const std::string& key, protocol::lookup_response reply,
                          std::optional<std::uint64_t> cache_id = std::nullopt);
  void drop_held_lookup_answers();
  boost::asio::awaitable<void> answer_when_decided(std::shared_ptr<session> self, detail::waiting_request waiting,
                                                   std::uint64_t call_id, std::string request_key,
                                                   std::uint64_t cache_id, clock::time_point t0);
  void forget_lookup(const std::string& request_key);
  void release_owned_lookups();
  void release_rank_holds(const std::string& request_key, std::uint64_t cache_id, std::uint16_t rank);

  // copies between the engine's region and L1 (impl/copy_requests.hpp)
  class copy_scope;
  class first_error;
  class progress_sender;
  static request_error closing_error(std::string_view what);
  cache::copy_out_sink retrieve_sink(const registration& reg, const protocol::retrieve_request& r, bool by_layer,
                                     std::shared_ptr<progress_sender> progress, first_error& refused);
  /// The call's id is the one its progress frames carry.
  boost::asio::awaitable<request_result<protocol::retrieve_response>> on(const protocol::retrieve_request& r, call& c);
  boost::asio::awaitable<request_result<protocol::store_response>> on(const protocol::store_request& r, call&);

  // ping, clear, get_chunk_size, status (impl/control_requests.hpp)
  request_result<protocol::ping_response> on(const protocol::ping_request&, call&);
  request_result<protocol::clear_response> on(const protocol::clear_request& r, call&);
  request_result<protocol::get_chunk_size_response> on(const protocol::get_chunk_size_request&, call&);
  request_result<protocol::status_response> on(const protocol::status_request&, call&);

  // descriptions of chunks for the KV events (impl/describe_requests.hpp)
  request_result<protocol::describe_chunks_response> on(const protocol::describe_chunks_request& r, call&);
  static std::optional<request_error> description_error(const registration& reg,
                                                        const protocol::describe_chunks_request& r);

  // administration: list_objects, evict, list_keys (impl/admin_requests.hpp)
  /// The longest one backend operation of an administration request may take (a listing, a
  /// batch of removals): a listing of a million Redis keys takes ~1000 SCAN round trips.
  static constexpr auto admin_deadline = std::chrono::seconds(60);
  /// Null when this connection's peer is the server's owner or root; else the refusal.
  std::optional<request_error> admin_refusal(std::string_view what);
  boost::asio::awaitable<request_result<protocol::list_objects_response>> on(const protocol::list_objects_request& r,
                                                                             call&);
  boost::asio::awaitable<request_result<protocol::evict_response>> on(const protocol::evict_request& r, call&);
  boost::asio::awaitable<request_result<protocol::list_keys_response>> on(const protocol::list_keys_request& r, call&);
  boost::asio::awaitable<request_result<detail::tier_removal>> evict_from_backend(l2::any_backend& backend,
                                                                                  const l2::key_filter& selected);

  // --- the connection's state, shared by the loop and the handlers ------------------------
  std::uint64_t id_;
  /// The scope of this connection's lookups: its engine's (engine_table), or id_ alone.
  std::uint64_t scope_;
  connection_type conn_;
  server_context& ctx_;
  session_host& host_;
  clock::time_point last_activity_;
  std::string close_reason_;
  bool closing_ = false;
  std::size_t copies_ = 0;            ///< copy operations in flight (copy_scope)
  std::deque<protocol::frame> lane_;  ///< read, not yet handled (run, lane)
  std::size_t lane_bytes_ = 0;
  bool reader_done_ = false;
  bool lane_done_ = false;
  /// Wake-ups between the two coroutines: a wait ends when the other side cancels the timer.
  boost::asio::steady_timer lane_wake_{conn_.get_executor(), boost::asio::steady_timer::time_point::max()};
  boost::asio::steady_timer reader_wake_{conn_.get_executor(), boost::asio::steady_timer::time_point::max()};
  std::uint64_t requests_ = 0;
  /// Requests whose handler awaits (handle()) or whose answer waits for its lookup's decision
  /// (answer_when_decided): counted by detail::waiting_request.
  std::size_t waiting_ = 0;
  /// Lookup answers held until decided (hold_lookup_answer), by request key.
  struct held_lookup {
    std::uint64_t call_id = 0;
    std::uint64_t cache_id = 0;
    clock::time_point t0{};
  };
  std::unordered_map<std::string, held_lookup> held_lookups_;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

// What each request does: members of session, one file per kind of request.
#include <kvtier/server/session/impl/admin_requests.hpp>
#include <kvtier/server/session/impl/control_requests.hpp>
#include <kvtier/server/session/impl/copy_requests.hpp>
#include <kvtier/server/session/impl/describe_requests.hpp>
#include <kvtier/server/session/impl/lookup_requests.hpp>
#include <kvtier/server/session/impl/registration_requests.hpp>
#include <kvtier/server/session/impl/request_checks.hpp>
