// The l2_backend conformance suite: every backend passes the same tests. A backend joins by
// adding a fixture type (below) to the TEMPLATE_TEST_CASE lists: it owns an io_context and a
// backend of the requested capacity.
#include <kvtier/l2/concepts.hpp>

#include <kvtier/core/buffer.hpp>
#include <kvtier/l2/memory_backend.hpp>

#include <catch2/catch.hpp>

#include "l2/backend_fixtures.hpp"
#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_backend_conformance_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {

constexpr std::size_t object_bytes = 16 * 1024;

chunk_key key_of(std::uint64_t i) { return chunk_key{0x1234, 1, 0, hash128{i * 7919 + 1, i}}; }

// n objects of object_bytes, each filled with a pattern that depends on its index.
struct objects {
  std::vector<chunk_key> keys;
  std::vector<aligned_buffer> data;
  objects(std::uint64_t first, std::size_t n, std::size_t bytes = object_bytes) {
    for (std::size_t i = 0; i < n; ++i) {
      keys.push_back(key_of(first + i));
      aligned_buffer b(bytes);
      for (std::size_t j = 0; j < b.size(); ++j)
        b.data()[j] = static_cast<std::byte>((first + i) * 31 + j * 7 + (j >> 12));
      data.push_back(std::move(b));
    }
  }
  std::vector<std::span<const std::byte>> sources() const {
    std::vector<std::span<const std::byte>> s;
    for (const auto& b : data) s.push_back(b.span());
    return s;
  }
};

l2::deadline soon() { return l2::clock::now() + std::chrono::seconds(60); }

template <class B>
std::tuple<error_code, bitmap> lookup(asio::io_context& io, B& b, std::span<const chunk_key> keys,
                                      l2::deadline d = soon()) {
  return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
    co_return co_await b.async_lookup_and_pin(keys, d, asio::as_tuple(asio::use_awaitable));
  }());
}

template <class B>
std::tuple<error_code, l2::batch_result> store(asio::io_context& io, B& b, const objects& o,
                                               l2::deadline d = soon()) {
  const auto src = o.sources();
  return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_store(o.keys, src, d, asio::as_tuple(asio::use_awaitable));
  }());
}

template <class B>
std::tuple<error_code, l2::batch_result> load(asio::io_context& io, B& b, std::span<const chunk_key> keys,
                                              std::vector<aligned_buffer>& out, std::size_t bytes = object_bytes,
                                              l2::deadline d = soon()) {
  out.clear();
  std::vector<std::span<std::byte>> dst;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    out.emplace_back(bytes);
    out.back().fill(std::byte{0xee});
  }
  for (auto& b2 : out) dst.push_back(std::span<std::byte>(b2.data(), bytes));
  return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_load(keys, dst, d, asio::as_tuple(asio::use_awaitable));
  }());
}

template <class B>
std::tuple<error_code, l2::batch_result> remove(asio::io_context& io, B& b, std::span<const chunk_key> keys) {
  return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await b.async_remove(keys, soon(), asio::as_tuple(asio::use_awaitable));
  }());
}

template <class B>
std::tuple<error_code, std::vector<l2::listed_object>> list(asio::io_context& io, B& b, l2::key_filter filter = {}) {
  return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, std::vector<l2::listed_object>>> {
    co_return co_await b.async_list(filter, soon(), asio::as_tuple(asio::use_awaitable));
  }());
}

/// The keys of a listing, sorted.
std::vector<chunk_key> keys_of(const std::vector<l2::listed_object>& listed) {
  std::vector<chunk_key> k;
  for (const auto& o : listed) k.push_back(o.key);
  std::sort(k.begin(), k.end());
  return k;
}

}  // namespace

#define KVTIER_BACKEND_FIXTURES KVTIER_L2_BACKEND_FIXTURES

TEMPLATE_TEST_CASE("a backend returns exactly the bytes it stored", "[l2][conformance]", KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects o(0, 5);
  auto [ec, stored] = store(f.io, b, o);
  REQUIRE_FALSE(ec);
  CHECK(stored.count(l2::key_outcome::ok) == 5);
  std::vector<aligned_buffer> out;
  auto [lec, loaded] = load(f.io, b, o.keys, out);
  REQUIRE_FALSE(lec);
  for (std::size_t i = 0; i < 5; ++i) {
    INFO(i);
    CHECK(loaded.outcomes[i] == l2::key_outcome::ok);
    CHECK(std::memcmp(out[i].data(), o.data[i].data(), object_bytes) == 0);
  }
  const auto u = b.usage();
  CHECK(u.objects == 5);
  CHECK(u.bytes_used >= 5 * object_bytes);
}

