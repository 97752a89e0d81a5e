#pragma once
// engine::connector<Bus>: the engine-side client of the cache server, shaped like vLLM's KV
// connector: lookups on the scheduler side; retrieves, stores, finished reporting and load
// errors on the worker side; layer progress, fencing (quarantine) and health. Its transport
// runs on a thread of its own (engine/detail/server_link.hpp). docs/fault-tolerance.md holds
// the rest: the API in one screen, threads and waits, lifetime, health, deadlines, fencing,
// finished reporting, events and every knob (engine/options.hpp).

#include <kvtier/bus/events.hpp>
#include <kvtier/bus/null_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/detail/call_table.hpp>
#include <kvtier/engine/detail/server_link.hpp>
#include <kvtier/engine/finished_tracker.hpp>
#include <kvtier/engine/health.hpp>
#include <kvtier/engine/options.hpp>
#include <kvtier/engine/quarantine.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/protocol/messages.hpp>

#include <boost/asio/awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

/// Counters for diagnostics and tests (a snapshot).
struct connector_stats {
  std::uint64_t registrations = 0;   ///< successful registrations (first connect + reconnects)
  std::uint64_t late_replies = 0;    ///< replies to calls the connector had given up on
  std::uint64_t progress_messages = 0;  ///< retrieve progress messages for retrieves in flight
  std::uint64_t ignored_progress = 0;   ///< progress for calls not in flight (late: ignored)
  std::uint64_t calls_issued = 0;    ///< requests handed to a connection
  /// Of them, written by the engine's thread that issued them (without waking the
  /// connector's thread; docs/fault-tolerance.md, "Sends leave the mutex").
  std::uint64_t calls_sent_by_caller = 0;
  std::size_t pending_calls = 0;     ///< calls waiting for their reply now
  std::size_t tracked_requests = 0;  ///< finished_tracker::tracked()
  std::size_t lookups = 0;           ///< lookup entries kept (pending or answered)
  std::size_t open_connections = 0;  ///< the current one plus those kept for late replies
  std::uint64_t descriptions_sent = 0;  ///< describe_chunks_request frames sent
  std::uint64_t chunks_described = 0;   ///< chunks in them
  std::size_t quarantined_blocks = 0;   ///< blocks quarantined now (quarantined_blocks().size())
  /// Nanoseconds spent unhealthy (without a registered server: health_state::unhealthy)
  /// since the connector started, the current outage included: exactly the sum of the
  /// outages connector_healthy reported once healthy again. Not the first connection's
  /// attempt while it lasts (health_state::starting), which counts only once it failed.
  std::uint64_t unhealthy_ns = 0;
};

template <class Bus>
class connector final : private detail::link_owner {
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
  [[nodiscard]] bool healthy() const noexcept { return link_.healthy(); }
  [[nodiscard]] health_state state() const;
  /// Why the last connection attempt or connection failed (human-readable, may be empty).
  [[nodiscard]] std::string last_error() const;
  [[nodiscard]] connector_stats stats() const;

