#pragma once
// Forward declarations of kvtier's main types and the default aliases hosts use.

#include <kvtier/config.hpp>

namespace kvtier::inline KVTIER_ABI_TAG {

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

/// The bus of a process that exports metrics (inline, exact) and writes logs (deferred).
using default_event_bus = bus::basic_event_bus<telemetry::metrics_subscriber, telemetry::logging_subscriber>;

}  // namespace kvtier::inline KVTIER_ABI_TAG
