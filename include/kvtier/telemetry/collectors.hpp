#pragma once
// Collectors: the gauges (and counters a component keeps itself) that are read from a
// component's plain snapshot at scrape time: collect_l1, collect_cache, collect_disk_backend,
// collect_io, collect_redis_backend, collect_bus. Each is written against a small concept, so
// this header includes no l1/, l2/, io/ or cache/ header. docs/metrics.md holds how to
// register them, their lifetime rules and every series.

#include <kvtier/config.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <array>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

namespace detail {

/// A relaxed atomic (statistics another thread writes) or a plain number, as a double.
template <class T>
[[nodiscard]] double metric_value(const T& v) noexcept {
  if constexpr (requires { v.load(std::memory_order_relaxed); })
    return static_cast<double>(v.load(std::memory_order_relaxed));
  else
    return static_cast<double>(v);
}

}  // namespace detail

// --- L1 ---------------------------------------------------------------------------------

/// The memory accounting of an L1 tier (l1::usage_info).
template <class U>
concept l1_usage = requires(const U& u) {
  u.bytes_used;
  u.bytes_capacity;
  u.objects;
};

/// An L1 tier: usage() gives its accounting (l1::tier).
template <class T>
concept l1_usage_source = requires(const T& t) {
  { t.usage() } -> l1_usage;
};

namespace detail {

/// kvtier_l1_bytes_used, kvtier_l1_bytes_capacity, kvtier_l1_objects read from `snap` (a
/// scrape_snapshot, the callbacks' collector group) through l1_of(snap->get()), an l1_usage.
template <class Snapshot, class L1Of>
void collect_l1_usage(registry& reg, const label_pairs& labels, const std::shared_ptr<Snapshot>& snap, L1Of l1_of) {
  auto gauge = [&](const char* name, const char* help, auto get) {
    reg.add_callback(
        name, help, metric_type::gauge, labels, [snap, l1_of, get] { return get(l1_of(snap->get())); }, snap);
  };
  gauge("kvtier_l1_bytes_used", "Bytes of L1 slots in use (objects and objects being freed)",
        [](const auto& u) { return metric_value(u.bytes_used); });
  gauge("kvtier_l1_bytes_capacity", "Bytes of the L1 arena",
        [](const auto& u) { return metric_value(u.bytes_capacity); });
  gauge("kvtier_l1_objects", "Objects held in L1 (being written, ready or being read)",
        [](const auto& u) { return metric_value(u.objects); });
}

}  // namespace detail

/// Registers the L1 gauges kvtier_l1_bytes_used, kvtier_l1_bytes_capacity and
/// kvtier_l1_objects over tier.usage(), read once per scrape (with `labels`, e.g.
/// {{"tier", "l1"}} when a process has several tiers). The tier must outlive scrapes.
template <l1_usage_source Tier>
void collect_l1(registry& reg, const Tier& tier, const label_pairs& labels = {}) {
  detail::collect_l1_usage(reg, labels, make_scrape_snapshot([t = &tier] { return t->usage(); }), std::identity{});
}

// --- the cache ----------------------------------------------------------------------------

/// One backend in a cache status (cache::backend_status): name, usage, health.
template <class B>
concept backend_status_entry = requires(const B& b) {
  { b.name } -> std::convertible_to<std::string_view>;
  b.usage.bytes_used;
  b.usage.bytes_capacity;
  b.usage.objects;
  { b.health.healthy } -> std::convertible_to<bool>;
  { b.read_bytes_per_second } -> std::convertible_to<double>;
};

/// A cache's status snapshot (cache::cache_status).
template <class S>
concept cache_status_snapshot = requires(const S& s) {
  { s.l1 } -> l1_usage;
  { s.backends[0] } -> backend_status_entry;
  s.backends.size();
  s.lookups;
  s.prefetches_active;
  s.prefetch_inflight_bytes;
  s.store_inflight_tasks;
  s.store_inflight_bytes;
  s.store_staged_bytes;
};

