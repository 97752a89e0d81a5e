#pragma once
// Umbrella header: everything of kvtier::kvtier. Not here, because their targets add a
// dependency: core/token_hasher.hpp and engine/ (kvtier::engine, OpenSSL's libcrypto), io/
// and l2/disk/ (kvtier::uring, liburing), l2/redis/ (kvtier::redis, hiredis), cuda/
// (kvtier::cuda, the CUDA runtime) and server/ (kvtier::server, nlohmann/json); include
// those on their own.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/version.hpp>

#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/kv_transfer.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/slot_allocator.hpp>

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/event_type.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/bus/null_bus.hpp>

#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/policy/arc.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l1/policy/s3fifo.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l1/tier.hpp>

#include <kvtier/l2/any_backend.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/types.hpp>

#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/pipeline/load_or_recompute.hpp>
#include <kvtier/pipeline/plan.hpp>
#include <kvtier/pipeline/policies.hpp>
#include <kvtier/pipeline/prefetch_controller.hpp>
#include <kvtier/pipeline/store_controller.hpp>
#include <kvtier/pipeline/work_tracker.hpp>

#include <kvtier/cache/copy.hpp>
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/cache/traits.hpp>

#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/counter.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/gauge.hpp>
#include <kvtier/telemetry/histogram.hpp>
#include <kvtier/telemetry/logger.hpp>
#include <kvtier/telemetry/logging_subscriber.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/field.hpp>
#include <kvtier/protocol/frame.hpp>
#include <kvtier/protocol/frame_decoder.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>
#include <kvtier/protocol/unix_socket.hpp>
