#pragma once
// metrics_subscriber: turns bus events into Prometheus metrics in a registry. Delivery is
// immediate (inline on the publishing thread, owner-only relaxed updates), never behind the
// dropping queue, so every count is exact. Every metric is registered by the constructor and
// so present, at zero, from start-up. docs/metrics.md lists each one with the event that
// moves it.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

class metrics_subscriber {
 public:
  static constexpr bus::delivery delivery_mode = bus::delivery::immediate;

  explicit metrics_subscriber(registry& reg) : s_(std::make_unique<state>(reg)) {}

  /// Creates the per-backend series of L2 backend `index` (named `name`) so they read zero
  /// before its first event. Backends first seen in an event are declared then; a cache
  /// declares its own backends with cache_backend_attached.
  void declare_backend(std::uint8_t index, std::string_view name) { s_->backend(index, name); }
  void on(const bus::cache_backend_attached& e) { s_->backend(e.backend_index, e.backend); }

  // --- L1 ------------------------------------------------------------------------------
  void on(const bus::l1_read_reserved& e) noexcept {
    s_->l1_read_reserved_keys.inc(e.key_count);
    s_->l1_read_failed_keys.inc(e.failed_count);
    s_->l1_read_holds_taken.inc(e.holds);
  }
  void on(const bus::l1_read_finished& e) noexcept {
    s_->l1_read_keys.inc(e.key_count);
    s_->l1_read_holds_released.inc(e.holds);
  }
  void on(const bus::l1_write_reserved& e) noexcept {
    s_->l1_write_reserved_keys.inc(e.key_count);
    s_->l1_write_failed_keys.inc(e.failed_count);
  }
  void on(const bus::l1_write_finished& e) noexcept { s_->l1_write_keys.inc(e.key_count); }
  void on(const bus::l1_write_finished_and_read_reserved& e) noexcept {
    s_->l1_write_keys.inc(e.key_count);
    s_->l1_prefetched_keys.inc(e.key_count);
    s_->l1_read_holds_taken.inc(e.holds);
  }
  void on(const bus::l1_keys_evicted& e) noexcept {
    const auto r = static_cast<std::size_t>(e.reason);
    s_->l1_evicted_keys[r]->inc(e.key_count);
    s_->l1_evicted_bytes[r]->inc(e.bytes);
  }
  void on(const bus::l1_allocation_failed& e) noexcept {
    const auto p = static_cast<std::size_t>(e.purpose);
    s_->l1_allocation_failures[p]->inc();
    s_->l1_allocation_failed_keys[p]->inc(e.key_count);
  }
  void on(const bus::l1_lock_expired& e) noexcept {
    s_->l1_lock_expired_keys[static_cast<std::size_t>(e.lock)]->inc(e.key_count);
    s_->l1_read_holds_expired.inc(e.holds);
  }

  // --- cache facade --------------------------------------------------------------------
  void on(const bus::cache_lookup& e) noexcept {
    s_->lookups.inc();
    s_->lookup_requested_chunks.inc(e.requested_chunks);
    s_->lookup_requested_tokens.inc(e.requested_tokens);
    s_->lookup_hit_chunks_l1.inc(e.l1_hit_chunks);
    s_->lookup_hit_chunks_l2.inc(e.l2_hit_chunks);
    s_->lookup_hit_tokens_l1.inc(std::uint64_t{e.l1_hit_chunks} * e.chunk_tokens);
    s_->lookup_hit_tokens_l2.inc(std::uint64_t{e.l2_hit_chunks} * e.chunk_tokens);
  }
  void on(const bus::cache_read_prefetched& e) noexcept {
    s_->cache_read_requests.inc();
    s_->cache_read_succeeded_keys.inc(e.succeeded_keys);
    s_->cache_read_failed_keys.inc(e.failed_keys);
  }
  void on(const bus::cache_write_reserved& e) noexcept {
    s_->cache_write_requests.inc();
    s_->cache_write_succeeded_keys.inc(e.succeeded_keys);
    s_->cache_write_failed_keys.inc(e.failed_keys);
  }
  void on(const bus::cache_write_finished& e) noexcept {
    s_->cache_write_finished_keys.inc(e.succeeded_keys);
    s_->cache_write_finish_failed_keys.inc(e.failed_keys);
  }