/// A cache: status() gives its snapshot (cache::tiered_cache, server::any_cache).
template <class C>
concept cache_status_source = requires(const C& c) {
  { c.status() } -> cache_status_snapshot;
};

/// Registers the cache's gauges over cache.status(): the L1 gauges (as collect_l1), per
/// backend (label backend = its name) kvtier_l2_bytes_used, kvtier_l2_bytes_capacity,
/// kvtier_l2_objects, kvtier_l2_healthy, and kvtier_prefetch_requests_active,
/// kvtier_prefetch_inflight_load_bytes, kvtier_store_inflight_bytes,
/// kvtier_store_inflight_tasks, kvtier_store_staged_bytes, kvtier_lookups_active, and per
/// backend kvtier_l2_read_bandwidth_bytes_per_second (in that order: the order of the page).
/// They are one collector group: a scrape calls status() once (it takes L1's mutex and asks
/// every backend), and every gauge reads that snapshot. The backends are those of the status
/// at registration (a cache's backends are fixed). The cache must outlive scrapes.
template <cache_status_source Cache>
void collect_cache(registry& reg, const Cache& cache) {
  const auto snap = make_scrape_snapshot([c = &cache] { return c->status(); });
  detail::collect_l1_usage(
      reg, {}, snap, [](const auto& s) -> const auto& { return s.l1; });
  auto gauge = [&](const char* name, const char* help, const label_pairs& labels, auto get) {
    reg.add_callback(
        name, help, metric_type::gauge, labels, [snap, get] { return detail::metric_value(get(snap->get())); }, snap);
  };
  // A field of backend b's entry (a cache's backends never go away; 0 should one be missing).
  auto backend_gauge = [&](const char* name, const char* help, std::size_t b, auto get) {
    const label_pairs l = {{"backend", std::string(std::string_view(snap->get().backends[b].name))}};
    gauge(name, help, l, [b, get](const auto& s) { return b < s.backends.size() ? get(s.backends[b]) : 0.0; });
  };
  const std::size_t backends = snap->get().backends.size();
  for (std::size_t b = 0; b < backends; ++b) {
    backend_gauge("kvtier_l2_bytes_used", "Bytes used on the L2 backend", b,
                  [](const auto& e) { return detail::metric_value(e.usage.bytes_used); });
    backend_gauge("kvtier_l2_bytes_capacity", "Capacity of the L2 backend in bytes (0: unbounded)", b,
                  [](const auto& e) { return detail::metric_value(e.usage.bytes_capacity); });
    backend_gauge("kvtier_l2_objects", "Objects on the L2 backend", b,
                  [](const auto& e) { return detail::metric_value(e.usage.objects); });
    backend_gauge("kvtier_l2_healthy", "1 while the L2 backend is healthy", b,
                  [](const auto& e) { return e.health.healthy ? 1.0 : 0.0; });
  }
  gauge("kvtier_prefetch_requests_active", "Prefetch requests not finished (late loads included)", {},
        [](const auto& s) { return s.prefetches_active; });
  gauge("kvtier_prefetch_inflight_load_bytes", "Bytes of L2 loads in flight", {},
        [](const auto& s) { return s.prefetch_inflight_bytes; });
  gauge("kvtier_store_inflight_bytes", "Bytes of L2 stores in flight", {},
        [](const auto& s) { return s.store_inflight_bytes; });
  gauge("kvtier_store_inflight_tasks", "L2 store tasks in flight", {},
        [](const auto& s) { return s.store_inflight_tasks; });
  gauge("kvtier_store_staged_bytes", "Staging memory of stores larger than L1 (reserved or being stored to L2)", {},
        [](const auto& s) { return s.store_staged_bytes; });
  gauge("kvtier_lookups_active", "Lookups holding L1 locks or prefetching", {},
        [](const auto& s) { return s.lookups; });
  for (std::size_t b = 0; b < backends; ++b)
    backend_gauge("kvtier_l2_read_bandwidth_bytes_per_second",
                  "Achieved L2 load bandwidth of the backend (bytes landed per second of loading over its recent load "
                  "tasks, a task that landed nothing counting its time; 0 before the first); "
                  "the load-or-recompute gate compares it with the engine's prefill rate",
                  b, [](const auto& e) { return static_cast<double>(e.read_bytes_per_second); });
}