  // --- an idle engine's wait ---------------------------------------------------------------
  /// A count that moves each time something an engine acts on happens: a lookup answered, a
  /// retrieve's progress or completion, a store's end, quarantined blocks released. Read it
  /// at the top of a step; wait_progress(seen, t) then sleeps until it moved (true) or `t`
  /// passed (false), so an engine with nothing to compute wakes at the answer instead of
  /// polling on a timer (and returns at once when it moved meanwhile: nothing is missed).
  [[nodiscard]] std::uint64_t progress() const;
  bool wait_progress(std::uint64_t seen, std::chrono::microseconds timeout);
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
  /// stores must pass the same one. The looked-up chunks are also described
  /// (describe_chunks, no extras) unless options().describe_chunks is false.
  void lookup(std::string_view request_id, std::span<const token_id> tokens, std::string_view cache_salt = {});
  /// The same with the chunk hashes already computed (chunk_hashes(tokens)); describes
  /// nothing (it has no tokens): call describe_chunks beside it.
  void lookup_hashes(std::string_view request_id, std::vector<hash128> hashes, std::string_view cache_salt = {});
  /// Whether describe_chunks may send anything now: false with options().describe_chunks
  /// false, and once this connection's server answered that it publishes no KV events (until
  /// a reconnection asks again). A caller that must prepare a description (convert tokens,
  /// read extras) asks this first: a server without KV events then costs it nothing per lookup.
  [[nodiscard]] bool describes_chunks() const;
  /// Tells the server the token ids of consecutive chunks of one prompt (`hashes`, as a
  /// lookup names them; `tokens`: at least hashes.size() x chunk_tokens, the chunks' tokens
  /// from the first, the rest ignored), so that a server publishing KV events for routers can
  /// announce them (docs/integration.md, "Routers"). Fire and forget, never blocks, any role.
  /// Sends nothing while unhealthy, when options().describe_chunks is false, once this
  /// connection's server answered that it publishes no KV events (until a reconnection), and
  /// for the chunks (hash and salt) described on this connection recently
  /// (described_chunks_window): the others go as runs of consecutive chunks, each with its
  /// parent, split to fit the protocol's limits. Throws std::invalid_argument on malformed
  /// arguments (too few tokens, a block size that does not divide chunk_tokens, extra keys
  /// not one per block, a salt or LoRA name too long, lora_id below -1).
  void describe_chunks(std::span<const hash128> hashes, std::span<const token_id> tokens,
                       std::string_view cache_salt = {}, const chunk_description_extras& extras = {});
  /// Hit tokens (hit chunks x chunk_tokens, a chunk counting only when every rank has it)
  /// once answered; nullopt while pending. 0 when unhealthy, on any failure, and for ids
  /// never looked up (or whose answer was dropped by end_request or max_lookups). Stable
  /// once answered. The engine keeps at least one token to compute itself.
  [[nodiscard]] std::optional<std::size_t> lookup_result(std::string_view request_id) const;
  /// Blocks until every listed lookup is answered (or has no entry: never looked up, or
  /// dropped by end_request / max_lookups): true; false when `timeout` passed first. A
  /// lookup is always answered by its deadline (lookup_timeout), so this never outlives it
  /// by much. For engines that ask synchronously (SGLang's batch_exists). Throws
  /// std::logic_error on a connector that is not the scheduler.
  bool wait_lookups(std::span<const std::string> request_ids, std::chrono::microseconds timeout);
  /// Releases the server's locks of chunks of the lookup that will never be retrieved.
  /// Fire and forget; skipped while unhealthy.
  void free_lookup_locks(std::string_view request_id);
  /// The request is over: the server forgets its lookup, the connector its answer. Fire and
  /// forget; skipped (only the local answer is dropped) while unhealthy. Sent without waking
  /// the connector's thread: with its next call that does, or when that thread runs anyway
  /// (a reply, the next ping), so within ping_interval.
  void end_request(std::string_view request_id);

  // --- worker side ---------------------------------------------------------------------
  /// Loads chunks [first_chunk, first_chunk + n) of the request into `block_ids`
  /// (n * chunk_tokens / block_size ids, chunk-major), but the first `skip_tokens` tokens of
  /// that range, which the engine already has. Asynchronous: the id is reported in
  /// finished_recving once, when this and every other retrieve of it issued so far have
  /// completed (finished_tracker.hpp: a retrieve issued after that report is not reported
  /// again, but holds back finished_sending); blocks of chunks that did not land (failure,
  /// timeout, unhealthy, a shorter prefix) go to take_load_error_blocks(). `tokens` holds at
  /// least (first_chunk + n) * chunk_tokens tokens. `how`: layer progress, and a synchronous
  /// load (never reported in finished_recving; engine/options.hpp). Throws
  /// std::invalid_argument on malformed arguments.
  void retrieve(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens = 0,
                std::string_view cache_salt = {}, retrieve_options how = {});
  /// The same with the hashes of the n chunks retrieved.
  void retrieve_hashes(std::string_view request_id, std::span<const hash128> hashes, std::uint32_t first_chunk,
                       std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens = 0,
                       std::string_view cache_salt = {}, retrieve_options how = {});
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
  /// Blocks until no store of the listed requests is in flight (true), or `timeout` passes
  /// (false). A store is over when the server answered it (stored, refused, failed), timed
  /// out or was released by the unhealthy edge; the server reads the blocks no more after
  /// its answer, and a late copy of one given up on is fenced by block_reused. For engines
  /// that reuse the blocks right after a store (SGLang's staging pages).
  bool wait_stores(std::span<const std::string> request_ids, std::chrono::milliseconds timeout);
  /// vLLM's get_finished: `finished_by_engine` are the ids the engine finished this step.
  finished_requests get_finished(std::span<const std::string> finished_by_engine);
  /// Blocks whose KV did not land (each once; the set is cleared).
  std::vector<std::uint32_t> take_load_error_blocks();

