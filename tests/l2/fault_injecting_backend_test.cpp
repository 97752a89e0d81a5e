#include <kvtier/l2/fault_injecting_backend.hpp>

#include <kvtier/l2/memory_backend.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <optional>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_fault_injecting_backend_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {

chunk_key k(std::uint64_t i) { return chunk_key{9, 1, 0, hash128{i, ~i}}; }

struct fixture {
  asio::io_context io;
  l2::memory_backend mem{io.get_executor(), l2::memory_backend_options{"mem", 1 << 20, 0, {}}};
  l2::fault_injecting_backend<l2::memory_backend> b{mem};
  std::vector<chunk_key> keys{k(1), k(2), k(3)};
  std::vector<std::vector<std::byte>> data{3, std::vector<std::byte>(4096, std::byte{0x42})};

  fixture() {
    std::vector<std::span<const std::byte>> src(data.begin(), data.end());
    run_sync(io, [&]() -> asio::awaitable<void> {
      co_await mem.async_store(keys, src, l2::clock::now() + std::chrono::seconds(10),
                               asio::as_tuple(asio::use_awaitable));
    }());
  }

  std::tuple<error_code, l2::batch_result> load(std::vector<std::vector<std::byte>>& out) {
    out.assign(keys.size(), std::vector<std::byte>(4096, std::byte{0}));
    std::vector<std::span<std::byte>> dst(out.begin(), out.end());
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_load(keys, dst, l2::clock::now() + std::chrono::seconds(10),
                                      asio::as_tuple(asio::use_awaitable));
    }());
  }
};

bool is_k2(const chunk_key& key) { return key == k(2); }

}  // namespace

TEST_CASE("a fail fault with a key filter fails only those keys", "[l2][fault]") {
  fixture f;
  f.b.inject({.op = l2::fault_op::load, .kind = l2::fault_kind::fail, .match = is_k2, .outcome = l2::key_outcome::io_error});
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = f.load(out);
  CHECK_FALSE(ec);
  CHECK(r.outcomes[0] == l2::key_outcome::ok);
  CHECK(r.outcomes[1] == l2::key_outcome::io_error);
  CHECK(r.outcomes[2] == l2::key_outcome::ok);
  CHECK(out[1][0] == std::byte{0});  // the failed key's buffer was not written
}

TEST_CASE("a fail fault without a filter fails the whole operation, then expires", "[l2][fault]") {
  fixture f;
  l2::fault whole{.op = l2::fault_op::load, .kind = l2::fault_kind::fail};
  whole.times = 1;
  whole.error = make_error_code(errc::backend_unavailable);
  whole.outcome = l2::key_outcome::unavailable;
  f.b.inject(whole);
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = f.load(out);
  CHECK(ec == errc::backend_unavailable);
  CHECK(r.count(l2::key_outcome::unavailable) == 3);
  auto [ec2, r2] = f.load(out);  // times = 1: the next load is healthy
  CHECK_FALSE(ec2);
  CHECK(r2.count(l2::key_outcome::ok) == 3);
}

