#include <kvtier/detail/async_slots.hpp>

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/io_context.hpp>

#include <catch2/catch.hpp>

#include <vector>

namespace asio = boost::asio;
using kvtier::detail::async_slots;

namespace {
/// Handlers of `io` that can run now, run (no blocking wait).
void drain(asio::io_context& io) {
  io.restart();
  io.poll();
}
}  // namespace

TEST_CASE("async_slots hands out its count at once, then serves waiters in order as slots come back",
          "[io][async_slots]") {
  asio::io_context io;
  async_slots slots(io.get_executor(), 2);
  std::vector<int> got;
  for (int i = 0; i < 5; ++i)
    slots.async_acquire([&got, i](kvtier::error_code ec) {
      REQUIRE_FALSE(ec);
      got.push_back(i);
    });
  drain(io);
  CHECK(got == std::vector<int>{0, 1});
  slots.release();
  drain(io);
  CHECK(got == std::vector<int>{0, 1, 2});
  slots.release();
  slots.release();
  drain(io);
  CHECK(got == std::vector<int>{0, 1, 2, 3, 4});
  // Three slots out (2, 3, 4 hold them; 0 and 1 gave theirs back): none is free.
  bool more = false;
  slots.async_acquire([&more](kvtier::error_code ec) { more = !ec; });
  drain(io);
  CHECK_FALSE(more);
  slots.release();
  drain(io);
  CHECK(more);
}

TEST_CASE("a cancelled wait for a slot takes none, and the slot goes to the next waiter", "[io][async_slots]") {
  asio::io_context io;
  async_slots slots(io.get_executor(), 1);
  bool first = false;
  slots.async_acquire([&first](kvtier::error_code ec) { first = !ec; });
  drain(io);
  REQUIRE(first);
  asio::cancellation_signal cancel;
  kvtier::error_code cancelled_ec;
  bool cancelled_done = false;
  slots.async_acquire(asio::bind_cancellation_slot(cancel.slot(), [&](kvtier::error_code ec) {
    cancelled_ec = ec;
    cancelled_done = true;
  }));
  bool third = false;
  slots.async_acquire([&third](kvtier::error_code ec) { third = !ec; });
  drain(io);
  CHECK_FALSE(cancelled_done);
  cancel.emit(asio::cancellation_type::terminal);
  drain(io);
  REQUIRE(cancelled_done);
  CHECK(cancelled_ec);  // it took no slot
  CHECK_FALSE(third);
  {
    const async_slots::slot_guard back(slots);  // the first holder gives its slot back on scope exit
  }
  drain(io);
  CHECK(third);
}

TEST_CASE("async_slots refuses a count of zero", "[io][async_slots]") {
  asio::io_context io;
  CHECK_THROWS_AS(async_slots(io.get_executor(), 0), std::invalid_argument);
}