  // --- layer-wise loading (a synchronous engine: vLLM's wait_for_layer_load) -----------
  /// The leading layers usable in every block of the request's retrieves in flight: what
  /// their progress said (every retrieve asks for it), 0 before any; the model's layer
  /// count when none is in flight (completed ones, failed or not, wait for nothing: their
  /// failed blocks are load errors). A retrieve's final answer may still count fewer chunks
  /// than progress covered: the blocks of the chunks it does not count are load errors
  /// whatever progress said, so take_load_error_blocks() after wait_retrieves() decides
  /// what the step computed with (docs/protocol.md, "Layer-wise retrieves").
  [[nodiscard]] std::uint32_t layers_ready(std::string_view request_id) const;
  /// Blocks until every retrieve in flight of the listed requests has at least `layers`
  /// layers ready or completed (ok, failed, timed out, released by the unhealthy edge):
  /// true; false when `timeout` passed first.
  bool wait_layers(std::span<const std::string> request_ids, std::uint32_t layers, std::chrono::milliseconds timeout);
  /// Blocks until no retrieve of the listed requests is in flight (true), or `timeout`
  /// passes (false). Then take_load_error_blocks() holds every block of theirs that did not
  /// land.
  bool wait_retrieves(std::span<const std::string> request_ids, std::chrono::milliseconds timeout);

  // --- fencing -------------------------------------------------------------------------
  /// The engine must not write into (allocate) a quarantined block.
  [[nodiscard]] bool block_is_quarantined(std::uint32_t block) const;
  [[nodiscard]] std::vector<std::uint32_t> quarantined_blocks() const;
  /// The engine is about to write new content into `block` (kv_region::begin_reuse): a store
  /// that read the block earlier can no longer be stored. Returns false, and does nothing,
  /// when the block is quarantined (pick another block).
  [[nodiscard]] bool block_reused(std::uint32_t block);
  /// block_reused for each of `blocks` in turn, in one critical section; returns the
  /// quarantined ones (nothing done for them). Throws std::out_of_range at the first id out of
  /// range (the blocks before it are fenced), as block_reused would.
  [[nodiscard]] std::vector<std::uint32_t> blocks_reused(std::span<const std::uint32_t> blocks);
  /// Blocks until none of `blocks` is quarantined (true), or `timeout` passes (false). For an
  /// engine that must hand blocks back that a synchronous load it gave up on may still be
  /// written into (vLLM frees a preempted request's blocks at once). Bounded by
  /// quarantine_limit, when it is not 0.
  bool wait_released(std::span<const std::uint32_t> blocks, std::chrono::milliseconds timeout);

 private:
  using call_kind = detail::call_kind;
  using call_status = detail::call_status;
  using call_result = detail::call_result;
  using pending_call = detail::pending_call;

