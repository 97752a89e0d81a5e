#pragma once
// engine::connector<Bus>: the engine-side client of the cache server, shaped like vLLM's KV
// connector. One per engine worker (rank), each with its own kv_region and connection; and,
// as vLLM splits them, one without a region for the scheduler process (it registers with
// region kind none and may only look up, free lookup locks and end requests).
//
//   scheduler side   lookup(id, tokens)        non-blocking; lookup_result(id) polls the answer
//                    free_lookup_locks(id), end_request(id)            fire and forget
//   worker side      retrieve(id, tokens, first_chunk, block_ids, skip)  async load into blocks
//                    store(id, tokens, first_chunk, chunk_count, block_ids) async save
//                    get_finished(finished_by_engine) -> {finished sending, finished recving}
//                    take_load_error_blocks()  blocks the engine must recompute
//   fencing          block_is_quarantined(b), quarantined_blocks(), block_reused(b)
//   tenants          cache_salt: the options' (per connector) and each call's (per request,
//                    vLLM's cache_salt) are folded into the chunks' model id
//   health           healthy(), state(), wait_ready(timeout), last_error()
//
// The engine is synchronous, so the connector runs its own io_context on one background
// thread. Every public function is thread-safe and returns without waiting for the server
// (wait_ready aside, which the engine may call once at start-up). docs/fault-tolerance.md
// describes the behaviour and every knob (engine/options.hpp); in short:
//
//   health     EOF or a socket error: unhealthy at once; an unanswered ping (ping_timeout)
//              or breaker_threshold call timeouts in a row: unhealthy. Unhealthy: lookups
//              answer 0, stores are skipped, retrieves become load errors, every in-flight
//              call is released (finished receiving / sending as due); the connector
//              reconnects with backoff, registers its region again (a new boot token tells a
//              restart) and resumes. It starts degraded when no server is there yet.
//   deadlines  every call has one; a retrieve past retrieve_timeout is a load error (never
//              silent) and its blocks are quarantined.
//   fencing    blocks of a retrieve the connector gave up on stay quarantined until it is
//              proven that no copy can follow: the server answers that call, closes that
//              connection (it closes one only after every copy it started for it ended), or
//              its process is gone (pidfd); or, by default, after quarantine_limit (10 min).
//              Stores carry the blocks' generations read at store() time, which the server
//              checks after its copy, so a block reused meanwhile (block_reused) is never
//              stored.
//   finished   finished_tracker.hpp: each id once in each list, never in recving while a
//              retrieve of it is pending, nor in sending while a retrieve or store is;
//              bounded memory.
//
// Events (bus/events.hpp): connector.healthy / unhealthy / reconnected, lookup.completed,
// retrieve.completed, store.completed, load_error, quarantine.changed. They are published
// from the calling or the connector's thread with the connector's lock held: subscribers
// must not call back into the connector.
//
// Lifetime: the kv_region (if any) and the bus must outlive the connector. The destructor closes the
// connection (the server releases the registration and its locks at EOF) and joins the
// thread; nothing is reported after it.

#include <kvtier/bus/events.hpp>
#include <kvtier/bus/null_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/detail/server_process.hpp>
#include <kvtier/engine/finished_tracker.hpp>
#include <kvtier/engine/health.hpp>
#include <kvtier/engine/options.hpp>
#include <kvtier/engine/quarantine.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::engine {

/// Counters for diagnostics and tests (a snapshot).
struct connector_stats {
  std::uint64_t registrations = 0;   ///< successful registrations (first connect + reconnects)
  std::uint64_t late_replies = 0;    ///< replies to calls the connector had given up on
  std::uint64_t calls_issued = 0;    ///< requests handed to a connection
  std::size_t pending_calls = 0;     ///< calls waiting for their reply now
  std::size_t tracked_requests = 0;  ///< finished_tracker::tracked()
  std::size_t lookups = 0;           ///< lookup entries kept (pending or answered)
  std::size_t open_connections = 0;  ///< the current one plus those kept for late replies
};

template <class Bus>
class connector {
 public:
  static_assert(bus::event_bus<Bus>, "kvtier::engine::connector: Bus must model kvtier::bus::event_bus");
  using bus_type = Bus;
  using clock = std::chrono::steady_clock;

  /// A worker's connector: starts the connector's thread, which connects in the background.
  /// Throws std::invalid_argument when the options are invalid or do not fit the region
  /// (chunk_tokens must be a multiple of the region's block size; options.model must be left
  /// default).
  connector(connector_options options, kv_region& region, Bus& bus);

