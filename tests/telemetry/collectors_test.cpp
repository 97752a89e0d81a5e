// The collectors turn components' snapshots into series at scrape time: L1 (a real tier), the
// cache (a real tiered_cache at construction, then a scripted status), the bus. The I/O,
// disk and Redis collectors are checked against their real components in tests/io and
// tests/l2 (those need liburing and hiredis).
#include <kvtier/telemetry/collectors.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include <boost/asio/io_context.hpp>

#include <memory>
#include <string>
#include <vector>

using namespace kvtier;
using namespace kvtier::telemetry;

namespace {

chunk_key key(std::uint64_t i) { return chunk_key{7, 1, 0, hash128{i, i}}; }

/// A cache stand-in whose status the test scripts; counts the status() calls.
struct scripted_cache {
  cache::cache_status s;
  mutable std::size_t status_calls = 0;
  [[nodiscard]] cache::cache_status status() const {
    ++status_calls;
    return s;
  }
};

/// An L1 stand-in that counts the usage() calls.
struct counted_l1 {
  l1::usage_info u;
  mutable std::size_t usage_calls = 0;
  [[nodiscard]] l1::usage_info usage() const {
    ++usage_calls;
    return u;
  }
};

using metrics_bus = bus::basic_event_bus<metrics_subscriber>;

struct metrics_traits : cache::default_traits {
  using bus_type = metrics_bus;
};

}  // namespace

TEST_CASE("collect_l1 registers usage gauges read at scrape time", "[telemetry][collectors]") {
  l1::tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 8;
  l1::tier<> t(o);
  registry reg;
  collect_l1(reg, t, {{"tier", "l1"}});
  const label_pairs l{{"tier", "l1"}};
  CHECK(reg.value("kvtier_l1_bytes_capacity", l) == 8.0 * 4096);
  CHECK(reg.value("kvtier_l1_objects", l) == 0.0);
  const std::vector<chunk_key> ks = {key(1), key(2)};
  std::vector<l1::status> out(ks.size());
  REQUIRE(t.reserve_write(ks, 1000, {}, out) == 2);
  CHECK(reg.value("kvtier_l1_objects", l) == 2.0);  // being written counts
  REQUIRE(t.finish_write(ks, out) == 2);
  CHECK(reg.value("kvtier_l1_objects", l) == 2.0);
  CHECK(reg.value("kvtier_l1_bytes_used", l) == 2.0 * 4096);
}

TEST_CASE("collect_cache reads every gauge from the cache's status at scrape time", "[telemetry][collectors]") {
  scripted_cache c;
  c.s.l1.bytes_capacity = 1 << 20;
  c.s.backends.push_back({"disk", l2::usage_info{100, 1000, 3}, l2::health_info{true, ""}});
  c.s.backends.push_back({"redis", l2::usage_info{}, l2::health_info{false, "down"}});
  registry reg;
  collect_cache(reg, c);
  CHECK(reg.value("kvtier_l1_bytes_capacity") == double(1 << 20));
  CHECK(reg.value("kvtier_l2_bytes_used", {{"backend", "disk"}}) == 100.0);
  CHECK(reg.value("kvtier_l2_bytes_capacity", {{"backend", "disk"}}) == 1000.0);
  CHECK(reg.value("kvtier_l2_objects", {{"backend", "disk"}}) == 3.0);
  CHECK(reg.value("kvtier_l2_healthy", {{"backend", "disk"}}) == 1.0);
  CHECK(reg.value("kvtier_l2_healthy", {{"backend", "redis"}}) == 0.0);
  CHECK(reg.value("kvtier_lookups_active") == 0.0);

  // Every value follows the status, nothing is cached at registration.
  c.s.l1.bytes_used = 8192;
  c.s.l1.objects = 2;
  c.s.backends[0].usage.objects = 4;
  c.s.backends[1].health.healthy = true;
  c.s.lookups = 5;
  c.s.prefetches_active = 6;
  c.s.prefetch_inflight_bytes = 7;
  c.s.store_inflight_tasks = 8;
  c.s.store_inflight_bytes = 9;
  c.s.store_staged_bytes = 10;
  CHECK(reg.value("kvtier_l1_bytes_used") == 8192.0);
  CHECK(reg.value("kvtier_l1_objects") == 2.0);
  CHECK(reg.value("kvtier_l2_objects", {{"backend", "disk"}}) == 4.0);
  CHECK(reg.value("kvtier_l2_healthy", {{"backend", "redis"}}) == 1.0);
  CHECK(reg.value("kvtier_lookups_active") == 5.0);
  CHECK(reg.value("kvtier_prefetch_requests_active") == 6.0);
  CHECK(reg.value("kvtier_prefetch_inflight_load_bytes") == 7.0);
  CHECK(reg.value("kvtier_store_inflight_tasks") == 8.0);
  CHECK(reg.value("kvtier_store_inflight_bytes") == 9.0);
  CHECK(reg.value("kvtier_store_staged_bytes") == 10.0);
  CHECK(reg.value("kvtier_l2_read_bandwidth_bytes_per_second", {{"backend", "disk"}}) == 0.0);
  c.s.backends[0].read_bytes_per_second = 2.5e9;
  CHECK(reg.value("kvtier_l2_read_bandwidth_bytes_per_second", {{"backend", "disk"}}) == 2.5e9);
}