  // --- L2 store ------------------------------------------------------------------------
  void on(const bus::l2_store_submitted& e) {
    auto& b = s_->backend(e.backend_index, e.backend);
    b.store_tasks.inc();
    b.store_keys.inc(e.key_count);
  }
  void on(const bus::l2_store_completed& e) {
    auto& b = s_->backend(e.backend_index, e.backend);
    b.store_completed.inc();
    b.store_succeeded_keys.inc(e.succeeded_count);
    b.store_failed_keys.inc(e.failed_count);
    b.store_bytes.inc(e.bytes);
    b.store_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }

  // --- L2 prefetch ---------------------------------------------------------------------
  void on(const bus::l2_prefetch_lookup_submitted& e) noexcept {
    s_->prefetch_lookups.inc();
    s_->prefetch_lookup_keys.inc(e.key_count);
  }
  void on(const bus::l2_prefetch_lookup_completed& e) noexcept { s_->prefetch_hit_keys.inc(e.hit_count); }
  void on(const bus::l2_prefetch_load_submitted& e) noexcept {
    s_->prefetch_load_tasks.inc(e.backend_count);
    s_->prefetch_load_keys.inc(e.key_count);
    s_->prefetch_trimmed_keys.inc(e.trimmed_count);
  }
  void on(const bus::l2_prefetch_load_completed& e) noexcept {
    s_->prefetch_loaded_keys.inc(e.loaded_count);
    s_->prefetch_failed_keys.inc(e.failed_count);
    s_->prefetch_loaded_bytes.inc(e.bytes);
    s_->prefetch_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }
  void on(const bus::l2_prefetch_failed& e) noexcept {
    s_->prefetch_failure_keys[static_cast<std::size_t>(e.reason)]->inc(e.key_count);
  }
  void on(const bus::l2_prefetch_declined& e) noexcept {
    s_->l2_declined_tokens[static_cast<std::size_t>(e.reason)]->inc(e.tokens);
    s_->l2_probe_tokens.inc(e.probe_tokens);
  }
  void on(const bus::l2_backend_load_completed& e) {
    auto& b = s_->backend(e.backend_index, e.backend);
    b.load_keys.inc(e.key_count);
    b.load_succeeded_keys.inc(e.loaded_count);
    b.load_bytes.inc(e.bytes);
    b.load_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }

  // --- server --------------------------------------------------------------------------
  void on(const bus::server_request_started& e) noexcept {
    s_->requests_in_flight[static_cast<std::size_t>(e.kind)]->add(1);
  }
  void on(const bus::server_request_finished& e) noexcept {
    const auto k = static_cast<std::size_t>(e.kind);
    s_->requests_in_flight[k]->sub(1);
    s_->requests[k]->inc();
    if (!e.ok) s_->request_errors[k]->inc();
    s_->request_duration[k]->observe(static_cast<double>(e.duration_ns) * 1e-9);
  }

  // --- connector -----------------------------------------------------------------------
  void on(const bus::connector_healthy&) noexcept { s_->connector_healthy.set(1); }
  void on(const bus::connector_unhealthy& e) noexcept {
    s_->connector_healthy.set(0);
    s_->connector_unhealthy.inc();
    s_->connector_released_requests.inc(e.released_requests);
  }
  void on(const bus::connector_reconnected& e) noexcept {
    s_->connector_reconnects.inc();
    if (e.server_restarted) s_->connector_server_restarts.inc();
  }
  void on(const bus::connector_lookup_completed& e) noexcept {
    s_->connector_lookups[static_cast<std::size_t>(e.outcome)]->inc();
    s_->connector_lookup_requested_tokens.inc(std::uint64_t{e.requested_chunks} * e.chunk_tokens);
    s_->connector_lookup_hit_tokens.inc(std::uint64_t{e.hit_chunks} * e.chunk_tokens);
    s_->connector_lookup_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }
  void on(const bus::connector_retrieve_completed& e) noexcept {
    s_->connector_retrieves[static_cast<std::size_t>(e.outcome)]->inc();
    s_->connector_retrieve_requested_chunks.inc(e.requested_chunks);
    s_->connector_retrieved_chunks.inc(e.retrieved_chunks);
    s_->connector_retrieve_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }
  void on(const bus::connector_store_completed& e) noexcept {
    s_->connector_stores[static_cast<std::size_t>(e.outcome)]->inc();
    s_->connector_store_requested_chunks.inc(e.requested_chunks);
    s_->connector_store_chunks_stored.inc(e.stored_chunks);
    s_->connector_store_chunks_present.inc(e.already_present_chunks);
    s_->connector_store_chunks_failed.inc(e.failed_chunks);
    s_->connector_store_duration.observe(static_cast<double>(e.duration_ns) * 1e-9);
  }
  void on(const bus::connector_load_error& e) noexcept {
    s_->connector_load_error_blocks[static_cast<std::size_t>(e.reason)]->inc(e.block_count);
  }
  void on(const bus::connector_peer_refused&) noexcept { s_->connector_peer_refusals.inc(); }
  void on(const bus::connector_quarantine_changed& e) noexcept {
    // add/sub rather than set: several connectors (ranks) may share one bus.
    s_->connector_quarantined_blocks.add(static_cast<double>(e.held_blocks));
    s_->connector_quarantined_blocks.sub(static_cast<double>(e.released_blocks));
    s_->connector_quarantine_held.inc(e.held_blocks);
    s_->connector_quarantine_released.inc(e.released_blocks);
  }

