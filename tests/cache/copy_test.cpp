// tiered_cache's whole operations: async_wait answers when the prefetch is decided,
// async_copy_out copies each chunk as soon as it lands (the pipelined L2 hit) and ends its
// prefix at a failed load, copies part-major with progress when everything is readable, keeps
// its slots held against a concurrent release_all; async_copy_in stores, fences and counts;
// the load-or-recompute gate declines what a slow backend cannot deliver in time. Every step
// is driven by hand (gated_backend lands keys on command): no timing.
#include <kvtier/cache/tiered_cache.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include "cache/gated_backend.hpp"
#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_copy_test {

using namespace kvtier;
namespace asio = boost::asio;

namespace {

constexpr std::size_t object_bytes = 8192;
using metrics_bus = bus::basic_event_bus<telemetry::metrics_subscriber>;

struct traits : cache::default_traits {
  using bus_type = metrics_bus;
  using wait_policy = pipeline::wait_complete;
};
using cache_type = cache::tiered_cache<traits>;

chunk_key key(std::uint64_t i, std::uint16_t rank = 0, std::uint16_t ws = 1) {
  return chunk_key{91, ws, rank, hash128{i, i * 17}};
}

std::vector<std::byte> payload(const chunk_key& k) {
  std::vector<std::byte> b(object_bytes);
  for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<std::byte>(k.hash.lo * 5 + k.rank * 3 + j);
  return b;
}

std::vector<chunk_key> keys(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(key(first + i));
  return k;
}

/// A copy out of lookup `id`'s keys `k` in `parts` parts (progress, when given, collected).
cache::copy_out_request copy_request(std::uint64_t id, std::span<const chunk_key> k, std::size_t parts = 1,
                                     std::vector<std::size_t>* progress = nullptr) {
  cache::copy_out_request r;
  r.lookup = id;
  r.keys = k;
  r.object_bytes = object_bytes;
  r.parts = parts;
  if (progress != nullptr) r.on_progress = [progress](std::size_t p) { progress->push_back(p); };
  return r;
}

/// What a copy out's sink saw: (key index, part) in call order, and the bytes of each key.
struct recording_sink {
  std::mutex m;
  std::vector<std::pair<std::size_t, std::size_t>> calls;
  std::vector<std::vector<std::byte>> bytes;
  std::size_t parts = 1;
  std::optional<std::size_t> fail_index;

  explicit recording_sink(std::size_t n, std::size_t p = 1)
      : bytes(n, std::vector<std::byte>(object_bytes)), parts(p) {}

  cache::copy_out_sink make() {
    return [this](std::size_t i, std::size_t part, std::span<const std::byte> obj) {
      std::lock_guard g(m);
      calls.emplace_back(i, part);
      if (fail_index && *fail_index == i) return false;
      const std::size_t slice = obj.size() / parts;
      std::memcpy(bytes[i].data() + part * slice, obj.data() + part * slice, slice);
      return true;
    };
  }
  std::size_t calls_for(std::size_t i) {
    std::lock_guard g(m);
    std::size_t n = 0;
    for (auto& c : calls) n += c.first == i ? 1 : 0;
    return n;
  }
};

struct fixture {
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  std::shared_ptr<test::gated_backend> gated;
  /// The copies run on a thread of their own (copy_pool) when `own_copy_thread`.
  std::unique_ptr<asio::thread_pool> copy_pool;
  std::unique_ptr<cache_type> cache;

  explicit fixture(std::size_t slots = 64, bool own_copy_thread = false) {
    gated = std::make_shared<test::gated_backend>(io.get_executor());
    cache::cache_options o;
    if (own_copy_thread) {
      copy_pool = std::make_unique<asio::thread_pool>(1);
      o.copy_executor = copy_pool->get_executor();
    }
    o.l1.slot_bytes = object_bytes;
    o.l1.slot_count = slots;
    o.l1.eviction_watermark = 1.0;
    o.l1.eviction_target = 0.9;
    cache = std::make_unique<cache_type>(io.get_executor(), o, events,
                                         std::vector<l2::any_backend>{l2::any_backend(gated)});
  }
  ~fixture() {
    if (copy_pool) copy_pool->join();
    if (gated->loading()) {
      gated->complete();
    }
    io.restart();
    io.run();
  }

