#include <kvtier/engine/health.hpp>

#include <catch2/catch.hpp>

#include <chrono>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_health_test {

using namespace std::chrono_literals;
using kvtier::engine::backoff;
using kvtier::engine::breaker;

TEST_CASE("reconnection backoff doubles up to its cap and starts over after a success", "[engine][health]") {
  backoff b(50ms, 400ms);
  CHECK(b.next() == 50ms);
  CHECK(b.next() == 100ms);
  CHECK(b.next() == 200ms);
  CHECK(b.next() == 400ms);
  CHECK(b.next() == 400ms);
  b.reset();
  CHECK(b.next() == 50ms);
  CHECK_THROWS_AS(backoff(0ms, 1s), std::invalid_argument);
  CHECK_THROWS_AS(backoff(2s, 1s), std::invalid_argument);
}

TEST_CASE("the breaker trips on consecutive timeouts only", "[engine][health]") {
  breaker b(3);
  CHECK_FALSE(b.on_timeout());
  CHECK_FALSE(b.on_timeout());
  b.on_reply();  // the server did some work: start over
  CHECK_FALSE(b.on_timeout());
  CHECK_FALSE(b.on_timeout());
  CHECK(b.on_timeout());
  CHECK(b.consecutive_timeouts() == 3);
  b.reset();
  CHECK(b.consecutive_timeouts() == 0);
}

TEST_CASE("health states have names", "[engine][health]") {
  CHECK(kvtier::engine::name(kvtier::engine::health_state::unhealthy) == "unhealthy");
  CHECK(kvtier::engine::name(kvtier::engine::health_state::healthy) == "healthy");
}

}  // namespace file_health_test