  struct lookup_entry {
    std::uint64_t serial = 0;
    bool answered = false;
    std::size_t tokens = 0;
    std::uint32_t requested_chunks = 0;
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
  /// A retrieve in flight, for the layer-wise waits and an early end.
  struct load_in_flight {
    std::string request_id;
    std::uint32_t chunks = 0;        ///< chunks requested
    std::uint32_t layers_ready = 0;  ///< from its progress messages, at most the layer count
    std::uint32_t chunks_ready = 0;  ///< from its progress messages, at most `chunks`
  };
  struct store_info {
    std::string request_id;
    std::uint32_t chunks = 0;
    clock::time_point started{};
  };

  static bus::null_bus& null_bus_instance() noexcept {
    static bus::null_bus b;
    return b;
  }

  // Engine-thread helpers.
  void check_request_id(std::string_view id) const;
  /// std::logic_error on a connector that is not the scheduler; then check_request_id.
  void check_lookup(std::string_view request_id) const;
  static void check_salt(std::string_view salt);
  /// The region of a worker's connector; std::logic_error naming `what` without one.
  kv_region& region_for(const char* what) const;
  void check_blocks(std::span<const std::uint32_t> block_ids, std::size_t chunks) const;
  [[nodiscard]] std::vector<hash128> hashes_of(std::span<const token_id> tokens, std::uint32_t first_chunk,
                                               std::size_t chunks) const;
  /// What every connection registers.
  [[nodiscard]] protocol::register_kv_request registration() const;
  [[nodiscard]] std::mutex& mu() const noexcept { return link_.mutex(); }

  // detail::link_owner: the link's edges, on its thread with the mutex held.
  void on_healthy_locked(bool reconnect, bool restarted, std::uint64_t unhealthy_ns) override;
  void on_unhealthy_locked(std::string_view reason, std::size_t released_transfers) override;
  void after_unhealthy_locked() override;
  void on_peer_refused_locked(std::uint32_t uid, std::uint32_t pid, std::uint32_t expected) override;
  void on_copies_over_locked(std::uint64_t epoch) override;
  void on_late_reply_locked(std::uint64_t id) override;
  void on_retrieve_progress_locked(std::uint64_t id, std::uint32_t layers_ready, std::uint32_t chunks_ready) override;
  [[nodiscard]] bool awaits_late_replies_locked(std::uint64_t epoch) const override;

  // Everything below runs with the mutex held; the *_io functions on the link's thread.
  void finish_retrieve_locked(const retrieve_info& info, std::uint32_t retrieved, bus::connector_outcome outcome,
                              const pending_call* call);
  void finish_store_locked(const store_info& info, const call_result* r, bus::connector_outcome outcome);
  void answer_lookup_locked(const std::string& id, lookup_entry& e, std::size_t tokens, bus::connector_outcome outcome);
  lookup_entry* find_lookup_locked(const std::string& id, std::uint64_t serial);
  void issue_query_locked(const std::string& id, std::uint64_t serial);
  void on_lookup_reply_io(const std::string& id, std::uint64_t serial, call_result& r, bool from_lookup);
  /// `lazy`: server_link::issue_locked's (sent with the next call that wakes the link).
  template <class Msg>
  void send_notify_locked(const Msg& m, bool lazy = false);
  void publish_quarantine_locked(std::size_t held, std::size_t released);
  /// block_reused's work for one block, under mu(): fences it unless quarantined (false).
  bool reuse_block_locked(kv_region& region, std::uint32_t block);
  /// describe_chunks's argument checks (std::invalid_argument); the block size it sends.
  [[nodiscard]] std::uint32_t description_block_size(std::size_t chunks, std::size_t token_count,
                                                     std::string_view cache_salt,
                                                     const chunk_description_extras& extras) const;
  /// The description of chunks [begin, end) of `hashes`.
  [[nodiscard]] protocol::describe_chunks_request description_of(std::span<const hash128> hashes,
                                                                 std::span<const token_id> tokens,
                                                                 std::string_view cache_salt,
                                                                 const chunk_description_extras& extras,
                                                                 std::uint32_t block_size, std::size_t begin,
                                                                 std::size_t end, std::uint64_t model_id) const;
  /// Where the description of the run [begin, end) that starts at `begin` ends: within the
  /// protocol's limits and max_description_body_bytes.
  [[nodiscard]] std::size_t description_end(std::size_t begin, std::size_t end, std::uint32_t block_size,
                                            const chunk_description_extras& extras) const;
  /// The described-chunks key of `h` under request salt `salt`.
  [[nodiscard]] static hash128 described_key(const hash128& h, std::string_view salt) noexcept;
  /// Marks `key` described on this connection; false when it was already.
  bool mark_described_locked(const hash128& key);
  void on_description_reply_io(std::uint64_t generation, const call_result& r);
  /// Moves progress() and wakes every wait (mutex held).
  void notify_waiters_locked() {
    ++progress_;
    waits_cv_.notify_all();
  }
  /// Waits on waits_cv_ until done() holds (true) or `timeout` passes (false).
  template <class Rep, class Period, class Done>
  bool wait_for_locked(std::unique_lock<std::mutex>& lock, std::chrono::duration<Rep, Period> timeout, Done done);
  /// Whether a retrieve in flight belongs to one of `ids`.
  static bool listed(std::span<const std::string> ids, const std::string& id) noexcept {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  }
  [[nodiscard]] static bus::connector_outcome outcome_of(call_status s) noexcept;
  [[nodiscard]] std::uint32_t blocks_per_chunk() const noexcept {
    return options_.chunk_tokens / region_->layout().block_size;
  }
  [[nodiscard]] clock::duration scaled(std::chrono::milliseconds d) const noexcept { return options_.scaled(d); }
  /// Releases quarantined blocks held past quarantine_limit (a coroutine on the link's thread).
  boost::asio::awaitable<void> housekeeping();
  static connector_options validated(connector_options o, const kv_region* region);
  connector(connector_options options, kv_region* region, Bus& bus);

