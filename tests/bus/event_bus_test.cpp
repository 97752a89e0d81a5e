#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/null_bus.hpp>
#include <kvtier/telemetry/counter.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

using namespace kvtier;
using namespace kvtier::bus;

namespace {

struct counts {
  int store_submitted = 0;
  int store_completed = 0;
  int lookups = 0;
};

// Handles l2_store_submitted only.
struct store_only {
  std::shared_ptr<counts> c = std::make_shared<counts>();
  void on(const l2_store_submitted&) { ++c->store_submitted; }
};

// Handles both store events and cache lookups.
struct store_and_lookup {
  std::shared_ptr<counts> c = std::make_shared<counts>();
  void on(const l2_store_submitted&) { ++c->store_submitted; }
  void on(const l2_store_completed&) { ++c->store_completed; }
  void on(const cache_lookup&) { ++c->lookups; }
};

// A deferred subscriber that signals each delivery.
struct deferred_recorder {
  static constexpr delivery delivery_mode = delivery::deferred;
  struct shared {
    std::mutex m;
    std::condition_variable cv;
    std::vector<std::uint32_t> keys;
  };
  std::shared_ptr<shared> s = std::make_shared<shared>();
  void on(const l1_write_finished& e) {
    std::lock_guard g(s->m);
    s->keys.push_back(e.key_count);
    s->cv.notify_all();
  }
  bool wait_for(std::size_t n, std::chrono::seconds deadline = std::chrono::seconds(60)) {
    std::unique_lock l(s->m);
    return s->cv.wait_for(l, deadline, [&] { return s->keys.size() >= n; });
  }
  std::size_t size() {
    std::lock_guard g(s->m);
    return s->keys.size();
  }
};

// A deferred subscriber that wants only the writes of more than one key (bus::filters).
struct filtering_recorder : deferred_recorder {
  bool wants(const l1_write_finished& e) const noexcept { return e.key_count > 1; }
};
static_assert(filters<filtering_recorder, l1_write_finished> && !filters<deferred_recorder, l1_write_finished>);

struct throwing_deferred {
  static constexpr delivery delivery_mode = delivery::deferred;
  void on(const l1_read_finished&) { throw std::runtime_error("subscriber bug"); }
};

}  // namespace

// Compile-time dispatch: which subscribers see which event is decided by their on() overloads.
using test_bus = basic_event_bus<store_only, store_and_lookup>;
static_assert(test_bus::handles_event<l2_store_submitted>);
static_assert(test_bus::handles_event<cache_lookup>);
static_assert(!test_bus::handles_event<l1_keys_evicted>);
static_assert(!test_bus::defers_event<l2_store_submitted>);
static_assert(!null_bus::handles_event<l2_store_submitted>);
static_assert(handles<store_only, l2_store_submitted> && !handles<store_only, cache_lookup>);

TEST_CASE("publish reaches exactly the subscribers that handle the event", "[bus]") {
  store_only a;
  store_and_lookup b;
  test_bus bus(a, b);
  bus.publish(l2_store_submitted{});
  CHECK(a.c->store_submitted == 1);
  CHECK(b.c->store_submitted == 1);
  bus.publish(l2_store_completed{});
  bus.publish(cache_lookup{});
  CHECK(a.c->store_submitted == 1);
  CHECK(b.c->store_completed == 1);
  CHECK(b.c->lookups == 1);
}

TEST_CASE("an event type no subscriber handles reaches nobody", "[bus]") {
  store_only a;
  store_and_lookup b;
  test_bus bus(a, b);
  bus.publish(l1_keys_evicted{});
  bus.publish(connector_healthy{});
  CHECK(a.c->store_submitted == 0);
  CHECK(b.c->store_submitted == 0);
  CHECK(b.c->store_completed == 0);
  CHECK(b.c->lookups == 0);
  CHECK(bus.drain() == 0);  // nothing was queued either
  CHECK(bus.dropped() == 0);
}

