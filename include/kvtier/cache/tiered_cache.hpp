#pragma once
// tiered_cache<Traits>: L1 + L2 backends + the store and prefetch pipelines + the bus behind
// one façade (LMCache's StorageManager). The server's sessions call it; an engine may also
// embed it directly. It speaks whole operations: start_lookup, async_wait(_loaded),
// async_copy_out (a retrieve), async_copy_in (a store), release_all, async_stop.
// docs/pipelines.md, "The façade", holds each call, how holds belong to their lookup, the
// write path and threads; docs/architecture.md, "Shutdown", stopping and destroying it.
// Key events (bus::tier_keys_stored / tier_keys_removed, when the bus wants them): L1's are
// published by l1::tier itself (tier l1_tier); each backend's by the key listener the
// constructor sets on it (tier l2_tier(b), see key_publisher) and the destructor clears.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/cache/copy.hpp>
#include <kvtier/cache/l1_registration.hpp>
#include <kvtier/cache/traits.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/pipeline/prefetch_controller.hpp>
#include <kvtier/pipeline/store_controller.hpp>
#include <kvtier/pipeline/work_tracker.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

struct cache_options {
  l1::tier_options l1;
  pipeline::store_options store;
  pipeline::prefetch_options prefetch;
  /// A lookup's holds (pinned in L1, owned by the lookup) are given back and the lookup
  /// forgotten when expire() runs this long after its answer, if release_all() did not come
  /// first (a client that went away). Keeps the bookkeeping bounded however long we run.
  /// Measured on l1.clock. The L1 read TTL (l1.read_lock_ttl) does not apply to these holds.
  std::chrono::nanoseconds lookup_ttl = std::chrono::seconds(300);
  /// Where async_copy_out's sinks and async_copy_in's sources run (the server's worker pool);
  /// empty: the cache's own executor.
  boost::asio::any_io_executor copy_executor;
};

/// What a lookup asks for.
struct lookup_request {
  std::span<const chunk_key> keys;  ///< chunk-major: chunk c is keys [c*group, c*group + group)
  std::size_t group = 1;            ///< shards per chunk (the world size)
  std::size_t object_bytes = 0;     ///< size of each object (one shard of one chunk; 0: any, none loaded)
  std::uint32_t chunk_tokens = 0;   ///< tokens per chunk (for the token-level counters)
  std::uint32_t extra_count = 0;    ///< extra read holds per key (MLA: several readers)
  std::uint64_t request_id = 0;     ///< the caller's id, carried into events
  /// The engine's prefill rate (tokens/s; 0: not declared): L2 offers only the prefix that
  /// loads faster than the engine computes it (pipeline/load_or_recompute.hpp).
  std::uint64_t prefill_tokens_per_second = 0;
};

/// The answer of a decided lookup.
struct lookup_status {
  std::size_t chunks = 0;     ///< leading chunks held for the caller or being loaded for it
  std::size_t l1_chunks = 0;  ///< of those, chunks L1 had (no shard loaded from L2 for this lookup)
  std::size_t loading_chunks = 0;  ///< of those, chunks with a shard still loading (async_wait)
};

/// One backend in status(): its name, usage, health and achieved load bandwidth.
struct backend_status {
  std::string name;
  l2::usage_info usage;
  l2::health_info health;
  /// Achieved L2 load bandwidth (bytes landed per second of loading over its recent load
  /// tasks, pipeline/load_or_recompute.hpp; 0 before the first): what the load-or-recompute
  /// gate compares with the engine's prefill rate.
  double read_bytes_per_second = 0;
};

struct cache_status {
  l1::usage_info l1;
  std::vector<backend_status> backends;
  std::size_t lookups = 0;              ///< lookups holding locks or running
  std::size_t prefetches_active = 0;    ///< prefetch requests not finished (late loads included)
  std::uint64_t prefetch_inflight_bytes = 0;
  std::size_t store_inflight_tasks = 0;
  std::uint64_t store_inflight_bytes = 0;
  std::size_t store_pending_keys = 0;
  std::uint64_t store_staged_bytes = 0;  ///< staging memory of stores larger than L1 (reserved or in flight)
};

