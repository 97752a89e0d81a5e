#include <kvtier/l2/memory_backend.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_memory_backend_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {
struct model_fixture {
  asio::io_context io;
  l2::memory_backend backend;
  explicit model_fixture(double bandwidth, std::chrono::nanoseconds latency = {})
      : backend(io.get_executor(), l2::memory_backend_options{"mock", 1 << 24, bandwidth, latency}) {}
};
chunk_key k(std::uint64_t i) { return chunk_key{1, 1, 0, hash128{i, i}}; }
}  // namespace

TEST_CASE("the bandwidth model cuts a batch at the deadline after the keys that fit", "[l2][memory_backend]") {
  // 1 MB/s: each 100 KB object takes 100 ms of channel time.
  model_fixture f(1e6);
  std::vector<chunk_key> keys = {k(1), k(2), k(3)};
  std::vector<std::vector<std::byte>> data(3, std::vector<std::byte>(100'000, std::byte{7}));
  std::vector<std::span<const std::byte>> src(data.begin(), data.end());
  auto [ec, r] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await f.backend.async_store(keys, src, l2::clock::now() + std::chrono::milliseconds(250),
                                             asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(ec == errc::timeout);
  CHECK(r.outcomes[0] == l2::key_outcome::ok);
  CHECK(r.outcomes[1] == l2::key_outcome::ok);
  CHECK(r.outcomes[2] == l2::key_outcome::timeout);
  CHECK(f.backend.usage().objects == 2);
}

TEST_CASE("an unhealthy memory backend answers unavailable and finds nothing", "[l2][memory_backend]") {
  model_fixture f(0);
  f.backend.set_health({false, "test says down"});
  std::vector<chunk_key> keys = {k(1)};
  auto [ec, found] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
    co_return co_await f.backend.async_lookup_and_pin(keys, l2::clock::now() + std::chrono::seconds(5),
                                                      asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(ec == errc::backend_unavailable);
  CHECK(found.none());
  CHECK_FALSE(f.backend.health().healthy);
  CHECK(f.backend.health().reason == "test says down");
}

TEST_CASE("a cancelled load completes with operation_aborted and writes nothing", "[l2][memory_backend]") {
  model_fixture f(0);
  std::vector<chunk_key> keys = {k(5)};
  std::vector<std::byte> data(10'000, std::byte{9});
  std::vector<std::span<const std::byte>> src = {data};
  run_sync(f.io, [&]() -> asio::awaitable<void> {
    co_await f.backend.async_store(keys, src, l2::clock::now() + std::chrono::hours(1),
                                   asio::as_tuple(asio::use_awaitable));
  }());
  f.backend.set_model(1e3, {});  // 1 KB/s from now on: the load would take 10 s
  std::vector<std::byte> dst(10'000, std::byte{0});
  std::vector<std::span<std::byte>> dsts = {dst};
  asio::cancellation_signal cancel;
  std::optional<std::tuple<error_code, l2::batch_result>> result;
  f.backend.async_load(keys, dsts, l2::clock::now() + std::chrono::hours(1),
                       asio::bind_cancellation_slot(cancel.slot(), [&](error_code ec, l2::batch_result r) {
                         result.emplace(ec, std::move(r));
                       }));
  asio::post(f.io, [&] { cancel.emit(asio::cancellation_type::terminal); });
  f.io.restart();
  f.io.run();
  REQUIRE(result);
  CHECK(std::get<0>(*result) == asio::error::operation_aborted);
  CHECK(std::get<1>(*result).outcomes[0] != l2::key_outcome::ok);
  CHECK(dst[0] == std::byte{0});
}

}  // namespace file_memory_backend_test
