#pragma once
// logging_subscriber: writes bus events as log lines through a logger. Deferred by default
// (formatting is not for the hot path); drops under overload are counted by the bus. Each
// event has a level: routine traffic at debug/trace, failures at warn, health edges at
// warn/info (level_of), so the logger's level decides what is written, and what is queued:
// wants(e) tells the bus to skip an event the level would not write.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <fmt/format.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

class logging_subscriber {
 public:
  static constexpr bus::delivery delivery_mode = bus::delivery::deferred;

  explicit logging_subscriber(logger& log) : log_(&log), request_failures_(std::make_shared<request_throttles>()) {}

  static log_level level_of(const bus::l1_read_reserved&) noexcept { return log_level::trace; }
  void on(const bus::l1_read_reserved& e) {
    log_->log(level_of(e), "L1 read reserved: {} keys, {} refused", e.key_count, e.failed_count);
  }
  static log_level level_of(const bus::l1_read_finished&) noexcept { return log_level::trace; }
  void on(const bus::l1_read_finished& e) { log_->log(level_of(e), "L1 read finished: {} keys", e.key_count); }
  static log_level level_of(const bus::l1_write_reserved&) noexcept { return log_level::trace; }
  void on(const bus::l1_write_reserved& e) {
    log_->log(level_of(e), "L1 write reserved ({}): {} keys, {} refused", bus::name(e.purpose), e.key_count,
              e.failed_count);
  }
  static log_level level_of(const bus::l1_write_finished&) noexcept { return log_level::trace; }
  void on(const bus::l1_write_finished& e) { log_->log(level_of(e), "L1 write finished: {} keys", e.key_count); }
  static log_level level_of(const bus::l1_write_finished_and_read_reserved&) noexcept { return log_level::trace; }
  void on(const bus::l1_write_finished_and_read_reserved& e) {
    log_->log(level_of(e), "L1 prefetched keys ready and read-locked: {}", e.key_count);
  }
  static log_level level_of(const bus::l1_keys_evicted&) noexcept { return log_level::debug; }
  void on(const bus::l1_keys_evicted& e) {
    log_->log(level_of(e), "L1 removed {} keys ({} bytes), reason {}", e.key_count, e.bytes, bus::name(e.reason));
  }
  static log_level level_of(const bus::l1_allocation_failed&) noexcept { return log_level::warn; }
  void on(const bus::l1_allocation_failed& e) {
    log_->log(level_of(e), "L1 allocation failed for {} keys ({})", e.key_count, bus::name(e.purpose));
  }
  static log_level level_of(const bus::l1_lock_expired&) noexcept { return log_level::warn; }
  void on(const bus::l1_lock_expired& e) {
    log_->log(level_of(e), "L1 {} locks expired by TTL on {} keys (a client went away?)", bus::name(e.lock),
              e.key_count);
  }

  static log_level level_of(const bus::cache_lookup&) noexcept { return log_level::debug; }
  void on(const bus::cache_lookup& e) {
    log_->log(level_of(e), "lookup {}: {} chunks asked, {} in L1, {} from L2", e.request_id, e.requested_chunks,
              e.l1_hit_chunks, e.l2_hit_chunks);
  }
  static log_level level_of(const bus::cache_read_prefetched&) noexcept { return log_level::debug; }
  void on(const bus::cache_read_prefetched& e) {
    log_->log(level_of(e), "read prefetched: {} keys ok, {} failed", e.succeeded_keys, e.failed_keys);
  }
  static log_level level_of(const bus::cache_write_reserved&) noexcept { return log_level::debug; }
  void on(const bus::cache_write_reserved& e) {
    log_->log(level_of(e), "write reserved: {} keys ok, {} refused", e.succeeded_keys, e.failed_keys);
  }
  static log_level level_of(const bus::cache_write_finished&) noexcept { return log_level::debug; }
  void on(const bus::cache_write_finished& e) {
    log_->log(level_of(e), "write finished: {} keys ok, {} abandoned", e.succeeded_keys, e.failed_keys);
  }

