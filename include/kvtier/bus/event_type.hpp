#pragma once
// event_type: every kind of event kvtier publishes, each with a stable dotted name (LMCache's
// where it has one, so their meaning carries over). Values and names are stable: append only.

#include <kvtier/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {

enum class event_type : std::uint16_t {
  // L1 tier (l1::tier)
  l1_read_reserved,
  l1_read_finished,
  l1_write_reserved,
  l1_write_finished,
  l1_write_finished_and_read_reserved,
  l1_keys_evicted,
  l1_allocation_failed,
  l1_lock_expired,
  // cache facade (cache::tiered_cache)
  cache_lookup,
  cache_read_prefetched,
  cache_write_reserved,
  cache_write_finished,
  // L2 store pipeline (per backend)
  l2_store_submitted,
  l2_store_completed,
  // L2 prefetch pipeline (per request, and per backend for loads)
  l2_prefetch_lookup_submitted,
  l2_prefetch_lookup_completed,
  l2_prefetch_load_submitted,
  l2_prefetch_load_completed,
  l2_prefetch_failed,
  l2_backend_load_completed,
  // cache server
  server_request_started,
  server_request_finished,
  // engine connector
  connector_healthy,
  connector_unhealthy,
  connector_reconnected,
  connector_lookup_completed,
  connector_retrieve_completed,
  connector_store_completed,
  connector_load_error,
  connector_quarantine_changed,
  connector_peer_refused,
  // L2 prefetch pipeline (appended: the load-or-recompute gate)
  l2_prefetch_declined,
  // cache facade, once per L2 backend at construction (appended: values are stable)
  cache_backend_attached,
  // what each tier holds, key by key (appended; built only when a subscriber wants them:
  // the KV events of issue 28, kv_events/)
  tier_keys_stored,
  tier_keys_removed,
  chunks_described,
};

inline constexpr std::size_t event_type_count = static_cast<std::size_t>(event_type::chunks_described) + 1;

namespace detail {
inline constexpr std::array<std::string_view, event_type_count> event_type_names = {
    "l1.read.reserved",
    "l1.read.finished",
    "l1.write.reserved",
    "l1.write.finished",
    "l1.write_finished_and_read_reserved",
    "l1.keys.evicted",
    "l1.allocation.failed",
    "l1.lock.expired",
    "cache.lookup",
    "cache.read.prefetched",
    "cache.write.reserved",
    "cache.write.finished",
    "l2.store.submitted",
    "l2.store.completed",
    "l2.prefetch.lookup.submitted",
    "l2.prefetch.lookup.completed",
    "l2.prefetch.load.submitted",
    "l2.prefetch.load.completed",
    "l2.prefetch.failed",
    "l2.backend.load.completed",
    "server.request.started",
    "server.request.finished",
    "connector.healthy",
    "connector.unhealthy",
    "connector.reconnected",
    "connector.lookup.completed",
    "connector.retrieve.completed",
    "connector.store.completed",
    "connector.load_error",
    "connector.quarantine.changed",
    "connector.peer.refused",
    "l2.prefetch.declined",
    "cache.backend.attached",
    "tier.keys.stored",
    "tier.keys.removed",
    "chunks.described",
};
}  // namespace detail

/// The stable dotted name, e.g. "l2.prefetch.load.completed".
[[nodiscard]] constexpr std::string_view name(event_type t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < event_type_count ? detail::event_type_names[i] : std::string_view{"unknown"};
}

/// The event type with that dotted name.
[[nodiscard]] constexpr std::optional<event_type> parse_event_type(std::string_view s) noexcept {
  for (std::size_t i = 0; i < event_type_count; ++i)
    if (detail::event_type_names[i] == s) return static_cast<event_type>(i);
  return std::nullopt;
}

}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