 private:
  struct backend_metrics {
    backend_metrics(registry& r, const label_pairs& l)
        : store_tasks(r.add_counter("kvtier_l2_store_tasks_total", "L2 store tasks submitted", l)),
          store_keys(r.add_counter("kvtier_l2_store_keys_total", "Keys submitted to L2 store", l)),
          store_completed(r.add_counter("kvtier_l2_store_completed_total", "L2 store tasks completed", l)),
          store_succeeded_keys(
              r.add_counter("kvtier_l2_store_succeeded_keys_total", "Keys stored in L2 successfully", l)),
          store_failed_keys(r.add_counter("kvtier_l2_store_failed_keys_total", "Keys whose L2 store failed", l)),
          store_bytes(r.add_counter("kvtier_l2_store_bytes_total", "Bytes stored in L2 successfully", l)),
          store_duration(r.add_histogram("kvtier_l2_store_duration_seconds",
                                         "Time from L2 store submission to completion", latency_buckets_seconds(), l)),
          load_keys(r.add_counter("kvtier_l2_load_keys_total", "Keys submitted for loading from this L2 backend", l)),
          load_succeeded_keys(r.add_counter("kvtier_l2_load_succeeded_keys_total",
                                            "Keys loaded from this L2 backend into L1", l)),
          load_bytes(r.add_counter("kvtier_l2_load_bytes_total", "Bytes loaded from this L2 backend into L1", l)),
          load_duration(r.add_histogram("kvtier_l2_load_duration_seconds", "Time of one L2 backend load task",
                                        latency_buckets_seconds(), l)) {}
    counter& store_tasks;
    counter& store_keys;
    counter& store_completed;
    counter& store_succeeded_keys;
    counter& store_failed_keys;
    counter& store_bytes;
    histogram& store_duration;
    counter& load_keys;
    counter& load_succeeded_keys;
    counter& load_bytes;
    histogram& load_duration;
  };

  template <std::size_t N, class Enum, class Make>
  static std::array<counter*, N> per_enum_counters(registry& r, std::string_view name, std::string_view help,
                                                   std::string_view label, Make name_of) {
    std::array<counter*, N> a{};
    for (std::size_t i = 0; i < N; ++i)
      a[i] = &r.add_counter(name, help, {{std::string(label), std::string(name_of(static_cast<Enum>(i)))}});
    return a;
  }