  /// A scheduler's connector, without a KV region: registers options.model (one rank's
  /// shape) and options.layout_kind with region kind none. Only the scheduler side of the
  /// interface may be used; retrieve, store and block_reused throw std::logic_error. Throws
  /// std::invalid_argument when the options are invalid or not a scheduler's.
  connector(connector_options options, Bus& bus);

  /// Connectors that publish nothing.
  // clang-format off
  connector(connector_options options, kv_region& region)
    requires std::same_as<Bus, bus::null_bus>
      : connector(std::move(options), region, null_bus_instance()) {}
  explicit connector(connector_options options)
    requires std::same_as<Bus, bus::null_bus>
      : connector(std::move(options), null_bus_instance()) {}
  // clang-format on

  connector(const connector&) = delete;
  connector& operator=(const connector&) = delete;
  ~connector();

  // --- health ---------------------------------------------------------------------------
  /// Blocks until the connector is registered with a server (true) or `timeout` passes.
  bool wait_ready(std::chrono::milliseconds timeout);
  [[nodiscard]] bool healthy() const noexcept { return healthy_.load(std::memory_order_acquire); }
  [[nodiscard]] health_state state() const;
  /// Why the last connection attempt or connection failed (human-readable, may be empty).
  [[nodiscard]] std::string last_error() const;
  [[nodiscard]] connector_stats stats() const;
  /// The current server's boot token (0 before the first registration).
  [[nodiscard]] std::uint64_t boot_token() const;
  [[nodiscard]] const connector_options& options() const noexcept { return options_; }
  /// Whether this connector has a KV region (a worker) or not (a scheduler).
  [[nodiscard]] bool has_region() const noexcept { return region_ != nullptr; }

  /// The rolling prefix hashes of the full chunks of `tokens` (the connector's algorithm and
  /// chunk size), for engines that hash once and call the *_hashes variants.
  [[nodiscard]] std::vector<hash128> chunk_hashes(std::span<const token_id> tokens) const {
    return hasher_.chunk_hashes(tokens);
  }

  // --- scheduler side (options.is_scheduler()) -----------------------------------------
  /// Starts the lookup of the request's full chunks (every rank's shard of each). Idempotent
  /// per request id: a second call while an entry exists does nothing. Never blocks.
  /// Throws std::logic_error on a connector that is not the scheduler.
  /// `cache_salt` (<= 256 bytes): the request's salt (vLLM's cache_salt); its retrieves and
  /// stores must pass the same one.
  void lookup(std::string_view request_id, std::span<const token_id> tokens, std::string_view cache_salt = {});
  /// The same with the chunk hashes already computed (chunk_hashes(tokens)).
  void lookup_hashes(std::string_view request_id, std::vector<hash128> hashes, std::string_view cache_salt = {});
  /// Hit tokens (hit chunks x chunk_tokens, a chunk counting only when every rank has it)
  /// once answered; nullopt while pending. 0 when unhealthy, on any failure, and for ids
  /// never looked up (or whose answer was dropped by end_request or max_lookups). Stable
  /// once answered. The engine keeps at least one token to compute itself.
  [[nodiscard]] std::optional<std::size_t> lookup_result(std::string_view request_id) const;
  /// Releases the server's locks of chunks of the lookup that will never be retrieved.
  /// Fire and forget; skipped while unhealthy.
  void free_lookup_locks(std::string_view request_id);
  /// The request is over: the server forgets its lookup, the connector its answer. Fire and
  /// forget; skipped (only the local answer is dropped) while unhealthy.
  void end_request(std::string_view request_id);

  // --- worker side ---------------------------------------------------------------------
  /// Loads chunks [first_chunk, first_chunk + n) of the request into `block_ids`
  /// (n * chunk_tokens / block_size ids, chunk-major), but the first `skip_tokens` tokens of
  /// that range, which the engine already has. Asynchronous: the id is reported in
  /// finished_recving once, when this and every other retrieve of it issued so far have
  /// completed (finished_tracker.hpp: a retrieve issued after that report is not reported
  /// again, but holds back finished_sending); blocks of chunks that did not land (failure,
  /// timeout, unhealthy, a shorter prefix) go to take_load_error_blocks(). `tokens` holds at
  /// least (first_chunk + n) * chunk_tokens tokens. Throws std::invalid_argument on
  /// malformed arguments.
  void retrieve(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens = 0,
                std::string_view cache_salt = {});
  /// The same with the hashes of the n chunks retrieved.
  void retrieve_hashes(std::string_view request_id, std::span<const hash128> hashes, std::uint32_t first_chunk,
                       std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens = 0,
                       std::string_view cache_salt = {});
  /// Saves chunks [first_chunk, first_chunk + chunk_count) of the request from `block_ids`
  /// (chunk_count * chunk_tokens / block_size ids). The blocks' generations are read now,
  /// so call it after the forward pass wrote them and before any block_reused of them.
  /// Asynchronous; skipped while unhealthy (the KV is simply not cached). Either way the id
  /// is reported in finished_sending once the engine reports it finished.
  void store(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
             std::uint32_t chunk_count, std::span<const std::uint32_t> block_ids, std::string_view cache_salt = {});
  /// The same with the hashes of the chunks stored.
  void store_hashes(std::string_view request_id, std::span<const hash128> hashes, std::uint32_t first_chunk,
                    std::span<const std::uint32_t> block_ids, std::string_view cache_salt = {});
  /// vLLM's get_finished: `finished_by_engine` are the ids the engine finished this step.
  finished_requests get_finished(std::span<const std::string> finished_by_engine);
  /// Blocks whose KV did not land (each once; the set is cleared).
  std::vector<std::uint32_t> take_load_error_blocks();

