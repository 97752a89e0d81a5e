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
  b.publish(bus::l1_read_finished{1});  // trace: below the level
  CHECK(c.lines.empty());                // deferred
  CHECK(b.drain() == 3);
  REQUIRE(c.lines.size() == 2);
  CHECK(c.lines[0].first == log_level::debug);
  CHECK(c.lines[0].second.find("L2 store completed: backend 0 (disk), 3 succeeded, 0 failed, 1.500 ms") !=
        std::string::npos);
  CHECK(c.lines[1].first == log_level::warn);
  CHECK(c.lines[1].second.find("L2 prefetch 7 could not deliver 2 keys: timeout") != std::string::npos);
  CHECK(c.lines[1].second.find(" warn  test: ") != std::string::npos);
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
