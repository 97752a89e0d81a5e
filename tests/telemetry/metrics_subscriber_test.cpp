#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <kvtier/bus/event_bus.hpp>

#include <catch2/catch.hpp>

#include <map>
#include <string>

using namespace kvtier;
using namespace kvtier::telemetry;

namespace {

using values = std::map<std::string, double>;

// Every sample of the registry as "name{labels}" -> value (histograms: their count and sum).
values snapshot(const registry& reg) {
  values v;
  reg.for_each_family([&](const metric_family& f) {
    for (const auto& c : f.children) {
      std::string key = f.name;
      if (!c.label_values.empty()) {
        key += '{';
        for (std::size_t i = 0; i < c.label_values.size(); ++i)
          key += (i ? "," : "") + f.label_names[i] + "=" + c.label_values[i];
        key += '}';
      }
      if (c.as_counter) v[key] = static_cast<double>(c.as_counter->value());
      else if (c.as_gauge) v[key] = c.as_gauge->value();
      else if (c.callback) v[key] = c.callback();
      else if (c.as_histogram) {
        const auto s = c.as_histogram->snapshot();
        v[key + ":count"] = static_cast<double>(s.count());
        v[key + ":sum"] = s.sum;
      }
    }
  });
  return v;
}

// What changed between two snapshots (new samples count as changed from 0).
values diff(const values& before, const values& after) {
  values d;
  for (const auto& [k, v] : after) {
    const auto it = before.find(k);
    const double old = it == before.end() ? 0.0 : it->second;
    if (v != old) d[k] = v - old;
  }
  return d;
}

struct fixture {
  registry reg;
  bus::basic_event_bus<metrics_subscriber> bus{metrics_subscriber{reg}};

  template <class E>
  values publish(const E& e) {
    const auto before = snapshot(reg);
    bus.publish(e);
    return diff(before, snapshot(reg));
  }
};

}  // namespace

TEST_CASE("every metric is present at zero before any event", "[telemetry][metrics_subscriber]") {
  fixture f;
  const auto v = snapshot(f.reg);
  CHECK(v.size() > 60);
  for (const auto& [k, x] : v) {
    INFO(k);
    CHECK(x == 0.0);
  }
  for (const char* name :
       {"kvtier_l1_write_keys_total", "kvtier_l2_prefetch_lookups_total", "kvtier_l2_prefetch_hit_keys_total",
        "kvtier_l2_prefetch_loaded_keys_total", "kvtier_lookup_requested_tokens_total"}) {
    INFO(name);
    CHECK(f.reg.value(name).has_value());
  }
}

