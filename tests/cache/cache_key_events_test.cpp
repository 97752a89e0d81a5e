// The cache's key events end to end over a disk backend: L1 (tier l1_tier) and the backend
// (tier l2_tier(0), told by the backend's own key listener, which the cache sets) each end
// with the keys they list, through stores, L1 and disk evictions, prefetches that land and
// go, a corrupt file, an operator's removal, clear, skip_l1; and a backend the cache let go
// tells its bus nothing more.
#include <kvtier/cache/tiered_cache.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"
#include "support/key_collector.hpp"
#include "support/process.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_cache_key_events_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::key_collector;
using kvtier::test::run_sync;

namespace {

constexpr std::size_t object_bytes = 64 * 1024;  // 68 KiB on disk with the header block
constexpr std::uint8_t l1_tier = bus::l1_tier;
constexpr std::uint8_t disk_tier = bus::l2_tier(0);

using keyed_bus = bus::basic_event_bus<key_collector>;

template <class Store = pipeline::write_through>
struct traits : cache::default_traits {
  using bus_type = keyed_bus;
  using store_policy = Store;
  using wait_policy = pipeline::wait_complete;
};

chunk_key ck(std::uint64_t i) { return chunk_key{0xcace, 1, 0, hash128{i, i * 977}}; }

std::vector<chunk_key> ck_range(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(ck(first + i));
  return v;
}

template <class Traits = traits<>>
struct fixture {
  test::temp_dir dir{"kvtier-cache-key-events"};
  asio::io_context io;
  key_collector collector;
  std::shared_ptr<test::key_ledger> ledger = collector.ledger;
  keyed_bus events{test::large_queue(), collector};
  std::shared_ptr<l2::disk_backend> disk;
  std::unique_ptr<cache::tiered_cache<Traits>> cache;

  explicit fixture(std::uint64_t disk_objects = 10, std::size_t l1_slots = 8) {
    l2::disk_backend_options d;
    d.path = dir.path() / "l2";
    d.capacity_bytes = disk_objects * (object_bytes + 4096);
    disk = std::make_shared<l2::disk_backend>(io.get_executor(), d);
    cache::cache_options o;
    o.l1.slot_bytes = object_bytes;
    o.l1.slot_count = l1_slots;
    o.l1.eviction_watermark = 0.75;
    o.l1.eviction_target = 0.5;
    cache = std::make_unique<cache::tiered_cache<Traits>>(io.get_executor(), o, events,
                                                          std::vector<l2::any_backend>{l2::any_backend(disk)});
  }

  void settle() {
    run_sync(io, [&]() -> asio::awaitable<void> { co_await cache->wait_idle(); }());
  }

  void put(std::span<const chunk_key> ks) {
    std::vector<l1::status> st(ks.size());
    std::vector<std::span<std::byte>> buf(ks.size());
    cache->reserve_write(ks, object_bytes, st, buf);
    for (std::size_t i = 0; i < ks.size(); ++i) {
      REQUIRE(st[i] == l1::status::success);
      std::memset(buf[i].data(), static_cast<int>(ks[i].hash.lo & 0xff), object_bytes);
    }
    cache->finish_write(ks, {}, st);
    settle();
  }

  /// Looks keys up (loading what L2 has), waits for the loads, then gives every hold back.
  cache::lookup_status lookup(std::span<const chunk_key> ks) {
    cache::lookup_request r;
    r.keys = ks;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    const auto id = cache->start_lookup(r);
    auto [ec, st] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
      co_return co_await cache->async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    cache->release_all(id);
    settle();
    return st;
  }

