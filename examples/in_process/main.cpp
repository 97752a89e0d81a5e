// In-process example: wire an event bus with the metrics subscriber (inline, exact) and the
// logging subscriber (deferred, on the bus's drain thread), publish the events one engine
// request produces as it flows through L1 and L2, and print the Prometheus exposition.
//
//   kvtier_example_in_process [--log-level debug]
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/kvtier.hpp>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  using namespace kvtier;
  auto level = telemetry::log_level::info;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--log-level") == 0) {
      if (auto l = telemetry::parse_log_level(argv[i + 1]))
        level = *l;
      else {
        std::fprintf(stderr, "unknown log level '%s': use trace, debug, info, warn, error or off\n", argv[i + 1]);
        return 2;
      }
    }

  telemetry::registry registry;
  telemetry::logger log(level, "in_process");
  default_event_bus events{telemetry::metrics_subscriber{registry}, telemetry::logging_subscriber{log}};
  telemetry::collect_bus(registry, events);
  events.publish(bus::cache_backend_attached{0, "disk"});  // as a tiered_cache does for its backends
  events.start_drain_thread();

  // A 10,000-token prompt of a 0.5B-class model: 39 full chunks of 256 tokens (3 MiB each).
  const model_shape shape{24, 2, 64, dtype_kind::bf16, attention_kind::mha};
  const chunk_layout layout{shape, 256};
  const token_hasher hasher(layout.chunk_tokens);
  std::vector<token_id> prompt(10'000);
  std::iota(prompt.begin(), prompt.end(), 1000u);
  const auto hashes = hasher.chunk_hashes(prompt);
  const auto chunks = static_cast<std::uint32_t>(hashes.size());
  const std::uint64_t bytes = std::uint64_t{chunks} * layout.object_bytes();
  std::printf("prompt: %zu tokens -> %u chunks of %zu bytes; first key %s\n\n", prompt.size(), chunks,
              layout.object_bytes(),
              chunk_key{make_model_id("Qwen/Qwen2.5-0.5B", shape), 1, 0, hashes.front()}.to_string().c_str());

  // 1. First time: a miss everywhere, then the engine's prefill is stored: L1, then L2.
  events.publish(bus::server_request_started{bus::request_kind::lookup, 1});
  events.publish(bus::cache_lookup{1, chunks * 256, chunks, 0, 0, 256});
  events.publish(bus::l2_prefetch_lookup_submitted{1, chunks, 1});
  events.publish(bus::l2_prefetch_lookup_completed{1, chunks, 0});
  events.publish(bus::server_request_finished{bus::request_kind::lookup, 1, true, 80'000});
  events.publish(bus::l1_write_reserved{chunks, 0, bus::allocation_purpose::store});
  events.publish(bus::cache_write_reserved{chunks, 0});
  events.publish(bus::l1_write_finished{chunks});
  events.publish(bus::cache_write_finished{chunks, 0});
  events.publish(bus::l1_read_reserved{chunks, 0, chunks});
  events.publish(bus::l2_store_submitted{0, "disk", chunks, bytes});
  events.publish(bus::l2_store_completed{0, "disk", chunks, 0, bytes, 90'000'000});
  events.publish(bus::l1_read_finished{chunks, chunks});

  // 2. Memory pressure: L1 evicts the prompt; it stays on disk.
  events.publish(bus::l1_keys_evicted{chunks, bytes, bus::removal_reason::evicted});

  // 3. The same prompt again: an L2 hit, prefetched into L1 and read by the engine.
  events.publish(bus::cache_lookup{2, chunks * 256, chunks, 0, chunks, 256});
  events.publish(bus::l2_prefetch_lookup_submitted{2, chunks, 1});
  events.publish(bus::l2_prefetch_lookup_completed{2, chunks, chunks});
  events.publish(bus::l1_write_reserved{chunks, 0, bus::allocation_purpose::prefetch});
  events.publish(bus::l2_prefetch_load_submitted{2, chunks, 1, 0, bytes});
  events.publish(bus::l2_backend_load_completed{0, "disk", chunks, chunks, bytes, 60'000'000});
  events.publish(bus::l1_write_finished_and_read_reserved{chunks, chunks});
  events.publish(bus::l2_prefetch_load_completed{2, chunks, 0, bytes, 61'000'000});
  events.publish(bus::cache_read_prefetched{chunks, 0});
  events.publish(bus::l1_read_finished{chunks, chunks});
  events.publish(bus::l1_keys_evicted{chunks, bytes, bus::removal_reason::temporary});

  events.stop_drain_thread();  // delivers the log lines still queued
  std::printf("%s", telemetry::prometheus_text(registry).c_str());
  return 0;
}