// --- file I/O -------------------------------------------------------------------------------

/// What file I/O counts (io::io_stats): relaxed atomics.
template <class S>
concept io_counter_set = requires(const S& s) {
  s.ops_completed.load();
  s.ops_cancelled.load();
  s.ops_failed.load();
  s.ops_in_flight.load();
  s.enter_calls.load();
  s.sqes_submitted.load();
  s.fixed_ops.load();
  s.fixed_buffer_registration_failures.load();
  s.fixed_buffer_bytes.load();
};

/// Registers the kvtier_io_* metrics of docs/io.md: kvtier_io_uring_enabled (1 when `uring`,
/// 0 on the pread fallback) and the counters and gauges over `stats` (io::any_file_io's
/// shared_stats(), a disk backend's shared_io_stats()). They hold `stats`: readable after
/// the file I/O is gone. One file I/O per registry (a second one replaces the callbacks).
template <io_counter_set Stats>
void collect_io(registry& reg, bool uring, std::shared_ptr<const Stats> stats) {
  const double enabled = uring ? 1.0 : 0.0;
  reg.add_callback("kvtier_io_uring_enabled",
                   "1 when L2 file I/O runs on io_uring, 0 on the pread thread-pool fallback", metric_type::gauge, {},
                   [enabled] { return enabled; });
  auto add = [&](const char* name, const char* help, metric_type type, const auto Stats::*field) {
    reg.add_callback(name, help, type, {}, [stats, field] { return detail::metric_value((*stats).*field); });
  };
  add("kvtier_io_ops_total", "File I/O operations completed (any result)", metric_type::counter, &Stats::ops_completed);
  add("kvtier_io_cancelled_ops_total", "File I/O operations completed with operation_aborted", metric_type::counter,
      &Stats::ops_cancelled);
  add("kvtier_io_failed_ops_total", "File I/O operations completed with an error other than cancellation",
      metric_type::counter, &Stats::ops_failed);
  add("kvtier_io_uring_enter_calls_total", "io_uring_enter system calls made to submit or reap", metric_type::counter,
      &Stats::enter_calls);
  add("kvtier_io_uring_sqes_total", "Submission queue entries the kernel accepted", metric_type::counter,
      &Stats::sqes_submitted);
  add("kvtier_io_fixed_ops_total", "Reads and writes that used a registered (fixed) buffer", metric_type::counter,
      &Stats::fixed_ops);
  add("kvtier_io_fixed_buffer_registration_failures_total",
      "Fixed-buffer registrations the kernel refused (the same memory is then used with plain reads)",
      metric_type::counter, &Stats::fixed_buffer_registration_failures);
  add("kvtier_io_fixed_buffer_bytes", "Bytes registered as io_uring fixed buffers now", metric_type::gauge,
      &Stats::fixed_buffer_bytes);
  add("kvtier_io_in_flight", "File I/O operations started and not completed", metric_type::gauge,
      &Stats::ops_in_flight);
}

// --- the disk L2 backend --------------------------------------------------------------------

/// What the disk backend counts (l2::disk_stats): relaxed atomics, the per-operation ones
/// indexed by op (op_count of them, named by op_name()).
template <class S>
concept disk_counter_set = requires(const S& s, std::size_t op) {
  { S::op_count } -> std::convertible_to<std::size_t>;
  { S::op_name(op) } -> std::convertible_to<std::string_view>;
  s.io_errors[op].load();
  s.timeouts[op].load();
  s.enospc.load();
  s.corrupt_objects.load();
  s.o_direct.load();
  s.directory_fsync.load();
};