  // --- fencing -------------------------------------------------------------------------
  /// The engine must not write into (allocate) a quarantined block.
  [[nodiscard]] bool block_is_quarantined(std::uint32_t block) const;
  [[nodiscard]] std::vector<std::uint32_t> quarantined_blocks() const;
  /// The engine is about to write new content into `block` (kv_region::begin_reuse): a store
  /// that read the block earlier can no longer be stored. Returns false, and does nothing,
  /// when the block is quarantined (pick another block).
  [[nodiscard]] bool block_reused(std::uint32_t block);

 private:
  enum class call_kind : std::uint8_t { control, ping, lookup, query, retrieve, store, notify };
  enum class call_status : std::uint8_t {
    reply,        ///< the expected response
    error_reply,  ///< error_response
    timeout,      ///< the deadline passed
    unhealthy,    ///< released on the unhealthy edge
    closed,       ///< the connection broke before an answer (handshake) or was gone at send
  };
  struct call_result {
    call_status status = call_status::closed;
    protocol::message reply{};
    std::string error;  ///< error_response message, or why
  };
  struct pending_call;
  using call_done = std::function<void(pending_call&, call_result&)>;
  struct pending_call {
    std::uint64_t id = 0;
    call_kind kind = call_kind::control;
    std::uint64_t epoch = 0;
    protocol::message_type expect{};
    clock::duration timeout{};
    std::vector<std::byte> bytes;  ///< the encoded frame until sent
    int fd = -1;                   ///< passed beside the frame (register)
    bool sent = false;             ///< handed to the socket: the server may act on it
    std::optional<boost::asio::steady_timer> deadline;
    call_done done;
  };
  struct peer {
    std::uint64_t epoch = 0;
    std::shared_ptr<protocol::connection> conn;
    ::pid_t pid = 0;
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
  };
  struct lookup_entry {
    std::uint64_t serial = 0;
    bool answered = false;
    std::size_t tokens = 0;
    std::uint32_t requested_chunks = 0;
    std::vector<hash128> hashes;  ///< until the lookup request is sent
    std::string cache_salt;
    clock::time_point started{};
    clock::time_point deadline{};
  };
  struct retrieve_info {
    std::string request_id;
    std::vector<std::uint32_t> block_ids;
    std::uint32_t chunks = 0;
    std::uint32_t skip_tokens = 0;
    clock::time_point started{};
  };
  struct store_info {
    std::string request_id;
    std::uint32_t chunks = 0;
    clock::time_point started{};
  };
  struct call_waiter {
    explicit call_waiter(const boost::asio::any_io_executor& ex) : timer(ex, clock::time_point::max()) {}
    boost::asio::steady_timer timer;
    std::optional<call_result> result;
  };

  static bus::null_bus& null_bus_instance() noexcept {
    static bus::null_bus b;
    return b;
  }

  // Engine-thread helpers.
  void check_request_id(std::string_view id) const;
  static void check_salt(std::string_view salt);
  /// The region of a worker's connector; std::logic_error naming `what` without one.
  kv_region& region_for(const char* what) const;
  void check_blocks(std::span<const std::uint32_t> block_ids, std::size_t chunks) const;
  [[nodiscard]] std::vector<hash128> hashes_of(std::span<const token_id> tokens, std::uint32_t first_chunk,
                                               std::size_t chunks) const;
  template <class Msg>
  [[nodiscard]] static std::vector<std::byte> encode(std::uint64_t call_id, const Msg& m);

