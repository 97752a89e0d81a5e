#pragma once
// Forward declarations of kvtier's main types and the default aliases hosts use: those of
// the kvtier::kvtier target (as <kvtier/kvtier.hpp> includes them) and, as declarations only,
// kvtier::engine's token_hasher and engine:: types (defining them needs that target). Templates
// whose parameters are constrained by a concept are left out (a declaration would have to
// repeat the constraint); so are the io_uring, Redis, CUDA and server parts.

#include <kvtier/config.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

struct hash128;
struct chunk_key;
struct chunk_key_hash;
class bitmap;
class aligned_buffer;
class slot_allocator;
class token_hasher;
struct model_shape;
struct chunk_layout;
struct paged_kv_layout;
class kv_region;

namespace bus {
template <class... Subscribers>
class basic_event_bus;
struct null_bus;
}  // namespace bus

namespace l1 {
class lru;
class s3fifo;
class arc;
class noop;
struct tier_options;
/// The L1 tier (l1/tier.hpp); by default LRU eviction and no events.
template <class Policy = lru, class Bus = bus::null_bus>
class tier;
}  // namespace l1

namespace l2 {
struct memory_backend_options;
class memory_backend;
class any_backend;
struct fault;
}  // namespace l2

namespace pipeline {
struct prefetch_options;
struct prefetch_request;
struct prefetch_result;
struct store_options;
class work_tracker;
struct first_backend_plan;
struct write_through;
struct skip_l1;
struct admit_all;
struct best_effort;
struct wait_complete;
}  // namespace pipeline

namespace cache {
struct default_traits;
struct cache_options;
struct lookup_request;
struct cache_status;
/// The tiered cache (cache/tiered_cache.hpp); by default cache::default_traits.
template <class Traits>
class tiered_cache;
}  // namespace cache

namespace engine {
struct connector_options;
class finished_tracker;
class quarantine;
/// The engine worker's connector (engine/connector.hpp); by default it publishes nothing.
template <class Bus = bus::null_bus>
class connector;
}  // namespace engine

namespace telemetry {
class counter;
class gauge;
class histogram;
class registry;
class logger;
class metrics_subscriber;
class logging_subscriber;
}  // namespace telemetry

namespace kv_events {
class tier_key_relay;
}  // namespace kv_events

/// The bus of a process that exports metrics (inline, exact) and writes logs (deferred).
using default_event_bus = bus::basic_event_bus<telemetry::metrics_subscriber, telemetry::logging_subscriber>;
/// The cache server's bus: the default one, and the relay of the key events to the KV event
/// publisher (kv_events/tier_key_relay.hpp; it wants nothing until a publisher attaches).
using server_event_bus =
    bus::basic_event_bus<telemetry::metrics_subscriber, telemetry::logging_subscriber, kv_events::tier_key_relay>;

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