TEST_CASE("deferred subscribers run only when the bus drains", "[bus]") {
  deferred_recorder d;
  store_only imm;
  basic_event_bus<store_only, deferred_recorder> bus(imm, d);
  bus.publish(l1_write_finished{3});
  bus.publish(l2_store_submitted{});
  CHECK(imm.c->store_submitted == 1);  // immediate: at once
  CHECK(d.size() == 0);                // deferred: not yet
  CHECK(bus.drain() == 1);             // only the event the deferred subscriber handles was queued
  REQUIRE(d.size() == 1);
  CHECK(d.s->keys[0] == 3);
  CHECK(bus.delivered() == 1);
}

TEST_CASE("an event no deferred subscriber wants is not queued; one that another wants reaches only its handlers",
          "[bus]") {
  filtering_recorder f;
  basic_event_bus<filtering_recorder> only_filtering(f);
  only_filtering.publish(l1_write_finished{1});  // unwanted: not queued
  only_filtering.publish(l1_write_finished{4});
  CHECK(only_filtering.drain() == 1);
  REQUIRE(f.size() == 1);
  CHECK(f.s->keys[0] == 4);
  CHECK(only_filtering.dropped() == 0);

  // Beside a subscriber without a filter the event is queued, and each subscriber's on() is
  // called: the filter decides what is queued, not who is called.
  filtering_recorder g;
  deferred_recorder all;
  basic_event_bus<filtering_recorder, deferred_recorder> both(g, all);
  both.publish(l1_write_finished{1});
  CHECK(both.drain() == 1);
  CHECK(all.size() == 1);
}

TEST_CASE("a full deferred queue drops and counts, immediate delivery is unaffected", "[bus]") {
  deferred_recorder d;
  basic_event_bus<deferred_recorder> bus(bus_options{4}, d);
  REQUIRE(bus.queue_capacity() == 4);
  for (std::uint32_t i = 0; i < 10; ++i) bus.publish(l1_write_finished{i});
  CHECK(bus.dropped() == 6);
  CHECK(bus.drain() == 4);
  CHECK(d.s->keys == std::vector<std::uint32_t>{0, 1, 2, 3});  // the oldest survive, in order
  CHECK(bus.enqueue(l1_write_finished{42}));
  CHECK(bus.drain() == 1);
  CHECK(bus.dropped() == 6);
}

TEST_CASE("the drain thread delivers queued events without being polled", "[bus]") {
  deferred_recorder d;
  basic_event_bus<deferred_recorder> bus(d);
  bus.start_drain_thread();
  bus.start_drain_thread();  // idempotent
  for (std::uint32_t i = 0; i < 100; ++i) bus.publish(l1_write_finished{i});
  REQUIRE(d.wait_for(100));
  bus.stop_drain_thread();
  bus.publish(l1_write_finished{7});
  CHECK(d.size() == 100);  // stopped: the next event waits for a drain
  CHECK(bus.drain() == 1);
}

TEST_CASE("a throwing deferred subscriber is counted and does not stop the drain", "[bus]") {
  basic_event_bus<throwing_deferred> bus{throwing_deferred{}};
  bus.publish(l1_read_finished{1});
  bus.publish(l1_read_finished{2});
  CHECK(bus.drain() == 2);
  CHECK(bus.subscriber_errors() == 2);
}

namespace {
struct counting_immediate {
  telemetry::counter* c;
  void on(const l1_write_finished& e) noexcept { c->inc(e.key_count); }
};
}  // namespace

TEST_CASE("concurrent publishers: immediate counts are exact, deferred delivered plus dropped is total",
          "[bus][concurrency]") {
  telemetry::counter counter;
  deferred_recorder d;
  basic_event_bus<counting_immediate, deferred_recorder> bus(bus_options{1024}, counting_immediate{&counter}, d);
  bus.start_drain_thread();
  constexpr int threads = 4;
  constexpr int per_thread = 20000;
  std::vector<std::thread> pubs;
  for (int t = 0; t < threads; ++t)
    pubs.emplace_back([&] {
      for (int i = 0; i < per_thread; ++i) bus.publish(l1_write_finished{1});
    });
  for (auto& t : pubs) t.join();
  bus.stop_drain_thread();
  bus.drain();
  CHECK(counter.value() == threads * per_thread);
  CHECK(bus.delivered() + bus.dropped() == threads * per_thread);
  CHECK(d.size() == bus.delivered());
}