  // Everything below runs with mu_ held; the *_io functions on the connector's thread.
  void issue_locked(std::uint64_t id, call_kind kind, std::uint64_t epoch, protocol::message_type expect,
                    std::vector<std::byte> bytes, int fd, clock::duration timeout, call_done done);
  void complete_locked(pending_call& c, call_result r);
  void send_io(std::uint64_t id);
  void on_deadline_io(std::uint64_t id);
  bool on_frame_io(peer& p, protocol::frame f);
  /// `server_closed`: the break is the server's close (EOF, EPIPE, ECONNRESET), which
  /// releases the connection's quarantine.
  void on_peer_broken_io(peer& p, std::string_view reason, bool server_closed);
  void mark_unhealthy_io(std::string_view reason);
  void fail_calls_io(std::optional<std::uint64_t> epoch, call_status status);
  void maybe_retire_peer_io(std::uint64_t epoch);
  void finish_retrieve_locked(const retrieve_info& info, std::uint32_t retrieved, bus::connector_outcome outcome,
                              const pending_call* call);
  void finish_store_locked(const store_info& info, const call_result* r, bus::connector_outcome outcome);
  void answer_lookup_locked(const std::string& id, lookup_entry& e, std::size_t tokens, bus::connector_outcome outcome);
  lookup_entry* find_lookup_locked(const std::string& id, std::uint64_t serial);
  void start_lookup_io(const std::string& id, std::uint64_t serial);
  void issue_query_locked(const std::string& id, std::uint64_t serial);
  void on_lookup_reply_io(const std::string& id, std::uint64_t serial, call_result& r, bool ack);
  template <class Msg>
  void send_notify_locked(const Msg& m);
  void publish_quarantine_locked(std::size_t held, std::size_t released);
  [[nodiscard]] static bus::connector_outcome outcome_of(call_status s) noexcept;
  [[nodiscard]] std::uint32_t blocks_per_chunk() const noexcept {
    return options_.chunk_tokens / region_->layout().block_size;
  }

  // Coroutines on the connector's thread.
  template <class Msg>
  boost::asio::awaitable<call_result> async_call(call_kind kind, std::uint64_t epoch, const Msg& m, int fd,
                                                 clock::duration timeout);
  boost::asio::awaitable<void> lifecycle();
  boost::asio::awaitable<std::string> establish();
  boost::asio::awaitable<void> ping_loop(std::uint64_t epoch);
  boost::asio::awaitable<void> reader(std::shared_ptr<peer> p);
  boost::asio::awaitable<void> housekeeping();
  void watch_process_io(const std::shared_ptr<peer>& p);
  std::string fail_handshake_locked(std::uint64_t epoch, std::string_view reason, std::string message);
  [[nodiscard]] clock::duration scaled(std::chrono::milliseconds d) const noexcept { return options_.scaled(d); }
  static connector_options validated(connector_options o, const kv_region* region);
  connector(connector_options options, kv_region* region, Bus& bus);

  connector_options options_;
  kv_region* region_;  ///< null: a scheduler's connector
  Bus& bus_;
  token_hasher hasher_;
  std::uint64_t instance_id_;

  // I/O objects: the io_context first, so the destructor can tear the others down before it.
  std::unique_ptr<boost::asio::io_context> io_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  boost::asio::any_io_executor ex_;
  std::optional<boost::asio::steady_timer> ping_timer_;   ///< the ping loop's pause
  std::optional<boost::asio::steady_timer> retry_timer_;  ///< the reconnection pause
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable ready_cv_;
  std::atomic<bool> healthy_{false};
  std::atomic<std::uint64_t> next_call_id_{1};  ///< call ids are allocated before the lock (encoding)
  // --- guarded by mu_ ---
  bool stopping_ = false;
  health_state state_ = health_state::starting;
  clock::time_point unhealthy_since_{};
  std::string last_error_;
  std::optional<std::uint64_t> boot_token_;  ///< of the last registration
  std::uint64_t model_id_ = 0;
  std::uint64_t next_epoch_ = 0;
  std::uint64_t current_epoch_ = 0;  ///< the connection being set up or registered; 0: none
  std::uint64_t next_lookup_serial_ = 1;
  breaker breaker_;
  std::unordered_map<std::uint64_t, std::shared_ptr<pending_call>> calls_;
  std::map<std::uint64_t, std::shared_ptr<peer>> peers_;
  finished_tracker tracker_;
  quarantine quarantine_;
  std::vector<std::uint32_t> load_errors_;
  std::vector<bool> is_load_error_;
  std::unordered_map<std::string, lookup_entry> lookups_;
  std::deque<std::pair<std::string, std::uint64_t>> answered_order_;  ///< (id, serial), oldest first
  connector_stats stats_{};
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::engine

#include <kvtier/engine/impl/connector.hpp>
