// The L2 backends' key listener (l2::key_listener, set_key_listener): told synchronously, in
// index order, when a store becomes visible and when a listed object goes (evicted by the
// capacity, corrupt on load, deleted on request). A subscriber that applies what the listener
// publishes holds exactly what async_list lists: the memory backend, the fault injector and
// any_backend around it, the disk backend (capacity evictions, a file corrupted behind its
// back, removal, a restart's scan left to the server to announce).
#include <kvtier/l2/types.hpp>

#include <kvtier/core/buffer.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"
#include "support/key_collector.hpp"
#include "support/process.hpp"
#include "support/stub_backend.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_backend_key_events_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::key_bus;
using kvtier::test::key_collector;
using kvtier::test::run_sync;

namespace {

chunk_key ke(std::uint64_t i) { return chunk_key{0xe7e, 1, 0, hash128{i * 0x9e3779b97f4a7c15ULL + 3, i}}; }

std::vector<chunk_key> ke_range(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(ke(first + i));
  return v;
}

l2::deadline later() { return l2::clock::now() + std::chrono::seconds(60 * config::timeout_scale); }

/// What the cache does with a backend's listener: publish the key events of tier `tier`.
l2::key_listener publish_to(key_bus& b, std::uint8_t tier) {
  return [&b, tier](l2::key_change c, bus::key_removal why, std::span<const chunk_key> keys) {
    if (c == l2::key_change::stored)
      b.publish(bus::tier_keys_stored{tier, {keys.begin(), keys.end()}});
    else
      b.publish(bus::tier_keys_removed{tier, why, {keys.begin(), keys.end()}});
  };
}

/// A backend's operations run to completion on `io`; its objects are `bytes` each, their
/// bytes a function of the key.
template <class B>
struct driver {
  asio::io_context& io;
  B& b;
  std::size_t bytes;

