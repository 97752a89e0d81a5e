#pragma once
// tiered_cache<Traits>: L1 + L2 backends + the store and prefetch pipelines + the bus behind
// one façade (LMCache's StorageManager). The server's sessions call it; an engine may also
// embed it directly.
//
// Lookups. start_lookup(keys) takes expiring read locks on the contiguous L1 prefix at
// once and prefetches the rest from L2 in the background; poll() / async_wait() give the
// answer: the number of leading chunks now in L1 and read-locked for the caller. Keys are
// chunk-major groups: with world size W, chunk c is keys [c*W, c*W + W) (one shard per
// rank), and a chunk is a hit only when all its shards are. The caller copies a locked
// object out between pin_for_copy() and unpin_after_copy() (a pinned hold, so no TTL can
// free the slot mid-copy), and gives the lookup's locks back with release() (after a
// retrieve) or release_all() (free_lookup_locks, end_request).
//
// Writes. reserve_write() returns slots to copy into (pinned write locks);
// finish_write() makes them readable and offers the admitted keys to the store pipeline;
// abandon_write() drops a failed or fenced write without it ever becoming readable.
//
// Threading: every member may be called from any thread; the pipelines run on the executor
// given at construction (one thread or a strand). Events: cache.lookup, cache.write.*,
// cache.read.prefetched, plus everything L1 and the pipelines publish.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/cache/traits.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/pipeline/prefetch_controller.hpp>
#include <kvtier/pipeline/store_controller.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/dispatch.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::cache {

struct cache_options {
  l1::tier_options l1;
  pipeline::store_options store;
  pipeline::prefetch_options prefetch;
  /// A lookup whose locks were never given back is forgotten after this long (its L1 read
  /// locks expire by their own TTL); keeps the bookkeeping bounded however long we run.
  std::chrono::nanoseconds lookup_ttl = std::chrono::seconds(300);
};

/// What a lookup asks for.
struct lookup_request {
  std::span<const chunk_key> keys;  ///< chunk-major: chunk c is keys [c*group, c*group + group)
  std::size_t group = 1;            ///< shards per chunk (the world size)
  std::size_t object_bytes = 0;     ///< size of each object (one shard of one chunk)
  std::uint32_t chunk_tokens = 0;   ///< tokens per chunk (for the token-level counters)
  std::uint32_t extra_count = 0;    ///< extra read holds per key (MLA: several readers)
  std::uint64_t request_id = 0;     ///< the caller's id, carried into events
};

/// The answer of a finished lookup.
struct lookup_status {
  std::size_t chunks = 0;     ///< leading chunks in L1 and read-locked for the caller
  std::size_t l1_chunks = 0;  ///< of those, already in L1 at the lookup
};

/// One backend in status(): its name, usage and health.
struct backend_status {
  std::string name;
  l2::usage_info usage;
  l2::health_info health;
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
        bus_(bus),
        l1_(options_.l1, bus, std::move(p.eviction)),
        backends_(std::move(backends)),
        store_(executor_, l1_, backends_, bus, std::move(p.store), options_.store),
        prefetch_(executor_, l1_, backends_, bus, std::move(p.plan), options_.prefetch),
        admission_(std::move(p.admission)),
        wait_(std::move(p.wait)) {
    if constexpr (requires(bus_type& b) { b.template subscriber<telemetry::metrics_subscriber>(); }) {
      for (std::size_t b = 0; b < backends_.size(); ++b)
        bus_.template subscriber<telemetry::metrics_subscriber>().declare_backend(static_cast<std::uint8_t>(b),
                                                                                 backends_[b].name());
    }
    store_.start();
  }

  tiered_cache(const tiered_cache&) = delete;
  tiered_cache& operator=(const tiered_cache&) = delete;

  ~tiered_cache() { store_.stop(); }

