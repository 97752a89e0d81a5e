#pragma once
// tiered_cache<Traits>: L1 + L2 backends + the store and prefetch pipelines + the bus behind
// one façade (LMCache's StorageManager). The server's sessions call it; an engine may also
// embed it directly.
//
// Lookups. start_lookup(keys) read-locks the contiguous L1 prefix at once (nothing after its
// first miss) and prefetches the rest in the background: the prefetch serves the longest
// prefix L1 and L2 can give together (keys only L2 has are loaded, as many as L1 has room
// for; keys L1 holds are read-locked; keys another lookup is loading are shared);
// poll() / async_wait() give the answer: the number of leading chunks now in L1 and held
// for the caller. Keys are chunk-major groups: with world size W, chunk c is keys
// [c*W, c*W + W) (one shard per rank), and a chunk is a hit only when all its shards are.
// The caller copies a held object out between pin_for_copy() and unpin_after_copy() (a
// pinned hold for the copy), and gives the lookup's holds back with release() (after a
// retrieve) or release_all() (free_lookup_locks, end_request).
//
// Holds are owned by their lookup. They are pinned L1 holds (no L1 TTL frees them) that the
// cache tracks per lookup (its `held` bits): release() and release_all() give back exactly
// the holds that lookup took, so a stale lookup can never release a newer lookup's hold on
// the same key; expire() gives back the holds of lookups answered more than lookup_ttl ago
// (a client that went away) and forgets them.
//
// Writes. reserve_write() returns memory to copy into: an L1 slot (pinned write lock) for
// each new key that fits, after eviction, and for the keys L1 cannot take a staging buffer
// that goes straight to L2 (so a store larger than L1 still reaches L2; staging memory is
// bounded by store_options::max_inflight_bytes). finish_write() makes the L1 keys readable
// and offers the admitted keys, L1 and staged, to the store pipeline; abandon_write() drops
// a failed or fenced write without it ever becoming readable or stored.
//
// Shutdown. async_stop() stops the pipelines (answers every prefetch, drops queued stores,
// lets the backend operations in flight finish) and completes once every coroutine the
// cache started has ended (docs/architecture.md, "Shutdown"). An idle cache
// runs no coroutine at all. The destructor is safe in any state of the executor: with work
// in flight it stops it and waits (or, when the executor is a stopped io_context, runs it
// until that work is done); destroying it with work in flight from a handler running on its
// own executor, where it can neither wait nor run, terminates with a message: co_await
// async_stop() first.
//
// Threading: every member may be called from any thread; the pipelines run on the executor
// given at construction (one thread or a strand). Every per-request operation is linear in
// its keys. Events: cache.lookup, cache.write.*, cache.read.prefetched, plus everything L1
// and the pipelines publish.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
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
#include <kvtier/telemetry/registry.hpp>

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
  /// A lookup's holds (pinned in L1, owned by the lookup) are given back and the lookup
  /// forgotten when expire() runs this long after its answer, if release_all() did not come
  /// first (a client that went away). Keeps the bookkeeping bounded however long we run.
  /// Measured on l1.clock. The L1 read TTL (l1.read_lock_ttl) does not apply to these holds.
  std::chrono::nanoseconds lookup_ttl = std::chrono::seconds(300);
};

/// What a lookup asks for.
struct lookup_request {
  std::span<const chunk_key> keys;  ///< chunk-major: chunk c is keys [c*group, c*group + group)
  std::size_t group = 1;            ///< shards per chunk (the world size)
  std::size_t object_bytes = 0;     ///< size of each object (one shard of one chunk; 0: any, none loaded)
  std::uint32_t chunk_tokens = 0;   ///< tokens per chunk (for the token-level counters)
  std::uint32_t extra_count = 0;    ///< extra read holds per key (MLA: several readers)
  std::uint64_t request_id = 0;     ///< the caller's id, carried into events
};

/// The answer of a finished lookup.
struct lookup_status {
  std::size_t chunks = 0;     ///< leading chunks in L1 and held for the caller
  std::size_t l1_chunks = 0;  ///< of those, chunks L1 had (no shard loaded from L2 for this lookup)
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
        store_(executor_, l1_, backends_, bus, tracker_, std::move(p.store), options_.store),
        prefetch_(executor_, l1_, backends_, bus, tracker_, std::move(p.plan), options_.prefetch),
        admission_(std::move(p.admission)),
        wait_(std::move(p.wait)) {
    if constexpr (requires(bus_type& b) { b.template subscriber<telemetry::metrics_subscriber>(); }) {
      for (std::size_t b = 0; b < backends_.size(); ++b)
        bus_.template subscriber<telemetry::metrics_subscriber>().declare_backend(static_cast<std::uint8_t>(b),
                                                                                 backends_[b].name());
    }
  }

