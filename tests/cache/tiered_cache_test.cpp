// The façade and both pipelines together, against memory backends (with the fault injector):
// lookups (L1 prefix + L2 continuation), every trimming case of the prefetch plan, the four
// counting rules (read off the metrics the bus exports), deadlines and hung backends, the
// store policies, and abandoned writes.
#include <kvtier/cache/tiered_cache.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include "cache/cache_checks.hpp"
#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstring>
#include <functional>
#include <atomic>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_tiered_cache_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {

constexpr std::size_t object_bytes = 8192;
using metrics_bus = bus::basic_event_bus<telemetry::metrics_subscriber>;

template <class Store = pipeline::write_through, class Wait = pipeline::wait_complete, class Eviction = l1::lru>
struct traits : cache::default_traits {
  using eviction_policy = Eviction;
  using bus_type = metrics_bus;
  using store_policy = Store;
  using wait_policy = Wait;
};

chunk_key key(std::uint64_t i, std::uint16_t rank = 0, std::uint16_t ws = 1) {
  return chunk_key{77, ws, rank, hash128{i, i * 31}};
}

std::vector<std::byte> payload(const chunk_key& k) {
  std::vector<std::byte> b(object_bytes);
  for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<std::byte>(k.hash.lo * 13 + k.rank * 7 + j);
  return b;
}

template <class Traits = traits<>>
struct fixture {
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  std::shared_ptr<l2::memory_backend> mem;
  std::shared_ptr<l2::fault_injecting_backend<l2::memory_backend>> faulty;
  std::unique_ptr<cache::tiered_cache<Traits>> cache;

  explicit fixture(std::size_t l1_slots = 64, typename cache::tiered_cache<Traits>::policies p = {},
                   std::chrono::nanoseconds wait_cap = std::chrono::seconds(60),
                   const std::function<void(cache::cache_options&)>& tweak = {}) {
    mem = std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{"mem", 1 << 26, 0, {}});
    faulty = std::make_shared<l2::fault_injecting_backend<l2::memory_backend>>(*mem);
    cache::cache_options o;
    o.l1.slot_bytes = object_bytes;
    o.l1.slot_count = l1_slots;
    o.l1.eviction_watermark = 1.0;
    o.l1.eviction_target = 0.9;
    if (tweak) tweak(o);
    if constexpr (std::is_same_v<typename Traits::wait_policy, pipeline::wait_complete>) p.wait.cap = wait_cap;
    cache = std::make_unique<cache::tiered_cache<Traits>>(io.get_executor(), o, events,
                                                          std::vector<l2::any_backend>{l2::any_backend(faulty)}, std::move(p));
  }

  double metric(const char* name, const telemetry::label_pairs& l = {}) { return reg.value(name, l).value_or(-1); }

  void put_l2(std::span<const chunk_key> keys) {
    std::vector<std::vector<std::byte>> data;
    for (const auto& k : keys) data.push_back(payload(k));
    std::vector<std::span<const std::byte>> src(data.begin(), data.end());
    run_sync(io, [&]() -> asio::awaitable<void> {
      co_await mem->async_store(keys, src, l2::clock::now() + std::chrono::seconds(10),
                                asio::as_tuple(asio::use_awaitable));
    }());
  }

  // Writes keys into L1 through the façade (as a store from the engine would).
  void put_l1(std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    std::vector<std::span<std::byte>> buf(keys.size());
    cache->reserve_write(keys, object_bytes, st, buf);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      REQUIRE(st[i] == l1::status::success);
      const auto p = payload(keys[i]);
      std::memcpy(buf[i].data(), p.data(), p.size());
    }
    cache->finish_write(keys, {}, st);
    settle();
  }

  // Runs the io_context until the pipelines are idle.
  void settle() {
    run_sync(io, [&]() -> asio::awaitable<void> { co_await cache->wait_idle(); }());
  }

  /// `rate`: the engine's declared prefill rate (tokens/s; 0: the load-or-recompute gate is off).
  cache::lookup_status lookup(std::span<const chunk_key> keys, std::size_t group = 1, std::uint64_t rate = 0) {
    cache::lookup_request r;
    r.keys = keys;
    r.group = group;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    r.prefill_tokens_per_second = rate;
    const auto id = cache->start_lookup(r);
    last_id = id;
    auto [ec, st] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
      co_return co_await cache->async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    settle();
    return st;
  }

  // Copies a locked object out and compares it with what was written.
  bool serves_right_bytes(const chunk_key& k) { return test::serves_bytes(*cache, k, payload(k)); }

  std::uint64_t last_id = 0;
};