/// A disk backend: its name and its shared statistics.
template <class B>
concept disk_stats_source = requires(const B& b) {
  { b.name() } -> std::convertible_to<std::string_view>;
  requires disk_counter_set<std::remove_cvref_t<decltype(*b.shared_stats())>>;
};

/// Registers the kvtier_l2_disk_* metrics of docs/metrics.md (label backend = its name, and
/// op where it applies). They hold the backend's shared statistics: readable after it is
/// gone.
template <disk_stats_source Backend>
void collect_disk_backend(registry& reg, const Backend& backend) {
  const label_pairs l = {{"backend", std::string(backend.name())}};
  auto st = backend.shared_stats();
  using stats_type = std::remove_cvref_t<decltype(*st)>;
  auto add = [&](const char* name, const char* help, metric_type type, const auto& field, const label_pairs& labels) {
    reg.add_callback(name, help, type, labels, [st, f = &field] { return detail::metric_value(*f); });
  };
  auto counter = [&](const char* name, const char* help, const auto& field) {
    add(name, help, metric_type::counter, field, l);
  };
  auto gauge = [&](const char* name, const char* help, const auto& field) {
    add(name, help, metric_type::gauge, field, l);
  };
  counter("kvtier_l2_disk_enospc_total", "Stores failed because the file system was full (ENOSPC, EDQUOT)", st->enospc);
  for (std::size_t o = 0; o < stats_type::op_count; ++o) {
    // Built with its final size reserved: g++ 12 at -O1 reported a false -Wstringop-overflow
    // for a copy followed by emplace_back here.
    label_pairs lo;
    lo.reserve(l.size() + 1);
    lo.insert(lo.end(), l.begin(), l.end());
    lo.emplace_back("op", std::string(stats_type::op_name(o)));
    add("kvtier_l2_disk_io_errors_total", "Keys failed by an I/O error of the file system or device",
        metric_type::counter, st->io_errors[o], lo);
    add("kvtier_l2_disk_timeouts_total", "Keys that missed their operation's deadline", metric_type::counter,
        st->timeouts[o], lo);
  }
  counter("kvtier_l2_disk_corrupt_objects_total",
          "Loads that found a bad header, a truncated file or a payload checksum mismatch (never served)",
          st->corrupt_objects);
  counter("kvtier_l2_disk_dropped_objects_total", "Objects deleted after a failed load (corrupt or unreadable)",
          st->dropped_objects);
  counter("kvtier_l2_disk_evicted_objects_total", "Objects evicted to make room", st->evicted_objects);
  counter("kvtier_l2_disk_evicted_bytes_total", "Allocated bytes freed by eviction", st->evicted_bytes);
  counter("kvtier_l2_disk_read_bytes_total", "Payload bytes of loads answered ok", st->loaded_bytes);
  counter("kvtier_l2_disk_written_bytes_total", "Payload bytes of stores answered ok", st->stored_bytes);
  gauge("kvtier_l2_disk_recovered_objects", "Objects found valid by the start-up scan", st->recovered_objects);
  gauge("kvtier_l2_disk_recovered_bytes", "Allocated bytes of the objects found by the start-up scan",
        st->recovered_bytes);
  gauge("kvtier_l2_disk_recovery_dropped_objects", "Torn or corrupt object files deleted by the start-up scan",
        st->recovery_dropped);
  gauge("kvtier_l2_disk_recovery_temp_files", "Temporary files of interrupted stores deleted by the start-up scan",
        st->recovery_temp_files);
  gauge("kvtier_l2_disk_recovery_untrusted_files",
        "Object files the start-up scan skipped because another user owns them or others may write them",
        st->recovery_untrusted);
  reg.add_callback("kvtier_l2_disk_o_direct", "1 when the disk backend uses O_DIRECT", metric_type::gauge, l,
                   [st] { return st->o_direct.load(std::memory_order_relaxed) ? 1.0 : 0.0; });
  reg.add_callback("kvtier_l2_disk_directory_fsync",
                   "1 when stores fsync the shard directories they touched (sync data, name_sync directory); 0 "
                   "when each object's fsync commits its name, or with sync none",
                   metric_type::gauge, l,
                   [st] { return st->directory_fsync.load(std::memory_order_relaxed) ? 1.0 : 0.0; });
}