  tiered_cache(const tiered_cache&) = delete;
  tiered_cache& operator=(const tiered_cache&) = delete;

  /// Safe in any state of the executor (see the header comment): returns at once when
  /// nothing runs, else stops the pipelines and waits until every coroutine ended.
  ~tiered_cache() {
    stopping_.store(true, std::memory_order_relaxed);
    if (tracker_.idle()) return;
    prefetch_.stop();
    store_.stop();
    wait_for_work();
  }

  // --- lookups ------------------------------------------------------------------------
  /// Starts a lookup; see the header comment. Returns its id at once. After async_stop(),
  /// lookups answer from L1 only.
  lookup_id start_lookup(const lookup_request& r) {
    if (r.group == 0 || r.keys.size() % r.group != 0)
      throw std::invalid_argument("tiered_cache::start_lookup: keys must be whole groups of `group` shards");
    auto l = std::make_shared<lookup>();
    l->keys.assign(r.keys.begin(), r.keys.end());
    l->group = r.group;
    l->chunk_tokens = r.chunk_tokens;
    l->extra = r.extra_count;
    l->request_id = r.request_id;
    l->held = bitmap(l->keys.size());
    const std::size_t n = l->keys.size();

    // The L1 prefix, held now (pinned, owned by this lookup); nothing after its first miss
    // is touched.
    std::vector<l1::prefix_take> takes(n);
    l1::prefix_options po;
    po.object_bytes = r.object_bytes;
    po.extra_count = r.extra_count;
    po.read_lock = l1::lock_lifetime::pinned;
    po.count_refused_read = true;
    const std::size_t prefix = l1_.reserve_read_prefix(l->keys, po, takes).length;
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
    if (prefix == n || backends_.empty() || stopping_.load(std::memory_order_relaxed)) {
      complete(id, *l, {});
      return id;
    }
    pipeline::prefetch_request pr;
    pr.id = r.request_id ? r.request_id : id;
    pr.keys.assign(l->keys.begin() + static_cast<std::ptrdiff_t>(prefix), l->keys.end());
    pr.object_bytes = r.object_bytes;
    pr.extra_count = r.extra_count;
    pr.wait_budget = wait_.wait_budget((n / r.group) * r.chunk_tokens);
    prefetch_.async_prefetch(std::move(pr), [this, id, l](error_code ec, pipeline::prefetch_result res) {
      complete(id, *l, ec ? pipeline::prefetch_result{} : std::move(res));
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

  /// Pins the contiguous prefix of readable keys for a copy (of `object_bytes` bytes each
  /// when not 0: an object of another size ends the prefix) and returns its length; views[i]
  /// is the memory of key i of the prefix. Keys after the prefix are not touched: the key
  /// that ended it answers as l1::tier::reserve_read would (not_found, not_readable, or
  /// wrong_state for a wrong size), the rest skipped. cache.read.prefetched counts the
  /// prefix as read and the other keys as failed. Release with unpin_after_copy(prefix).
  std::size_t pin_for_copy(std::span<const chunk_key> keys, std::span<l1::status> out,
                           std::span<std::span<const std::byte>> views, std::size_t object_bytes = 0) {
    const std::size_t n = keys.size();
    if (out.size() != n || views.size() != n)
      throw std::invalid_argument("tiered_cache::pin_for_copy: out and views need one element per key");
    std::vector<l1::prefix_take> takes(n);
    l1::prefix_options po;
    po.object_bytes = object_bytes;
    po.read_lock = l1::lock_lifetime::pinned;
    po.count_refused_read = true;
    const auto r = l1_.reserve_read_prefix(keys, po, takes);
    for (std::size_t i = 0; i < n; ++i) {
      views[i] = {};
      out[i] = i < r.length ? l1::status::success : l1::status::skipped;
    }
    if (r.length < n) {
      switch (r.end) {
        case l1::prefix_end::busy:
          out[r.length] = l1::status::not_readable;
          break;
        case l1::prefix_end::wrong_size:
          out[r.length] = l1::status::wrong_state;
          break;
        default:
          out[r.length] = l1::status::not_found;
          break;
      }
    }
    if (r.length > 0) {
      std::vector<l1::status> vs(r.length);
      l1_.read_views(keys.first(r.length), vs, views.first(r.length));
    }
    bus_.publish(
        bus::cache_read_prefetched{static_cast<std::uint32_t>(r.length), static_cast<std::uint32_t>(n - r.length)});
    return r.length;
  }

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
    std::vector<chunk_key> back;
    {
      std::lock_guard g(mutex_);
      const std::size_t n = l->keys.size();
      std::size_t guess = n;  // where the next key should be: retrieves walk a rank's shards in order
      for (const auto& k : keys) {
        std::size_t i = n;
        if (guess < n && l->keys[guess] == k)
          i = guess;
        else if (k.rank < l->group && k.rank < n && l->keys[k.rank] == k)
          i = k.rank;  // chunk 0
        else
          i = position_of(*l, k);
        if (i >= n) continue;
        guess = i + l->group;
        if (!l->held.test(i)) continue;
        l->held.reset(i);
        back.push_back(k);
      }
    }
    release_holds(back, l->extra);
    forget_if_done(id, *l);
  }

  /// Gives back every hold of the lookup and forgets it (free_lookup_locks, end_request, a
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
  /// Reserves memory to copy new keys into: an L1 slot (pinned write lock) for each one
  /// that fits, after evicting unlocked objects, in batch order; for the others a staging
  /// buffer (4 KiB-aligned, object_bytes) whose contents finish_write hands straight to the
  /// store pipeline, as long as staging stays under store_options::max_inflight_bytes.
  /// buffers[i] gets key i's memory. Answers per key: success, not_writable (already in
  /// L1 or being written), out_of_memory (neither L1 nor staging could take it: counted in
  /// kvtier_cache_write_failed_keys_total).
  std::size_t reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes, std::span<l1::status> out,
                            std::span<std::span<std::byte>> buffers) {
    const std::size_t n = keys.size();
    if (out.size() != n || buffers.size() != n)
      throw std::invalid_argument("tiered_cache::reserve_write: out and buffers need one element per key");
    l1::write_options o;
    o.mode = l1::write_mode::new_only;
    o.lock = l1::lock_lifetime::pinned;
    o.purpose = bus::allocation_purpose::store;
    o.all_or_nothing = false;
    if (!any_staged()) {
      l1_.reserve_write(keys, object_bytes, o, out, buffers);
    } else {
      // A key being written through staging is not written twice: only the others go to L1.
      std::vector<chunk_key> rest;
      std::vector<std::size_t> where;
      {
        std::lock_guard g(mutex_);
        for (std::size_t i = 0; i < n; ++i) {
          buffers[i] = {};
          if (staged_.contains(keys[i])) {
            out[i] = l1::status::not_writable;
          } else {
            rest.push_back(keys[i]);
            where.push_back(i);
          }
        }
      }
      std::vector<l1::status> st(rest.size());
      std::vector<std::span<std::byte>> buf(rest.size());
      if (!rest.empty()) l1_.reserve_write(rest, object_bytes, o, st, buf);
      for (std::size_t j = 0; j < rest.size(); ++j) {
        out[where[j]] = st[j];
        buffers[where[j]] = buf[j];
      }
    }
    // What L1 had no room for goes through staging.
    const std::uint64_t bytes = align_up(object_bytes);
    for (std::size_t i = 0; i < n; ++i) {
      if (out[i] != l1::status::out_of_memory || object_bytes == 0) continue;
      if (!store_.try_reserve_staging(bytes)) continue;
      staged_object so;
      try {
        so.buffer = aligned_buffer(object_bytes);
      } catch (const std::bad_alloc&) {
        store_.release_staging(bytes);
        continue;
      }
      so.reserved = bytes;
      so.object_bytes = object_bytes;
      std::lock_guard g(mutex_);
      auto [it, inserted] = staged_.try_emplace(keys[i], std::move(so));
      if (!inserted) {  // the same key twice in the batch
        store_.release_staging(bytes);
        out[i] = l1::status::not_writable;
        continue;
      }
      buffers[i] = {it->second.buffer.data(), object_bytes};
      out[i] = l1::status::success;
      staged_count_.store(staged_.size(), std::memory_order_relaxed);
    }
    std::size_t ok = 0;
    for (std::size_t i = 0; i < n; ++i) ok += out[i] == l1::status::success ? 1 : 0;
    bus_.publish(bus::cache_write_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(n - ok)});
    return ok;
  }