TEST_CASE("L1 events move exactly their counters", "[telemetry][metrics_subscriber]") {
  fixture f;
  CHECK(f.publish(bus::l1_read_reserved{5, 2}) ==
        values{{"kvtier_l1_read_reserved_keys_total", 5}, {"kvtier_l1_read_failed_keys_total", 2}});
  CHECK(f.publish(bus::l1_read_finished{4}) == values{{"kvtier_l1_read_keys_total", 4}});
  CHECK(f.publish(bus::l1_write_reserved{3, 1, bus::allocation_purpose::store}) ==
        values{{"kvtier_l1_write_reserved_keys_total", 3}, {"kvtier_l1_write_failed_keys_total", 1}});
  CHECK(f.publish(bus::l1_write_finished{3}) == values{{"kvtier_l1_write_keys_total", 3}});
  CHECK(f.publish(bus::l1_write_finished_and_read_reserved{2}) ==
        values{{"kvtier_l1_write_keys_total", 2}, {"kvtier_l1_prefetched_keys_total", 2}});
  CHECK(f.publish(bus::l1_keys_evicted{6, 6 * 4096, bus::removal_reason::evicted}) ==
        values{{"kvtier_l1_evicted_keys_total{reason=evicted}", 6},
               {"kvtier_l1_evicted_bytes_total{reason=evicted}", 6 * 4096}});
  CHECK(f.publish(bus::l1_keys_evicted{1, 4096, bus::removal_reason::abandoned}) ==
        values{{"kvtier_l1_evicted_keys_total{reason=abandoned}", 1},
               {"kvtier_l1_evicted_bytes_total{reason=abandoned}", 4096}});
  CHECK(f.publish(bus::l1_allocation_failed{8, bus::allocation_purpose::prefetch}) ==
        values{{"kvtier_l1_allocation_failures_total{purpose=prefetch}", 1},
               {"kvtier_l1_allocation_failed_keys_total{purpose=prefetch}", 8}});
  CHECK(f.publish(bus::l1_lock_expired{2, bus::lock_kind::write}) ==
        values{{"kvtier_l1_lock_expired_keys_total{lock=write}", 2}});
  // Read holds: keys x readers, taken by reads and by prefetch loads, released or expired.
  CHECK(f.publish(bus::l1_read_reserved{2, 0, 6}) ==
        values{{"kvtier_l1_read_reserved_keys_total", 2}, {"kvtier_l1_read_holds_taken_total", 6}});
  CHECK(f.publish(bus::l1_write_finished_and_read_reserved{2, 3}) ==
        values{{"kvtier_l1_write_keys_total", 2}, {"kvtier_l1_prefetched_keys_total", 2},
               {"kvtier_l1_read_holds_taken_total", 3}});
  CHECK(f.publish(bus::l1_read_finished{2, 4}) ==
        values{{"kvtier_l1_read_keys_total", 2}, {"kvtier_l1_read_holds_released_total", 4}});
  CHECK(f.publish(bus::l1_lock_expired{1, bus::lock_kind::read, 5}) ==
        values{{"kvtier_l1_lock_expired_keys_total{lock=read}", 1}, {"kvtier_l1_read_holds_expired_total", 5}});
}

TEST_CASE("cache facade events move exactly their counters", "[telemetry][metrics_subscriber]") {
  fixture f;
  CHECK(f.publish(bus::cache_lookup{1, 2560, 10, 4, 3, 256}) ==
        values{{"kvtier_lookups_total", 1},
               {"kvtier_lookup_requested_chunks_total", 10},
               {"kvtier_lookup_requested_tokens_total", 2560},
               {"kvtier_lookup_hit_chunks_total{tier=l1}", 4},
               {"kvtier_lookup_hit_chunks_total{tier=l2}", 3},
               {"kvtier_lookup_hit_tokens_total{tier=l1}", 1024},
               {"kvtier_lookup_hit_tokens_total{tier=l2}", 768}});
  CHECK(f.publish(bus::cache_read_prefetched{5, 1}) == values{{"kvtier_cache_read_requests_total", 1},
                                                              {"kvtier_cache_read_succeeded_keys_total", 5},
                                                              {"kvtier_cache_read_failed_keys_total", 1}});
  CHECK(f.publish(bus::cache_write_reserved{2, 3}) == values{{"kvtier_cache_write_requests_total", 1},
                                                             {"kvtier_cache_write_succeeded_keys_total", 2},
                                                             {"kvtier_cache_write_failed_keys_total", 3}});
  CHECK(f.publish(bus::cache_write_finished{2, 1}) == values{{"kvtier_cache_write_finished_keys_total", 2},
                                                             {"kvtier_cache_write_finish_failed_keys_total", 1}});
}

