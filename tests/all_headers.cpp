// One translation unit that includes every header of kvtier::kvtier and kvtier::engine, linked
// into a test binary beside others that include the same headers: a non-inline definition in
// a header would fail the link (ODR).
#include <kvtier/kvtier.hpp>

// kvtier::engine's headers (OpenSSL), which the umbrella leaves out.
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/connector.hpp>
#include <kvtier/engine/finished_tracker.hpp>
#include <kvtier/engine/health.hpp>
#include <kvtier/engine/options.hpp>
#include <kvtier/engine/quarantine.hpp>

// kv_events/: vLLM's KV event format, standard library only (its publisher.hpp needs libzmq,
// which this binary does not link: tests/kv_events/ and the header check compile it).
#include <kvtier/kv_events/msgpack_writer.hpp>
#include <kvtier/kv_events/vllm_format.hpp>

#include <catch2/catch.hpp>

TEST_CASE("the umbrella header exposes the library and its version", "[odr]") {
  CHECK(std::string(kvtier::version_string) ==
        std::to_string(kvtier::version_major) + "." + std::to_string(kvtier::version_minor) + "." +
            std::to_string(kvtier::version_patch));
  kvtier::telemetry::registry reg;
  kvtier::telemetry::logger log(kvtier::telemetry::log_level::off);
  kvtier::default_event_bus bus{kvtier::telemetry::metrics_subscriber{reg},
                                kvtier::telemetry::logging_subscriber{log}};
  bus.publish(kvtier::bus::l1_write_finished{2});
  CHECK(reg.value("kvtier_l1_write_keys_total") == 2.0);
}
