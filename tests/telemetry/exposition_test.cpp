#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include "support/process.hpp"

#include <fstream>
#include <memory>
#include <string>

using namespace kvtier::telemetry;

TEST_CASE("exposition writes HELP, TYPE and samples in the text format", "[telemetry][exposition]") {
  registry reg;
  reg.add_counter("kvtier_test_keys_total", "Keys seen").inc(3);
  reg.add_gauge("kvtier_test_bytes", "Bytes used", {{"tier", "l1"}}).set(4096);
  reg.add_callback("kvtier_test_ratio", "A callback gauge", metric_type::gauge, {}, [] { return 0.25; });
  CHECK(prometheus_text(reg) ==
        "# HELP kvtier_test_keys_total Keys seen\n"
        "# TYPE kvtier_test_keys_total counter\n"
        "kvtier_test_keys_total 3\n"
        "# HELP kvtier_test_bytes Bytes used\n"
        "# TYPE kvtier_test_bytes gauge\n"
        "kvtier_test_bytes{tier=\"l1\"} 4096\n"
        "# HELP kvtier_test_ratio A callback gauge\n"
        "# TYPE kvtier_test_ratio gauge\n"
        "kvtier_test_ratio 0.25\n");
}

TEST_CASE("histograms expose cumulative buckets with +Inf, _sum and _count", "[telemetry][exposition]") {
  registry reg;
  auto& h = reg.add_histogram("kvtier_test_seconds", "Latency", {0.1, 1.0}, {{"backend", "disk"}});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(3.0);
  CHECK(prometheus_text(reg) ==
        "# HELP kvtier_test_seconds Latency\n"
        "# TYPE kvtier_test_seconds histogram\n"
        "kvtier_test_seconds_bucket{backend=\"disk\",le=\"0.1\"} 1\n"
        "kvtier_test_seconds_bucket{backend=\"disk\",le=\"1\"} 2\n"
        "kvtier_test_seconds_bucket{backend=\"disk\",le=\"+Inf\"} 3\n"
        "kvtier_test_seconds_sum{backend=\"disk\"} 3.55\n"
        "kvtier_test_seconds_count{backend=\"disk\"} 3\n");
}

TEST_CASE("label values and help text are escaped", "[telemetry][exposition]") {
  registry reg;
  reg.add_counter("kvtier_test_total", "Help with \\ and\nnewline", {{"name", "a\"b\\c\nd"}}).inc();
  const std::string text = prometheus_text(reg);
  CHECK(text.find("# HELP kvtier_test_total Help with \\\\ and\\nnewline\n") != std::string::npos);
  CHECK(text.find("kvtier_test_total{name=\"a\\\"b\\\\c\\nd\"} 1\n") != std::string::npos);
}

TEST_CASE("registry rejects names and reuse that would make invalid output", "[telemetry][registry]") {
  registry reg;
  CHECK_THROWS_AS(reg.add_counter("kvtier_no_suffix", "x"), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_gauge("kvtier_bad_total", "x"), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_counter("9starts_with_digit_total", "x"), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_counter("kvtier_x_total", "x", {{"bad-label", "v"}}), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_histogram("kvtier_h", "x", {1.0}, {{"le", "v"}}), std::invalid_argument);
  auto& a = reg.add_counter("kvtier_x_total", "x", {{"k", "1"}});
  CHECK(&reg.add_counter("kvtier_x_total", "x", {{"k", "1"}}) == &a);  // idempotent
  CHECK(&reg.add_counter("kvtier_x_total", "x", {{"k", "2"}}) != &a);  // another child
  CHECK_THROWS_AS(reg.add_gauge("kvtier_x_total", "x"), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_counter("kvtier_x_total", "other help", {{"k", "1"}}), std::invalid_argument);
  CHECK_THROWS_AS(reg.add_counter("kvtier_x_total", "x", {{"j", "1"}}), std::invalid_argument);
  a.inc(5);
  CHECK(reg.value("kvtier_x_total", {{"k", "1"}}) == 5.0);
  CHECK_FALSE(reg.value("kvtier_missing_total").has_value());
}

TEST_CASE("a collector group's snapshot is taken once per scrape, before its callbacks read it",
          "[telemetry][registry]") {
  registry reg;
  int source = 1;
  int reads = 0;
  auto snap = make_scrape_snapshot([&] {
    ++reads;
    return source;
  });
  CHECK(reads == 1);  // taken at construction, for registration
  for (const char* name : {"kvtier_a", "kvtier_b", "kvtier_c"})
    reg.add_callback(
        name, "x", metric_type::gauge, {}, [snap] { return static_cast<double>(snap->get()); }, snap);
  source = 7;
  const std::string text = prometheus_text(reg);
  CHECK(reads == 2);  // one refresh for three gauges
  CHECK(text.find("kvtier_a 7\n") != std::string::npos);
  CHECK(text.find("kvtier_c 7\n") != std::string::npos);
  source = 8;
  CHECK(reg.value("kvtier_b") == 8.0);  // value() refreshes the group it reads
  CHECK(reads == 3);
  // Callbacks registered again without the hook drop it: the registry no longer refreshes it.
  const std::weak_ptr<scrape_hook> gone = snap;
  snap.reset();
  for (const char* name : {"kvtier_a", "kvtier_b", "kvtier_c"})
    reg.add_callback(name, "x", metric_type::gauge, {}, [] { return 0.0; });
  CHECK(gone.expired());
  CHECK(prometheus_text(reg).find("kvtier_a 0\n") != std::string::npos);
  CHECK(reads == 3);
}

#ifdef KVTIER_PROMTOOL
TEST_CASE("promtool accepts the full metrics exposition", "[telemetry][exposition][promtool]") {
  registry reg;
  metrics_subscriber m(reg);
  m.declare_backend(0, "disk");
  m.on(kvtier::bus::l2_store_completed{0, "disk", 3, 1, 4096, 2'000'000});
  m.on(kvtier::bus::server_request_finished{kvtier::bus::request_kind::lookup, 1, true, 50'000});
  reg.add_counter("kvtier_test_escape_total", "Escapes \\ \n", {{"v", "q\"\\\n"}}).inc();
  kvtier::test::temp_dir dir;
  const auto file = dir.path() / "metrics.txt";
  std::ofstream(file) << prometheus_text(reg);
  const auto r = kvtier::test::run_command(std::string(KVTIER_PROMTOOL) + " check metrics < " + file.string());
  INFO(r.output);
  CHECK(r.exit_code == 0);
}

TEST_CASE("promtool rejects broken exposition, so the check above can fail", "[telemetry][exposition][promtool]") {
  kvtier::test::temp_dir dir;
  const auto file = dir.path() / "bad.txt";
  std::ofstream(file) << "# TYPE kvtier_broken_total counter\nkvtier_broken_total{le=\"x\" 1\n";
  const auto r = kvtier::test::run_command(std::string(KVTIER_PROMTOOL) + " check metrics < " + file.string());
  CHECK(r.exit_code != 0);
}
#endif