TEST_CASE("L2 store events move the counters of their backend", "[telemetry][metrics_subscriber]") {
  fixture f;
  CHECK_FALSE(f.reg.value("kvtier_l2_store_keys_total", {{"backend", "disk"}}).has_value());
  f.bus.publish(bus::cache_backend_attached{0, "disk"});  // what a cache publishes for its backends
  CHECK(f.reg.value("kvtier_l2_store_keys_total", {{"backend", "disk"}}) == 0.0);
  CHECK(f.reg.value("kvtier_l2_load_keys_total", {{"backend", "disk"}}) == 0.0);
  CHECK(f.publish(bus::l2_store_submitted{0, "disk", 7, 7 * 4096}) ==
        values{{"kvtier_l2_store_tasks_total{backend=disk}", 1}, {"kvtier_l2_store_keys_total{backend=disk}", 7}});
  CHECK(f.publish(bus::l2_store_completed{0, "disk", 6, 1, 6 * 4096, 3'000'000}) ==
        values{{"kvtier_l2_store_completed_total{backend=disk}", 1},
               {"kvtier_l2_store_succeeded_keys_total{backend=disk}", 6},
               {"kvtier_l2_store_failed_keys_total{backend=disk}", 1},
               {"kvtier_l2_store_bytes_total{backend=disk}", 6 * 4096},
               {"kvtier_l2_store_duration_seconds{backend=disk}:count", 1},
               {"kvtier_l2_store_duration_seconds{backend=disk}:sum", 0.003}});
  // A backend first seen in an event gets its own series.
  const auto d = f.publish(bus::l2_store_submitted{1, "redis", 2, 100});
  CHECK(d.at("kvtier_l2_store_keys_total{backend=redis}") == 2);
  CHECK(f.reg.value("kvtier_l2_store_keys_total", {{"backend", "disk"}}) == 7.0);
}

TEST_CASE("L2 prefetch events follow the three counting rules", "[telemetry][metrics_subscriber]") {
  fixture f;
  CHECK(f.publish(bus::l2_prefetch_lookup_submitted{9, 20, 2}) ==
        values{{"kvtier_l2_prefetch_lookups_total", 1}, {"kvtier_l2_prefetch_lookup_keys_total", 20}});
  CHECK(f.publish(bus::l2_prefetch_lookup_completed{9, 20, 18}) == values{{"kvtier_l2_prefetch_hit_keys_total", 18}});
  CHECK(f.publish(bus::l2_prefetch_load_submitted{9, 15, 2, 3, 15 * 4096}) ==
        values{{"kvtier_l2_prefetch_load_tasks_total", 2},
               {"kvtier_l2_prefetch_load_keys_total", 15},
               {"kvtier_l2_prefetch_trimmed_keys_total", 3}});
  CHECK(f.publish(bus::l2_prefetch_load_completed{9, 14, 1, 14 * 4096, 5'000'000}) ==
        values{{"kvtier_l2_prefetch_loaded_keys_total", 14},
               {"kvtier_l2_prefetch_failed_keys_total", 1},
               {"kvtier_l2_prefetch_loaded_bytes_total", 14 * 4096},
               {"kvtier_l2_prefetch_duration_seconds:count", 1},
               {"kvtier_l2_prefetch_duration_seconds:sum", 0.005}});
  CHECK(f.publish(bus::l2_prefetch_failed{9, bus::prefetch_failure::corrupt_object, 1}) ==
        values{{"kvtier_l2_prefetch_failure_keys_total{reason=corrupt_object}", 1}});
  CHECK(f.publish(bus::l2_backend_load_completed{0, "disk", 15, 14, 14 * 4096, 4'000'000}) ==
        values{{"kvtier_l2_load_keys_total{backend=disk}", 15},
               {"kvtier_l2_load_succeeded_keys_total{backend=disk}", 14},
               {"kvtier_l2_load_bytes_total{backend=disk}", 14 * 4096},
               {"kvtier_l2_load_duration_seconds{backend=disk}:count", 1},
               {"kvtier_l2_load_duration_seconds{backend=disk}:sum", 0.004}});
}