  static log_level level_of(const bus::l2_store_submitted&) noexcept { return log_level::debug; }
  void on(const bus::l2_store_submitted& e) {
    log_->log(level_of(e), "L2 store submitted: {} keys ({} bytes) to backend {} ({})", e.key_count, e.bytes,
              e.backend_index, e.backend.view());
  }
  static log_level level_of(const bus::l2_store_completed& e) noexcept {
    return e.failed_count ? log_level::warn : log_level::debug;
  }
  void on(const bus::l2_store_completed& e) {
    log_->log(level_of(e), "L2 store completed: backend {} ({}), {} succeeded, {} failed, {:.3f} ms", e.backend_index,
              e.backend.view(), e.succeeded_count, e.failed_count, static_cast<double>(e.duration_ns) * 1e-6);
  }
  static log_level level_of(const bus::l2_prefetch_lookup_submitted&) noexcept { return log_level::debug; }
  void on(const bus::l2_prefetch_lookup_submitted& e) {
    log_->log(level_of(e), "L2 prefetch {} lookup submitted: {} keys to {} backends", e.request_id, e.key_count,
              e.backend_count);
  }
  static log_level level_of(const bus::l2_prefetch_lookup_completed&) noexcept { return log_level::debug; }
  void on(const bus::l2_prefetch_lookup_completed& e) {
    log_->log(level_of(e), "L2 prefetch {} lookup completed: {} of {} keys in the L2 prefix", e.request_id, e.hit_count,
              e.key_count);
  }
  static log_level level_of(const bus::l2_prefetch_load_submitted&) noexcept { return log_level::debug; }
  void on(const bus::l2_prefetch_load_submitted& e) {
    log_->log(level_of(e), "L2 prefetch {} load submitted: {} keys in {} tasks, {} trimmed", e.request_id, e.key_count,
              e.backend_count, e.trimmed_count);
  }
  static log_level level_of(const bus::l2_prefetch_load_completed& e) noexcept {
    return e.failed_count ? log_level::warn : log_level::debug;
  }
  void on(const bus::l2_prefetch_load_completed& e) {
    log_->log(level_of(e), "L2 prefetch {} load completed: {} loaded, {} failed, {:.3f} ms", e.request_id,
              e.loaded_count, e.failed_count, static_cast<double>(e.duration_ns) * 1e-6);
  }
  static log_level level_of(const bus::l2_prefetch_failed&) noexcept { return log_level::warn; }
  void on(const bus::l2_prefetch_failed& e) {
    log_->log(level_of(e), "L2 prefetch {} could not deliver {} keys: {}", e.request_id, e.key_count,
              bus::name(e.reason));
  }
  static log_level level_of(const bus::l2_prefetch_declined&) noexcept { return log_level::debug; }
  void on(const bus::l2_prefetch_declined& e) {
    log_->log(level_of(e), "L2 prefetch {} declined {} keys ({} tokens): {}; {} keys loaded as a probe",
              e.request_id, e.key_count, e.tokens, bus::name(e.reason), e.probe_key_count);
  }
  static log_level level_of(const bus::l2_backend_load_completed&) noexcept { return log_level::debug; }
  void on(const bus::l2_backend_load_completed& e) {
    log_->log(level_of(e), "L2 backend {} ({}) load: {} of {} keys, {} bytes, {:.3f} ms", e.backend_index,
              e.backend.view(), e.loaded_count, e.key_count, e.bytes, static_cast<double>(e.duration_ns) * 1e-6);
  }

  static log_level level_of(const bus::server_request_started&) noexcept { return log_level::trace; }
  void on(const bus::server_request_started& e) {
    log_->log(level_of(e), "request {} from client {} started", bus::name(e.kind), e.client_id);
  }
  static log_level level_of(const bus::server_request_finished& e) noexcept {
    return e.ok ? log_level::trace : log_level::warn;
  }
  void on(const bus::server_request_finished& e) {
    if (e.ok) {
      log_->log(level_of(e), "request {} from client {} succeeded in {:.3f} ms", bus::name(e.kind), e.client_id,
                static_cast<double>(e.duration_ns) * 1e-6);
      return;
    }
    // Failures are a client's misbehaviour as often as the server's: throttled per request
    // kind (a client that sends 20,000 bad frames makes a few lines, not 20,000).
    if (auto hidden = request_failures_->by_kind[static_cast<std::size_t>(e.kind)].allow())
      log_->log(
          level_of(e), "request {} from client {} failed in {:.3f} ms{}", bus::name(e.kind), e.client_id,
          static_cast<double>(e.duration_ns) * 1e-6,
          *hidden ? fmt::format(" ({} more {} requests failed since)", *hidden, bus::name(e.kind)) : std::string());
  }