/// A clock the test moves by hand (shared by copies, so the options can hold one).
struct manual_clock {
  std::shared_ptr<l1::clock_type::time_point> now =
      std::make_shared<l1::clock_type::time_point>(l1::clock_type::time_point{} + std::chrono::hours(1));
  l1::clock_type::time_point operator()() const { return *now; }
  void advance(l1::clock_type::duration d) const { *now += d; }
};

/// LRU that counts the reads the tier reports to its policy.
struct counting_lru : l1::lru {
  static constexpr std::string_view name = "counting_lru";
  // Every counting_lru's accesses (the tier calls on_access under its mutex; one test uses it).
  static inline std::atomic<std::size_t> accesses{0};
  void on_access(hook& h) noexcept {
    accesses.fetch_add(1, std::memory_order_relaxed);
    l1::lru::on_access(h);
  }
};

std::vector<chunk_key> keys(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(key(first + i));
  return k;
}

}  // namespace

TEST_CASE("a lookup takes the L1 prefix, then continues from L2", "[cache]") {
  fixture f;
  const auto k = keys(0, 4);
  f.put_l2(k);
  f.put_l1(std::span(k).first(2));
  const auto before_store = f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}});
  const auto st = f.lookup(k);
  CHECK(st.chunks == 4);
  CHECK(st.l1_chunks == 2);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
  // Counting rules: the lookup asked L2 for the 2 keys L1 lacked.
  CHECK(f.metric("kvtier_l2_prefetch_lookups_total") == 1);
  CHECK(f.metric("kvtier_l2_prefetch_lookup_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_hit_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_failed_keys_total") == 0);
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 0);
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l1"}}) == 2);
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l2"}}) == 2);
  CHECK(f.metric("kvtier_lookup_requested_tokens_total") == 4 * 256);
  // Prefetched objects are never offered back to the store pipeline.
  CHECK(f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == before_store);
  CHECK(f.metric("kvtier_l1_prefetched_keys_total") == 2);
  f.cache->release_all(f.last_id);
  CHECK(f.cache->status().lookups == 0);
}

TEST_CASE("an L2 hole trims the prefetch: hit keys are the pure prefix, trimmed keys counted apart", "[cache]") {
  fixture f;
  const auto k = keys(10, 5);
  std::vector<chunk_key> in_l2 = {k[0], k[1], k[3], k[4]};
  f.put_l2(in_l2);
  const auto st = f.lookup(k);
  CHECK(st.chunks == 2);
  CHECK(f.metric("kvtier_l2_prefetch_hit_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_failed_keys_total") == 0);
  CHECK(f.mem->pins(k[3]) == 0);  // trimmed keys were unpinned
  CHECK(f.mem->pins(k[0]) == 0);  // loaded keys too, once loaded
}

TEST_CASE("L1 out of memory trims the prefetch to the longest prefix that fits, L2 hit count untouched", "[cache]") {
  fixture<traits<pipeline::write_through, pipeline::wait_complete, l1::noop>> f(2);  // two slots, never evicts
  const auto k = keys(20, 4);
  f.put_l2(k);
  const auto st = f.lookup(k);
  CHECK(st.chunks == 2);                                       // the two that fit, not all or nothing
  CHECK(f.metric("kvtier_l2_prefetch_hit_keys_total") == 4);   // pure L2 prefix
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);  // what was reserved
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_failed_keys_total") == 0);  // not submitted, not failed
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "l1_out_of_memory"}}) == 2);
  CHECK(f.metric("kvtier_l1_allocation_failures_total", {{"purpose", "prefetch"}}) == 1);
  CHECK(f.metric("kvtier_l1_allocation_failed_keys_total", {{"purpose", "prefetch"}}) == 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(f.serves_right_bytes(k[i]));
}