TEMPLATE_TEST_CASE("lookup pins what it finds and reports misses", "[l2][conformance]", KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects o(10, 3);
  REQUIRE_FALSE(std::get<0>(store(f.io, b, o)));
  std::vector<chunk_key> keys = {o.keys[0], key_of(999), o.keys[2], o.keys[1]};
  auto [ec, found] = lookup(f.io, b, keys);
  REQUIRE_FALSE(ec);
  CHECK(found.to_string() == "1011");
  // Pinned objects cannot be removed; after unpin they can.
  auto [rec, removed] = remove(f.io, b, std::span(o.keys).first(1));
  CHECK(removed.outcomes[0] == l2::key_outcome::rejected);
  b.unpin(keys);
  auto [rec2, removed2] = remove(f.io, b, std::span(o.keys).first(1));
  CHECK(removed2.outcomes[0] == l2::key_outcome::ok);
  auto [ec3, found3] = lookup(f.io, b, std::span(o.keys).first(1));
  CHECK(found3.to_string() == "0");
  b.unpin(std::span(o.keys).first(1));  // unpinning an absent key is harmless
}

TEMPLATE_TEST_CASE("storing a key twice answers exists and keeps the first copy", "[l2][conformance]",
                   KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects first(20, 1);
  REQUIRE_FALSE(std::get<0>(store(f.io, b, first)));
  objects second(20, 1);
  second.data[0].fill(std::byte{0x5a});
  auto [ec, r] = store(f.io, b, second);
  CHECK(r.outcomes[0] == l2::key_outcome::exists);
  std::vector<aligned_buffer> out;
  load(f.io, b, first.keys, out);
  CHECK(std::memcmp(out[0].data(), first.data[0].data(), object_bytes) == 0);
}

TEMPLATE_TEST_CASE("loading a missing key or into a wrong-sized buffer fails that key only", "[l2][conformance]",
                   KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects o(30, 2);
  REQUIRE_FALSE(std::get<0>(store(f.io, b, o)));
  std::vector<chunk_key> keys = {o.keys[0], key_of(12345), o.keys[1]};
  std::vector<aligned_buffer> out;
  auto [ec, r] = load(f.io, b, keys, out);
  CHECK(r.outcomes[0] == l2::key_outcome::ok);
  CHECK(r.outcomes[1] == l2::key_outcome::not_found);
  CHECK(r.outcomes[2] == l2::key_outcome::ok);
  auto [ec2, r2] = load(f.io, b, std::span(o.keys).first(1), out, object_bytes / 2);
  CHECK(r2.outcomes[0] == l2::key_outcome::rejected);
}

TEMPLATE_TEST_CASE("a corrupted stored object is never served", "[l2][conformance]", KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  // The backend damages its own copy on command, or the fixture does it behind its back
  // (Redis: redis-cli SETRANGE).
  constexpr bool by_fixture = requires(TestType& t, const chunk_key& k) {
    { t.corrupt_stored(k) } -> std::same_as<bool>;
  };
  // Every fixture can: a backend that cannot damage its own copy gets a fixture that does.
  static_assert(by_fixture || l2::corruptible_backend<std::remove_cvref_t<decltype(b)>>,
                "every conformance fixture can damage a stored object (give the fixture corrupt_stored)");
  const objects o(40, 2);
  REQUIRE_FALSE(std::get<0>(store(f.io, b, o)));
  if constexpr (by_fixture) REQUIRE(f.corrupt_stored(o.keys[1]));
  else REQUIRE(b.corrupt_stored(o.keys[1]));
  std::vector<aligned_buffer> out;
  auto [ec, r] = load(f.io, b, o.keys, out);
  CHECK(r.outcomes[0] == l2::key_outcome::ok);
  CHECK(r.outcomes[1] == l2::key_outcome::corrupt);
  // The corrupt object was dropped: a later lookup misses it.
  auto [lec, found] = lookup(f.io, b, std::span(o.keys).subspan(1, 1));
  CHECK(found.to_string() == "0");
}

