// The Redis backend's key listener against a real redis-server: a SET NX that answered OK is
// told stored, a DEL the backend sent that deleted the key removed (async_remove: deleted; a
// value a load found bad: corrupt); an existing key, a miss, or a key written or deleted by
// another client is not told. Applied in order, what it told is what async_list lists while
// nobody else writes.
#include <kvtier/l2/redis/redis_backend.hpp>

#include <catch2/catch.hpp>

#include "l2/redis_support.hpp"
#include "support/asio.hpp"
#include "support/key_collector.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <set>
#include <vector>

// This file's names (kept apart from the other Redis test files').
namespace file_redis_key_events_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;
using kvtier::test::run_until;

namespace {

constexpr std::size_t bytes = 4096;

chunk_key rk(std::uint64_t i) { return chunk_key{0x4e4, 1, 0, hash128{i * 31 + 5, i}}; }

l2::deadline later() { return l2::clock::now() + std::chrono::seconds(30); }

struct fixture {
  asio::io_context io;
  std::unique_ptr<l2::redis_backend> b;
  test::key_collector collector;
  std::shared_ptr<test::key_ledger> ledger = collector.ledger;
  test::key_bus events{test::large_queue(), collector};
  static constexpr std::uint8_t tier = bus::l2_tier(0);

  explicit fixture(const test::redis_server& s) {
    l2::redis_backend_options o;
    o.nodes = {s.endpoint()};
    o.connections_per_node = 2;
    o.key_prefix = "kvtier-key-events";
    b = std::make_unique<l2::redis_backend>(io.get_executor(), o);
    REQUIRE(run_until(io, [&] { return b->health().healthy; }));
    b->set_key_listener([this](l2::key_change c, bus::key_removal why, std::span<const chunk_key> keys) {
      if (c == l2::key_change::stored)
        events.publish(bus::tier_keys_stored{tier, {keys.begin(), keys.end()}});
      else
        events.publish(bus::tier_keys_removed{tier, why, {keys.begin(), keys.end()}});
    });
  }

  l2::batch_result store(const std::vector<chunk_key>& keys) {
    std::vector<std::vector<std::byte>> data(keys.size(), std::vector<std::byte>(bytes, std::byte{0x5a}));
    std::vector<std::span<const std::byte>> src(data.begin(), data.end());
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_store(keys, src, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  l2::batch_result load(const std::vector<chunk_key>& keys) {
    std::vector<std::vector<std::byte>> data(keys.size(), std::vector<std::byte>(bytes));
    std::vector<std::span<std::byte>> dst(data.begin(), data.end());
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_load(keys, dst, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  l2::batch_result remove(const std::vector<chunk_key>& keys) {
    auto [ec, r] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_remove(keys, later(), asio::as_tuple(asio::use_awaitable));
    }());
    return r;
  }
  std::set<chunk_key> listed() {
    auto [ec, objects] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, std::vector<l2::listed_object>>> {
      co_return co_await b->async_list(l2::key_filter{}, later(), asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    std::set<chunk_key> s;
    for (const auto& o : objects) s.insert(o.key);
    return s;
  }
  const std::set<chunk_key>& announced() {
    events.drain();
    return ledger->of(tier);
  }
  void check_exact() {
    CHECK(announced() == listed());
    CHECK(ledger->unknown_removals == 0);
    CHECK(ledger->repeated_stores == 0);
    CHECK(events.dropped() == 0);
  }
};

}  // namespace

TEST_CASE("the Redis backend tells the stores it made and the deletes it sent", "[redis][key_events]") {
  auto& s = test::shared_standalone();
  s.command({"FLUSHALL"});
  fixture f(s);
  const std::vector<chunk_key> ks = {rk(1), rk(2), rk(3), rk(4)};
  CHECK(f.store(ks).count(l2::key_outcome::ok) == 4);
  f.check_exact();
  CHECK(f.store({rk(1)}).outcomes[0] == l2::key_outcome::exists);  // SET NX found it: nothing told
  CHECK(f.ledger->stored_keys == 4);

  // A value damaged by another client: the load answers corrupt and the backend deletes it.
  REQUIRE(s.command({"SET", f.b->key_of(rk(2)), "not a kvtier object"}));
  CHECK(f.load({rk(2)}).outcomes[0] == l2::key_outcome::corrupt);
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::corrupt) == 1);

  CHECK(f.remove({rk(3), rk(9)}).outcomes[0] == l2::key_outcome::ok);  // rk(9): not_found, not told
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::deleted) == 1);

  // Another client's delete is invisible to the listener (as Redis's own evictions are).
  REQUIRE(s.command({"DEL", f.b->key_of(rk(4))}));
  CHECK(f.announced().contains(rk(4)));
  CHECK_FALSE(f.listed().contains(rk(4)));
  f.b->set_key_listener({});
}

}  // namespace file_redis_key_events_test