TEST_CASE("server and connector events move their metrics", "[telemetry][metrics_subscriber]") {
  fixture f;
  CHECK(f.publish(bus::server_request_started{bus::request_kind::retrieve, 3}) ==
        values{{"kvtier_server_requests_in_flight{type=retrieve}", 1}});
  CHECK(f.publish(bus::server_request_finished{bus::request_kind::retrieve, 3, false, 1'000'000}) ==
        values{{"kvtier_server_requests_in_flight{type=retrieve}", -1},
               {"kvtier_server_requests_total{type=retrieve}", 1},
               {"kvtier_server_request_errors_total{type=retrieve}", 1},
               {"kvtier_server_request_duration_seconds{type=retrieve}:count", 1},
               {"kvtier_server_request_duration_seconds{type=retrieve}:sum", 0.001}});
  CHECK(f.publish(bus::connector_healthy{0, 0}) == values{{"kvtier_connector_healthy", 1}});
  CHECK(f.publish(bus::connector_unhealthy{0, "eof", 4}) ==
        values{{"kvtier_connector_healthy", -1},
               {"kvtier_connector_unhealthy_total", 1},
               {"kvtier_connector_released_requests_total", 4}});
  CHECK(f.publish(bus::connector_reconnected{0, true}) ==
        values{{"kvtier_connector_reconnects_total", 1}, {"kvtier_connector_server_restarts_total", 1}});
  CHECK(f.publish(bus::connector_reconnected{0, false}) == values{{"kvtier_connector_reconnects_total", 1}});
}

TEST_CASE("connector outcome events move their metrics, by outcome", "[telemetry][metrics_subscriber]") {
  fixture f;
  using o = bus::connector_outcome;
  CHECK(f.publish(bus::connector_lookup_completed{0, o::ok, 10, 4, 256, 2'000'000}) ==
        values{{"kvtier_connector_lookups_total{outcome=ok}", 1},
               {"kvtier_connector_lookup_requested_tokens_total", 2560},
               {"kvtier_connector_lookup_hit_tokens_total", 1024},
               {"kvtier_connector_lookup_duration_seconds:count", 1},
               {"kvtier_connector_lookup_duration_seconds:sum", 0.002}});
  CHECK(f.publish(bus::connector_retrieve_completed{0, o::partial, 4, 3, 16, 1'000'000}) ==
        values{{"kvtier_connector_retrieves_total{outcome=partial}", 1},
               {"kvtier_connector_retrieve_requested_chunks_total", 4},
               {"kvtier_connector_retrieved_chunks_total", 3},
               {"kvtier_connector_retrieve_duration_seconds:count", 1},
               {"kvtier_connector_retrieve_duration_seconds:sum", 0.001}});
  CHECK(f.publish(bus::connector_store_completed{0, o::ok, 5, 2, 2, 1, 4'000'000}) ==
        values{{"kvtier_connector_stores_total{outcome=ok}", 1},
               {"kvtier_connector_store_requested_chunks_total", 5},
               {"kvtier_connector_store_chunks_total{result=stored}", 2},
               {"kvtier_connector_store_chunks_total{result=already_present}", 2},
               {"kvtier_connector_store_chunks_total{result=failed}", 1},
               {"kvtier_connector_store_duration_seconds:count", 1},
               {"kvtier_connector_store_duration_seconds:sum", 0.004}});
  CHECK(f.publish(bus::connector_store_completed{0, o::unhealthy, 3, 0, 0, 0, 0}) ==
        values{{"kvtier_connector_stores_total{outcome=unhealthy}", 1},
               {"kvtier_connector_store_requested_chunks_total", 3},
               {"kvtier_connector_store_duration_seconds:count", 1}});
  CHECK(f.publish(bus::connector_load_error{0, o::timeout, 16}) ==
        values{{"kvtier_connector_load_error_blocks_total{reason=timeout}", 16}});
  // Two ranks on one bus: the gauge adds their quarantines up.
  CHECK(f.publish(bus::connector_quarantine_changed{0, 16, 0, 16}) ==
        values{{"kvtier_connector_quarantined_blocks", 16}, {"kvtier_connector_quarantine_held_blocks_total", 16}});
  CHECK(f.publish(bus::connector_quarantine_changed{1, 4, 0, 4}) ==
        values{{"kvtier_connector_quarantined_blocks", 4}, {"kvtier_connector_quarantine_held_blocks_total", 4}});
  CHECK(f.publish(bus::connector_quarantine_changed{0, 0, 16, 0}) ==
        values{{"kvtier_connector_quarantined_blocks", -16},
               {"kvtier_connector_quarantine_released_blocks_total", 16}});
  CHECK(f.reg.value("kvtier_connector_quarantined_blocks") == 4.0);
}