TEST_CASE("a lookup fail fault hides keys without pinning them", "[l2][fault]") {
  fixture f;
  f.b.inject({.op = l2::fault_op::lookup, .kind = l2::fault_kind::fail, .match = is_k2});
  auto [ec, found] = run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
    co_return co_await f.b.async_lookup_and_pin(f.keys, l2::clock::now() + std::chrono::seconds(10),
                                                asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(found.to_string() == "101");
  CHECK(f.mem.pins(k(1)) == 1);
  CHECK(f.mem.pins(k(2)) == 0);
}

TEST_CASE("a corrupt fault is caught by the backend's own check", "[l2][fault]") {
  fixture f;
  f.b.inject({.op = l2::fault_op::load, .kind = l2::fault_kind::corrupt, .match = is_k2});
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = f.load(out);
  CHECK(r.outcomes[0] == l2::key_outcome::ok);
  CHECK(r.outcomes[1] == l2::key_outcome::corrupt);
  CHECK(out[0][0] == std::byte{0x42});
  CHECK(out[1][0] == std::byte{0});
}

TEST_CASE("a delay fault still completes with the inner result", "[l2][fault]") {
  fixture f;
  l2::fault d{.op = l2::fault_op::load, .kind = l2::fault_kind::delay};
  d.delay = std::chrono::milliseconds(20);
  f.b.inject(d);
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = f.load(out);
  CHECK_FALSE(ec);
  CHECK(r.count(l2::key_outcome::ok) == 3);
}

TEST_CASE("a hung load ignores cancellation and writes its buffers only after release", "[l2][fault]") {
  fixture f;
  f.b.inject({.op = l2::fault_op::load, .kind = l2::fault_kind::hang});
  std::vector<std::byte> dst0(4096, std::byte{0});
  std::vector<std::span<std::byte>> dst = {dst0};
  std::vector<chunk_key> one = {k(1)};
  asio::cancellation_signal cancel;
  std::optional<l2::batch_result> result;
  f.b.async_load(one, dst, l2::clock::now() + std::chrono::seconds(10),
                 asio::bind_cancellation_slot(cancel.slot(),
                                              [&](error_code, l2::batch_result r) { result = std::move(r); }));
  cancel.emit(asio::cancellation_type::terminal);  // a stuck device does not listen
  f.io.restart();
  f.io.poll();
  CHECK(f.b.hung() == 1);
  CHECK_FALSE(result.has_value());
  CHECK(dst0[0] == std::byte{0});
  f.b.release_hung();
  f.io.restart();
  f.io.run();
  REQUIRE(result.has_value());
  CHECK(result->outcomes[0] == l2::key_outcome::ok);
  CHECK(dst0[0] == std::byte{0x42});  // the late read landed
  CHECK(f.b.hung() == 0);
}

TEST_CASE("a load cancelled while the wrapped backend runs completes with operation_aborted and writes nothing",
          "[l2][fault][cancel]") {
  fixture f;
  f.mem.set_model(1e3, {});  // 1 KB/s from now on: loading 4 KiB would take 4 s
  l2::fault d{.op = l2::fault_op::load, .kind = l2::fault_kind::delay};
  d.delay = std::chrono::hours(1);  // after the inner load: only the cancellation ends it soon
  f.b.inject(d);
  std::vector<std::byte> dst0(4096, std::byte{0});
  std::vector<std::span<std::byte>> dst = {dst0};
  std::vector<chunk_key> one = {k(1)};
  asio::cancellation_signal cancel;
  int calls = 0;
  error_code ec;
  f.b.async_load(one, dst, l2::clock::now() + std::chrono::hours(1),
                 asio::bind_cancellation_slot(cancel.slot(), [&](error_code e, l2::batch_result) {
                   ++calls;
                   ec = e;
                 }));
  test::run_until_idle(f.io);  // the inner load waits on its modelled channel
  CHECK(calls == 0);
  cancel.emit(asio::cancellation_type::terminal);
  REQUIRE(test::run_until(f.io, [&] { return calls > 0; }));  // no exception escapes either
  CHECK(ec == asio::error::operation_aborted);
  CHECK(dst0[0] == std::byte{0});
  test::run_until_idle(f.io);
  CHECK(calls == 1);
  CHECK(dst0[0] == std::byte{0});  // nothing lands after the completion
}

TEST_CASE("a delay cancelled after the wrapped load completed answers at once with the inner result",
          "[l2][fault][cancel]") {
  fixture f;
  l2::fault d{.op = l2::fault_op::load, .kind = l2::fault_kind::delay};
  d.delay = std::chrono::hours(1);
  f.b.inject(d);
  std::vector<std::byte> dst0(4096, std::byte{0});
  std::vector<std::span<std::byte>> dst = {dst0};
  std::vector<chunk_key> one = {k(1)};
  asio::cancellation_signal cancel;
  std::optional<std::tuple<error_code, l2::batch_result>> result;
  f.b.async_load(one, dst, l2::clock::now() + std::chrono::hours(1),
                 asio::bind_cancellation_slot(
                     cancel.slot(), [&](error_code e, l2::batch_result r) { result.emplace(e, std::move(r)); }));
  test::run_until_idle(f.io);  // the inner load is done; the delay runs
  REQUIRE_FALSE(result.has_value());
  CHECK(dst0[0] == std::byte{0x42});
  cancel.emit(asio::cancellation_type::terminal);
  REQUIRE(test::run_until(f.io, [&] { return result.has_value(); }));
  CHECK_FALSE(std::get<0>(*result));
  CHECK(std::get<1>(*result).outcomes[0] == l2::key_outcome::ok);
}

}  // namespace file_fault_injecting_backend_test
