// Shutting a tiered_cache down while its pipelines work (issue 13, item 8): the destructor in
// every state of the executor (running on another thread, stopped, never run), and
// async_stop, which cancels what is in flight and completes once every coroutine the cache
// started has ended. These run under ASan (use after free) and TSan ([concurrency]).
#include <kvtier/cache/tiered_cache.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_shutdown_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {

constexpr std::size_t object_bytes = 64 * 1024;
using metrics_bus = bus::basic_event_bus<telemetry::metrics_subscriber>;

struct traits : cache::default_traits {
  using bus_type = metrics_bus;
  using wait_policy = pipeline::wait_complete;
};
using cache_type = cache::tiered_cache<traits>;

chunk_key key(std::uint64_t i) { return chunk_key{91, 1, 0, hash128{i, i * 7}}; }

std::vector<chunk_key> keys(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(key(first + i));
  return k;
}

/// A memory L2 slow enough (a modelled 200 MB/s channel) that loads and stores are still in
/// flight when the test shuts the cache down.
struct fixture {
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  std::shared_ptr<l2::memory_backend> mem;
  std::unique_ptr<cache_type> cache;

  fixture() {
    mem =
        std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{"mem", 1 << 28, 200e6, {}});
    cache::cache_options o;
    o.l1.slot_bytes = object_bytes;
    o.l1.slot_count = 256;
    cache =
        std::make_unique<cache_type>(io.get_executor(), o, events, std::vector<l2::any_backend>{l2::any_backend(mem)});
  }

  // Objects in L2 only, written straight into the backend.
  void put_l2(std::span<const chunk_key> ks) {
    std::vector<std::vector<std::byte>> data(ks.size(), std::vector<std::byte>(object_bytes, std::byte{0x5a}));
    std::vector<std::span<const std::byte>> src(data.begin(), data.end());
    mem->set_model(0, {});
    run_sync(io, [&]() -> asio::awaitable<void> {
      co_await mem->async_store(ks, src, l2::clock::now() + std::chrono::seconds(30),
                                asio::as_tuple(asio::use_awaitable));
    }());
    mem->set_model(200e6, {});
  }

  // Starts lookups that prefetch from L2 and stores that write to L2; returns the lookup ids.
  std::vector<cache_type::lookup_id> start_work(std::span<const chunk_key> in_l2, std::span<const chunk_key> to_store) {
    std::vector<cache_type::lookup_id> ids;
    for (std::size_t at = 0; at < in_l2.size(); at += 8) {
      cache::lookup_request r;
      r.keys = in_l2.subspan(at, std::min<std::size_t>(8, in_l2.size() - at));
      r.object_bytes = object_bytes;
      r.chunk_tokens = 256;
      ids.push_back(cache->start_lookup(r));
    }
    std::vector<l1::status> st(to_store.size());
    std::vector<std::span<std::byte>> buf(to_store.size());
    cache->reserve_write(to_store, object_bytes, st, buf);
    for (auto& b : buf) std::memset(b.data(), 0x33, b.size());
    cache->finish_write(to_store, {}, st);
    return ids;
  }
};

}  // namespace

TEST_CASE("destroying a cache with prefetches and stores in flight, its executor running on another thread, is safe",
          "[cache][shutdown][concurrency]") {
  fixture f;
  const auto in_l2 = keys(0, 32);
  f.put_l2(in_l2);
  auto guard = asio::make_work_guard(f.io);
  f.io.restart();
  std::thread runner([&] { f.io.run(); });
  const auto to_store = keys(1000, 32);
  f.start_work(in_l2, to_store);
  // Wait until some of that work is really in flight (a load or store is on the channel).
  while (f.cache->status().prefetches_active == 0 && f.cache->status().store_inflight_tasks == 0)
    std::this_thread::yield();
  f.cache.reset();  // waits for what the cache started; nothing may touch it afterwards
  guard.reset();
  f.io.stop();
  runner.join();
  CHECK(f.mem->usage().objects >= in_l2.size());
}

TEST_CASE("destroying a cache with work in flight and its executor stopped finishes that work first",
          "[cache][shutdown]") {
  fixture f;
  const auto in_l2 = keys(0, 16);
  f.put_l2(in_l2);
  f.start_work(in_l2, keys(1000, 16));
  f.io.restart();
  f.io.run_one();  // some of it starts, then the executor is left stopped
  f.io.stop();
  f.cache.reset();
  CHECK(f.io.stopped());  // left as it was
  // Nothing the cache started is left to run.
  f.io.restart();
  CHECK(f.io.poll() == 0);
}

TEST_CASE("an idle cache is destroyed at once whatever its executor does", "[cache][shutdown]") {
  fixture f;
  f.cache.reset();  // never run, never stopped: no coroutine of the cache exists
  f.io.restart();
  CHECK(f.io.poll() == 0);
}

TEST_CASE("async_stop answers every lookup, drops queued work, and completes once every coroutine it started ended",
          "[cache][shutdown]") {
  fixture f;
  const auto in_l2 = keys(0, 32);
  f.put_l2(in_l2);
  const auto ids = f.start_work(in_l2, keys(1000, 32));
  std::optional<error_code> stopped;
  run_sync(f.io, [&]() -> asio::awaitable<void> {
    auto [ec] = co_await f.cache->async_stop(asio::as_tuple(asio::use_awaitable));
    stopped = ec;
  }());
  REQUIRE(stopped.has_value());
  CHECK_FALSE(*stopped);
  const auto s = f.cache->status();
  CHECK(s.prefetches_active == 0);
  CHECK(s.store_inflight_tasks == 0);
  CHECK(s.store_inflight_bytes == 0);
  // Every lookup was answered (cancelled: no chunk), and nothing the prefetches reserved
  // stays in L1 (the stored keys are still there, ready).
  for (const auto id : ids) {
    const auto st = f.cache->poll(id);
    REQUIRE(st.has_value());
    CHECK(st->chunks == 0);
    f.cache->release_all(id);
  }
  for (const auto& k : in_l2) CHECK(f.cache->l1().state(k) == l1::object_state::absent);
  CHECK(f.cache->l1().usage().objects == 32);
  // After the stop: lookups answer from L1 only, writes are not offered to L2.
  cache::lookup_request r;
  const auto more = keys(0, 4);
  r.keys = more;
  r.object_bytes = object_bytes;
  const auto late = f.cache->start_lookup(r);
  REQUIRE(f.cache->poll(late).has_value());
  CHECK(f.cache->poll(late)->chunks == 0);
  f.cache->release_all(late);
  f.io.restart();
  CHECK(f.io.poll() == 0);
  f.cache.reset();
}

}  // namespace file_shutdown_test