template <class Traits = default_traits>
class tiered_cache {
 public:
  using traits_type = Traits;
  using bus_type = typename Traits::bus_type;
  using tier_type = l1::tier<typename Traits::eviction_policy, bus_type>;
  using store_controller_type = pipeline::store_controller<tier_type, typename Traits::store_policy, bus_type>;
  using prefetch_controller_type = pipeline::prefetch_controller<tier_type, typename Traits::plan_policy, bus_type>;
  using executor_type = boost::asio::any_io_executor;
  using lookup_id = std::uint64_t;
  using wait_handler = boost::asio::any_completion_handler<void(error_code, lookup_status)>;
  using copy_out_handler = boost::asio::any_completion_handler<void(error_code, std::size_t)>;
  using copy_in_handler = boost::asio::any_completion_handler<void(error_code, copy_in_result)>;

  static_assert(bus::event_bus<bus_type>);
  static_assert(pipeline::admission_policy<typename Traits::admission_policy>);
  static_assert(pipeline::prefetch_wait_policy<typename Traits::wait_policy>);

  struct policies {
    typename Traits::eviction_policy eviction{};
    typename Traits::store_policy store{};
    typename Traits::plan_policy plan{};
    typename Traits::admission_policy admission{};
    typename Traits::wait_policy wait{};
  };