  // --- lookups ------------------------------------------------------------------------
  /// Starts a lookup; see the header comment. Returns its id at once.
  lookup_id start_lookup(const lookup_request& r) {
    if (r.group == 0 || r.keys.size() % r.group != 0)
      throw std::invalid_argument("tiered_cache::start_lookup: keys must be whole groups of `group` shards");
    auto l = std::make_shared<lookup>();
    l->keys.assign(r.keys.begin(), r.keys.end());
    l->group = r.group;
    l->chunk_tokens = r.chunk_tokens;
    l->extra = r.extra_count;
    l->request_id = r.request_id;
    l->created = l2::clock::now();
    l->held = bitmap(l->keys.size());
    const std::size_t n = l->keys.size();

    // The L1 prefix, read-locked now; holds after the first miss go back at once.
    std::vector<l1::status> st(n);
    l1_.reserve_read(l->keys, r.extra_count, l1::lock_lifetime::expiring, st);
    std::size_t prefix = 0;
    while (prefix < n && st[prefix] == l1::status::success) ++prefix;
    std::vector<chunk_key> back;
    for (std::size_t i = prefix; i < n; ++i)
      if (st[i] == l1::status::success) back.push_back(l->keys[i]);
    release_holds(back, r.extra_count);
    l->held.set_range(0, prefix);
    l->l1_prefix = prefix;
    if constexpr (requires(typename Traits::store_policy& sp) { sp.wants_hits(); }) {
      if (store_.policy().wants_hits() && prefix > 0) store_.offer(std::span(l->keys).first(prefix));
    }

    const lookup_id id = next_id_.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard g(mutex_);
      lookups_.emplace(id, l);
    }
    if (prefix == n || backends_.empty()) {
      complete(id, *l, 0);
      return id;
    }
    pipeline::prefetch_request pr;
    pr.id = r.request_id ? r.request_id : id;
    pr.keys.assign(l->keys.begin() + static_cast<std::ptrdiff_t>(prefix), l->keys.end());
    pr.object_bytes = r.object_bytes;
    pr.extra_count = r.extra_count;
    pr.wait_budget = wait_.wait_budget((n / r.group) * r.chunk_tokens);
    prefetch_.async_prefetch(std::move(pr), [this, id, l](error_code ec, pipeline::prefetch_result res) {
      complete(id, *l, ec ? 0 : res.prefix);
    });
    return id;
  }

  /// The answer of a lookup, nullopt while its prefetch runs (or when the id is unknown:
  /// check known()).
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

  /// Completes with the lookup's answer once it is known: void(error_code, lookup_status);
  /// errc::not_found for an unknown id.
  template <class Token>
  auto async_wait(lookup_id id, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, lookup_status)>(
        [this, id](auto handler) {
          std::unique_lock g(mutex_);
          auto it = lookups_.find(id);
          if (it == lookups_.end()) {
            g.unlock();
            deliver(wait_handler(std::move(handler)), make_error_code(errc::not_found), {});
            return;
          }
          if (it->second->done) {
            const auto r = it->second->result;
            g.unlock();
            deliver(wait_handler(std::move(handler)), {}, r);
            return;
          }
          it->second->waiters.emplace_back(std::move(handler));
        },
        token);
  }

  /// Pins locked objects for a copy and returns their memory (views[i] empty on failure).
  /// Answers per key as l1::tier::reserve_read. Release with unpin_after_copy().
  std::size_t pin_for_copy(std::span<const chunk_key> keys, std::span<l1::status> out,
                           std::span<std::span<const std::byte>> views) {
    l1_.reserve_read(keys, 0, l1::lock_lifetime::pinned, out);
    std::vector<chunk_key> ok;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      views[i] = {};
      if (out[i] == l1::status::success) {
        ok.push_back(keys[i]);
        where.push_back(i);
      }
    }
    std::vector<l1::status> vs(ok.size());
    std::vector<std::span<const std::byte>> v(ok.size());
    l1_.read_views(ok, vs, v);
    for (std::size_t j = 0; j < ok.size(); ++j) views[where[j]] = v[j];
    bus_.publish(bus::cache_read_prefetched{static_cast<std::uint32_t>(ok.size()),
                                            static_cast<std::uint32_t>(keys.size() - ok.size())});
    return ok.size();
  }

  /// Releases the pins of pin_for_copy (only for the keys it pinned).
  void unpin_after_copy(std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    l1_.finish_read(keys, 0, l1::lock_lifetime::pinned, st);
  }

  /// Gives back the lookup's locks on these keys (a retrieve finished with them).
  void release(lookup_id id, std::span<const chunk_key> keys) {
    std::shared_ptr<lookup> l = find(id);
    if (!l) return;
    std::vector<chunk_key> back;
    {
      std::lock_guard g(mutex_);
      for (const auto& k : keys)
        for (std::size_t i = 0; i < l->keys.size(); ++i)
          if (l->keys[i] == k && l->held.test(i)) {
            l->held.reset(i);
            back.push_back(k);
            break;
          }
    }
    release_holds(back, l->extra);
    forget_if_done(id, *l);
  }

  /// Gives back every lock of the lookup and forgets it (free_lookup_locks, end_request, a
  /// client that went away). A lookup whose prefetch still runs is forgotten when it ends.
  void release_all(lookup_id id) {
    std::shared_ptr<lookup> l = find(id);
    if (!l) return;
    std::vector<chunk_key> back;
    {
      std::lock_guard g(mutex_);
      l->abandoned = true;
      for (std::size_t i = 0; i < l->keys.size(); ++i)
        if (l->held.test(i)) {
          l->held.reset(i);
          back.push_back(l->keys[i]);
        }
    }
    release_holds(back, l->extra);
    forget_if_done(id, *l);
  }

  // --- writes -------------------------------------------------------------------------
  /// Reserves slots for new keys (pinned write locks: the server copies into them now).
  /// Answers per key as l1::tier::reserve_write (not_writable: already present).
  std::size_t reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes, std::span<l1::status> out,
                            std::span<std::span<std::byte>> buffers) {
    l1::write_options o;
    o.mode = l1::write_mode::new_only;
    o.lock = l1::lock_lifetime::pinned;
    o.purpose = bus::allocation_purpose::store;
    const std::size_t ok = l1_.reserve_write(keys, object_bytes, o, out, buffers);
    bus_.publish(bus::cache_write_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok)});
    return ok;
  }

  /// Makes written keys readable and offers the admitted ones to the store pipeline.
  std::size_t finish_write(std::span<const chunk_key> keys, const pipeline::write_context& ctx,
                           std::span<l1::status> out) {
    const std::size_t ok = l1_.finish_write(keys, out);
    std::vector<chunk_key> admitted;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (out[i] == l1::status::success && admission_.admit(keys[i], ctx)) admitted.push_back(keys[i]);
    bus_.publish(bus::cache_write_finished{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok)});
    store_.offer(admitted);
    return ok;
  }

  /// Drops reserved keys whose copy failed or was fenced: never readable, never stored.
  std::size_t abandon_write(std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    const std::size_t n = l1_.abandon_write(keys, st);
    bus_.publish(bus::cache_write_finished{0, static_cast<std::uint32_t>(keys.size())});
    return n;
  }

  // --- administration -----------------------------------------------------------------
  /// Deletes L1 objects (see l1::tier::clear). L2 is left as it is.
  std::size_t clear(bool force) { return l1_.clear(force); }

  /// Releases expired L1 locks and forgets lookups older than lookup_ttl. Call periodically.
  std::size_t expire() {
    std::size_t n = l1_.expire_locks();
    const auto now = l2::clock::now();
    std::vector<lookup_id> old;
    {
      std::lock_guard g(mutex_);
      for (const auto& [id, l] : lookups_)
        if (l->done && now - l->created > options_.lookup_ttl) old.push_back(id);
    }
    for (auto id : old) release_all(id);
    return n + old.size();
  }

  [[nodiscard]] cache_status status() const {
    cache_status s;
    s.l1 = l1_.usage();
    for (const auto& b : backends_) s.backends.push_back({std::string(b.name()), b.usage(), b.health()});
    {
      std::lock_guard g(mutex_);
      s.lookups = lookups_.size();
    }
    s.prefetches_active = prefetch_.active();
    s.prefetch_inflight_bytes = prefetch_.inflight_load_bytes();
    s.store_inflight_tasks = store_.inflight_tasks();
    s.store_inflight_bytes = store_.inflight_bytes();
    s.store_pending_keys = store_.pending_keys();
    return s;
  }

  /// Registers gauges over status(): L1 (see l1::tier::export_metrics), per backend
  /// kvtier_l2_bytes_used / kvtier_l2_bytes_capacity / kvtier_l2_objects / kvtier_l2_healthy,
  /// kvtier_prefetch_requests_active, kvtier_prefetch_inflight_load_bytes,
  /// kvtier_store_inflight_bytes, kvtier_store_inflight_tasks, kvtier_lookups_active. Read at
  /// scrape time; do not scrape after the cache is destroyed.
  void export_metrics(telemetry::registry& reg) {
    using telemetry::metric_type;
    l1_.export_metrics(reg);
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      const telemetry::label_pairs l = {{"backend", std::string(backends_[b].name())}};
      auto* be = &backends_[b];
      reg.add_callback("kvtier_l2_bytes_used", "Bytes used on the L2 backend", metric_type::gauge, l,
                       [be] { return static_cast<double>(be->usage().bytes_used); });
      reg.add_callback("kvtier_l2_bytes_capacity", "Capacity of the L2 backend in bytes (0: unbounded)",
                       metric_type::gauge, l, [be] { return static_cast<double>(be->usage().bytes_capacity); });
      reg.add_callback("kvtier_l2_objects", "Objects on the L2 backend", metric_type::gauge, l,
                       [be] { return static_cast<double>(be->usage().objects); });
      reg.add_callback("kvtier_l2_healthy", "1 while the L2 backend is healthy", metric_type::gauge, l,
                       [be] { return be->health().healthy ? 1.0 : 0.0; });
    }
    reg.add_callback("kvtier_prefetch_requests_active", "Prefetch requests not finished (late loads included)",
                     metric_type::gauge, {}, [this] { return static_cast<double>(prefetch_.active()); });
    reg.add_callback("kvtier_prefetch_inflight_load_bytes", "Bytes of L2 loads in flight", metric_type::gauge, {},
                     [this] { return static_cast<double>(prefetch_.inflight_load_bytes()); });
    reg.add_callback("kvtier_store_inflight_bytes", "Bytes of L2 stores in flight", metric_type::gauge, {},
                     [this] { return static_cast<double>(store_.inflight_bytes()); });
    reg.add_callback("kvtier_store_inflight_tasks", "L2 store tasks in flight", metric_type::gauge, {},
                     [this] { return static_cast<double>(store_.inflight_tasks()); });
    reg.add_callback("kvtier_lookups_active", "Lookups holding L1 locks or prefetching", metric_type::gauge, {},
                     [this] {
                       std::lock_guard g(mutex_);
                       return static_cast<double>(lookups_.size());
                     });
  }

  /// Completes once no prefetch or store is running or queued (tests, orderly shutdown).
  boost::asio::awaitable<void> wait_idle() {
    co_await prefetch_.wait_idle();
    co_await store_.wait_idle();
    co_await prefetch_.wait_idle();
  }

  [[nodiscard]] tier_type& l1() noexcept { return l1_; }
  [[nodiscard]] std::vector<l2::any_backend>& backends() noexcept { return backends_; }
  [[nodiscard]] store_controller_type& store() noexcept { return store_; }
  [[nodiscard]] prefetch_controller_type& prefetch() noexcept { return prefetch_; }
  [[nodiscard]] bus_type& bus() noexcept { return bus_; }
  [[nodiscard]] executor_type get_executor() const noexcept { return executor_; }

 private:
  struct lookup {
    std::vector<chunk_key> keys;
    std::size_t group = 1;
    std::uint32_t chunk_tokens = 0;
    std::uint32_t extra = 0;
    std::uint64_t request_id = 0;
    l2::clock::time_point created{};
    bitmap held;                 ///< keys this lookup holds read locks on
    std::size_t l1_prefix = 0;
    bool done = false;
    bool abandoned = false;      ///< release_all called: forget when done
    lookup_status result;
    std::vector<wait_handler> waiters;
  };

  void deliver(wait_handler h, error_code ec, lookup_status r) {
    auto ex = boost::asio::get_associated_executor(h, executor_);
    boost::asio::dispatch(ex, [h = std::move(h), ec, r]() mutable { std::move(h)(ec, r); });
  }

  std::shared_ptr<lookup> find(lookup_id id) const {
    std::lock_guard g(mutex_);
    auto it = lookups_.find(id);
    return it == lookups_.end() ? nullptr : it->second;
  }

  void release_holds(std::span<const chunk_key> keys, std::uint32_t extra) {
    if (keys.empty()) return;
    std::vector<l1::status> st(keys.size());
    l1_.finish_read(keys, extra, l1::lock_lifetime::expiring, st);
  }

  // The prefetch answered with `l2_prefix` leading keys (after the L1 prefix) read-locked:
  // round down to whole chunks, give back the rest, publish, wake the waiters.
  void complete(lookup_id id, lookup& l, std::size_t l2_prefix) {
    const std::size_t n = l.keys.size();
    const std::size_t locked = std::min(n, l.l1_prefix + l2_prefix);
    const std::size_t chunks = locked / l.group;
    std::vector<chunk_key> back;
    std::vector<wait_handler> waiters;
    lookup_status r{chunks, std::min(chunks, l.l1_prefix / l.group)};
    {
      std::lock_guard g(mutex_);
      if (l.abandoned) {
        // Released while prefetching (release_all gave back the L1 prefix): nobody will
        // read what L2 brought in.
        for (std::size_t i = l.l1_prefix; i < locked; ++i) back.push_back(l.keys[i]);
      } else {
        l.held.set_range(l.l1_prefix, locked);
        for (std::size_t i = chunks * l.group; i < locked; ++i) {  // a partial chunk is no hit
          back.push_back(l.keys[i]);
          l.held.reset(i);
        }
      }
      l.result = r;
      l.done = true;
      waiters.swap(l.waiters);
    }
    release_holds(back, l.extra);
    bus_.publish(bus::cache_lookup{l.request_id ? l.request_id : id,
                                   static_cast<std::uint32_t>(n / l.group * l.chunk_tokens),
                                   static_cast<std::uint32_t>(n / l.group), static_cast<std::uint32_t>(r.l1_chunks),
                                   static_cast<std::uint32_t>(r.chunks - r.l1_chunks), l.chunk_tokens});
    for (auto& w : waiters) deliver(std::move(w), {}, r);
    forget_if_done(id, l);
  }

  // A lookup is forgotten once released as a whole (release_all, or the TTL sweep of
  // expire()) and finished; until then poll() keeps answering.
  void forget_if_done(lookup_id id, lookup& l) {
    std::lock_guard g(mutex_);
    if (l.done && l.abandoned) lookups_.erase(id);
  }

  executor_type executor_;
  cache_options options_;
  bus_type& bus_;
  tier_type l1_;
  std::vector<l2::any_backend> backends_;
  store_controller_type store_;
  prefetch_controller_type prefetch_;
  typename Traits::admission_policy admission_;
  typename Traits::wait_policy wait_;
  mutable std::mutex mutex_;
  std::unordered_map<lookup_id, std::shared_ptr<lookup>> lookups_;
  std::atomic<lookup_id> next_id_{1};
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::cache