  void put_l1(std::span<const chunk_key> k) {
    std::vector<l1::status> st(k.size());
    std::vector<std::span<std::byte>> buf(k.size());
    cache->reserve_write(k, object_bytes, st, buf);
    for (std::size_t i = 0; i < k.size(); ++i) {
      REQUIRE(st[i] == l1::status::success);
      const auto p = payload(k[i]);
      std::memcpy(buf[i].data(), p.data(), p.size());
    }
    cache->finish_write(k, {}, st);
  }

  std::uint64_t start(std::span<const chunk_key> k, std::uint64_t rate = 0) {
    cache::lookup_request r;
    r.keys = k;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    r.prefill_tokens_per_second = rate;
    return cache->start_lookup(r);
  }

  void poll() {
    io.restart();
    io.poll();
  }
  double metric(const char* name, const telemetry::label_pairs& l = {}) { return reg.value(name, l).value_or(-1); }
};

}  // namespace

TEST_CASE("async_wait answers when the prefetch is decided, async_wait_loaded when the loads landed", "[cache]") {
  fixture f;
  const auto k = keys(0, 3);
  for (const auto& x : k) f.gated->put(x, payload(x));
  const auto id = f.start(k);
  std::optional<cache::lookup_status> decided, loaded;
  f.cache->async_wait(id, [&](error_code ec, cache::lookup_status s) {
    REQUIRE_FALSE(ec);
    decided = s;
  });
  f.cache->async_wait_loaded(id, [&](error_code ec, cache::lookup_status s) {
    REQUIRE_FALSE(ec);
    loaded = s;
  });
  f.poll();
  REQUIRE(f.gated->loading());  // nothing landed yet
  REQUIRE(decided);
  CHECK(decided->chunks == 3);
  CHECK(decided->l1_chunks == 0);
  CHECK(decided->loading_chunks == 3);
  CHECK_FALSE(loaded);
  f.gated->land(0);
  f.gated->land(1);
  f.poll();
  CHECK_FALSE(loaded);
  f.gated->land(2);
  f.poll();
  REQUIRE(loaded);
  CHECK(loaded->chunks == 3);
  CHECK(loaded->loading_chunks == 0);
  f.gated->complete();
  f.poll();
  f.cache->release_all(id);
  CHECK(f.cache->status().lookups == 0);
  CHECK(f.cache->l1().usage().objects == 0);  // temporary objects: freed with their holds
}

TEST_CASE("async_copy_out copies each chunk as soon as its load lands", "[cache]") {
  fixture f;
  const auto k = keys(10, 4);
  for (const auto& x : k) f.gated->put(x, payload(x));
  const auto id = f.start(k);
  f.poll();
  REQUIRE(f.cache->poll(id));
  REQUIRE(f.gated->loading());
  recording_sink sink(k.size());
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k);
  f.cache->async_copy_out(r, sink.make(), [&](error_code ec, std::size_t n) {
    REQUIRE_FALSE(ec);
    copied = n;
  });
  f.poll();
  CHECK(sink.calls.empty());  // nothing readable yet
  f.gated->land(0);
  f.poll();
  // Chunk 0 is copied while chunks 1..3 are still loading.
  CHECK(sink.calls_for(0) == 1);
  CHECK(sink.calls_for(1) == 0);
  CHECK_FALSE(copied);
  f.gated->land(1);
  f.poll();
  CHECK(sink.calls_for(1) == 1);
  f.gated->land(2);
  f.gated->land(3);
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 4);
  for (std::size_t i = 0; i < k.size(); ++i) CHECK(sink.bytes[i] == payload(k[i]));
  f.gated->complete();
  f.poll();
  // The copy gave the lookup's holds back: the temporary objects are gone.
  CHECK(f.cache->l1().usage().objects == 0);
  CHECK(f.metric("kvtier_cache_read_succeeded_keys_total") == 4);
  f.cache->release_all(id);
}

