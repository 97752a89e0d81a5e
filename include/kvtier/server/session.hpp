#pragma once
// session: one per accepted connection. A coroutine reads a frame, answers it, writes the
// answer, and reads the next, all on the server's one I/O thread. docs/server.md has the
// request semantics (the engine <-> server contract); here is how each is carried out.
//
// Every frame is answered:
//   - a request: its response, or error_response{errc, message} when refused (not
//     registered, counts that do not match the layout, block id out of range, rank not the
//     registration's, ...). Lookups start a background prefetch and answer at once. A
//     retrieve is decode -> one cache call (tiered_cache::async_copy_out: each chunk copied
//     into the engine's blocks as soon as it is readable, an L2 load pipelined with the
//     copies) -> encode; a store likewise (async_copy_in, the generation fence after the
//     copies). The copies run on the server's copy pool (copy_threads), so the I/O thread
//     keeps serving the other connections' protocol, pings and lookups meanwhile; this
//     connection's next frame is read once the answer went out, as for every request.
//   - a frame whose body does not decode (unknown type, truncated or oversized field,
//     trailing bytes) or that carries a response type: error_response, and the connection
//     goes on (its frame boundaries held; docs/protocol.md).
//   - a broken stream (bad magic, other version, body above the frame limit, fd overflow):
//     error_response with the call id when the header was readable (0 otherwise), then the
//     connection is closed: the stream cannot be trusted any more.
// One answer is in flight per connection: the next frame is read once the previous answer
// was handed to the socket. A client that stops reading its answers therefore stops being
// read, sends nothing the server sees, and is reaped by the idle timeout; it never holds
// more than one answer of server memory and never blocks the I/O thread.
//
// Closing keeps a promise engines rely on (docs/protocol.md, "Closing a connection"): the
// server closes a connection only after every copy it started between that connection's
// KV region and L1 has ended, and starts none after it decided to close. An engine that
// reads EOF on a connection therefore knows that no block it handed over on it can be
// written any more, and releases the blocks it had quarantined for calls it gave up on
// (engine/quarantine.hpp); breaking the promise lets a late copy write into blocks the
// engine already reuses: wrong KV. Copies run on the copy pool, so the session keeps it
// explicitly: it counts its copy operations in flight (copies_, on the I/O thread: a copy
// operation counts from its start until its completion ran, by which time every sink and
// source call of it returned); close() (reaper, shutdown, a broken stream: always on the I/O
// thread) sets closing_ at once but defers the socket's close until copies_ is 0; no copy
// starts once closing_ is set (the loop drops a frame read after it, and the copy handlers
// check it); and the region is unmapped only in session_closed, after the loop ended, which
// it cannot while it awaits a copy.
//
// Lookups are the connection's own (lookup_table, keyed by this session's id): query,
// free, end and the release after a retrieve touch this connection's lookup only.
//
// A session never outlives its use of the server: the server owns it in a map, its
// coroutine holds a shared_ptr, and when the coroutine ends it calls
// session_host::session_closed(), which reaps the connection's registration and lookups.

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_transfer.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/server/any_cache.hpp>
#include <kvtier/server/client_budget.hpp>
#include <kvtier/server/server_config.hpp>
#include <kvtier/server/region_registry.hpp>
#include <kvtier/server/request_kinds.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// Hooks into request handling, run on the server's I/O thread (during_copy: on a copy
/// thread). For tests and embedders.
struct server_hooks {
  /// Called by a store after the chunks were copied out of the engine's region into L1 and
  /// before their block generations are re-read: a test bumps a generation here to play an
  /// engine that reused a block while the server copied it (fencing).
  std::function<void(std::uint64_t client_id, std::span<const std::uint32_t> block_ids)> after_store_copy;
  /// Called on a copy-pool thread before each chunk a retrieve or store copies: a test
  /// blocks a copy here to close its connection meanwhile.
  std::function<void(std::uint64_t client_id)> during_copy;
};

/// What the sessions share: the server's state (owned by server::server).
struct server_context {
  const server_config& config;
  any_cache& cache;
  region_registry& clients;
  lookup_table& lookups;
  default_event_bus& bus;
  telemetry::logger& log;
  std::uint64_t boot_token = 0;
  const server_hooks& hooks;
  client_budget* budget = nullptr;  ///< lookup key budgets (client_budget.hpp); null: none
};