TEST_CASE("a document longer than L1 gets the front that fits every round, even when L1 holds its back half",
          "[cache][prefix]") {
  // 48 chunks on L2, a 24-slot L1 holding chunks 24..47 unlocked (what the engine stored last
  // round). Reserving 0..23 needs the slots 24..47 sit in: they lie past what fits, so they
  // give way, and each round is served the 24 chunks that fit (not 0, nor 0 and 24 in turn).
  fixture f(24);
  const auto doc = keys(600, 48);
  f.put_l2(doc);
  f.put_l1(std::span(doc).subspan(24));
  for (int round = 0; round < 4; ++round) {
    INFO("round " << round);
    const auto st = f.lookup(doc);
    CHECK(st.chunks == 24);
    CHECK(st.l1_chunks == 0);
    for (std::size_t i = 0; i < st.chunks; ++i) CHECK(f.serves_right_bytes(doc[i]));
    f.cache->release_all(f.last_id);
    // The engine computes the rest and stores it (L1 takes what fits, L2 has it already).
    const auto computed = std::span(doc).subspan(st.chunks);
    std::vector<l1::status> ws(computed.size());
    std::vector<std::span<std::byte>> buf(computed.size());
    f.cache->reserve_write(computed, object_bytes, ws, buf);
    for (std::size_t i = 0; i < computed.size(); ++i)
      if (ws[i] == l1::status::success) {
        const auto p = payload(computed[i]);
        std::memcpy(buf[i].data(), p.data(), p.size());
      }
    f.cache->finish_write(computed, {}, ws);
    f.settle();
  }
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l2"}}) == 4 * 24);
  CHECK(f.metric("kvtier_l1_allocation_failures_total", {{"purpose", "prefetch"}}) == 0);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "l1_out_of_memory"}}) == 0);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 4 * 24);
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 4 * 24);  // the back half, given way each round
}

TEST_CASE("the load-or-recompute gate recovers after one slow sample: its probes measure the backend again",
          "[cache][gate]") {
  // At 3,200 tokens/s a 256-token chunk computes in 80 ms. The backend's first load is slow
  // (2 objects of 8 KiB in >= 0.5 s: >= 250 ms a chunk), then it is fast again (memory).
  constexpr std::uint64_t rate = 3'200;
  fixture f;
  const auto k = keys(700, 2);
  f.put_l2(k);
  f.faulty->inject({.op = l2::fault_op::load, .kind = l2::fault_kind::delay, .delay = std::chrono::milliseconds(500),
                    .times = 1});
  CHECK(f.lookup(k, 1, rate).chunks == 2);  // no estimate yet: offered, and measured
  f.cache->release_all(f.last_id);
  CHECK(f.cache->status().backends[0].read_bytes_per_second < 40'000);
  // Every L2 chunk now looks slower than recompute. The gate declines, but one declining
  // lookup in probe_every still loads a chunk, and the samples bring the estimate back.
  const std::size_t probe_every = f.cache->options().prefetch.probe_every;
  REQUIRE(probe_every > 1);
  std::size_t declined = 0;
  std::size_t probed = 0;
  bool resumed = false;
  for (std::size_t i = 0; i < 20 * probe_every && !resumed; ++i) {
    const auto st = f.lookup(k, 1, rate);
    f.cache->release_all(f.last_id);
    resumed = st.chunks == 2;
    if (resumed) break;
    ++declined;
    CHECK(st.chunks <= 1);  // declined, or a probe of one chunk
    probed += st.chunks;
  }
  CHECK(resumed);
  CHECK(probed >= 1);
  CHECK(declined >= probe_every - 1);  // the first declining lookups do not probe
  CHECK(probed <= declined / probe_every + 1);  // a bounded share
  CHECK(f.metric("kvtier_lookup_l2_probe_tokens_total") == static_cast<double>(probed * 256));
  CHECK(f.metric("kvtier_lookup_l2_declined_tokens_total", {{"reason", "slower_than_recompute"}}) ==
        static_cast<double>((2 * declined - probed) * 256));
  CHECK(f.lookup(k, 1, rate).chunks == 2);  // and it stays open
  f.cache->release_all(f.last_id);
}

TEST_CASE("a backend that stalls lowers the estimate: the gate stops offering it", "[cache][gate]") {
  fixture f;
  const auto k = keys(720, 4);
  f.put_l2(k);
  // Measured fast (no rate declared: the gate is off, the loads are measured all the same).
  for (int i = 0; i < 2; ++i) {
    REQUIRE(f.lookup(k).chunks == 4);
    f.cache->release_all(f.last_id);
  }
  const double fast = f.cache->status().backends[0].read_bytes_per_second;
  REQUIRE(fast > 0);
  // The disk stalls: the next load lands nothing and gives up after 0.5 s.
  f.faulty->inject({.op = l2::fault_op::load,
                    .kind = l2::fault_kind::fail,
                    .outcome = l2::key_outcome::timeout,
                    .error = make_error_code(errc::timeout),
                    .times = 1});
  f.faulty->inject({.op = l2::fault_op::load, .kind = l2::fault_kind::delay, .delay = std::chrono::milliseconds(500),
                    .times = 1});
  CHECK(f.lookup(k).chunks == 0);
  f.cache->release_all(f.last_id);
  CHECK(f.cache->status().backends[0].read_bytes_per_second < fast / 10);
  // At 32,000 tokens/s a chunk computes in 8 ms; the backend's last half second delivered
  // nothing, so it now loses: nothing is offered, every token is declined.
  const std::size_t probe_every = f.cache->options().prefetch.probe_every;
  REQUIRE(probe_every > 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(f.lookup(k, 1, 32'000).chunks == 0);
    f.cache->release_all(f.last_id);
  }
  CHECK(f.metric("kvtier_lookup_l2_declined_tokens_total", {{"reason", "slower_than_recompute"}}) == 3 * 4 * 256);
  CHECK(f.metric("kvtier_lookup_l2_probe_tokens_total") == 0);
}

TEST_CASE("a failed load counts only submitted keys; loaded keys after the hole are released", "[cache]") {
  fixture f;
  const auto k = keys(30, 3);
  f.put_l2(k);
  f.faulty->inject({.op = l2::fault_op::load,
                    .kind = l2::fault_kind::fail,
                    .match = [&](const chunk_key& x) { return x == k[1]; },
                    .outcome = l2::key_outcome::io_error});
  const auto st = f.lookup(k);
  CHECK(st.chunks == 1);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 3);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_failed_keys_total") == 1);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "io_error"}}) == 1);
  CHECK(f.serves_right_bytes(k[0]));
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::absent);  // abandoned, never readable
  CHECK(f.cache->l1().state(k[2]) == l1::object_state::absent);  // temporary, released: freed
  CHECK(f.metric("kvtier_l1_evicted_keys_total", {{"reason", "abandoned"}}) == 1);
}

TEST_CASE("a corrupt object is a miss, never served", "[cache]") {
  fixture f;
  const auto k = keys(40, 2);
  f.put_l2(k);
  f.faulty->inject({.op = l2::fault_op::load,
                    .kind = l2::fault_kind::corrupt,
                    .match = [&](const chunk_key& x) { return x == k[0]; }});
  const auto st = f.lookup(k);
  CHECK(st.chunks == 0);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "corrupt_object"}}) == 1);
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::absent);
  CHECK(f.mem->usage().objects == 1);  // the corrupt copy was dropped from L2
}