  // The series, registered in this order (the order of the exposition): each group's
  // constructor registers its own, state's constructor the server's request series last.
  /// The L1 tier's series (bus l1_* events).
  struct l1_metrics {
    explicit l1_metrics(registry& r)
        : l1_read_keys(r.add_counter("kvtier_l1_read_keys_total", "L1 read locks released (keys read)")),
          l1_read_reserved_keys(r.add_counter("kvtier_l1_read_reserved_keys_total", "L1 keys read-locked")),
          l1_read_holds_taken(r.add_counter("kvtier_l1_read_holds_taken_total",
                                            "L1 read holds taken (a key read-locked for n readers counts n)")),
          l1_read_holds_released(r.add_counter("kvtier_l1_read_holds_released_total", "L1 read holds released")),
          l1_read_holds_expired(r.add_counter("kvtier_l1_read_holds_expired_total",
                                              "L1 read holds released by their TTL (a reader that went away)")),
          l1_read_failed_keys(r.add_counter("kvtier_l1_read_failed_keys_total",
                                            "L1 read reservations refused (absent or not readable)")),
          l1_write_reserved_keys(r.add_counter("kvtier_l1_write_reserved_keys_total", "L1 keys write-locked")),
          l1_write_failed_keys(r.add_counter("kvtier_l1_write_failed_keys_total",
                                             "L1 write reservations refused (exists, locked, out of memory)")),
          l1_write_keys(r.add_counter("kvtier_l1_write_keys_total", "L1 writes finished (keys made readable)")),
          l1_prefetched_keys(r.add_counter("kvtier_l1_prefetched_keys_total",
                                           "L1 keys written by L2 prefetch (not offered to L2 store)")),
          l1_evicted_keys(per_enum_counters<bus::removal_reason_count, bus::removal_reason>(
              r, "kvtier_l1_evicted_keys_total", "L1 objects removed, by reason", "reason",
              [](bus::removal_reason x) { return bus::name(x); })),
          l1_evicted_bytes(per_enum_counters<bus::removal_reason_count, bus::removal_reason>(
              r, "kvtier_l1_evicted_bytes_total", "Bytes of L1 objects removed, by reason", "reason",
              [](bus::removal_reason x) { return bus::name(x); })),
          l1_allocation_failures(per_enum_counters<bus::allocation_purpose_count, bus::allocation_purpose>(
              r, "kvtier_l1_allocation_failures_total", "L1 batch allocations that failed", "purpose",
              [](bus::allocation_purpose x) { return bus::name(x); })),
          l1_allocation_failed_keys(per_enum_counters<bus::allocation_purpose_count, bus::allocation_purpose>(
              r, "kvtier_l1_allocation_failed_keys_total", "Keys of failed L1 batch allocations", "purpose",
              [](bus::allocation_purpose x) { return bus::name(x); })),
          l1_lock_expired_keys(per_enum_counters<bus::lock_kind_count, bus::lock_kind>(
              r, "kvtier_l1_lock_expired_keys_total", "L1 locks released by their TTL", "lock",
              [](bus::lock_kind x) { return bus::name(x); })) {}
    counter& l1_read_keys;
    counter& l1_read_reserved_keys;
    counter& l1_read_holds_taken;
    counter& l1_read_holds_released;
    counter& l1_read_holds_expired;
    counter& l1_read_failed_keys;
    counter& l1_write_reserved_keys;
    counter& l1_write_failed_keys;
    counter& l1_write_keys;
    counter& l1_prefetched_keys;
    std::array<counter*, bus::removal_reason_count> l1_evicted_keys;
    std::array<counter*, bus::removal_reason_count> l1_evicted_bytes;
    std::array<counter*, bus::allocation_purpose_count> l1_allocation_failures;
    std::array<counter*, bus::allocation_purpose_count> l1_allocation_failed_keys;
    std::array<counter*, bus::lock_kind_count> l1_lock_expired_keys;
  };