TEST_CASE("collect_cache registers its families in the order of the page", "[telemetry][collectors]") {
  scripted_cache c;
  c.s.backends.push_back({"disk", l2::usage_info{}, l2::health_info{true, ""}});
  registry reg;
  collect_cache(reg, c);
  std::vector<std::string> names;
  reg.for_each_family([&](const metric_family& f) { names.push_back(f.name); });
  const std::vector<std::string> want = {"kvtier_l1_bytes_used",
                                         "kvtier_l1_bytes_capacity",
                                         "kvtier_l1_objects",
                                         "kvtier_l2_bytes_used",
                                         "kvtier_l2_bytes_capacity",
                                         "kvtier_l2_objects",
                                         "kvtier_l2_healthy",
                                         "kvtier_prefetch_requests_active",
                                         "kvtier_prefetch_inflight_load_bytes",
                                         "kvtier_store_inflight_bytes",
                                         "kvtier_store_inflight_tasks",
                                         "kvtier_store_staged_bytes",
                                         "kvtier_lookups_active",
                                         "kvtier_l2_read_bandwidth_bytes_per_second"};
  CHECK(names == want);
}

TEST_CASE("one scrape reads the cache's status and the tier's usage once, however many gauges read them",
          "[telemetry][collectors]") {
  scripted_cache c;
  c.s.l1.objects = 3;
  c.s.lookups = 2;
  c.s.backends.push_back({"disk", l2::usage_info{100, 1000, 3}, l2::health_info{true, ""}});
  c.s.backends.push_back({"redis", l2::usage_info{}, l2::health_info{false, "down"}});
  counted_l1 t;
  t.u.objects = 5;
  registry reg, l1_reg;
  collect_cache(reg, c);
  collect_l1(l1_reg, t, {{"tier", "l1"}});
  c.status_calls = 0;
  t.usage_calls = 0;
  const std::string text = prometheus_text(reg);
  CHECK(c.status_calls == 1);  // L1 usage under the tier's mutex, every backend's usage and health: once
  CHECK(prometheus_text(l1_reg).find("kvtier_l1_objects{tier=\"l1\"} 5\n") != std::string::npos);
  CHECK(t.usage_calls == 1);
  // Every series of the scrape was read from that one snapshot.
  CHECK(text.find("kvtier_l1_objects 3\n") != std::string::npos);
  CHECK(text.find("kvtier_lookups_active 2\n") != std::string::npos);
  CHECK(text.find("kvtier_l2_objects{backend=\"disk\"} 3\n") != std::string::npos);
  CHECK(text.find("kvtier_l2_healthy{backend=\"redis\"} 0\n") != std::string::npos);
  // The next scrape takes a fresh snapshot.
  c.s.lookups = 7;
  CHECK(prometheus_text(reg).find("kvtier_lookups_active 7\n") != std::string::npos);
  CHECK(c.status_calls == 2);
}

TEST_CASE("a cache names its backends on the bus, so their series read zero before any operation",
          "[telemetry][collectors]") {
  boost::asio::io_context io;
  registry reg;
  metrics_bus events{metrics_subscriber{reg}};
  auto mem = std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{"mem", 1 << 20, 0, {}});
  cache::cache_options o;
  o.l1.slot_bytes = 4096;
  o.l1.slot_count = 4;
  CHECK_FALSE(reg.value("kvtier_l2_store_keys_total", {{"backend", "mem"}}).has_value());
  cache::tiered_cache<metrics_traits> c(io.get_executor(), o, events, {l2::any_backend(mem)});
  CHECK(reg.value("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == 0.0);
  CHECK(reg.value("kvtier_l2_load_keys_total", {{"backend", "mem"}}) == 0.0);

  collect_cache(reg, c);
  CHECK(reg.value("kvtier_l1_bytes_capacity") == 4.0 * 4096);
  CHECK(reg.value("kvtier_l2_bytes_capacity", {{"backend", "mem"}}) == double(1 << 20));
  CHECK(reg.value("kvtier_l2_healthy", {{"backend", "mem"}}) == 1.0);
  const std::string text = prometheus_text(reg);
  CHECK(text.find("kvtier_l2_objects{backend=\"mem\"} 0\n") != std::string::npos);
}

namespace {
struct deferred_sink {
  static constexpr bus::delivery delivery_mode = bus::delivery::deferred;
  void on(const bus::l1_read_finished&) {}
};
}  // namespace

TEST_CASE("collect_bus exports the bus's drops and deliveries", "[telemetry][collectors]") {
  registry reg;
  bus::basic_event_bus<deferred_sink> b(bus::bus_options{2}, deferred_sink{});
  collect_bus(reg, b);
  for (int i = 0; i < 5; ++i) b.publish(bus::l1_read_finished{1});
  CHECK(reg.value("kvtier_event_bus_dropped_events_total") == 3.0);
  b.drain();
  CHECK(reg.value("kvtier_event_bus_delivered_events_total") == 2.0);
}