TEST_CASE("a hung backend does not hang the lookup, and its late read never lands in a reused slot", "[cache]") {
  fixture<traits<pipeline::write_through, pipeline::wait_complete>> f(64, {}, std::chrono::milliseconds(50));
  const auto k = keys(50, 2);
  f.put_l2(k);
  f.faulty->inject({.op = l2::fault_op::load, .kind = l2::fault_kind::hang});
  cache::lookup_request r;
  r.keys = k;
  r.object_bytes = object_bytes;
  r.chunk_tokens = 256;
  const auto id = f.cache->start_lookup(r);
  auto [ec, st] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
    co_return co_await f.cache->async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
  }());
  CHECK_FALSE(ec);
  CHECK(st.chunks == 0);  // answered at the wait budget with what landed: nothing
  REQUIRE(f.faulty->hung() == 1);
  // The slots stay reserved while the kernel (here: the hung backend) may write them.
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::write_locked);
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::write_locked);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 0);  // not complete yet: not counted
  f.faulty->release_hung();
  f.settle();
  // The late read landed in the still-reserved slots, which were then dropped, unread.
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::absent);
  CHECK(f.cache->l1().usage().slots_used == 0);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 0);
  CHECK(f.metric("kvtier_l2_prefetch_failed_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "timeout"}}) == 2);
}

TEST_CASE("best_effort answers from L1 at once and keeps what L2 brings for later", "[cache]") {
  fixture<traits<pipeline::write_through, pipeline::best_effort>> f;
  const auto k = keys(60, 3);
  f.put_l2(k);
  const auto st = f.lookup(k);
  CHECK(st.chunks == 0);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 3);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
  CHECK(f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == 0);  // not re-stored
  f.cache->release_all(f.last_id);
  const auto again = f.lookup(k);  // now an L1 hit
  CHECK(again.chunks == 3);
  CHECK(again.l1_chunks == 3);
}