  /// Makes written keys readable and offers the admitted ones to the store pipeline (staged
  /// keys go straight to it, or are dropped when not admitted).
  std::size_t finish_write(std::span<const chunk_key> keys, const pipeline::write_context& ctx,
                           std::span<l1::status> out) {
    const std::size_t n = keys.size();
    if (out.size() != n) throw std::invalid_argument("tiered_cache::finish_write: out needs one element per key");
    std::size_t ok = 0;
    std::vector<chunk_key> admitted;
    if (!any_staged()) {
      ok = l1_.finish_write(keys, out);
      for (std::size_t i = 0; i < n; ++i)
        if (out[i] == l1::status::success && admission_.admit(keys[i], ctx)) admitted.push_back(keys[i]);
    } else {
      std::vector<std::pair<std::size_t, staged_object>> mine;  // (index in keys, its staging)
      std::vector<chunk_key> rest;
      std::vector<std::size_t> where;
      {
        std::lock_guard g(mutex_);
        for (std::size_t i = 0; i < n; ++i) {
          auto node = staged_.extract(keys[i]);
          if (node.empty()) {
            rest.push_back(keys[i]);
            where.push_back(i);
          } else {
            mine.emplace_back(i, std::move(node.mapped()));
          }
        }
        staged_count_.store(staged_.size(), std::memory_order_relaxed);
      }
      pipeline::staged_keys staged;
      std::uint64_t refused = 0;
      for (auto& [i, so] : mine) {
        out[i] = l1::status::success;
        ++ok;
        if (!admission_.admit(keys[i], ctx)) {  // not for L2: its memory just goes
          refused += so.reserved;
          continue;
        }
        if (!staged.keys.empty() && staged.object_bytes != so.object_bytes)
          store_.offer_staged(std::exchange(staged, {}));  // one object size per batch
        staged.object_bytes = so.object_bytes;
        staged.reserved_bytes += so.reserved;
        staged.keys.push_back(keys[i]);
        staged.buffers.push_back(std::move(so.buffer));
      }
      if (refused > 0) store_.release_staging(refused);
      std::vector<l1::status> st(rest.size());
      if (!rest.empty()) ok += l1_.finish_write(rest, st);
      for (std::size_t j = 0; j < rest.size(); ++j) {
        out[where[j]] = st[j];
        if (st[j] == l1::status::success && admission_.admit(rest[j], ctx)) admitted.push_back(rest[j]);
      }
      store_.offer_staged(std::move(staged));
    }
    bus_.publish(bus::cache_write_finished{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(n - ok)});
    store_.offer(admitted);
    return ok;
  }

