#pragma once
// Test support for the connector's tests: the bus they record on, options with generous
// deadlines, and a harness that runs a scripted fake server (fake_server.hpp) next to a
// worker's connector.

#include <kvtier/engine/connector.hpp>

#include "engine/event_recorder.hpp"
#include "engine/fake_server.hpp"
#include "support/process.hpp"

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvtier::test {

using namespace std::chrono_literals;

/// Tokens per chunk in the connector's tests: 2 blocks of 4 tokens.
inline constexpr std::uint32_t connector_chunk_tokens = 8;

// Metrics first: by the time the recorder wakes a waiting test, the metrics are updated.
using connector_test_bus = bus::basic_event_bus<telemetry::metrics_subscriber, event_recorder>;

/// A bus that records every event and counts it in a metrics registry.
struct recording_bus {
  telemetry::registry reg;
  event_recorder rec;
  connector_test_bus bus{telemetry::metrics_subscriber{reg}, rec};
};

/// Options for a connector of the server at `path`. Generous deadlines everywhere a test
/// does not provoke a timeout: a loaded machine must not turn a healthy server unhealthy.
inline engine::connector_options connector_test_options(std::string path, std::uint16_t rank = 0,
                                                        std::uint16_t world_size = 1) {
  engine::connector_options o;
  o.socket_path = std::move(path);
  o.rank = rank;
  o.world_size = world_size;
  o.model_name = "test-model";
  o.chunk_tokens = connector_chunk_tokens;
  o.timeouts.ping_interval = 20ms;
  o.timeouts.ping_timeout = 10s;
  o.timeouts.request_timeout = 10s;
  o.timeouts.lookup_timeout = 60s;
  o.timeouts.retrieve_timeout = 30s;
  o.timeouts.store_timeout = 30s;
  o.timeouts.reconnect_initial = 5ms;
  o.timeouts.reconnect_max = 100ms;
  return o;
}

/// A fake server on a socket in a temporary directory, a KV region of `layout` and a
/// recording bus; connect() adds a worker's connector.
struct connector_harness : recording_bus {
  explicit connector_harness(const paged_kv_layout& layout) : region(make(layout)) {}

  temp_dir dir{"kvtier-engine"};
  std::string path = (dir.path() / "server.sock").string();
  kv_region region;
  std::unique_ptr<fake_server> server;

  void start_server(std::uint32_t chunk_tokens = connector_chunk_tokens) {
    server = std::make_unique<fake_server>(path, chunk_tokens);
    server->start();
  }

  [[nodiscard]] engine::connector_options options(std::uint16_t rank = 0, std::uint16_t world_size = 1) const {
    return connector_test_options(path, rank, world_size);
  }

  /// Starts the server (unless running) and a worker's connector with `o` (default:
  /// options()) on the region, registered.
  engine::connector<connector_test_bus>& connect(std::optional<engine::connector_options> o = std::nullopt) {
    if (!server) start_server();
    conn.emplace(o ? std::move(*o) : options(), region, bus);
    REQUIRE(conn->wait_ready(60s));
    return *conn;
  }

  template <class Pred>
  bool wait(Pred pred) {
    return rec.wait(pred);
  }

  /// The connector of connect(); declared last, so it goes first.
  std::optional<engine::connector<connector_test_bus>> conn;

 private:
  static kv_region make(const paged_kv_layout& layout) {
    auto r = kv_region::create(layout);
    if (!r) throw std::runtime_error("kv_region::create failed");
    return std::move(*r);
  }
};

}  // namespace kvtier::test