/// What a session needs from the server that owns it.
class session_host {
 public:
  /// The status document (status_request).
  [[nodiscard]] virtual std::string status_json() = 0;
  /// The session's loop ended: reap its registration and lookups, forget it.
  virtual void session_closed(std::uint64_t client_id) noexcept = 0;

 protected:
  ~session_host() = default;
};

class session : public std::enable_shared_from_this<session> {
 public:
  /// Most keys (chunks x world size) one lookup may take: 2^20, e.g. the protocol's 65536
  /// chunks at world size 16; bounds the memory (40 MiB of keys) and time of one request.
  static constexpr std::size_t max_lookup_keys = std::size_t{1} << 20;

  using connection_type = protocol::basic_connection<boost::asio::any_io_executor>;
  using clock = std::chrono::steady_clock;

  session(std::uint64_t client_id, connection_type conn, server_context& ctx, session_host& host)
      : id_(client_id), conn_(std::move(conn)), ctx_(ctx), host_(host), last_activity_(clock::now()) {}

  session(const session&) = delete;
  session& operator=(const session&) = delete;

  /// Starts the read loop on the connection's executor.
  void start() { boost::asio::co_spawn(conn_.get_executor(), run(shared_from_this()), boost::asio::detached); }

  /// Closes the connection; the loop ends and the host reaps it. `reason` goes to the log.
  /// On the I/O thread. With a copy of this session in flight the socket closes when it
  /// ended (the promise in the header comment); none starts after this call.
  void close(std::string reason) {
    if (close_reason_.empty()) close_reason_ = std::move(reason);
    closing_ = true;
    if (copies_ == 0) conn_.close();
  }

  /// Copy operations of this session in flight (I/O thread).
  [[nodiscard]] std::size_t copies_in_flight() const noexcept { return copies_; }

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// When the last complete frame arrived (or the connection was accepted).
  [[nodiscard]] clock::time_point last_activity() const noexcept { return last_activity_; }
  /// Why the session ended ("disconnected", "idle for ...", "protocol error: ...").
  [[nodiscard]] const std::string& close_reason() const noexcept { return close_reason_; }
  [[nodiscard]] std::uint64_t requests() const noexcept { return requests_; }

