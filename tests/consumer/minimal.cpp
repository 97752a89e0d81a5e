// A consumer of kvtier::kvtier alone (issue 16): an L1 tier publishing on a bus whose metrics
// subscriber counts into a registry, the tier's usage collected as gauges, and the Prometheus
// exposition checked. Built where OpenSSL, liburing and hiredis are hidden from the configure
// and their headers fail to compile (tests/consumer/run_consumer.cmake, PROGRAM=minimal), and
// the binary must not need libcrypto, liburing or libhiredis.
#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>
#include <kvtier/telemetry/registry.hpp>
#include <kvtier/version.hpp>

#include <cstdio>
#include <span>
#include <string>
#include <vector>

int main() {
  using namespace kvtier;
  telemetry::registry reg;
  using event_bus = bus::basic_event_bus<telemetry::metrics_subscriber>;
  event_bus events{telemetry::metrics_subscriber{reg}};

  l1::tier_options options;
  options.slot_bytes = 4096;
  options.slot_count = 8;
  l1::tier<l1::lru, event_bus> tier(options, events);
  telemetry::collect_l1(reg, tier);

  const std::vector<chunk_key> keys{chunk_key{1, 1, 0, {1, 0}}, chunk_key{1, 1, 0, {2, 0}}};
  std::vector<l1::status> out(keys.size());
  std::vector<std::span<std::byte>> buffers(keys.size());
  tier.reserve_write(keys, 1000, {}, out, buffers);
  for (auto& b : buffers) b[0] = std::byte{42};
  tier.finish_write(keys, out);

  const std::string text = telemetry::prometheus_text(reg);
  const bool ok = tier.contains(keys[0]) && tier.contains(keys[1]) &&
                  text.find("kvtier_l1_write_keys_total 2\n") != std::string::npos &&
                  text.find("kvtier_l1_objects 2\n") != std::string::npos;
  if (!ok) {
    std::printf("kvtier minimal consumer FAILED:\n%s\n", text.c_str());
    return 1;
  }
  std::printf("kvtier consumer ok: kvtier %s, L1 + bus + telemetry\n", version_string);
  return 0;
}