  static log_level level_of(const bus::connector_healthy&) noexcept { return log_level::info; }
  void on(const bus::connector_healthy& e) {
    log_->log(level_of(e), "connector rank {}: server healthy{}", e.rank,
              e.unhealthy_ns ? fmt::format(" again after {:.3f} s", static_cast<double>(e.unhealthy_ns) * 1e-9) : "");
  }
  static log_level level_of(const bus::connector_unhealthy&) noexcept { return log_level::warn; }
  void on(const bus::connector_unhealthy& e) {
    log_->log(level_of(e), "connector rank {}: server unhealthy ({}), degraded mode: {} pending requests released",
              e.rank, e.reason.view(), e.released_requests);
  }
  static log_level level_of(const bus::connector_reconnected&) noexcept { return log_level::info; }
  void on(const bus::connector_reconnected& e) {
    log_->log(level_of(e), "connector rank {}: reconnected{}", e.rank,
              e.server_restarted ? " to a restarted server, KV region registered again" : "");
  }
  static log_level level_of(const bus::connector_lookup_completed& e) noexcept {
    return e.outcome == bus::connector_outcome::ok ? log_level::debug : log_level::warn;
  }
  void on(const bus::connector_lookup_completed& e) {
    log_->log(level_of(e), "connector rank {}: lookup {}: {} of {} chunks hit, {:.3f} ms", e.rank, bus::name(e.outcome),
              e.hit_chunks, e.requested_chunks, static_cast<double>(e.duration_ns) * 1e-6);
  }
  static log_level level_of(const bus::connector_retrieve_completed& e) noexcept {
    return e.outcome == bus::connector_outcome::ok ? log_level::debug : log_level::warn;
  }
  void on(const bus::connector_retrieve_completed& e) {
    log_->log(level_of(e), "connector rank {}: retrieve {}: {} of {} chunks, {} load-error blocks, {:.3f} ms", e.rank,
              bus::name(e.outcome), e.retrieved_chunks, e.requested_chunks, e.load_error_blocks,
              static_cast<double>(e.duration_ns) * 1e-6);
  }
  static log_level level_of(const bus::connector_store_completed& e) noexcept {
    return e.outcome == bus::connector_outcome::ok ? log_level::debug : log_level::warn;
  }
  void on(const bus::connector_store_completed& e) {
    log_->log(level_of(e), "connector rank {}: store {}: {} chunks asked, {} stored, {} present, {} failed, {:.3f} ms",
              e.rank, bus::name(e.outcome), e.requested_chunks, e.stored_chunks, e.already_present_chunks,
              e.failed_chunks, static_cast<double>(e.duration_ns) * 1e-6);
  }
  static log_level level_of(const bus::connector_load_error&) noexcept { return log_level::warn; }
  void on(const bus::connector_load_error& e) {
    log_->log(level_of(e), "connector rank {}: {} blocks are load errors ({}), the engine recomputes them", e.rank,
              e.block_count, bus::name(e.reason));
  }
  static log_level level_of(const bus::connector_peer_refused&) noexcept { return log_level::warn; }
  void on(const bus::connector_peer_refused& e) {
    // Every reconnection attempt is refused again: a few lines, then one per interval.
    if (auto hidden = request_failures_->peer_refused.allow())
      log_->log(level_of(e),
                "connector rank {}: refused the server: its process (pid {}) runs as uid {}, not uid {} "
                "(connector_options::server_uid); nothing was sent to it{}",
                e.rank, e.peer_pid, e.peer_uid, e.expected_uid,
                *hidden ? fmt::format(" ({} more refusals since)", *hidden) : std::string());
  }
  static log_level level_of(const bus::connector_quarantine_changed& e) noexcept {
    return e.held_blocks ? log_level::warn : log_level::info;
  }
  void on(const bus::connector_quarantine_changed& e) {
    log_->log(level_of(e), "connector rank {}: quarantine +{} -{} blocks, {} quarantined", e.rank, e.held_blocks,
              e.released_blocks, e.quarantined_blocks);
  }

  /// The bus's filter (bus::filters): an event is queued for this subscriber only when the
  /// logger's level writes it, so at level info a lookup takes no queue slot and does not
  /// wake the drain thread. A level lowered later applies to the events published after it.
  /// (Declared after every level_of: its constraint looks them up where it stands.)
  template <class E>
  requires requires(const E& e) { level_of(e); }
  [[nodiscard]] bool wants(const E& e) const noexcept { return log_->enabled(level_of(e)); }

 private:
  /// Five lines per request kind per 10 s; shared so the subscriber stays copyable.
  struct request_throttles {
    std::deque<log_throttle> by_kind;  // (a deque: log_throttle holds a mutex and does not move)
    log_throttle peer_refused{std::chrono::seconds(60), 3};
    request_throttles() {
      for (std::size_t i = 0; i < bus::request_kind_count; ++i) by_kind.emplace_back(std::chrono::seconds(10), 5);
    }
  };

  logger* log_;
  std::shared_ptr<request_throttles> request_failures_;
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