  /// The answer to one frame (publishes server_request_started/finished), or nullopt for a
  /// query_prefetch of a lookup still deciding: answered later (answer_when_decided). Never
  /// throws.
  boost::asio::awaitable<std::optional<protocol::message>> handle_frame(protocol::frame& f) {
    ++requests_;
    const bus::request_kind kind = request_kind_of(f.header.type);
    const auto t0 = clock::now();
    ctx_.bus.publish(bus::server_request_started{kind, id_});
    protocol::message reply = co_await dispatch(f);
    if (const auto* q = std::get_if<protocol::query_prefetch_response>(&reply);
        q != nullptr && q->state == protocol::prefetch_state::pending) {
      // No polling on the wire: the answer goes out when the prefetch is decided.
      if (auto m = protocol::decode_message(f, conn_.frame_limits())) {
        const std::string key = std::get<protocol::query_prefetch_request>(*m).request_key;
        if (const lookup_table::entry* e = ctx_.lookups.find(id_, key)) {
          boost::asio::co_spawn(conn_.get_executor(),
                                answer_when_decided(shared_from_this(), f.header.call_id, key, e->cache_id, t0),
                                boost::asio::detached);
          co_return std::nullopt;
        }
      }
    }
    const bool ok = !std::holds_alternative<protocol::error_response>(reply);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
    ctx_.bus.publish(bus::server_request_finished{kind, id_, ok, static_cast<std::uint64_t>(ns)});
    co_return std::optional<protocol::message>(std::move(reply));
  }

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
    boost::asio::co_spawn(conn_.get_executor(), lane(self), boost::asio::detached);
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
      // so no copy starts after it (the promise in the header comment).
      if (closing_ || lane_done_) {
        set_reason("closed");
        break;
      }
      last_activity_ = clock::now();
      if (f.header.type == protocol::message_type::ping_request) {
        std::optional<protocol::message> reply = co_await handle_frame(f);  // never awaits a copy
        if (reply) {
          auto [wec] = co_await conn_.async_send(f.header.call_id, *reply, as_tuple(use_awaitable));
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
      std::optional<protocol::message> reply = co_await handle_frame(f);
      if (closing_) {  // closed while a copy ran: the socket closes now, unanswered
        set_reason("closed");
        break;
      }
      if (!reply) continue;  // answered when decided (a query_prefetch)
      auto [wec] = co_await conn_.async_send(f.header.call_id, *reply, as_tuple(use_awaitable));
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

  // --- dispatch ------------------------------------------------------------------------
  static protocol::error_response error(errc e, std::string_view text) {
    return protocol::error_response::make(e, text);
  }

  boost::asio::awaitable<protocol::message> dispatch(protocol::frame& f) {
    auto decoded = protocol::decode_message(f, conn_.frame_limits());
    if (!decoded) {
      const auto& e = decoded.error();
      const errc code =
          e.code.category() == kvtier_category() ? static_cast<errc>(e.code.value()) : errc::protocol_error;
      co_return error(code, e.reason);
    }
    if (protocol::is_response(f.header.type))
      co_return error(errc::protocol_error,
                      std::string(protocol::name(f.header.type)) + " is a response: a client sends requests only");
    std::string failure;
    errc failure_code = errc::invalid_argument;
    try {
      // The requests that await the cache (copies): one cache call each.
      if (auto* m = std::get_if<protocol::retrieve_request>(&*decoded)) {
        auto r = co_await on_retrieve(*m);
        if (!r) co_return r.error().response();
        co_return protocol::message(std::move(*r));
      }
      if (auto* m = std::get_if<protocol::store_request>(&*decoded)) {
        auto r = co_await on_store(*m);
        if (!r) co_return r.error().response();
        co_return protocol::message(std::move(*r));
      }
      co_return std::visit(
          [&](auto& m) -> protocol::message {
            using T = std::decay_t<decltype(m)>;
            if constexpr (!protocol::wire_request<T>) {
              return error(errc::protocol_error, "not a request");
            } else if constexpr (std::is_same_v<T, protocol::retrieve_request> ||
                                 std::is_same_v<T, protocol::store_request>) {
              return error(errc::protocol_error, "unreachable: copies are handled above");
            } else {
              request_result<typename T::response_type> r = [&] {
                if constexpr (std::is_same_v<T, protocol::register_kv_request>)
                  return on(m, std::move(f.fd));
                else
                  return on(m);
              }();
              if (!r) return r.error().response();
              return protocol::message(std::move(*r));
            }
          },
          *decoded);
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

  /// The connection's registration, or not_registered naming the request.
  request_result<registration*> registered(std::string_view what) {
    if (registration* r = ctx_.clients.find(id_)) return r;
    return request_error{errc::not_registered,
                         std::string(what) + " needs a registration: send register_kv_request first"};
  }

  /// The connection's registration when it brought a KV region; not_registered or
  /// no_kv_region (a scheduler's connection) naming the request otherwise.
  request_result<registration*> registered_with_region(std::string_view what) {
    auto reg = registered(what);
    if (!reg) return reg.error();
    if (!(*reg)->has_region())
      return request_error{errc::no_kv_region,
                           std::string(what) +
                               " needs a KV region: this connection registered without one (region kind none, a "
                               "scheduler), which may only look up, query, free lookup locks and end requests"};
    return *reg;
  }

  /// The checks shared by retrieve and store: the rank is the registration's, there are
  /// blocks_per_chunk block ids per chunk hash, and every block id is in the region.
  static std::optional<request_error> check_blocks(const registration& reg, std::string_view what, std::uint16_t rank,
                                                   std::size_t chunks, std::span<const std::uint32_t> block_ids) {
    if (rank != reg.rank)
      return request_error{errc::invalid_argument, std::string(what) + ".rank " + std::to_string(rank) +
                                                       " differs from the registration's rank " +
                                                       std::to_string(reg.rank)};
    if (block_ids.size() != chunks * reg.blocks_per_chunk)
      return request_error{
          errc::invalid_argument,
          std::string(what) + ": " + std::to_string(block_ids.size()) + " block ids for " + std::to_string(chunks) +
              " chunks; each chunk takes " + std::to_string(reg.blocks_per_chunk) + " blocks (chunk_tokens " +
              std::to_string(reg.chunk.chunk_tokens) + " / block_size " + std::to_string(reg.layout.block_size) + ")"};
    for (const std::uint32_t b : block_ids)
      if (b >= reg.layout.num_blocks)
        return request_error{errc::invalid_argument, std::string(what) + ": block id " + std::to_string(b) +
                                                         " is out of range (the region has " +
                                                         std::to_string(reg.layout.num_blocks) + " blocks)"};
    return std::nullopt;
  }

  static std::uint64_t request_id_of(const std::string& request_key) noexcept {
    return static_cast<std::uint64_t>(std::hash<std::string>{}(request_key));
  }

  // --- handlers ------------------------------------------------------------------------
  request_result<protocol::register_kv_response> on(const protocol::register_kv_request& r, protocol::unique_fd fd) {
    auto reg = ctx_.clients.register_client(id_, r, std::move(fd));
    if (!reg) {
      ctx_.log.warn("client {}: registration refused: {}", id_, reg.error().message);
      return reg.error();
    }
    const registration& g = **reg;
    ctx_.log.info(
        "client {}: registered pid {} rank {}/{} model {} ({} layers, {} KV heads, head dim {}, {}, {}), region {}: "
        "{} blocks of {} tokens, {} MiB",
        id_, g.instance_id, g.rank, g.world_size, g.model_name, g.chunk.model.num_layers, g.chunk.model.num_kv_heads,
        g.chunk.model.head_dim, name(g.chunk.model.dtype), name(g.layout.kind()), protocol::name(g.kind),
        g.layout.num_blocks, g.layout.block_size, g.region.bytes() >> 20);
    return protocol::register_kv_response{ctx_.boot_token, id_, g.model_id, g.chunk.chunk_tokens};
  }

  request_result<protocol::unregister_kv_response> on(const protocol::unregister_kv_request&) {
    auto reg = registered("unregister_kv_request");
    if (!reg) return reg.error();
    release_owned_lookups();
    ctx_.clients.remove(id_);
    ctx_.log.info("client {}: unregistered", id_);
    return protocol::unregister_kv_response{};
  }

  request_result<protocol::lookup_response> on(const protocol::lookup_request& r) {
    auto reg_r = registered("lookup_request");
    if (!reg_r) return reg_r.error();
    const registration& reg = **reg_r;
    if (r.model_id != reg.model_id)
      return request_error{errc::invalid_argument, "lookup_request.model_id " + std::to_string(r.model_id) +
                                                       " is not this connection's model id " +
                                                       std::to_string(reg.model_id) + " (from register_kv_response)"};
    if (r.world_size != reg.world_size)
      return request_error{errc::invalid_argument, "lookup_request.world_size " + std::to_string(r.world_size) +
                                                       " differs from the registration's " +
                                                       std::to_string(reg.world_size)};
    // Lookups are this connection's own (lookup_table): another engine's request of the same
    // id is another lookup.
    const lookup_table::entry* existing = ctx_.lookups.find(id_, r.request_key);
    const bool replaces_own = existing != nullptr;
    if (!replaces_own && ctx_.lookups.owned(id_) >= ctx_.config.max_lookups_per_client)
      return request_error{errc::out_of_memory,
                           "this connection holds " + std::to_string(ctx_.lookups.owned(id_)) +
                               " lookups (max_lookups_per_client): send end_request for finished requests"};
    const std::size_t ws = reg.world_size;
    if (r.chunk_hashes.size() * ws > max_lookup_keys)
      return request_error{errc::invalid_argument, "lookup_request: " + std::to_string(r.chunk_hashes.size()) +
                                                       " chunks x world size " + std::to_string(ws) + " is above " +
                                                       std::to_string(max_lookup_keys) +
                                                       " keys: look up fewer chunks at once"};
    if (ctx_.budget)
      if (auto refused =
              ctx_.budget->check_lookup(ctx_.lookups, id_, std::uint64_t{r.chunk_hashes.size()} * ws,
                                        replaces_own ? lookup_table::keys_of(*existing) : 0, ctx_.clients.size()))
        return *refused;
    const std::uint64_t mid = reg.model_id_for(r.cache_salt);
    std::vector<chunk_key> keys;
    keys.reserve(r.chunk_hashes.size() * ws);
    for (const hash128& h : r.chunk_hashes)
      for (std::size_t rank = 0; rank < ws; ++rank)
        keys.push_back(chunk_key{mid, reg.world_size, static_cast<std::uint16_t>(rank), h});
    cache::lookup_request lr;
    lr.keys = keys;
    lr.group = ws;
    lr.object_bytes = reg.object_bytes;
    lr.chunk_tokens = reg.chunk.chunk_tokens;
    lr.request_id = request_id_of(r.request_key);
    lr.prefill_tokens_per_second = reg.prefill_tokens_per_second;  // load or recompute
    const auto id = ctx_.cache.start_lookup(lr);
    lookup_table::entry e{id, id_, static_cast<std::uint32_t>(r.chunk_hashes.size()), reg.world_size};
    // The new lookup holds its locks before the old one gives its back: nothing the two
    // share can be evicted in between.
    if (auto old = ctx_.lookups.put(r.request_key, e)) ctx_.cache.release_all(old->cache_id);
    return protocol::lookup_response{};
  }

  request_result<protocol::query_prefetch_response> on(const protocol::query_prefetch_request& r) {
    auto reg = registered("query_prefetch_request");
    if (!reg) return reg.error();
    const lookup_table::entry* e = ctx_.lookups.find(id_, r.request_key);
    if (e == nullptr) return protocol::query_prefetch_response{protocol::prefetch_state::unknown, 0, 0};
    if (auto st = ctx_.cache.poll(e->cache_id)) return done_response(*st);
    if (ctx_.cache.known(e->cache_id))  // not decided yet: dispatch() answers it when it is
      return protocol::query_prefetch_response{protocol::prefetch_state::pending, 0, 0};
    ctx_.lookups.take(id_, r.request_key);  // expired in the cache (lookup_ttl)
    return protocol::query_prefetch_response{protocol::prefetch_state::unknown, 0, 0};
  }

  static protocol::query_prefetch_response done_response(const cache::lookup_status& st) {
    return protocol::query_prefetch_response{protocol::prefetch_state::done, static_cast<std::uint32_t>(st.chunks),
                                             static_cast<std::uint32_t>(st.l1_chunks)};
  }

  /// A query of a lookup still deciding: answered once it is decided (tiered_cache::
  /// async_wait; the prefetch decides within its wait budget, prefetch_timeout_cap_ms at
  /// most), while this connection's next frames are read and answered (answers carry their
  /// call id). A lookup replaced meanwhile is waited for in its turn; one released or
  /// reaped meanwhile answers unknown.
  boost::asio::awaitable<void> answer_when_decided(std::shared_ptr<session> self, std::uint64_t call_id,
                                                   std::string request_key, std::uint64_t cache_id,
                                                   clock::time_point t0) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    (void)self;  // keeps the session alive until the answer went out
    protocol::query_prefetch_response reply{protocol::prefetch_state::unknown, 0, 0};
    for (;;) {
      auto [ec, st] = co_await ctx_.cache.async_wait(cache_id, as_tuple(use_awaitable));
      const lookup_table::entry* e = closing_ ? nullptr : ctx_.lookups.find(id_, request_key);
      if (e == nullptr) break;        // released, ended, reaped
      if (e->cache_id != cache_id) {  // replaced by a newer lookup
        cache_id = e->cache_id;
        continue;
      }
      if (!ec) reply = done_response(st);
      break;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
    ctx_.bus.publish(
        bus::server_request_finished{bus::request_kind::query_prefetch, id_, true, static_cast<std::uint64_t>(ns)});
    if (!closing_) co_await conn_.async_send(call_id, protocol::message(reply), as_tuple(use_awaitable));
  }

  /// Copies of this session in flight: counted from the start of a copy operation until its
  /// completion ran; the last one to end closes the socket when close() came meanwhile.
  class copy_scope {
   public:
    explicit copy_scope(session& s) : s_(s) { ++s_.copies_; }
    copy_scope(const copy_scope&) = delete;
    copy_scope& operator=(const copy_scope&) = delete;
    ~copy_scope() {
      if (--s_.copies_ == 0 && s_.closing_) s_.conn_.close();
    }

   private:
    session& s_;
  };

  /// The first error of the copies of one request (they run on several threads at once).
  class first_error {
   public:
    void set(std::error_code ec) {
      std::lock_guard g(m_);
      if (!ec_) ec_ = ec;
    }
    [[nodiscard]] std::error_code get() {
      std::lock_guard g(m_);
      return ec_;
    }

   private:
    std::mutex m_;
    std::error_code ec_;
  };

  static request_error closing_error(std::string_view what) {
    return request_error{errc::shutting_down, std::string(what) + ": the connection is closing"};
  }

  boost::asio::awaitable<request_result<protocol::retrieve_response>> on_retrieve(const protocol::retrieve_request& r) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    auto reg_r = registered_with_region("retrieve_request");
    if (!reg_r) co_return reg_r.error();
    registration& reg = **reg_r;
    const std::size_t n = r.chunk_hashes.size();
    if (auto e = check_blocks(reg, "retrieve_request", r.rank, n, r.block_ids)) co_return *e;
    if (n == 0) co_return protocol::retrieve_response{0};
    if (closing_) co_return closing_error("retrieve_request");  // no copy starts after the close

    const std::uint64_t mid = reg.model_id_for(r.cache_salt);
    std::vector<chunk_key> keys(n);
    for (std::size_t i = 0; i < n; ++i) keys[i] = reg.key(mid, r.chunk_hashes[i]);
    cache::copy_out_request cr;
    // Only this connection's lookup: a worker retrieving what its scheduler looked up on
    // another connection copies what L1 holds and leaves the scheduler's holds to the
    // scheduler (end_request).
    if (const lookup_table::entry* e = ctx_.lookups.find(id_, r.request_key)) cr.lookup = e->cache_id;
    cr.keys = keys;
    cr.object_bytes = reg.object_bytes;
    // The sink runs on the copy pool; everything it reads stays alive until the completion
    // (this coroutine's frame, the registration: this connection cannot unregister meanwhile).
    const paged_kv_view view = reg.region.view();
    const chunk_layout& chunk = reg.chunk;
    const std::uint32_t ct = reg.chunk.chunk_tokens;
    const std::size_t bpc = reg.blocks_per_chunk;
    first_error refused;
    cache::copy_out_sink sink = [&](std::size_t i, std::size_t, std::span<const std::byte> object) {
      if (ctx_.hooks.during_copy) ctx_.hooks.during_copy(id_);
      const std::uint64_t done = std::uint64_t{ct} * i;
      const std::uint64_t skip = r.skip_tokens > done ? std::min<std::uint64_t>(r.skip_tokens - done, ct) : 0;
      const scatter_item item{std::span(r.block_ids).subspan(i * bpc, bpc), object.data(),
                              static_cast<std::uint32_t>(skip)};
      if (const std::error_code ec = scatter_chunks(view, chunk, std::span(&item, 1))) {
        refused.set(ec);
        return false;
      }
      return true;
    };
    std::size_t copied = 0;
    {
      copy_scope scope(*this);
      auto [ec, count] = co_await ctx_.cache.async_copy_out(std::move(cr), std::move(sink), as_tuple(use_awaitable));
      copied = ec ? 0 : count;
    }
    if (const std::error_code e = refused.get())
      ctx_.log.error("client {}: retrieve copy refused: {}", id_, e.message());
    co_return protocol::retrieve_response{static_cast<std::uint32_t>(copied)};
  }

  boost::asio::awaitable<request_result<protocol::store_response>> on_store(const protocol::store_request& r) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    auto reg_r = registered_with_region("store_request");
    if (!reg_r) co_return reg_r.error();
    registration& reg = **reg_r;
    const std::size_t n = r.chunk_hashes.size();
    if (auto e = check_blocks(reg, "store_request", r.rank, n, r.block_ids)) co_return *e;
    const std::uint64_t mid = reg.model_id_for(r.cache_salt);
    const std::size_t bpc = reg.blocks_per_chunk;
    auto blocks_of = [&](std::size_t i) { return std::span(r.block_ids).subspan(i * bpc, bpc); };
    auto fenced = [&](std::size_t i) {
      for (std::size_t b = i * bpc; b < (i + 1) * bpc; ++b)
        if (reg.region.generation(r.block_ids[b]) != r.block_generations[b]) return true;
      return false;
    };

    protocol::store_response out;
    // Chunks whose blocks were reused before we even start are not copied at all.
    std::vector<std::size_t> todo;
    std::vector<chunk_key> keys;
    for (std::size_t i = 0; i < n; ++i) {
      if (fenced(i)) {
        ++out.failed;
        continue;
      }
      todo.push_back(i);
      keys.push_back(reg.key(mid, r.chunk_hashes[i]));
    }
    if (keys.empty()) co_return out;
    if (closing_) co_return closing_error("store_request");  // no copy starts after the close

    cache::copy_in_request cr;
    cr.keys = keys;
    cr.object_bytes = reg.object_bytes;
    cr.context = pipeline::write_context{request_id_of(r.request_key), 0, r.first_chunk};
    const paged_kv_view view = reg.region.view();
    const chunk_layout& chunk = reg.chunk;
    first_error refused;
    cache::copy_in_source source = [&](std::size_t j, std::span<std::byte> object) {
      if (ctx_.hooks.during_copy) ctx_.hooks.during_copy(id_);
      const gather_item item{blocks_of(todo[j]), object.data(), 0};
      if (const std::error_code ec = gather_chunks(view, chunk, std::span(&item, 1))) {
        refused.set(ec);
        return false;
      }
      return true;
    };
    // The fence: a block the engine reused while we copied is never stored under the old
    // key. Runs on this thread after every copy ended.
    bool hooked = false;
    cache::copy_in_fence fence = [&](std::size_t j) {
      if (!std::exchange(hooked, true) && ctx_.hooks.after_store_copy) ctx_.hooks.after_store_copy(id_, r.block_ids);
      return !fenced(todo[j]);
    };
    cache::copy_in_result res;
    {
      copy_scope scope(*this);
      auto [ec, x] = co_await ctx_.cache.async_copy_in(std::move(cr), std::move(source), std::move(fence),
                                                       as_tuple(use_awaitable));
      res = ec ? cache::copy_in_result{0, 0, keys.size()} : x;
    }
    if (const std::error_code e = refused.get()) ctx_.log.error("client {}: store copy refused: {}", id_, e.message());
    out.stored += static_cast<std::uint32_t>(res.stored);
    out.already_present += static_cast<std::uint32_t>(res.already_present);
    out.failed += static_cast<std::uint32_t>(res.failed);
    co_return out;
  }

  request_result<protocol::free_lookup_locks_response> on(const protocol::free_lookup_locks_request& r) {
    auto reg = registered("free_lookup_locks_request");
    if (!reg) return reg.error();
    forget_lookup(r.request_key);
    return protocol::free_lookup_locks_response{};
  }

  request_result<protocol::end_request_response> on(const protocol::end_request_request& r) {
    auto reg = registered("end_request_request");
    if (!reg) return reg.error();
    forget_lookup(r.request_key);
    return protocol::end_request_response{};
  }

  request_result<protocol::ping_response> on(const protocol::ping_request&) {
    const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now().time_since_epoch()).count();
    return protocol::ping_response{ctx_.boot_token, static_cast<std::uint64_t>(now)};
  }

  request_result<protocol::clear_response> on(const protocol::clear_request& r) {
    const std::size_t n = ctx_.cache.clear(r.force);
    ctx_.log.info("client {}: cleared L1 ({} objects{})", id_, n, r.force ? ", forced" : "");
    return protocol::clear_response{};
  }

  request_result<protocol::get_chunk_size_response> on(const protocol::get_chunk_size_request&) {
    return protocol::get_chunk_size_response{ctx_.config.chunk_tokens};
  }

  request_result<protocol::status_response> on(const protocol::status_request&) {
    return protocol::status_response{host_.status_json()};
  }

  /// Releases this connection's lookup of `request_key` (none: nothing to do).
  void forget_lookup(const std::string& request_key) {
    if (auto e = ctx_.lookups.take(id_, request_key)) ctx_.cache.release_all(e->cache_id);
  }

  void release_owned_lookups() {
    for (const auto& e : ctx_.lookups.take_owned_by(id_)) ctx_.cache.release_all(e.cache_id);
  }

  std::uint64_t id_;
  connection_type conn_;
  server_context& ctx_;
  session_host& host_;
  clock::time_point last_activity_;
  std::string close_reason_;
  bool closing_ = false;
  std::size_t copies_ = 0;  ///< copy operations in flight (copy_scope)
  std::deque<protocol::frame> lane_;  ///< read, not yet handled (run, lane)
  std::size_t lane_bytes_ = 0;
  bool reader_done_ = false;
  bool lane_done_ = false;
  /// Wake-ups between the two coroutines: a wait ends when the other side cancels the timer.
  boost::asio::steady_timer lane_wake_{conn_.get_executor(), boost::asio::steady_timer::time_point::max()};
  boost::asio::steady_timer reader_wake_{conn_.get_executor(), boost::asio::steady_timer::time_point::max()};
  std::uint64_t requests_ = 0;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