TEST_CASE("with world size 2 a chunk is a hit only when both shards are present", "[cache]") {
  fixture f;
  std::vector<chunk_key> k;
  for (std::uint64_t c = 0; c < 3; ++c)
    for (std::uint16_t r = 0; r < 2; ++r) k.push_back(key(70 + c, r, 2));
  std::vector<chunk_key> in_l2 = {k[0], k[1], k[2], k[4], k[5]};  // chunk 1 lacks rank 1
  f.put_l2(in_l2);
  const auto st = f.lookup(k, 2);
  CHECK(st.chunks == 1);
  CHECK(f.cache->l1().state(k[2]) == l1::object_state::absent);  // partial chunk given back
  CHECK(f.metric("kvtier_lookup_requested_chunks_total") == 3);
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l2"}}) == 1);
}

TEST_CASE("write_through stores written keys in L2 and keeps them in L1", "[cache][store]") {
  fixture f;
  const auto k = keys(100, 5);
  f.put_l1(k);
  CHECK(f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == 5);
  CHECK(f.metric("kvtier_l2_store_succeeded_keys_total", {{"backend", "mem"}}) == 5);
  CHECK(f.metric("kvtier_l2_store_failed_keys_total", {{"backend", "mem"}}) == 0);
  CHECK(f.mem->usage().objects == 5);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
  CHECK(f.metric("kvtier_l1_write_keys_total") == 5);
}

TEST_CASE("skip_l1 drops keys from L1 once L2 has them; a later lookup loads them back", "[cache][store]") {
  fixture<traits<pipeline::skip_l1, pipeline::wait_complete, l1::noop>> f;
  const auto k = keys(110, 4);
  f.put_l1(k);
  CHECK(f.mem->usage().objects == 4);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::absent);
  CHECK(f.metric("kvtier_l1_evicted_keys_total", {{"reason", "deleted"}}) == 4);
  const auto st = f.lookup(k);
  CHECK(st.chunks == 4);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 4);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
}

TEST_CASE("a failed store is counted, not retried, and L1 keeps the data", "[cache][store]") {
  fixture f;
  f.faulty->inject({.op = l2::fault_op::store, .kind = l2::fault_kind::fail, .outcome = l2::key_outcome::no_space});
  const auto k = keys(120, 3);
  f.put_l1(k);
  CHECK(f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == 3);
  CHECK(f.metric("kvtier_l2_store_failed_keys_total", {{"backend", "mem"}}) == 3);
  CHECK(f.metric("kvtier_l2_store_succeeded_keys_total", {{"backend", "mem"}}) == 0);
  CHECK(f.mem->usage().objects == 0);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
  CHECK(f.cache->status().store_inflight_tasks == 0);
}

TEST_CASE("selective stores a chunk once it has been seen twice", "[cache][store]") {
  fixture<traits<pipeline::selective<2>>> f;
  const auto k = keys(130, 2);
  f.put_l1(k);
  CHECK(f.mem->usage().objects == 0);
  f.lookup(k);  // an L1 hit is the second sighting
  f.cache->release_all(f.last_id);
  f.settle();
  CHECK(f.mem->usage().objects == 2);
}

TEST_CASE("an abandoned write is never readable and never stored", "[cache][store]") {
  fixture f;
  const auto k = keys(140, 2);
  std::vector<l1::status> st(2);
  std::vector<std::span<std::byte>> buf(2);
  REQUIRE(f.cache->reserve_write(k, object_bytes, st, buf) == 2);
  f.cache->abandon_write(k);
  f.settle();
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::absent);
  CHECK(f.metric("kvtier_l2_store_keys_total", {{"backend", "mem"}}) == 0);
  CHECK(f.metric("kvtier_cache_write_finish_failed_keys_total") == 2);
}

// --- issue 13: owned holds, split prefixes, exact counts --------------------------------------