TEST_CASE("a load that fails ends the copied prefix there", "[cache]") {
  fixture f;
  const auto k = keys(20, 4);
  for (const auto& x : k) f.gated->put(x, payload(x));
  const auto id = f.start(k);
  f.poll();
  recording_sink sink(k.size());
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k);
  f.cache->async_copy_out(r, sink.make(), [&](error_code, std::size_t n) { copied = n; });
  f.gated->land(0);
  f.gated->fail(1);
  f.gated->land(2);
  f.gated->land(3);
  f.poll();
  f.gated->complete();
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 1);
  CHECK(sink.calls_for(1) == 0);
  CHECK(f.cache->l1().usage().objects == 0);  // nothing stays held past the failure
  std::optional<cache::lookup_status> loaded;
  f.cache->async_wait_loaded(id, [&](error_code, cache::lookup_status s) { loaded = s; });
  f.poll();
  REQUIRE(loaded);
  CHECK(loaded->chunks == 1);
  f.cache->release_all(id);
}

TEST_CASE("a copy of readable chunks goes part-major and reports its progress", "[cache]") {
  fixture f;
  const auto k = keys(30, 3);
  f.put_l1(k);
  const auto id = f.start(k);
  f.poll();
  recording_sink sink(k.size(), 4);
  std::vector<std::size_t> progress;
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k, 4, &progress);
  f.cache->async_copy_out(r, sink.make(), [&](error_code, std::size_t n) { copied = n; });
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 3);
  // Part 0 of every key before part 1 of any (one copy thread: the io_context).
  REQUIRE(sink.calls.size() == 12);
  for (std::size_t c = 0; c < 12; ++c) CHECK(sink.calls[c] == std::pair<std::size_t, std::size_t>{c % 3, c / 3});
  CHECK(progress == std::vector<std::size_t>{1, 2, 3});
  for (std::size_t i = 0; i < k.size(); ++i) CHECK(sink.bytes[i] == payload(k[i]));
  f.cache->release_all(id);
}

// The layer-wise L2 hit: a copy in parts reads the verified prefix of a key still loading.
TEST_CASE("a copy in parts copies each part as its bytes are verified, before the key lands", "[cache][partial]") {
  fixture f;
  const auto k = keys(50, 3);
  for (const auto& x : k) f.gated->put(x, payload(x));
  const auto id = f.start(k);
  f.poll();
  REQUIRE(f.gated->loading());
  recording_sink sink(k.size(), 4);  // parts of 2048 bytes
  std::vector<std::size_t> progress;
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k, 4, &progress);
  f.cache->async_copy_out(r, sink.make(), [&](error_code ec, std::size_t n) {
    REQUIRE_FALSE(ec);
    copied = n;
  });
  f.poll();
  CHECK(sink.calls.empty());
  // Part 0 of keys 0 and 1 verified (and a bit of part 1 of key 0: not enough for it).
  f.gated->verify(0, 3000);
  f.gated->verify(1, 2048);
  f.poll();
  CHECK(sink.calls_for(0) == 1);
  CHECK(sink.calls_for(1) == 1);
  CHECK(sink.calls_for(2) == 0);
  CHECK(progress.empty());  // key 2 has nothing yet
  // Key 2's first two parts: part 0 is now copied for every key.
  f.gated->verify(2, 4096);
  f.poll();
  CHECK(sink.calls_for(2) == 2);
  CHECK(progress == std::vector<std::size_t>{1});
  // Bytes past a verified prefix are never read: what lands there later is what is copied.
  f.gated->scribble(0, 4096, 4096);
  f.gated->verify(0, 6144);
  f.gated->verify(1, 6144);
  f.gated->verify(2, 6144);
  f.poll();
  CHECK(progress.back() == 3);
  CHECK_FALSE(copied);  // the last parts come with the keys
  f.gated->land(0);
  f.gated->land(1);
  f.gated->land(2);
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 3);
  for (std::size_t i = 0; i < k.size(); ++i) {
    CHECK(sink.calls_for(i) == 4);  // every part once
    CHECK(sink.bytes[i] == payload(k[i]));
  }
  f.gated->complete();
  f.poll();
  CHECK(f.cache->l1().usage().objects == 0);
  CHECK(f.cache->l1().usage().slots_used == 0);
  f.cache->release_all(id);
}