  std::set<chunk_key> l1_listed() {
    std::set<chunk_key> s;
    cache->l1().for_each_object([&](const chunk_key& k, std::size_t, l1::object_state) { s.insert(k); });
    return s;
  }
  std::set<chunk_key> disk_listed() {
    auto [ec, objects] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, std::vector<l2::listed_object>>> {
      co_return co_await disk->async_list(l2::key_filter{}, l2::clock::now() + std::chrono::seconds(30),
                                          asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    std::set<chunk_key> s;
    for (const auto& o : objects) s.insert(o.key);
    return s;
  }
  const std::set<chunk_key>& announced(std::uint8_t tier) {
    events.drain();
    return ledger->of(tier);
  }
  /// Both tiers: what their events hold is what they list; no event broke the contract.
  void check_exact() {
    CHECK(announced(l1_tier) == l1_listed());
    CHECK(announced(disk_tier) == disk_listed());
    CHECK(ledger->unknown_removals == 0);
    CHECK(ledger->repeated_stores == 0);  // the store pipeline does not tell the stores again
    CHECK(ledger->empty_events == 0);
    CHECK(events.dropped() == 0);
  }
};

}  // namespace

TEST_CASE(
    "the cache's L1 and disk key events follow both listings through stores, evictions, prefetches, a "
    "corrupt file, removals and clear",
    "[cache][key_events]") {
  fixture f;
  // 16 objects through a 8-slot L1 (evicting above 6) into a disk of 10 (evicting above 9.5).
  for (std::uint64_t b = 0; b < 4; ++b) {
    f.put(ck_range(4 * b, 4));
    f.check_exact();
  }
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) > 0);
  const auto on_disk = f.disk_listed();
  REQUIRE(on_disk.size() >= 6);
  CHECK(f.announced(disk_tier) == on_disk);

  // A key only on disk: the prefetch lands it in L1 (announced), its holds go back and the
  // temporary object goes with them (expired).
  std::vector<chunk_key> only_disk;
  const auto in_l1 = f.l1_listed();
  for (const auto& k : on_disk)
    if (!in_l1.contains(k)) only_disk.push_back(k);
  REQUIRE(only_disk.size() >= 3);
  const std::uint64_t expired_before = f.ledger->removed_as(bus::key_removal::expired);
  CHECK(f.lookup(std::span(only_disk).first(1)).chunks == 1);
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == expired_before + 1);

  // A disk file damaged behind the backend's back: the prefetch's load finds it corrupt, the
  // backend deletes it and says so.
  {
    std::fstream file(f.disk->object_file(only_disk[1]), std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(file);
    file.seekp(4096 + 7);
    const char junk = 0x42;
    file.write(&junk, 1);
  }
  CHECK(f.lookup(std::span(only_disk).subspan(1, 1)).chunks == 0);
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::corrupt) == 1);
  CHECK_FALSE(f.announced(disk_tier).contains(only_disk[1]));

  // An operator's removal from the backend, then clear of L1.
  auto [rec, removed] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await f.cache->backends()[0].async_remove(std::span(only_disk).subspan(2, 1),
                                                           l2::clock::now() + std::chrono::seconds(30),
                                                           asio::as_tuple(asio::use_awaitable));
  }());
  REQUIRE_FALSE(rec);
  CHECK(removed.ok(0));
  CHECK(f.cache->clear(false) > 0);
  f.check_exact();
  CHECK(f.announced(l1_tier).empty());
  CHECK(f.ledger->removed_as(bus::key_removal::deleted) >= 2);

  // The cache gone, the backend (shared) tells its bus nothing more.
  const auto before = f.ledger->stored_events + f.ledger->removed_events;
  f.cache.reset();
  std::vector<std::byte> data(object_bytes);
  std::vector<std::span<const std::byte>> src{std::span<const std::byte>(data)};
  const auto k = ck(1000);
  auto [sec, stored] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await f.disk->async_store(std::span(&k, 1), src, l2::clock::now() + std::chrono::seconds(30),
                                           asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(stored.ok(0));
  f.events.drain();
  CHECK(f.ledger->stored_events + f.ledger->removed_events == before);
}

TEST_CASE(
    "with skip_l1, L1 announces the copy it drops once the disk has it (deleted), the disk announces the "
    "store",
    "[cache][key_events]") {
  fixture<traits<pipeline::skip_l1>> f(32, 8);
  f.put(ck_range(0, 3));
  f.check_exact();
  CHECK(f.announced(disk_tier).size() == 3);
  CHECK(f.announced(l1_tier).empty());
  CHECK(f.ledger->removed_as(bus::key_removal::deleted) == 3);
}

TEST_CASE("a cache whose bus wants no key event builds none", "[cache][key_events]") {
  fixture f;
  f.collector.enabled->store(false);
  f.put(ck_range(0, 8));
  f.lookup(ck_range(0, 2));
  f.cache->clear(false);
  f.events.drain();
  CHECK(f.events.delivered() == 0);
  CHECK(f.ledger->stored_events + f.ledger->removed_events == 0);

  // The default bus (null_bus) has no key event at all: nothing to set on the backends.
  static_assert(!bus::null_bus::handles_event<bus::tier_keys_stored>);
  static_assert(!bus::null_bus::handles_event<bus::tier_keys_removed>);
}

}  // namespace file_cache_key_events_test