TEST_CASE("a lookup whose holds expired cannot release a newer lookup's holds on the same keys", "[cache][holds]") {
  manual_clock clock;
  fixture f(64, {}, std::chrono::seconds(60), [&](cache::cache_options& o) {
    o.l1.clock = clock;
    o.l1.read_lock_ttl = std::chrono::seconds(10);
    o.lookup_ttl = std::chrono::seconds(10);
  });
  const auto k = keys(200, 3);
  f.put_l1(k);
  REQUIRE(f.lookup(k).chunks == 3);
  const auto a = f.last_id;
  clock.advance(std::chrono::seconds(11));  // A went silent past its TTL
  f.cache->expire();
  REQUIRE(f.lookup(k).chunks == 3);
  const auto b = f.last_id;
  // A's late retrieve and end_request give back what A believes it holds.
  f.cache->release(a, k);
  f.cache->release_all(a);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::read_locked);  // B's holds
  // Nothing can take B's chunks away: its retrieve succeeds.
  f.cache->clear(false);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
  f.cache->release(b, k);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
}

TEST_CASE("a lookup's holds go when the cache expires it, not before", "[cache][holds]") {
  manual_clock clock;
  fixture f(64, {}, std::chrono::seconds(60), [&](cache::cache_options& o) {
    o.l1.clock = clock;
    o.l1.read_lock_ttl = std::chrono::seconds(10);
    o.lookup_ttl = std::chrono::seconds(20);
  });
  const auto k = keys(210, 2);
  f.put_l1(k);
  REQUIRE(f.lookup(k).chunks == 2);
  clock.advance(std::chrono::seconds(15));  // past the L1 read TTL, within the lookup's
  f.cache->expire();
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::read_locked);
  CHECK(f.cache->known(f.last_id));
  clock.advance(std::chrono::seconds(10));
  f.cache->expire();
  CHECK_FALSE(f.cache->known(f.last_id));
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
}

TEST_CASE("a prefix split between L2 and L1 is served whole: L2-only keys load, L1 keys are read", "[cache][prefix]") {
  fixture f;
  const auto k = keys(300, 15);
  f.put_l2(k);
  f.put_l1(std::span(k).subspan(1));  // chunk 0 on L2 only (as after a corrupt L1 copy was dropped)
  for (int round = 0; round < 2; ++round) {
    const auto st = f.lookup(k);
    CHECK(st.chunks == 15);
    CHECK(st.l1_chunks == 14);
    for (const auto& x : k) CHECK(f.serves_right_bytes(x));
    f.cache->release_all(f.last_id);
  }
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);  // chunk 0, once per round
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 0);
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l1"}}) == 28);
  CHECK(f.metric("kvtier_lookup_hit_chunks_total", {{"tier", "l2"}}) == 2);
}

TEST_CASE("a prefix that alternates between L2-only and L1-only keys is served whole", "[cache][prefix]") {
  fixture f;
  const auto k = keys(320, 5);
  f.put_l2(std::vector<chunk_key>{k[0], k[4]});
  f.faulty->inject({.op = l2::fault_op::store, .kind = l2::fault_kind::fail, .outcome = l2::key_outcome::io_error});
  f.put_l1(std::span(k).subspan(1, 3));  // chunks 1..3 in L1 only (their store to L2 failed)
  f.faulty->clear();
  REQUIRE(f.mem->usage().objects == 2);
  const auto st = f.lookup(k);
  CHECK(st.chunks == 5);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 2);
  CHECK(f.metric("kvtier_l2_prefetch_hit_keys_total") == 1);  // the pure L2 prefix is still reported as such
}

TEST_CASE("kvtier_cache_read_succeeded_keys_total counts only the prefix a retrieve can copy", "[cache][counts]") {
  fixture f;
  const auto k = keys(400, 3);
  f.put_l1(std::vector<chunk_key>{k[0], k[2]});  // a hole at k[1]
  std::vector<l1::status> st(3);
  std::vector<std::span<const std::byte>> v(3);
  CHECK(f.cache->pin_for_copy(k, st, v) == 1);
  CHECK(st[0] == l1::status::success);
  CHECK(st[1] == l1::status::not_found);
  CHECK(f.cache->l1().info(k[2])->pinned_readers == 0);  // never pinned: nobody copies it
  f.cache->unpin_after_copy(std::span(k).first(1));
  CHECK(f.metric("kvtier_cache_read_requests_total") == 1);
  CHECK(f.metric("kvtier_cache_read_succeeded_keys_total") == 1);
  CHECK(f.metric("kvtier_cache_read_failed_keys_total") == 2);
}