  /// The cache's lookups, reads and writes (bus cache_* events).
  struct cache_metrics {
    explicit cache_metrics(registry& r)
        : lookups(r.add_counter("kvtier_lookups_total", "Cache lookups answered")),
          lookup_requested_chunks(r.add_counter("kvtier_lookup_requested_chunks_total", "Chunks asked for by lookups")),
          lookup_requested_tokens(
              r.add_counter("kvtier_lookup_requested_tokens_total", "Tokens asked for by lookups (full chunks)")),
          lookup_hit_chunks_l1(
              r.add_counter("kvtier_lookup_hit_chunks_total", "Chunks a lookup found, by tier", {{"tier", "l1"}})),
          lookup_hit_chunks_l2(
              r.add_counter("kvtier_lookup_hit_chunks_total", "Chunks a lookup found, by tier", {{"tier", "l2"}})),
          lookup_hit_tokens_l1(
              r.add_counter("kvtier_lookup_hit_tokens_total", "Tokens a lookup found, by tier", {{"tier", "l1"}})),
          lookup_hit_tokens_l2(
              r.add_counter("kvtier_lookup_hit_tokens_total", "Tokens a lookup found, by tier", {{"tier", "l2"}})),
          cache_read_requests(r.add_counter("kvtier_cache_read_requests_total", "Reads of prefetched chunks")),
          cache_read_succeeded_keys(
              r.add_counter("kvtier_cache_read_succeeded_keys_total", "Prefetched chunks read successfully")),
          cache_read_failed_keys(
              r.add_counter("kvtier_cache_read_failed_keys_total", "Prefetched chunks that could not be read")),
          cache_write_requests(r.add_counter("kvtier_cache_write_requests_total", "Write reservations requested")),
          cache_write_succeeded_keys(
              r.add_counter("kvtier_cache_write_succeeded_keys_total", "Chunks reserved for writing")),
          cache_write_failed_keys(
              r.add_counter("kvtier_cache_write_failed_keys_total", "Chunks refused for writing (present or no room)")),
          cache_write_finished_keys(
              r.add_counter("kvtier_cache_write_finished_keys_total", "Chunks written and made readable")),
          cache_write_finish_failed_keys(r.add_counter("kvtier_cache_write_finish_failed_keys_total",
                                                       "Chunk writes abandoned (copy failed or fenced)")) {}
    counter& lookups;
    counter& lookup_requested_chunks;
    counter& lookup_requested_tokens;
    counter& lookup_hit_chunks_l1;
    counter& lookup_hit_chunks_l2;
    counter& lookup_hit_tokens_l1;
    counter& lookup_hit_tokens_l2;
    counter& cache_read_requests;
    counter& cache_read_succeeded_keys;
    counter& cache_read_failed_keys;
    counter& cache_write_requests;
    counter& cache_write_succeeded_keys;
    counter& cache_write_failed_keys;
    counter& cache_write_finished_keys;
    counter& cache_write_finish_failed_keys;
  };

  /// The L2 prefetch pipeline and the load-or-recompute gate (bus l2_prefetch_*, cache_lookup_declined).
  struct prefetch_metrics {
    explicit prefetch_metrics(registry& r)
        : prefetch_lookups(r.add_counter("kvtier_l2_prefetch_lookups_total", "L2 prefetch requests (lookup phase)")),
          prefetch_lookup_keys(r.add_counter("kvtier_l2_prefetch_lookup_keys_total", "Keys looked up in L2")),
          prefetch_hit_keys(
              r.add_counter("kvtier_l2_prefetch_hit_keys_total", "Keys in the contiguous L2 prefix of lookups")),
          prefetch_load_tasks(r.add_counter("kvtier_l2_prefetch_load_tasks_total", "L2 load tasks submitted")),
          prefetch_load_keys(r.add_counter("kvtier_l2_prefetch_load_keys_total", "Keys submitted for L2 load")),
          prefetch_trimmed_keys(r.add_counter("kvtier_l2_prefetch_trimmed_keys_total",
                                              "Keys found in L2 but dropped by prefix trimming")),
          prefetch_loaded_keys(r.add_counter("kvtier_l2_prefetch_loaded_keys_total", "Keys loaded from L2 into L1")),
          prefetch_failed_keys(
              r.add_counter("kvtier_l2_prefetch_failed_keys_total", "Keys submitted for L2 load that did not land")),
          prefetch_loaded_bytes(r.add_counter("kvtier_l2_prefetch_loaded_bytes_total", "Bytes loaded from L2")),
          prefetch_failure_keys(per_enum_counters<bus::prefetch_failure_count, bus::prefetch_failure>(
              r, "kvtier_l2_prefetch_failure_keys_total", "Keys an L2 prefetch could not deliver, by reason", "reason",
              [](bus::prefetch_failure x) { return bus::name(x); })),
          l2_declined_tokens(per_enum_counters<bus::decline_reason_count, bus::decline_reason>(
              r, "kvtier_lookup_l2_declined_tokens_total",
              "Tokens L2 could have served that lookups did not offer, by reason (slower_than_recompute: the "
              "backend loads them slower than the engine's declared prefill rate computes them)",
              "reason", [](bus::decline_reason x) { return bus::name(x); })),
          l2_probe_tokens(r.add_counter("kvtier_lookup_l2_probe_tokens_total",
                                        "Tokens of chunks the load-or-recompute gate judged slower than recompute "
                                        "but loaded as probes, so that the backend's estimate keeps learning")),
          prefetch_duration(r.add_histogram("kvtier_l2_prefetch_duration_seconds",
                                            "Time from L2 lookup submission to prefetch completion",
                                            latency_buckets_seconds())) {}
    counter& prefetch_lookups;
    counter& prefetch_lookup_keys;
    counter& prefetch_hit_keys;
    counter& prefetch_load_tasks;
    counter& prefetch_load_keys;
    counter& prefetch_trimmed_keys;
    counter& prefetch_loaded_keys;
    counter& prefetch_failed_keys;
    counter& prefetch_loaded_bytes;
    std::array<counter*, bus::prefetch_failure_count> prefetch_failure_keys;
    std::array<counter*, bus::decline_reason_count> l2_declined_tokens;
    counter& l2_probe_tokens;
    histogram& prefetch_duration;
  };