TEST_CASE("a key that fails after its verified prefix was copied ends the prefix, and its slot outlives the copy",
          "[cache][partial][concurrency]") {
  fixture f(64, true);
  const auto k = keys(60, 3);
  for (const auto& x : k) f.gated->put(x, payload(x));
  const auto id = f.start(k);
  f.poll();
  // The sink blocks on part 1 of key 1 until the test lets it go, so the load of key 1 fails
  // while its verified bytes are being read.
  std::mutex m;
  std::condition_variable cv;
  bool in_sink = false, release_sink = false;
  recording_sink rec(k.size(), 4);
  auto inner = rec.make();
  cache::copy_out_sink sink = [&](std::size_t i, std::size_t part, std::span<const std::byte> obj) {
    if (i == 1 && part == 1) {
      std::unique_lock g(m);
      in_sink = true;
      cv.notify_all();
      cv.wait(g, [&] { return release_sink; });
    }
    return inner(i, part, obj);
  };
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k, 4);
  f.cache->async_copy_out(r, sink, [&](error_code, std::size_t n) { copied = n; });
  f.gated->land(0);
  f.gated->verify(1, 4096);  // parts 0 and 1 of key 1
  f.gated->land(2);
  f.poll();
  {
    std::unique_lock g(m);
    cv.wait(g, [&] { return in_sink; });
  }
  // Key 1's load fails while its verified bytes are read: the prefix ends at 1, and its slot
  // leaves the tier but is not freed under the copy.
  f.gated->fail(1);
  f.gated->complete();
  f.poll();
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::removing);
  CHECK(f.cache->l1().usage().removing == 1);
  {
    std::lock_guard g(m);
    release_sink = true;
  }
  cv.notify_all();
  f.copy_pool->join();
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 1);
  CHECK(rec.bytes[0] == payload(k[0]));
  const auto p1 = payload(k[1]);
  CHECK(std::equal(p1.begin(), p1.begin() + 4096, rec.bytes[1].begin()));  // the verified bytes
  CHECK(rec.calls_for(1) == 2);  // and only them
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::absent);
  CHECK(f.cache->l1().usage().removing == 0);
  CHECK(f.cache->l1().usage().objects == 0);
  CHECK(f.cache->l1().usage().slots_used == 0);
  f.cache->release_all(id);
}

TEST_CASE("a copy keeps its objects held while release_all runs, and copies without a lookup", "[cache][concurrency]") {
  fixture f;
  const auto k = keys(40, 2);
  f.put_l1(k);
  const auto id = f.start(k);
  f.poll();
  std::mutex m;
  std::condition_variable cv;
  bool in_sink = false, go = false;
  std::vector<std::vector<std::byte>> got(k.size(), std::vector<std::byte>(object_bytes));
  std::optional<std::size_t> copied;
  const cache::copy_out_request r = copy_request(id, k);
  f.cache->async_copy_out(
      r,
      [&](std::size_t i, std::size_t, std::span<const std::byte> obj) {
        if (i == 0) {
          std::unique_lock g(m);
          in_sink = true;
          cv.notify_all();
          cv.wait(g, [&] { return go; });
        }
        std::memcpy(got[i].data(), obj.data(), obj.size());
        return true;
      },
      [&](error_code, std::size_t n) { copied = n; });
  std::thread runner([&] {
    f.io.restart();
    f.io.run_one();  // the copy of key 0, which blocks in the sink
  });
  {
    std::unique_lock g(m);
    cv.wait(g, [&] { return in_sink; });
  }
  f.cache->release_all(id);  // the lookup goes; the copy's holds stay
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::read_locked);
  {
    std::lock_guard g(m);
    go = true;
  }
  cv.notify_all();
  runner.join();
  f.poll();
  REQUIRE(copied);
  CHECK(*copied == 2);
  for (std::size_t i = 0; i < k.size(); ++i) CHECK(got[i] == payload(k[i]));
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::ready);  // all holds given back

  // Without a lookup: what L1 holds is pinned and copied.
  recording_sink sink(3);
  const std::vector<chunk_key> mixed = {k[0], k[1], key(999)};
  cache::copy_out_request r2;
  r2.keys = mixed;
  r2.object_bytes = object_bytes;
  std::optional<std::size_t> copied2;
  f.cache->async_copy_out(r2, sink.make(), [&](error_code, std::size_t n) { copied2 = n; });
  f.poll();
  REQUIRE(copied2);
  CHECK(*copied2 == 2);
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::ready);
}

