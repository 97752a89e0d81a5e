#pragma once
// session: one per accepted connection. A coroutine reads a frame, answers it, writes the
// answer, and reads the next, all on the server's one I/O thread. docs/server.md has the
// request semantics (the engine <-> server contract); here is how each is carried out.
//
// Every frame is answered:
//   - a request: its response, or error_response{errc, message} when refused (not
//     registered, counts that do not match the layout, block id out of range, rank not the
//     registration's, ...). Handlers are synchronous: lookups start a background prefetch
//     and answer at once; copies between the engine's region and L1 happen inline (a
//     retrieve of 10k tokens of a 0.5B model moves 117 MiB, see docs/server.md for the time).
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
// engine already reuses: wrong KV. Today copies run inline in the handlers on the one I/O
// thread, and close() is only ever called on that thread (reaper, shutdown, a broken
// stream), between handlers: no copy can be running when the socket closes, and the loop
// drops a frame read after close() unanswered (a read completed before it), so none starts
// after. Whoever moves copies off the I/O thread (a copy pool) must keep it explicitly:
// count a session's copies in flight, defer the socket's close (and the region's unmapping
// in session_closed) until they are 0, and start no copy once closing_ is set.
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
#include <kvtier/server/config.hpp>
#include <kvtier/server/region_registry.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// Hooks into request handling, run on the server's I/O thread. For tests and embedders.
struct server_hooks {
  /// Called by a store after the chunks were copied out of the engine's region into L1 and
  /// before their block generations are re-read: a test bumps a generation here to play an
  /// engine that reused a block while the server copied it (fencing).
  std::function<void(std::uint64_t client_id, std::span<const std::uint32_t> block_ids)> after_store_copy;
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
  /// On the I/O thread, between handlers (no copy of this session is running: the promise
  /// in the header comment).
  void close(std::string reason) {
    if (close_reason_.empty()) close_reason_ = std::move(reason);
    closing_ = true;
    conn_.close();
  }

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// When the last complete frame arrived (or the connection was accepted).
  [[nodiscard]] clock::time_point last_activity() const noexcept { return last_activity_; }
  /// Why the session ended ("disconnected", "idle for ...", "protocol error: ...").
  [[nodiscard]] const std::string& close_reason() const noexcept { return close_reason_; }
  [[nodiscard]] std::uint64_t requests() const noexcept { return requests_; }

  /// The answer to one frame (publishes server_request_started/finished). Never throws.
  protocol::message handle_frame(protocol::frame& f) {
    ++requests_;
    const bus::request_kind kind = protocol::request_kind_of(f.header.type);
    const auto t0 = clock::now();
    ctx_.bus.publish(bus::server_request_started{kind, id_});
    protocol::message reply = dispatch(f);
    const bool ok = !std::holds_alternative<protocol::error_response>(reply);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
    ctx_.bus.publish(bus::server_request_finished{kind, id_, ok, static_cast<std::uint64_t>(ns)});
    return reply;
  }