  /// The connector's link to its server and its lookups (bus connector_* events).
  struct connector_link_metrics {
    explicit connector_link_metrics(registry& r)
        : connector_healthy(r.add_gauge("kvtier_connector_healthy", "1 while the connector's server is healthy")),
          connector_unhealthy(
              r.add_counter("kvtier_connector_unhealthy_total", "Transitions of the connector to unhealthy")),
          connector_reconnects(r.add_counter("kvtier_connector_reconnects_total", "Connector reconnections")),
          connector_peer_refusals(r.add_counter(
              "kvtier_connector_peer_refusals_total",
              "Connections the connector refused because the server's process runs as an unexpected uid")),
          connector_server_restarts(
              r.add_counter("kvtier_connector_server_restarts_total", "Server restarts seen by the connector")),
          connector_released_requests(r.add_counter("kvtier_connector_released_requests_total",
                                                    "Pending requests released when the server became unhealthy")),
          connector_lookups(per_enum_counters<bus::connector_outcome_count, bus::connector_outcome>(
              r, "kvtier_connector_lookups_total", "Connector lookups answered, by outcome", "outcome",
              [](bus::connector_outcome x) { return bus::name(x); })),
          connector_lookup_requested_tokens(r.add_counter("kvtier_connector_lookup_requested_tokens_total",
                                                          "Tokens (full chunks) the connector looked up")),
          connector_lookup_hit_tokens(
              r.add_counter("kvtier_connector_lookup_hit_tokens_total", "Tokens the connector's lookups found")),
          connector_lookup_duration(r.add_histogram("kvtier_connector_lookup_duration_seconds",
                                                    "Time from lookup to its answer", latency_buckets_seconds())) {}
    gauge& connector_healthy;
    counter& connector_unhealthy;
    counter& connector_reconnects;
    counter& connector_peer_refusals;
    counter& connector_server_restarts;
    counter& connector_released_requests;
    std::array<counter*, bus::connector_outcome_count> connector_lookups;
    counter& connector_lookup_requested_tokens;
    counter& connector_lookup_hit_tokens;
    histogram& connector_lookup_duration;
  };