  tiered_cache(executor_type executor, cache_options options, bus_type& bus, std::vector<l2::any_backend> backends,
               policies p = {})
      : executor_(std::move(executor)),
        options_(std::move(options)),
        copy_executor_(options_.copy_executor ? options_.copy_executor : executor_),
        bus_(bus),
        l1_(options_.l1, bus, std::move(p.eviction)),
        backends_(std::move(backends)),
        store_(executor_, l1_, backends_, bus, tracker_, std::move(p.store), options_.store),
        prefetch_(executor_, l1_, backends_, bus, tracker_, std::move(p.plan), options_.prefetch),
        admission_(std::move(p.admission)),
        wait_(std::move(p.wait)) {
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      bus_.publish(bus::cache_backend_attached{static_cast<std::uint8_t>(b), backends_[b].name()});
      if constexpr (publishes_key_events) backends_[b].set_key_listener(key_publisher(bus::l2_tier(b)));
    }
  }

  tiered_cache(const tiered_cache&) = delete;
  tiered_cache& operator=(const tiered_cache&) = delete;

  /// Safe in any state of the executor (docs/architecture.md, "Shutdown"): returns at once when
  /// nothing runs, else stops the pipelines and waits until every coroutine ended.
  ~tiered_cache() {
    stopping_.store(true, std::memory_order_relaxed);
    if (!tracker_.idle()) {
      prefetch_.stop();
      store_.stop();
      wait_for_work();
    }
    // The backends may outlive the cache (shared): they must stop calling into its bus.
    if constexpr (publishes_key_events)
      for (auto& b : backends_) b.set_key_listener({});
  }

  // --- lookups ------------------------------------------------------------------------
  /// Starts a lookup (docs/pipelines.md, "The façade"). Returns its id at once. After async_stop(),
  /// lookups answer from L1 only.
  lookup_id start_lookup(const lookup_request& r);

  /// The decided answer of a lookup, nullopt while its prefetch decides (or when the id is
  /// unknown: check known()).
  [[nodiscard]] std::optional<lookup_status> poll(lookup_id id) const {
    std::lock_guard g(mutex_);
    auto it = lookups_.find(id);
    if (it == lookups_.end() || !it->second->done) return std::nullopt;
    return it->second->result;
  }
  [[nodiscard]] bool known(lookup_id id) const {
    std::lock_guard g(mutex_);
    return lookups_.contains(id);
  }

  /// Completes with the lookup's answer once its prefetch is decided (the hit count is
  /// known; loads may still be landing): void(error_code, lookup_status); errc::not_found
  /// for an unknown id.
  template <class Token>
  auto async_wait(lookup_id id, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, lookup_status)>(
        [this, id](auto handler) { wait(id, wait_handler(std::move(handler)), false); }, token);
  }

  /// Completes once every load of the decided answer landed or failed, with the leading
  /// chunks that landed (or were there): chunks = the prefix a copy can take, loading 0.
  template <class Token>
  auto async_wait_loaded(lookup_id id, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, lookup_status)>(
        [this, id](auto handler) { wait(id, wait_handler(std::move(handler)), true); }, token);
  }

  // --- whole copies (cache/copy.hpp) ----------------------------------------------------
  /// Copies the request's keys out through `sink`, each as soon as it is readable (see
  /// docs/pipelines.md and cache/copy.hpp); void(error_code, std::size_t copied): the contiguous
  /// prefix of keys whose every part the sink copied. Gives back the lookup's holds on these
  /// keys (copied or not). cache.read.prefetched counts the copied prefix as read and the
  /// other keys as failed.
  template <class Token>
  auto async_copy_out(copy_out_request request, copy_out_sink sink, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, std::size_t)>(
        [this](auto handler, copy_out_request r, copy_out_sink s) {
          start_copy_out(std::move(r), std::move(s), copy_out_handler(std::move(handler)));
        },
        token, std::move(request), std::move(sink));
  }

  /// Stores the request's keys from `source`: reserve_write, the copies (in parallel on the
  /// copy executor), then `fence` per copied key on the completion's executor, then
  /// finish_write (fenced ok) or abandon_write; void(error_code, copy_in_result).
  template <class Token>
  auto async_copy_in(copy_in_request request, copy_in_source source, copy_in_fence fence, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, copy_in_result)>(
        [this](auto handler, copy_in_request r, copy_in_source s, copy_in_fence f) {
          start_copy_in(std::move(r), std::move(s), std::move(f), copy_in_handler(std::move(handler)));
        },
        token, std::move(request), std::move(source), std::move(fence));
  }

  /// Pins the contiguous prefix of readable keys for a copy (of `object_bytes` bytes each
  /// when not 0: an object of another size ends the prefix) and returns its length; views[i]
  /// is the memory of key i of the prefix. Keys after the prefix are not touched: the key
  /// that ended it answers as l1::tier::reserve_read would (not_found, not_readable, or
  /// wrong_state for a wrong size), the rest skipped. cache.read.prefetched counts the
  /// prefix as read and the other keys as failed. Release with unpin_after_copy(prefix).
  std::size_t pin_for_copy(std::span<const chunk_key> keys, std::span<l1::status> out,
                           std::span<std::span<const std::byte>> views, std::size_t object_bytes = 0);

  /// Releases the pins of pin_for_copy (only for the keys it pinned).
  void unpin_after_copy(std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    l1_.finish_read(keys, 0, l1::lock_lifetime::pinned, st);
  }

  /// Gives back the lookup's holds on these keys (a retrieve finished with them); keys the
  /// lookup does not hold (any more) are ignored. Linear in the keys.
  void release(lookup_id id, std::span<const chunk_key> keys) {
    std::shared_ptr<lookup> l = find(id);
    if (!l) return;
    std::vector<chunk_key> back, partial;
    {
      std::lock_guard g(mutex_);
      std::size_t guess = l->keys.size();
      for (const auto& k : keys) {
        const std::size_t i = locate(*l, k, guess);
        if (i >= l->keys.size()) continue;
        if (l->pending.test(i)) l->gone.set(i);  // its hold goes back when it lands
        take_partial_back(*l, i, partial);
        if (!l->held.test(i)) continue;
        l->held.reset(i);
        back.push_back(k);
      }
    }
    release_holds(back, l->extra);
    release_holds(partial, 0);
    forget_if_done(id, *l);
  }

  /// Gives back every hold of the lookup and forgets it (free_lookup_locks, end_request, a
  /// client that went away). A lookup whose prefetch still runs is forgotten when it ends.
  void release_all(lookup_id id) {
    std::shared_ptr<lookup> l = find(id);
    if (!l) return;
    std::vector<chunk_key> back, partial;
    {
      std::lock_guard g(mutex_);
      l->abandoned = true;
      for (std::size_t i = 0; i < l->keys.size(); ++i) {
        take_partial_back(*l, i, partial);
        if (l->held.test(i)) {
          l->held.reset(i);
          back.push_back(l->keys[i]);
        }
      }
    }
    release_holds(back, l->extra);
    release_holds(partial, 0);
    forget_if_done(id, *l);
  }

  // --- writes -------------------------------------------------------------------------
  /// Reserves memory to copy new keys into: an L1 slot (pinned write lock) for each one
  /// that fits, after evicting unlocked objects, in batch order; for the others a staging
  /// buffer (4 KiB-aligned, object_bytes) whose contents finish_write hands straight to the
  /// store pipeline, as long as staging stays under store_options::max_inflight_bytes.
  /// buffers[i] gets key i's memory. Answers per key: success, not_writable (already in
  /// L1 or being written), out_of_memory (neither L1 nor staging could take it: counted in
  /// kvtier_cache_write_failed_keys_total).
  std::size_t reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes, std::span<l1::status> out,
                            std::span<std::span<std::byte>> buffers);

  /// Makes written keys readable and offers the admitted ones to the store pipeline (staged
  /// keys go straight to it, or are dropped when not admitted).
  std::size_t finish_write(std::span<const chunk_key> keys, const pipeline::write_context& ctx,
                           std::span<l1::status> out);

  /// Drops reserved keys whose copy failed or was fenced: never readable, never stored.
  /// Returns (and counts as failed writes) the keys it abandoned; keys it does not know
  /// are ignored.
  std::size_t abandon_write(std::span<const chunk_key> keys);

  // --- administration -----------------------------------------------------------------
  /// Deletes L1 objects (see l1::tier::clear). L2 is left as it is.
  std::size_t clear(bool force) { return l1_.clear(force); }

  /// Releases expired L1 locks, and gives back the holds of lookups answered more than
  /// lookup_ttl ago and forgets them (measured on options().l1.clock). Call periodically.
  std::size_t expire() {
    std::size_t n = l1_.expire_locks();
    const auto now = options_.l1.clock();
    std::vector<lookup_id> old;
    {
      std::lock_guard g(mutex_);
      for (const auto& [id, l] : lookups_)
        if (l->done && now - l->answered_at > options_.lookup_ttl) old.push_back(id);
    }
    for (auto id : old) release_all(id);
    return n + old.size();
  }

  [[nodiscard]] cache_status status() const {
    cache_status s;
    s.l1 = l1_.usage();
    for (std::size_t b = 0; b < backends_.size(); ++b)
      s.backends.push_back({std::string(backends_[b].name()), backends_[b].usage(), backends_[b].health(),
                            prefetch_.bandwidth().bytes_per_second(b)});
    {
      std::lock_guard g(mutex_);
      s.lookups = lookups_.size();
    }
    s.prefetches_active = prefetch_.active();
    s.prefetch_inflight_bytes = prefetch_.inflight_load_bytes();
    s.store_inflight_tasks = store_.inflight_tasks();
    s.store_inflight_bytes = store_.inflight_bytes();
    s.store_pending_keys = store_.pending_keys();
    s.store_staged_bytes = store_.staged_bytes();
    return s;
  }

  /// Completes once no prefetch or store is running or queued (tests, orderly shutdown).
  boost::asio::awaitable<void> wait_idle() {
    co_await prefetch_.wait_idle();
    co_await store_.wait_idle();
    co_await prefetch_.wait_idle();
  }

  /// Stops the pipelines: every prefetch is answered with no chunk (its holds given back),
  /// nothing more is reserved or loaded, queued stores are dropped (L1 keeps the data);
  /// completes with void(error_code) once every coroutine the cache started has ended. The
  /// backend operations already in flight are not cancelled (not every backend survives
  /// that, and L1 memory they use must not be freed before they ended): they complete by
  /// their deadlines (prefetch lookup_timeout / load_timeout, store task_timeout). Afterwards lookups answer from L1
  /// only and writes are not offered to L2; the cache may then be destroyed from any thread. For an orderly shutdown
  /// that stores what is queued first, await wait_idle() before.
  template <class Token>
  auto async_stop(Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code)>(
        [this](auto handler) {
          stopping_.store(true, std::memory_order_relaxed);
          prefetch_.stop();
          store_.stop();
          tracker_.async_wait_idle(executor_, std::move(handler));
        },
        token);
  }

  [[nodiscard]] tier_type& l1() noexcept { return l1_; }
  [[nodiscard]] std::vector<l2::any_backend>& backends() noexcept { return backends_; }

  /// Registers L1's arena with the L2 backends that read into registered memory faster
  /// (cache/l1_registration.hpp), all at once: on this cache's executor or before it runs
  /// anything, best once L1's pages are in (registering pins, so allocates, every page). A
  /// program that serves meanwhile takes register_l1_in_pieces() and runs a step per turn.
  l1_registration_report register_l1() {
    l1_registration_report r;
    for (l1_registration reg = register_l1_in_pieces(); reg.step(r);) {
    }
    return r;
  }
  /// The same registration, a piece (l1_register_piece_bytes) per l1_registration::step().
  [[nodiscard]] l1_registration register_l1_in_pieces() { return l1_registration(l1_.arena(), backends_); }
  [[nodiscard]] store_controller_type& store() noexcept { return store_; }
  [[nodiscard]] prefetch_controller_type& prefetch() noexcept { return prefetch_; }
  [[nodiscard]] bus_type& bus() noexcept { return bus_; }
  [[nodiscard]] executor_type get_executor() const noexcept { return executor_; }
  [[nodiscard]] const cache_options& options() const noexcept { return options_; }

 private:
  struct lookup {
    std::vector<chunk_key> keys;
    std::size_t group = 1;
    std::uint32_t chunk_tokens = 0;
    std::uint32_t extra = 0;
    std::uint64_t request_id = 0;
    l1::clock_type::time_point answered_at{};
    bitmap held;     ///< keys this lookup holds (pinned) read locks on: its own, nobody else's
    bitmap pending;  ///< keys of the decided answer whose load is in flight (held when they land)
    bitmap failed;   ///< keys of the decided answer whose load failed (or came too late)
    bitmap gone;     ///< pending keys a retrieve gave up: their hold goes back when they land
    /// Pending keys whose verified prefix this lookup holds (one pinned hold on the slot
    /// being written: l1::tier::reserve_unfinished_read) until a copy takes it over or the
    /// key settles; `partial_given`: a copy took it over (no second hold is taken).
    bitmap partial;
    bitmap partial_given;
    std::vector<std::size_t> verified;                  ///< per key: leading bytes verified while pending
    std::vector<std::span<const std::byte>> partial_views;  ///< per key: its slot, while partial
    std::size_t l1_prefix = 0;
    std::size_t hit_keys = 0;  ///< the decided answer in keys (whole chunks)
    bool done = false;         ///< decided
    bool abandoned = false;    ///< release_all called: forget when done
    lookup_status result;
    std::vector<wait_handler> waiters;                ///< async_wait
    std::vector<wait_handler> loaded_waiters;         ///< async_wait_loaded
    std::vector<std::function<void()>> watchers;      ///< copies waiting for pending keys
    std::vector<std::pair<std::size_t, bool>> early;  ///< progress that came before the decision
    /// key -> first index, built on the first release that misses its guess (under mutex_).
    std::unordered_map<chunk_key, std::size_t, chunk_key_hash> index;
  };

  struct staged_object {
    aligned_buffer buffer;
    std::uint64_t reserved = 0;
    std::size_t object_bytes = 0;
  };

  class copy_out_op;  // cache/impl/copy_ops.hpp
  class copy_in_op;

  void deliver(wait_handler h, error_code ec, lookup_status r) {
    auto ex = boost::asio::get_associated_executor(h, executor_);
    boost::asio::dispatch(ex, [h = std::move(h), ec, r]() mutable { std::move(h)(ec, r); });
  }

  std::shared_ptr<lookup> find(lookup_id id) const {
    std::lock_guard g(mutex_);
    auto it = lookups_.find(id);
    return it == lookups_.end() ? nullptr : it->second;
  }

  // The index of key k in l's keys (the first one), keys.size() when absent. Under mutex_.
  static std::size_t position_of(lookup& l, const chunk_key& k) {
    if (l.index.empty() && !l.keys.empty()) {
      l.index.reserve(l.keys.size());
      for (std::size_t i = 0; i < l.keys.size(); ++i) l.index.try_emplace(l.keys[i], i);
    }
    auto it = l.index.find(k);
    return it == l.index.end() ? l.keys.size() : it->second;
  }

  // Where key k is in l, keys.size() when absent; `guess` (start with keys.size()) follows a
  // rank's shards in order, so a retrieve's keys are found in O(1) each. Under mutex_.
  static std::size_t locate(lookup& l, const chunk_key& k, std::size_t& guess) {
    const std::size_t n = l.keys.size();
    std::size_t i = n;
    if (guess < n && l.keys[guess] == k)
      i = guess;
    else if (k.rank < l.group && k.rank < n && l.keys[k.rank] == k)
      i = k.rank;  // chunk 0
    else
      i = position_of(l, k);
    if (i < n) guess = i + l.group;
    return i;
  }

  // The L2 key events: each backend tells its own index changes (l2::key_listener), on its
  // thread, and the listener publishes them on the bus as tier l2_tier(b), when the bus wants
  // them (bus::wants_kind: a server without a key subscriber builds none). The store pipeline
  // publishes no key event of its own: the backend is the one source, in its index's order.
  static constexpr bool publishes_key_events = bus_type::template handles_event<bus::tier_keys_stored> ||
                                               bus_type::template handles_event<bus::tier_keys_removed>;
  l2::key_listener key_publisher(std::uint8_t tier) {
    return [b = &bus_, tier](l2::key_change change, bus::key_removal why, std::span<const chunk_key> keys) {
      if (change == l2::key_change::stored) {
        if (bus::wants_kind<bus::tier_keys_stored>(*b))
          b->publish(bus::tier_keys_stored{tier, std::vector<chunk_key>(keys.begin(), keys.end())});
      } else if (bus::wants_kind<bus::tier_keys_removed>(*b)) {
        b->publish(bus::tier_keys_removed{tier, why, std::vector<chunk_key>(keys.begin(), keys.end())});
      }
    };
  }

  bool any_staged() const noexcept { return staged_count_.load(std::memory_order_relaxed) > 0; }
  // reserve_write's keys that L1 had no room for (out_of_memory) get a staging buffer while
  // the store pipeline's staging budget allows.
  void stage_out_of_memory(std::span<const chunk_key> keys, std::size_t object_bytes, std::span<l1::status> out,
                           std::span<std::span<std::byte>> buffers);

  // Key i's verified-prefix hold, when the lookup still has it, goes into `back` (released
  // with extra 0). Under mutex_.
  static void take_partial_back(lookup& l, std::size_t i, std::vector<chunk_key>& back) {
    if (i >= l.partial.size() || !l.partial.test(i)) return;
    l.partial.reset(i);
    l.partial_views[i] = {};
    back.push_back(l.keys[i]);
  }

  void release_holds(std::span<const chunk_key> keys, std::uint32_t extra) {
    if (keys.empty()) return;
    std::vector<l1::status> st(keys.size());
    l1_.finish_read(keys, extra, l1::lock_lifetime::pinned, st);
  }

  // cache/impl/tiered_cache.hpp
  void wait(lookup_id id, wait_handler h, bool loaded);
  void complete(lookup_id id, lookup& l, const pipeline::prefetch_result& res);
  // Whether key i of l is set in `bits`, a bitmap of a prefetch answer (over the keys after
  // l's L1 prefix).
  static bool answered_past_l1(const lookup& l, const bitmap& bits, std::size_t i) noexcept {
    return i >= l.l1_prefix && i - l.l1_prefix < bits.size() && bits.test(i - l.l1_prefix);
  }
  // The status of a decided answer of `chunks` whole chunks.
  static lookup_status decided_status(const lookup& l, const pipeline::prefetch_result& res, std::size_t chunks);
  void on_key(lookup_id id, const std::shared_ptr<lookup>& l, std::size_t i, bool landed);
  void on_verified(const std::shared_ptr<lookup>& l, std::size_t i, std::size_t bytes);
  [[nodiscard]] lookup_status loaded_status(const lookup& l) const;
  // cache/impl/copy_ops.hpp
  void start_copy_out(copy_out_request r, copy_out_sink sink, copy_out_handler h);
  void start_copy_in(copy_in_request r, copy_in_source source, copy_in_fence fence, copy_in_handler h);

  // A lookup is forgotten once released as a whole (release_all, or the TTL sweep of
  // expire()) and finished; until then poll() keeps answering.
  void forget_if_done(lookup_id id, lookup& l) {
    std::lock_guard g(mutex_);
    if (l.done && l.abandoned) lookups_.erase(id);
  }

  // The destructor's wait for the work the pipelines still run (docs/architecture.md, "Shutdown").
  void wait_for_work();

  executor_type executor_;
  cache_options options_;
  executor_type copy_executor_;
  bus_type& bus_;
  tier_type l1_;
  std::vector<l2::any_backend> backends_;
  pipeline::work_tracker tracker_;  ///< before the controllers, which count their work in it
  store_controller_type store_;
  prefetch_controller_type prefetch_;
  typename Traits::admission_policy admission_;
  typename Traits::wait_policy wait_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::unordered_map<lookup_id, std::shared_ptr<lookup>> lookups_;
  std::unordered_map<chunk_key, staged_object, chunk_key_hash> staged_;  ///< keys being written through staging
  std::atomic<std::size_t> staged_count_{0};
  std::atomic<lookup_id> next_id_{1};
};

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/cache/impl/copy_ops.hpp>
#include <kvtier/cache/impl/tiered_cache.hpp>