TEST_CASE("async_copy_in stores, counts what is present, and abandons what the fence refuses", "[cache]") {
  fixture f;
  const auto k = keys(50, 4);
  f.put_l1(std::span(k).first(1));  // already present
  cache::copy_in_request r;
  r.keys = k;
  r.object_bytes = object_bytes;
  std::optional<cache::copy_in_result> res;
  f.cache->async_copy_in(
      r,
      [&](std::size_t i, std::span<std::byte> obj) {
        if (i == 3) return false;  // the copy of key 3 fails
        const auto p = payload(k[i]);
        std::memcpy(obj.data(), p.data(), p.size());
        return true;
      },
      [&](std::size_t i) { return i != 2; },  // key 2's blocks were reused meanwhile
      [&](error_code ec, cache::copy_in_result x) {
        REQUIRE_FALSE(ec);
        res = x;
      });
  f.poll();
  REQUIRE(res);
  CHECK(res->stored == 1);
  CHECK(res->already_present == 1);
  CHECK(res->failed == 2);
  CHECK(f.cache->l1().contains(k[1]));
  CHECK_FALSE(f.cache->l1().contains(k[2]));  // fenced: never readable
  CHECK_FALSE(f.cache->l1().contains(k[3]));
  CHECK(f.metric("kvtier_l1_evicted_keys_total", {{"reason", "abandoned"}}) == 2);
}

TEST_CASE("the load-or-recompute gate offers from L2 only what loads faster than the engine computes", "[cache]") {
  // A memory backend of 1 MB/s: 8 KiB objects take ~8 ms each; the engine computes a
  // 256-token chunk in 0.26 us at 10^9 tokens/s, far faster than L2 delivers it.
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  auto mem =
      std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{"slow", 1 << 26, 1e6, {}});
  cache::cache_options o;
  o.l1.slot_bytes = object_bytes;
  o.l1.slot_count = 64;
  cache_type c(io.get_executor(), o, events, std::vector<l2::any_backend>{l2::any_backend(mem)});
  const auto k = keys(60, 4);
  std::vector<std::vector<std::byte>> data;
  for (const auto& x : k) data.push_back(payload(x));
  std::vector<std::span<const std::byte>> src(data.begin(), data.end());
  auto lookup = [&](std::span<const chunk_key> keys_, std::uint64_t rate) {
    cache::lookup_request r;
    r.keys = keys_;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    r.prefill_tokens_per_second = rate;
    const auto id = c.start_lookup(r);
    auto [ec, st] = test::run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
      co_return co_await c.async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
    }());
    c.release_all(id);
    test::run_sync(io, c.wait_idle());
    return st.chunks;
  };
  test::run_sync(io, [&]() -> asio::awaitable<void> {
    co_await mem->async_store(k, src, l2::clock::now() + std::chrono::seconds(10), asio::as_tuple(asio::use_awaitable));
  }());
  // No estimate yet: everything is offered, and the load measures the backend.
  CHECK(lookup(std::span(k).first(2), 1'000'000'000) == 2);
  const double bw = c.prefetch().bandwidth().bytes_per_second(0);
  CHECK(bw > 0);
  CHECK(bw < 2e6);
  // Now the engine is faster: L2 is declined, and counted.
  CHECK(lookup(k, 1'000'000'000) == 0);
  CHECK(reg.value("kvtier_lookup_l2_declined_tokens_total", {{"reason", "slower_than_recompute"}}) == 4 * 256);
  // Undeclared rate: offered as before.
  CHECK(lookup(k, 0) == 4);
  // At 32,000 tokens/s a chunk computes in 8 ms and loads in 8.2 ms or more: L2 alone loses,
  CHECK(lookup(k, 32'000) == 0);
  // but a prefix split between the tiers wins: chunks 1..3 come from L1 for free, so
  // loading chunk 0 pays for itself (the best prefix is the whole one).
  std::vector<l1::status> st(3);
  std::vector<std::span<std::byte>> buf(3);
  const auto tail = std::span(k).subspan(1);
  c.reserve_write(tail, object_bytes, st, buf);
  for (std::size_t i = 0; i < 3; ++i) std::memcpy(buf[i].data(), data[i + 1].data(), object_bytes);
  c.finish_write(tail, {}, st);
  test::run_sync(io, c.wait_idle());
  CHECK(lookup(k, 32'000) == 4);
}

}  // namespace file_copy_test