  /// The connector's retrieves, stores, load errors and quarantine (bus connector_* events).
  struct connector_transfer_metrics {
    explicit connector_transfer_metrics(registry& r)
        : connector_retrieves(per_enum_counters<bus::connector_outcome_count, bus::connector_outcome>(
              r, "kvtier_connector_retrieves_total", "Connector retrieves completed, by outcome", "outcome",
              [](bus::connector_outcome x) { return bus::name(x); })),
          connector_retrieve_requested_chunks(r.add_counter("kvtier_connector_retrieve_requested_chunks_total",
                                                            "Chunks the connector asked to retrieve")),
          connector_retrieved_chunks(
              r.add_counter("kvtier_connector_retrieved_chunks_total", "Chunks retrieved into the engine's blocks")),
          connector_retrieve_duration(r.add_histogram("kvtier_connector_retrieve_duration_seconds",
                                                      "Time from retrieve to completion", latency_buckets_seconds())),
          connector_stores(per_enum_counters<bus::connector_outcome_count, bus::connector_outcome>(
              r, "kvtier_connector_stores_total", "Connector stores completed or skipped, by outcome", "outcome",
              [](bus::connector_outcome x) { return bus::name(x); })),
          connector_store_requested_chunks(
              r.add_counter("kvtier_connector_store_requested_chunks_total", "Chunks the connector asked to store")),
          connector_store_chunks_stored(r.add_counter("kvtier_connector_store_chunks_total",
                                                      "Chunks of completed stores, by result", {{"result", "stored"}})),
          connector_store_chunks_present(r.add_counter("kvtier_connector_store_chunks_total",
                                                       "Chunks of completed stores, by result",
                                                       {{"result", "already_present"}})),
          connector_store_chunks_failed(r.add_counter("kvtier_connector_store_chunks_total",
                                                      "Chunks of completed stores, by result", {{"result", "failed"}})),
          connector_store_duration(r.add_histogram("kvtier_connector_store_duration_seconds",
                                                   "Time from store to completion", latency_buckets_seconds())),
          connector_load_error_blocks(per_enum_counters<bus::connector_outcome_count, bus::connector_outcome>(
              r, "kvtier_connector_load_error_blocks_total", "Blocks reported as load errors, by reason", "reason",
              [](bus::connector_outcome x) { return bus::name(x); })),
          connector_quarantined_blocks(r.add_gauge("kvtier_connector_quarantined_blocks",
                                                   "Engine blocks quarantined (a server may still write them)")),
          connector_quarantine_held(
              r.add_counter("kvtier_connector_quarantine_held_blocks_total", "Blocks that entered quarantine")),
          connector_quarantine_released(
              r.add_counter("kvtier_connector_quarantine_released_blocks_total", "Blocks that left quarantine")) {}
    std::array<counter*, bus::connector_outcome_count> connector_retrieves;
    counter& connector_retrieve_requested_chunks;
    counter& connector_retrieved_chunks;
    histogram& connector_retrieve_duration;
    std::array<counter*, bus::connector_outcome_count> connector_stores;
    counter& connector_store_requested_chunks;
    counter& connector_store_chunks_stored;
    counter& connector_store_chunks_present;
    counter& connector_store_chunks_failed;
    histogram& connector_store_duration;
    std::array<counter*, bus::connector_outcome_count> connector_load_error_blocks;
    gauge& connector_quarantined_blocks;
    counter& connector_quarantine_held;
    counter& connector_quarantine_released;
  };

  struct state : l1_metrics, cache_metrics, prefetch_metrics, connector_link_metrics, connector_transfer_metrics {
    explicit state(registry& r)
        : l1_metrics(r),
          cache_metrics(r),
          prefetch_metrics(r),
          connector_link_metrics(r),
          connector_transfer_metrics(r),
          reg(r) {
      for (std::size_t k = 0; k < bus::request_kind_count; ++k) {
        const label_pairs l = {{"type", std::string(bus::name(static_cast<bus::request_kind>(k)))}};
        requests[k] = &r.add_counter("kvtier_server_requests_total", "Server requests handled, by type", l);
        request_errors[k] =
            &r.add_counter("kvtier_server_request_errors_total", "Server requests answered with an error", l);
        requests_in_flight[k] =
            &r.add_gauge("kvtier_server_requests_in_flight", "Server requests being handled, by type", l);
        request_duration[k] = &r.add_histogram("kvtier_server_request_duration_seconds",
                                               "Server request handling time, by type", latency_buckets_seconds(), l);
      }
    }

    backend_metrics& backend(std::uint8_t index, std::string_view name) {
      if (backend_metrics* b = backends[index].load(std::memory_order_acquire)) return *b;
      std::lock_guard g(backend_mutex);
      if (backend_metrics* b = backends[index].load(std::memory_order_relaxed)) return *b;
      auto owned = std::make_unique<backend_metrics>(reg, label_pairs{{"backend", std::string(name)}});
      backend_metrics* b = owned.get();
      owned_backends.push_back(std::move(owned));
      backends[index].store(b, std::memory_order_release);
      return *b;
    }

    registry& reg;
    std::array<counter*, bus::request_kind_count> requests{};
    std::array<counter*, bus::request_kind_count> request_errors{};
    std::array<gauge*, bus::request_kind_count> requests_in_flight{};
    std::array<histogram*, bus::request_kind_count> request_duration{};
    std::array<std::atomic<backend_metrics*>, 256> backends{};
    std::mutex backend_mutex;
    std::vector<std::unique_ptr<backend_metrics>> owned_backends;
  };

  std::unique_ptr<state> s_;
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