TEMPLATE_TEST_CASE("a full backend evicts unpinned objects and never pinned ones", "[l2][conformance]",
                   KVTIER_BACKEND_FIXTURES) {
  TestType f(8 * object_bytes + 64 * 1024);  // room for about 8 objects with per-object overhead
  auto& b = f.backend();
  if constexpr (!kvtier::test::pins_prevent_eviction<TestType>) {
    // Advisory pins (Redis): eviction is the store's own policy (tested with each such
    // backend). What must hold here: stores succeed, and every key loads exactly the bytes
    // stored under it or answers not_found (evicted), never another key's bytes.
    const objects old(100, 4);
    REQUIRE_FALSE(std::get<0>(store(f.io, b, old)));
    auto [lec, pinned] = lookup(f.io, b, std::span(old.keys).first(2));
    REQUIRE(pinned.to_string() == "11");
    const objects fresh(200, 12);
    auto [ec, r] = store(f.io, b, fresh);
    CHECK(r.count(l2::key_outcome::ok) == 12);
    std::vector<aligned_buffer> out;
    for (const objects* set : {&old, &fresh}) {
      auto [lec2, loaded] = load(f.io, b, set->keys, out);
      for (std::size_t i = 0; i < set->keys.size(); ++i) {
        INFO(i);
        REQUIRE((loaded.outcomes[i] == l2::key_outcome::ok || loaded.outcomes[i] == l2::key_outcome::not_found));
        if (loaded.ok(i)) CHECK(std::memcmp(out[i].data(), set->data[i].data(), object_bytes) == 0);
      }
    }
    b.unpin(std::span(old.keys).first(2));
    b.unpin(std::span(old.keys).first(2));
    return;
  }
  const objects old(100, 4);
  REQUIRE_FALSE(std::get<0>(store(f.io, b, old)));
  auto [lec, pinned] = lookup(f.io, b, std::span(old.keys).first(2));  // pin the two oldest
  REQUIRE(pinned.to_string() == "11");
  const objects fresh(200, 12);
  auto [ec, r] = store(f.io, b, fresh);
  CHECK(r.count(l2::key_outcome::ok) >= 4);
  auto [ec2, still] = lookup(f.io, b, std::span(old.keys).first(2));
  CHECK(still.to_string() == "11");  // pinned survived eviction
  b.unpin(std::span(old.keys).first(2));
  b.unpin(std::span(old.keys).first(2));
  CHECK(b.usage().bytes_used <= b.usage().bytes_capacity);
}

TEMPLATE_TEST_CASE("an operation whose deadline has passed answers timeout", "[l2][conformance]",
                   KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects o(300, 2);
  auto [sec, sr] = store(f.io, b, o, l2::clock::now() - std::chrono::seconds(1));
  CHECK(sec == errc::timeout);
  CHECK(sr.count(l2::key_outcome::ok) == 0);
}

TEMPLATE_TEST_CASE("a backend lists the objects it stores, those its filter accepts, and removes what it listed "
                   "but the pinned ones",
                   "[l2][conformance]", KVTIER_BACKEND_FIXTURES) {
  TestType f(64 * object_bytes);
  auto& b = f.backend();
  const objects mine(400, 3);
  objects theirs(500, 2);
  for (auto& k : theirs.keys) k.model_id = 0x5678;  // another model namespace
  REQUIRE_FALSE(std::get<0>(store(f.io, b, mine)));
  REQUIRE_FALSE(std::get<0>(store(f.io, b, theirs)));

  auto [ec, all] = list(f.io, b);
  REQUIRE_FALSE(ec);
  std::vector<chunk_key> expected = mine.keys;
  expected.insert(expected.end(), theirs.keys.begin(), theirs.keys.end());
  std::sort(expected.begin(), expected.end());
  CHECK(keys_of(all) == expected);
  for (const auto& o : all) CHECK(o.bytes >= object_bytes);  // the payload at least (plus headers, blocks)

  auto [fec, filtered] = list(f.io, b, [](const chunk_key& k) { return k.model_id == 0x5678; });
  REQUIRE_FALSE(fec);
  std::vector<chunk_key> their_keys = theirs.keys;
  std::sort(their_keys.begin(), their_keys.end());
  CHECK(keys_of(filtered) == their_keys);

  // Removing what the listing returned leaves the object a prefetch pinned.
  auto [lec, pinned] = lookup(f.io, b, std::span(theirs.keys).first(1));
  REQUIRE(pinned.to_string() == "1");
  const std::vector<chunk_key> listed = keys_of(filtered);
  auto [rec, removed] = remove(f.io, b, listed);
  REQUIRE_FALSE(rec);
  for (std::size_t i = 0; i < listed.size(); ++i)
    CHECK(removed.outcomes[i] == (listed[i] == theirs.keys[0] ? l2::key_outcome::rejected : l2::key_outcome::ok));
  b.unpin(std::span(theirs.keys).first(1));
  auto [aec, after] = list(f.io, b);
  REQUIRE_FALSE(aec);
  expected = mine.keys;
  expected.push_back(theirs.keys[0]);
  std::sort(expected.begin(), expected.end());
  CHECK(keys_of(after) == expected);
}

}  // namespace file_backend_conformance_test