  connector_options options_;
  kv_region* region_;  ///< null: a scheduler's connector
  Bus& bus_;
  token_hasher hasher_;
  std::uint64_t instance_id_;
  // --- guarded by mu() ---
  std::uint64_t next_lookup_serial_ = 1;
  finished_tracker tracker_;
  quarantine quarantine_;
  std::vector<std::uint32_t> load_errors_;
  std::vector<bool> is_load_error_;
  std::unordered_map<std::string, lookup_entry> lookups_;
  std::deque<std::pair<std::string, std::uint64_t>> answered_order_;  ///< (id, serial), oldest first
  std::unordered_map<std::uint64_t, load_in_flight> loads_;  ///< retrieves in flight, by call id
  /// Descriptions on the current connection (reset at each registration: describe_generation_).
  /// `off`: its server answered described=false (or refused one): no more on it.
  enum class describe_state : std::uint8_t { unknown, on, off };
  describe_state describe_state_ = describe_state::unknown;
  std::uint64_t describe_generation_ = 0;  ///< bumped at each registration
  struct hash128_hasher {
    std::size_t operator()(const hash128& h) const noexcept {
      return static_cast<std::size_t>(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ULL));
    }
  };
  std::unordered_set<hash128, hash128_hasher> described_;  ///< described on this connection
  std::deque<hash128> described_order_;                    ///< oldest first (the window)
  std::uint64_t descriptions_sent_ = 0;
  std::uint64_t chunks_described_ = 0;
  /// Notified (mutex held) when a retrieve progresses or completes and when quarantined
  /// blocks are released, a lookup is answered or a store ends: wait_layers, wait_retrieves,
  /// wait_released, wait_lookups, wait_stores, wait_progress.
  std::condition_variable waits_cv_;
  std::uint64_t progress_ = 0;  ///< bumped with each waits_cv_ notification (progress())
  // The transport last: it starts after everything above exists and stops (~connector)
  // before any of it goes.
  detail::server_link link_;
};

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/engine/impl/connector.hpp>
#include <kvtier/engine/impl/connector_descriptions.hpp>
#include <kvtier/engine/impl/connector_lookups.hpp>
#include <kvtier/engine/impl/connector_transfers.hpp>