  std::vector<aligned_buffer> fill(std::span<const chunk_key> keys) const {
    std::vector<aligned_buffer> data;
    for (const auto& k : keys) {
      data.emplace_back(bytes);
      std::memset(data.back().data(), static_cast<int>(k.hash.hi & 0xff), bytes);
    }
    return data;
  }
  l2::batch_result store(std::span<const chunk_key> keys) {
    auto data = fill(keys);
    std::vector<std::span<const std::byte>> src;
    for (auto& d : data) src.emplace_back(d.data(), bytes);
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_store(keys, src, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  l2::batch_result load(std::span<const chunk_key> keys) {
    std::vector<aligned_buffer> data(keys.size());
    std::vector<std::span<std::byte>> dst;
    for (auto& d : data) {
      d = aligned_buffer(bytes);
      dst.emplace_back(d.data(), bytes);
    }
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_load(keys, dst, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  l2::batch_result remove(std::span<const chunk_key> keys) {
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_remove(keys, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  std::set<chunk_key> listed() {
    auto [ec, objects] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, std::vector<l2::listed_object>>> {
      co_return co_await b.async_list(l2::key_filter{}, later(), asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    std::set<chunk_key> s;
    for (const auto& o : objects) s.insert(o.key);
    return s;
  }
};

/// The bus and its collector, for backend 0 (tier 1).
struct key_events {
  key_collector collector;
  std::shared_ptr<test::key_ledger> ledger = collector.ledger;
  key_bus bus{test::large_queue(), collector};
  static constexpr std::uint8_t tier = bus::l2_tier(0);

  const std::set<chunk_key>& announced() {
    bus.drain();
    return ledger->of(tier);
  }
  /// The announced keys are the listing, and no event broke the contract.
  template <class B>
  void check_exact(driver<B>& d) {
    CHECK(announced() == d.listed());
    CHECK(ledger->unknown_removals == 0);
    CHECK(ledger->repeated_stores == 0);
    CHECK(ledger->empty_events == 0);
    CHECK(bus.dropped() == 0);
  }
};

std::size_t ok_count(const l2::batch_result& r) { return r.count(l2::key_outcome::ok); }

}  // namespace

static_assert(l2::key_announcing_backend<l2::memory_backend>);
static_assert(l2::key_announcing_backend<l2::disk_backend>);
static_assert(l2::key_announcing_backend<l2::fault_injecting_backend<l2::memory_backend>>);
static_assert(l2::key_announcing_backend<l2::any_backend>);
static_assert(!l2::key_announcing_backend<l2::l2_backend_archetype>);

TEST_CASE("the memory backend tells its stores, FIFO evictions, corrupt drops and removals", "[l2][key_events]") {
  asio::io_context io;
  l2::memory_backend_options o;
  o.capacity_bytes = 8 * 1000;
  l2::memory_backend mem(io.get_executor(), o);
  key_events ev;
  mem.set_key_listener(publish_to(ev.bus, ev.tier));
  driver<l2::memory_backend> d{io, mem, 1000};

  CHECK(ok_count(d.store(ke_range(0, 6))) == 6);
  ev.check_exact(d);
  CHECK(ev.ledger->stored_keys == 6);
  CHECK(d.store(ke_range(0, 2)).count(l2::key_outcome::exists) == 2);  // not stored again
  CHECK(ok_count(d.store(ke_range(10, 5))) == 5);                      // 11 objects for 8: 3 evicted
  ev.check_exact(d);
  CHECK(ev.ledger->removed_as(bus::key_removal::evicted) == 3);

  REQUIRE(mem.corrupt_stored(ke(5)));
  CHECK(d.load(std::vector{ke(5)}).outcomes[0] == l2::key_outcome::corrupt);
  ev.check_exact(d);
  CHECK(ev.ledger->removed_as(bus::key_removal::corrupt) == 1);

  CHECK(ok_count(d.remove(ke_range(10, 2))) == 2);
  CHECK(d.remove(ke_range(10, 2)).count(l2::key_outcome::not_found) == 2);  // nothing more to tell
  ev.check_exact(d);
  CHECK(ev.ledger->removed_as(bus::key_removal::deleted) == 2);

  // Without a listener nothing is told (and nothing breaks).
  mem.set_key_listener({});
  CHECK(ok_count(d.store(ke_range(20, 2))) == 2);
  CHECK(ev.announced().size() + 2 == d.listed().size());
}

TEST_CASE(
    "the fault injector and any_backend pass the listener to the backend they wrap; a backend without one "
    "tells nothing",
    "[l2][key_events]") {
  asio::io_context io;
  auto mem = std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{});
  auto faulty = std::make_shared<l2::fault_injecting_backend<l2::memory_backend>>(*mem);
  l2::any_backend any(faulty);
  CHECK(any.announces_keys());
  key_events ev;
  any.set_key_listener(publish_to(ev.bus, ev.tier));
  driver<l2::any_backend> d{io, any, 512};

  CHECK(ok_count(d.store(ke_range(0, 4))) == 4);
  faulty->inject(l2::fault{.op = l2::fault_op::store, .kind = l2::fault_kind::fail});  // the inner never sees it
  CHECK(ok_count(d.store(ke_range(10, 2))) == 0);
  faulty->clear();
  faulty->inject(l2::fault{.op = l2::fault_op::load, .kind = l2::fault_kind::corrupt, .match = [](const chunk_key& k) {
                             return k == ke(1);
                           }});
  CHECK(d.load(std::vector{ke(1)}).outcomes[0] == l2::key_outcome::corrupt);
  CHECK(ok_count(d.remove(std::vector{ke(2)})) == 1);
  ev.check_exact(d);
  CHECK(ev.announced() == std::set<chunk_key>{ke(0), ke(3)});
  CHECK(ev.ledger->removed_as(bus::key_removal::corrupt) == 1);
  CHECK(ev.ledger->removed_as(bus::key_removal::deleted) == 1);

  // The test stub has no listener: any_backend accepts one and nothing is ever told.
  auto stub = std::make_shared<test::stub_backend>(io.get_executor());
  l2::any_backend quiet(stub);
  CHECK_FALSE(quiet.announces_keys());
  quiet.set_key_listener(publish_to(ev.bus, 2));
  CHECK(ev.ledger->of(2).empty());
}

TEST_CASE("the disk backend tells its stores, capacity evictions, corrupt drops and removals, in index order",
          "[l2][key_events][disk]") {
  test::temp_dir dir("kvtier-key-events");
  asio::io_context io;
  constexpr std::size_t bytes = 60 * 1024;  // 64 KiB allocated per object (with its header)
  l2::disk_backend_options o;
  o.path = dir.path();
  o.capacity_bytes = 10 * (std::uint64_t{64} << 10);
  auto disk = std::make_unique<l2::disk_backend>(io.get_executor(), o);
  key_events ev;
  disk->set_key_listener(publish_to(ev.bus, ev.tier));
  driver<l2::disk_backend> d{io, *disk, bytes};

  CHECK(ok_count(d.store(ke_range(0, 6))) == 6);
  ev.check_exact(d);
  CHECK(ev.ledger->stored_keys == 6);
  for (int round = 0; round < 3; ++round) {  // past the high watermark: evicts down to the low one
    CHECK(ok_count(d.store(ke_range(100 + 4 * static_cast<std::uint64_t>(round), 4))) == 4);
    ev.check_exact(d);
  }
  CHECK(ev.ledger->removed_as(bus::key_removal::evicted) > 0);
  CHECK(ev.ledger->removed_as(bus::key_removal::evicted) == disk->stats().evicted_objects.load());

  // A byte of an object's file flipped behind the backend's back: its load finds it corrupt
  // and deletes it.
  const auto listed = d.listed();
  const chunk_key victim = *listed.begin();
  {
    std::fstream f(disk->object_file(victim), std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(f);
    f.seekg(4096 + 100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(4096 + 100);
    f.write(&c, 1);
  }
  CHECK(d.load(std::vector{victim}).outcomes[0] == l2::key_outcome::corrupt);
  ev.check_exact(d);
  CHECK_FALSE(ev.announced().contains(victim));
  CHECK(ev.ledger->removed_as(bus::key_removal::corrupt) == 1);

  // A file removed behind its back: its load forgets it (deleted, not corrupt).
  const chunk_key gone = *std::next(d.listed().begin());
  std::filesystem::remove(disk->object_file(gone));
  CHECK(d.load(std::vector{gone}).outcomes[0] == l2::key_outcome::not_found);
  ev.check_exact(d);
  CHECK(ev.ledger->removed_as(bus::key_removal::corrupt) == 1);

  // async_remove (an operator's evict).
  const auto before = d.listed();
  std::vector<chunk_key> two(before.begin(), std::next(before.begin(), 2));
  CHECK(ok_count(d.remove(two)) == 2);
  ev.check_exact(d);
  CHECK(ev.ledger->removed_as(bus::key_removal::deleted) == 3);  // the vanished file and these two

  // A restart: the scan's objects are not told (the server lists the backend and announces
  // them itself); what the events of the first run left is exactly what the restart finds.
  const std::set<chunk_key> held = ev.announced();
  disk->set_key_listener({});
  disk.reset();
  key_events ev2;
  auto again = std::make_unique<l2::disk_backend>(io.get_executor(), o);
  again->set_key_listener(publish_to(ev2.bus, ev2.tier));
  driver<l2::disk_backend> d2{io, *again, bytes};
  CHECK(ev2.announced().empty());
  CHECK(d2.listed() == held);
  CHECK(ev2.ledger->stored_events + ev2.ledger->removed_events == 0);
}

}  // namespace file_backend_key_events_test