 private:
  // --- the loop ------------------------------------------------------------------------
  boost::asio::awaitable<void> run(std::shared_ptr<session> self) {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    (void)self;  // keeps the session alive while the loop runs
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
        } else if (ec != boost::asio::error::operation_aborted) {
          set_reason("socket error: " + ec.message());
        } else {
          set_reason("closed");
        }
        break;
      }
      // Closed meanwhile (reaped, shutting down): a frame read before the close is dropped,
      // so no copy starts after it (the promise in the header comment).
      if (closing_) {
        set_reason("closed");
        break;
      }
      last_activity_ = clock::now();
      protocol::message reply = handle_frame(f);
      const std::uint64_t call_id = f.header.call_id;
      auto [wec] = co_await conn_.async_send(call_id, reply, as_tuple(use_awaitable));
      if (wec) {
        set_reason(closing_ ? "closed" : "write failed: " + wec.message());
        break;
      }
      if (closing_) break;
    }
    conn_.close();
    host_.session_closed(id_);
  }

  void set_reason(std::string r) {
    if (close_reason_.empty()) close_reason_ = std::move(r);
  }

  // --- dispatch ------------------------------------------------------------------------
  static protocol::error_response error(errc e, std::string_view text) {
    return protocol::error_response::make(e, text);
  }

  protocol::message dispatch(protocol::frame& f) {
    auto decoded = protocol::decode_message(f, conn_.frame_limits());
    if (!decoded) {
      const auto& e = decoded.error();
      const errc code =
          e.code.category() == kvtier_category() ? static_cast<errc>(e.code.value()) : errc::protocol_error;
      return error(code, e.reason);
    }
    if (protocol::is_response(f.header.type))
      return error(errc::protocol_error,
                   std::string(protocol::name(f.header.type)) + " is a response: a client sends requests only");
    try {
      return std::visit(
          [&](auto& m) -> protocol::message {
            using T = std::decay_t<decltype(m)>;
            if constexpr (!protocol::wire_request<T>) {
              return error(errc::protocol_error, "not a request");
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
      return error(errc::out_of_memory, "the server ran out of memory handling this request");
    } catch (const std::exception& e) {
      ctx_.log.error("client {}: {} failed: {}", id_, protocol::name(f.header.type), e.what());
      return error(errc::invalid_argument, e.what());
    }
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
    if (auto st = ctx_.cache.poll(e->cache_id))
      return protocol::query_prefetch_response{protocol::prefetch_state::done, static_cast<std::uint32_t>(st->chunks),
                                               static_cast<std::uint32_t>(st->l1_chunks)};
    if (ctx_.cache.known(e->cache_id))
      return protocol::query_prefetch_response{protocol::prefetch_state::pending, 0, 0};
    ctx_.lookups.take(id_, r.request_key);  // expired in the cache (lookup_ttl)
    return protocol::query_prefetch_response{protocol::prefetch_state::unknown, 0, 0};
  }

  request_result<protocol::retrieve_response> on(const protocol::retrieve_request& r) {
    auto reg_r = registered_with_region("retrieve_request");
    if (!reg_r) return reg_r.error();
    registration& reg = **reg_r;
    const std::size_t n = r.chunk_hashes.size();
    if (auto e = check_blocks(reg, "retrieve_request", r.rank, n, r.block_ids)) return *e;
    if (n == 0) return protocol::retrieve_response{0};

    const std::uint64_t mid = reg.model_id_for(r.cache_salt);
    std::vector<chunk_key> keys(n);
    for (std::size_t i = 0; i < n; ++i) keys[i] = reg.key(mid, r.chunk_hashes[i]);
    std::vector<l1::status> st(n);
    std::vector<std::span<const std::byte>> views(n);
    ctx_.cache.pin_for_copy(keys, st, views, reg.object_bytes);  // the copyable prefix only

    // The contiguous prefix of pinned objects of the right size is copied out.
    const std::uint32_t ct = reg.chunk.chunk_tokens;
    const std::size_t bpc = reg.blocks_per_chunk;
    std::size_t prefix = 0;
    while (prefix < n && st[prefix] == l1::status::success && views[prefix].size() == reg.object_bytes) ++prefix;
    std::vector<scatter_item> items(prefix);
    for (std::size_t i = 0; i < prefix; ++i) {
      const std::uint64_t done = std::uint64_t{ct} * i;
      const std::uint64_t skip = r.skip_tokens > done ? std::min<std::uint64_t>(r.skip_tokens - done, ct) : 0;
      items[i] =
          scatter_item{std::span(r.block_ids).subspan(i * bpc, bpc), views[i].data(), static_cast<std::uint32_t>(skip)};
    }
    std::uint32_t retrieved = static_cast<std::uint32_t>(prefix);
    if (const std::error_code ec = scatter_chunks(reg.region.view(), reg.chunk, items)) {
      ctx_.log.error("client {}: retrieve copy refused: {}", id_, ec.message());
      retrieved = 0;  // nothing was written
    }

    std::vector<chunk_key> pinned;
    pinned.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      if (st[i] == l1::status::success) pinned.push_back(keys[i]);
    ctx_.cache.unpin_after_copy(pinned);
    // Only this connection's lookup: a worker retrieving what its scheduler looked up on
    // another connection leaves the scheduler's holds to the scheduler (end_request).
    if (const lookup_table::entry* e = ctx_.lookups.find(id_, r.request_key)) ctx_.cache.release(e->cache_id, keys);
    return protocol::retrieve_response{retrieved};
  }

  request_result<protocol::store_response> on(const protocol::store_request& r) {
    auto reg_r = registered_with_region("store_request");
    if (!reg_r) return reg_r.error();
    registration& reg = **reg_r;
    const std::size_t n = r.chunk_hashes.size();
    if (auto e = check_blocks(reg, "store_request", r.rank, n, r.block_ids)) return *e;
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
    std::vector<l1::status> st(keys.size());
    std::vector<std::span<std::byte>> buffers(keys.size());
    if (!keys.empty()) ctx_.cache.reserve_write(keys, reg.object_bytes, st, buffers);

    std::vector<gather_item> items;
    std::vector<std::size_t> reserved;  // indexes into todo/keys
    for (std::size_t j = 0; j < keys.size(); ++j) {
      if (st[j] == l1::status::success) {
        items.push_back(gather_item{blocks_of(todo[j]), buffers[j].data(), 0});
        reserved.push_back(j);
      } else if (st[j] == l1::status::not_writable) {
        ++out.already_present;
      } else {
        ++out.failed;
      }
    }
    if (items.empty()) return out;

    std::vector<chunk_key> good, bad;
    if (const std::error_code ec = gather_chunks(reg.region.view(), reg.chunk, items)) {
      ctx_.log.error("client {}: store copy refused: {}", id_, ec.message());
      for (std::size_t j : reserved) bad.push_back(keys[j]);
    } else {
      if (ctx_.hooks.after_store_copy) ctx_.hooks.after_store_copy(id_, r.block_ids);
      // The fence: a block the engine reused while we copied is never stored under the old key.
      for (std::size_t j : reserved) (fenced(todo[j]) ? bad : good).push_back(keys[j]);
    }
    if (!bad.empty()) {
      ctx_.cache.abandon_write(bad);
      out.failed += static_cast<std::uint32_t>(bad.size());
    }
    if (!good.empty()) {
      std::vector<l1::status> fs(good.size());
      const pipeline::write_context wc{request_id_of(r.request_key), 0, r.first_chunk};
      const std::size_t ok = ctx_.cache.finish_write(good, wc, fs);
      out.stored += static_cast<std::uint32_t>(ok);
      out.failed += static_cast<std::uint32_t>(good.size() - ok);
    }
    return out;
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
  std::uint64_t requests_ = 0;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