TEST_CASE("a lookup read-locks only the L1 prefix: reads after the first miss are not counted or seen by the policy",
          "[cache][counts]") {
  fixture<traits<pipeline::write_through, pipeline::wait_complete, counting_lru>> f;
  const auto k = keys(410, 3);
  f.put_l1(std::vector<chunk_key>{k[0], k[2]});  // k[1] nowhere
  // The store pipeline's own reads of k[0] and k[2] (write-through) happened; count from here.
  const std::size_t before = counting_lru::accesses.load();
  const double reserved0 = f.metric("kvtier_l1_read_reserved_keys_total");
  const double read0 = f.metric("kvtier_l1_read_keys_total");
  const auto st = f.lookup(k);
  CHECK(st.chunks == 1);
  CHECK(f.metric("kvtier_l1_read_reserved_keys_total") - reserved0 == 1);
  CHECK(f.metric("kvtier_l1_read_keys_total") - read0 == 0);  // nothing locked and given back
  CHECK(counting_lru::accesses.load() == before + 1);
  CHECK(f.cache->l1().state(k[2]) == l1::object_state::ready);
  f.cache->release_all(f.last_id);
  CHECK(f.metric("kvtier_l1_read_keys_total") - read0 == 1);
}

TEST_CASE("the l1_out_of_memory reason counts only keys that needed a slot and got none", "[cache][counts]") {
  fixture<traits<pipeline::write_through, pipeline::wait_complete, l1::noop>> f(2);  // two slots, never evicts
  const auto k = keys(420, 4);
  f.put_l2(k);
  f.put_l1(std::span(k).subspan(1, 1));  // k[1] in L1: one slot left
  const auto st = f.lookup(k);
  CHECK(st.chunks == 2);  // k[0] loaded into the free slot, k[1] read from L1
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "l1_out_of_memory"}}) == 2);  // k[2], k[3]
  CHECK(f.metric("kvtier_l1_allocation_failed_keys_total", {{"purpose", "prefetch"}}) == 2);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 1);
  CHECK(f.metric("kvtier_l2_prefetch_trimmed_keys_total") == 2);
}

TEST_CASE("abandon_write counts only the keys it abandoned", "[cache][counts]") {
  fixture f;
  const auto k = keys(430, 2);
  std::vector<l1::status> st(1);
  std::vector<std::span<std::byte>> buf(1);
  REQUIRE(f.cache->reserve_write(std::span(k).first(1), object_bytes, st, buf) == 1);
  CHECK(f.cache->abandon_write(k) == 1);  // k[1] was never reserved
  CHECK(f.metric("kvtier_cache_write_finish_failed_keys_total") == 1);
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::absent);
}

TEST_CASE("release gives back exactly the keys named, in any order, and ignores keys the lookup does not hold",
          "[cache][holds]") {
  fixture f;
  std::vector<chunk_key> k;
  for (std::uint64_t c = 0; c < 4; ++c)
    for (std::uint16_t r = 0; r < 2; ++r) k.push_back(key(500 + c, r, 2));
  f.put_l1(k);
  REQUIRE(f.lookup(k, 2).chunks == 4);
  // Rank 1's shards of chunks 3, 0 and 2 (not where a retrieve walk expects them), a key
  // twice, and a key the lookup never had.
  const std::vector<chunk_key> back = {k[7], k[1], k[5], k[5], key(999, 1, 2)};
  f.cache->release(f.last_id, back);
  for (std::size_t i = 0; i < k.size(); ++i) {
    const bool released = i == 7 || i == 1 || i == 5;
    INFO("key " << i);
    CHECK(f.cache->l1().state(k[i]) == (released ? l1::object_state::ready : l1::object_state::read_locked));
  }
  // A retrieve of rank 0 in chunk order, then the rest at end_request.
  const std::vector<chunk_key> rank0 = {k[0], k[2], k[4], k[6]};
  f.cache->release(f.last_id, rank0);
  CHECK(f.cache->l1().state(k[6]) == l1::object_state::ready);
  CHECK(f.cache->l1().state(k[3]) == l1::object_state::read_locked);
  f.cache->release_all(f.last_id);
  for (const auto& x : k) CHECK(f.cache->l1().state(x) == l1::object_state::ready);
}

}  // namespace file_tiered_cache_test