  /// Drops reserved keys whose copy failed or was fenced: never readable, never stored.
  /// Returns (and counts as failed writes) the keys it abandoned; keys it does not know
  /// are ignored.
  std::size_t abandon_write(std::span<const chunk_key> keys) {
    std::size_t n = 0;
    std::vector<chunk_key> rest;
    if (any_staged()) {
      std::uint64_t freed = 0;
      {
        std::lock_guard g(mutex_);
        for (const auto& k : keys) {
          auto node = staged_.extract(k);
          if (node.empty()) {
            rest.push_back(k);
            continue;
          }
          freed += node.mapped().reserved;
          ++n;
        }
        staged_count_.store(staged_.size(), std::memory_order_relaxed);
      }
      store_.release_staging(freed);
    } else {
      rest.assign(keys.begin(), keys.end());
    }
    std::vector<l1::status> st(rest.size());
    if (!rest.empty()) n += l1_.abandon_write(rest, st);
    bus_.publish(bus::cache_write_finished{0, static_cast<std::uint32_t>(n)});
    return n;
  }

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
    s.store_staged_bytes = store_.staged_bytes();
    return s;
  }

  /// Registers gauges over status(): L1 (see l1::tier::export_metrics), per backend
  /// kvtier_l2_bytes_used / kvtier_l2_bytes_capacity / kvtier_l2_objects / kvtier_l2_healthy,
  /// kvtier_prefetch_requests_active, kvtier_prefetch_inflight_load_bytes,
  /// kvtier_store_inflight_bytes, kvtier_store_inflight_tasks, kvtier_store_staged_bytes,
  /// kvtier_lookups_active. Read at scrape time; do not scrape after the cache is destroyed.
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
    reg.add_callback("kvtier_store_staged_bytes",
                     "Staging memory of stores larger than L1 (reserved or being stored to L2)", metric_type::gauge, {},
                     [this] { return static_cast<double>(store_.staged_bytes()); });
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
    bitmap held;  ///< keys this lookup holds (pinned) read locks on: its own, nobody else's
    std::size_t l1_prefix = 0;
    bool done = false;
    bool abandoned = false;      ///< release_all called: forget when done
    lookup_status result;
    std::vector<wait_handler> waiters;
    /// key -> first index, built on the first release that misses its guess (under mutex_).
    std::unordered_map<chunk_key, std::size_t, chunk_key_hash> index;
  };

  struct staged_object {
    aligned_buffer buffer;
    std::uint64_t reserved = 0;
    std::size_t object_bytes = 0;
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

  // The index of key k in l's keys (the first one), keys.size() when absent. Under mutex_.
  static std::size_t position_of(lookup& l, const chunk_key& k) {
    if (l.index.empty() && !l.keys.empty()) {
      l.index.reserve(l.keys.size());
      for (std::size_t i = 0; i < l.keys.size(); ++i) l.index.try_emplace(l.keys[i], i);
    }
    auto it = l.index.find(k);
    return it == l.index.end() ? l.keys.size() : it->second;
  }

  bool any_staged() const noexcept { return staged_count_.load(std::memory_order_relaxed) > 0; }

  void release_holds(std::span<const chunk_key> keys, std::uint32_t extra) {
    if (keys.empty()) return;
    std::vector<l1::status> st(keys.size());
    l1_.finish_read(keys, extra, l1::lock_lifetime::pinned, st);
  }

  // The prefetch answered with `res.prefix` leading keys (after the L1 prefix) held for this
  // lookup: round down to whole chunks, give back the rest, publish, wake the waiters.
  void complete(lookup_id id, lookup& l, const pipeline::prefetch_result& res) {
    const std::size_t n = l.keys.size();
    const std::size_t locked = std::min(n, l.l1_prefix + res.prefix);
    const std::size_t chunks = locked / l.group;
    // A hit chunk counts for L1 when none of its shards was loaded from L2 for this lookup.
    std::size_t l1_chunks = 0;
    for (std::size_t c = 0; c < chunks; ++c) {
      bool loaded = false;
      for (std::size_t i = c * l.group; i < (c + 1) * l.group && !loaded; ++i)
        loaded = i >= l.l1_prefix && i - l.l1_prefix < res.from_l2.size() && res.from_l2.test(i - l.l1_prefix);
      l1_chunks += loaded ? 0 : 1;
    }
    std::vector<chunk_key> back;
    std::vector<wait_handler> waiters;
    lookup_status r{chunks, l1_chunks};
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
      l.answered_at = options_.l1.clock();
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

  // The destructor's wait for the work the pipelines still run (see the header comment).
  void wait_for_work() {
    namespace asio = boost::asio;
    using io_executor = asio::io_context::executor_type;
    asio::io_context* ctx = nullptr;
    bool here = false;
    if (const auto* e = executor_.template target<io_executor>()) {
      ctx = &e->context();
      here = e->running_in_this_thread();
    } else if (const auto* s = executor_.template target<asio::strand<io_executor>>()) {
      ctx = &s->get_inner_executor().context();
      here = s->running_in_this_thread() || s->get_inner_executor().running_in_this_thread();
    }
    if (here) {
      // Its coroutines need this thread to finish, and the L1 memory they may be writing
      // must not be freed before: nothing safe is left.
      std::fputs(
          "kvtier: tiered_cache destroyed by a handler of its own executor while its pipelines work: co_await "
          "async_stop() before destroying it\n",
          stderr);
      std::terminate();
    }
    if (ctx != nullptr && ctx->stopped()) {
      // Nobody runs the executor: run it here until the cache's work is done, then leave it
      // stopped as it was.
      ctx->restart();
      while (!tracker_.idle()) ctx->run_one_for(std::chrono::milliseconds(100));
      ctx->stop();
      return;
    }
    tracker_.wait_idle();  // another thread runs the executor
  }

  executor_type executor_;
  cache_options options_;
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

}  // namespace kvtier::inline KVTIER_ABI_TAG::cache
