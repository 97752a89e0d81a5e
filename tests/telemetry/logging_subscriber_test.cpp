#include <kvtier/telemetry/logging_subscriber.hpp>

#include <kvtier/bus/event_bus.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace kvtier;
using namespace kvtier::telemetry;

namespace {
struct captured {
  std::vector<std::pair<log_level, std::string>> lines;
};
logger capturing_logger(log_level level, captured& c) {
  return logger(level, "test", [&c](log_level l, std::string_view line) { c.lines.emplace_back(l, std::string(line)); });
}
}  // namespace

TEST_CASE("logging subscriber writes events at their level after a drain", "[telemetry][logging]") {
  captured c;
  logger log = capturing_logger(log_level::debug, c);
  bus::basic_event_bus<logging_subscriber> b{logging_subscriber{log}};
  b.publish(bus::l2_store_completed{0, "disk", 3, 0, 100, 1'500'000});
  b.publish(bus::l2_prefetch_failed{7, bus::prefetch_failure::timeout, 2});
  b.publish(bus::l1_read_finished{1});  // trace: below the level, so not even queued
  CHECK(c.lines.empty());                // deferred
  CHECK(b.drain() == 2);
  REQUIRE(c.lines.size() == 2);
  CHECK(c.lines[0].first == log_level::debug);
  CHECK(c.lines[0].second.find("L2 store completed: backend 0 (disk), 3 succeeded, 0 failed, 1.500 ms") !=
        std::string::npos);
  CHECK(c.lines[1].first == log_level::warn);
  CHECK(c.lines[1].second.find("L2 prefetch 7 could not deliver 2 keys: timeout") != std::string::npos);
  CHECK(c.lines[1].second.find(" warn  test: ") != std::string::npos);
}

static_assert(bus::filters<logging_subscriber, bus::server_request_finished> &&
              bus::filters<logging_subscriber, bus::l1_read_finished>);

TEST_CASE("the bus queues for the logging subscriber only what the logger's level writes", "[telemetry][logging]") {
  captured c;
  logger log = capturing_logger(log_level::info, c);
  bus::basic_event_bus<logging_subscriber> b{logging_subscriber{log}};
  // A served request at info: nothing queued, so nothing wakes a drain thread.
  b.publish(bus::server_request_started{bus::request_kind::lookup, 1});
  b.publish(bus::server_request_finished{bus::request_kind::lookup, 1, true, 20'000});
  b.publish(bus::cache_lookup{});
  CHECK(b.drain() == 0);
  // The same event type at a level the logger writes (a failed request: warn) is queued.
  b.publish(bus::server_request_finished{bus::request_kind::lookup, 1, false, 20'000});
  b.publish(bus::l2_store_completed{0, "disk", 3, 0, 100, 1'000});  // debug: not queued
  b.publish(bus::l2_store_completed{0, "disk", 2, 1, 100, 1'000});  // a failure: warn, queued
  CHECK(b.drain() == 2);
  REQUIRE(c.lines.size() == 2);
  CHECK(c.lines[0].second.find("request lookup from client 1 failed") != std::string::npos);
  CHECK(c.lines[1].second.find("2 succeeded, 1 failed") != std::string::npos);
  // Lowering the level applies to the events published after it.
  log.set_level(log_level::trace);
  b.publish(bus::server_request_started{bus::request_kind::lookup, 1});
  CHECK(b.drain() == 1);
  CHECK(c.lines.size() == 3);
  CHECK(b.dropped() == 0);  // skipped events are not drops
}

TEST_CASE("log levels parse and filter", "[telemetry][logging]") {
  CHECK(parse_log_level("warning") == log_level::warn);
  CHECK_FALSE(parse_log_level("loud").has_value());
  captured c;
  logger log = capturing_logger(log_level::warn, c);
  log.info("hidden {}", 1);
  log.error("shown {}", 2);
  log.set_level(log_level::off);
  log.error("hidden too");
  REQUIRE(c.lines.size() == 1);
  CHECK(c.lines[0].second.ends_with("error test: shown 2"));
}

TEST_CASE("log_throttle lets one message through per interval and counts the rest", "[telemetry][logging]") {
  using clock = std::chrono::steady_clock;
  log_throttle t(std::chrono::seconds(10));
  const auto t0 = clock::now();
  CHECK(t.allow(t0) == std::optional<std::uint64_t>(0));
  CHECK_FALSE(t.allow(t0 + std::chrono::seconds(1)).has_value());
  CHECK_FALSE(t.allow(t0 + std::chrono::seconds(2)).has_value());
  CHECK(t.allow(t0 + std::chrono::seconds(11)) == std::optional<std::uint64_t>(2));
}

TEST_CASE("log_throttle with a burst lets that many through per interval", "[telemetry][logging]") {
  using clock = std::chrono::steady_clock;
  log_throttle t(std::chrono::seconds(10), 3);
  const auto t0 = clock::now();
  for (int i = 0; i < 3; ++i) CHECK(t.allow(t0 + std::chrono::milliseconds(i)) == std::optional<std::uint64_t>(0));
  for (int i = 0; i < 5; ++i) CHECK_FALSE(t.allow(t0 + std::chrono::seconds(1)).has_value());
  CHECK(t.allow(t0 + std::chrono::seconds(10)) == std::optional<std::uint64_t>(5));
  CHECK(t.allow(t0 + std::chrono::seconds(11)) == std::optional<std::uint64_t>(0));
}

TEST_CASE("failed requests are logged a few per kind and interval, the rest counted", "[telemetry][logging]") {
  captured c;
  logger log = capturing_logger(log_level::info, c);
  bus::basic_event_bus<logging_subscriber> b{logging_subscriber{log}};
  for (int i = 0; i < 20000; ++i) {
    b.publish(bus::server_request_finished{bus::request_kind::other, 3, false, 1000});
    if (i % 100 == 99) b.drain();  // (the deferred queue is bounded)
  }
  b.publish(bus::server_request_finished{bus::request_kind::lookup, 3, false, 1000});  // its own kind
  b.publish(bus::connector_peer_refused{0, 65534, 4242, 0});
  b.drain();
  // Five "other" lines (the burst), one lookup line, one refusal line: not 20,002.
  std::size_t other = 0, lookup = 0, refused = 0;
  for (const auto& [level, line] : c.lines) {
    other += line.find("request other") != std::string::npos;
    lookup += line.find("request lookup") != std::string::npos;
    refused += line.find("runs as uid 65534, not uid 0") != std::string::npos;
  }
  CHECK(other == 5);
  CHECK(lookup == 1);
  CHECK(refused == 1);
  CHECK(c.lines.size() == 7);
}