// --- the Redis L2 backend -------------------------------------------------------------------

/// What the Redis backend counts (l2::redis_counters): relaxed atomics, errors indexed by
/// kind (error_kind_count of them, named by error_kind_name()).
template <class S>
concept redis_counter_set = requires(const S& s, std::size_t kind) {
  { S::error_kind_count } -> std::convertible_to<std::size_t>;
  { S::error_kind_name(kind) } -> std::convertible_to<std::string_view>;
  s.errors[kind].load();
  s.reconnects.load();
  s.moved.load();
  s.ask.load();
  s.connections_up.load();
};

/// A Redis backend: its name and its shared counters.
template <class B>
concept redis_stats_source = requires(const B& b) {
  { b.name() } -> std::convertible_to<std::string_view>;
  requires redis_counter_set<std::remove_cvref_t<decltype(*b.shared_stats())>>;
};

/// Registers, with label backend = its name: kvtier_l2_redis_errors_total{kind} (one child
/// per error kind), kvtier_l2_redis_reconnects_total, kvtier_l2_redis_redirects_total{kind =
/// moved | ask}, kvtier_l2_redis_connections (gauge: connections up). They hold the
/// backend's shared counters: readable after it is gone.
template <redis_stats_source Backend>
void collect_redis_backend(registry& reg, const Backend& backend) {
  const std::string b(backend.name());
  auto c = backend.shared_stats();
  using stats_type = std::remove_cvref_t<decltype(*c)>;
  for (std::size_t k = 0; k < stats_type::error_kind_count; ++k)
    reg.add_callback("kvtier_l2_redis_errors_total", "Failures of the Redis L2 backend by kind (keys or connections)",
                     metric_type::counter, {{"backend", b}, {"kind", std::string(stats_type::error_kind_name(k))}},
                     [c, k] { return detail::metric_value(c->errors[k]); });
  reg.add_callback("kvtier_l2_redis_reconnects_total", "Connections to Redis re-established after a failure",
                   metric_type::counter, {{"backend", b}}, [c] { return detail::metric_value(c->reconnects); });
  reg.add_callback("kvtier_l2_redis_redirects_total", "Redis Cluster redirects followed", metric_type::counter,
                   {{"backend", b}, {"kind", "moved"}}, [c] { return detail::metric_value(c->moved); });
  reg.add_callback("kvtier_l2_redis_redirects_total", "Redis Cluster redirects followed", metric_type::counter,
                   {{"backend", b}, {"kind", "ask"}}, [c] { return detail::metric_value(c->ask); });
  reg.add_callback("kvtier_l2_redis_connections", "Connections to Redis nodes that are up", metric_type::gauge,
                   {{"backend", b}}, [c] { return detail::metric_value(c->connections_up); });
}

// --- the event bus ---------------------------------------------------------------------------

/// A bus with a deferred queue: dropped() and delivered() count its events.
template <class B>
concept bus_stats_source = requires(const B& b) {
  b.dropped();
  b.delivered();
};

/// Exposes a bus's own health: kvtier_event_bus_dropped_events_total (deferred events dropped,
/// queue full) and kvtier_event_bus_delivered_events_total. The bus must outlive scrapes.
template <bus_stats_source Bus>
void collect_bus(registry& reg, const Bus& b) {
  reg.add_callback("kvtier_event_bus_dropped_events_total",
                   "Events dropped for deferred subscribers because the bus queue was full", metric_type::counter, {},
                   [&b] { return detail::metric_value(b.dropped()); });
  reg.add_callback("kvtier_event_bus_delivered_events_total", "Events delivered to deferred subscribers",
                   metric_type::counter, {}, [&b] { return detail::metric_value(b.delivered()); });
}

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
