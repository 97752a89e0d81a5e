#include <kvtier/telemetry/counter.hpp>
#include <kvtier/telemetry/gauge.hpp>
#include <kvtier/telemetry/histogram.hpp>

#include <catch2/catch.hpp>

#include <thread>
#include <vector>

using namespace kvtier::telemetry;

TEST_CASE("counter adds exactly", "[telemetry][counter]") {
  counter c;
  CHECK(c.value() == 0);
  c.inc();
  c.inc(41);
  CHECK(c.value() == 42);
}

TEST_CASE("gauge sets, adds and subtracts", "[telemetry][gauge]") {
  gauge g;
  g.set(10);
  g.add(2.5);
  g.sub(0.5);
  CHECK(g.value() == Approx(12.0));
}

TEST_CASE("histogram puts values in the first bucket whose bound is not below them", "[telemetry][histogram]") {
  histogram h({1.0, 2.0, 5.0});
  for (double v : {0.5, 1.0, 1.5, 2.0, 4.0, 9.0}) h.observe(v);
  const auto s = h.snapshot();
  CHECK(s.counts == std::vector<std::uint64_t>{2, 2, 1, 1});  // le=1, le=2, le=5, +Inf
  CHECK(s.count() == 6);
  CHECK(s.sum == Approx(18.0));
  CHECK_THROWS_AS(histogram({2.0, 1.0}), std::invalid_argument);
  CHECK_THROWS_AS(histogram({1.0, 1.0}), std::invalid_argument);
}

TEST_CASE("counters and histograms lose nothing when threads exit and their shards are reused",
          "[telemetry][concurrency]") {
  counter c;
  histogram h({1.0});
  // More threads over time than there are shards, several alive at once.
  for (int round = 0; round < 5; ++round) {
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t)
      ts.emplace_back([&] {
        for (int i = 0; i < 10000; ++i) {
          c.inc();
          h.observe(0.5);
        }
      });
    for (auto& t : ts) t.join();
  }
  CHECK(c.value() == 5 * 8 * 10000);
  CHECK(h.snapshot().count() == 5 * 8 * 10000);
  CHECK(h.snapshot().sum == Approx(0.5 * 5 * 8 * 10000));
}

TEST_CASE("counters stay exact with more live threads than shards", "[telemetry][concurrency]") {
  counter c;
  constexpr int threads = 24;  // > detail::max_shards: some use the shared overflow cell
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) c.inc(2);
    });
  for (auto& t : ts) t.join();
  CHECK(c.value() == 2 * threads * 5000);
}
