// What only the thread-pool fallback does: cancellation of queued (not running) ops,
// shutdown with ops queued and running, completions posted from worker threads.
#include <kvtier/io/pread_pool.hpp>

// g++ 12 at -O1 with sanitizers inlines Asio's awaitable-frame allocator (aligned_alloc, then
// free in thread_info_base) into the co_spawn below and misreads it as a new/free mismatch.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include "io_test_support.hpp"

#include <support/asio.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace asio = boost::asio;
using namespace kvtier;
using test::aligned_buffer_of;

using op_result = test::size_result;

}  // namespace

TEST_CASE("a pread pool rejects a thread count of zero", "[io][pread]") {
  asio::io_context ctx;
  io::pread_pool_options o;
  o.threads = 0;
  CHECK_THROWS_AS(io::pread_pool(ctx.get_executor(), o), std::invalid_argument);
  io::pread_pool pool(ctx.get_executor());
  CHECK(pool.thread_count() == 2);
  CHECK(pool.kind() == io::file_io_kind::pread);
  const io::buffer_region none[] = {std::span<std::byte>()};
  CHECK_FALSE(pool.register_buffers(none));
  CHECK_FALSE(pool.fixed_buffers_active());
}

TEST_CASE("pool completions run on the caller's executor thread, not on a worker", "[io][pread]") {
  asio::io_context ctx;
  io::pread_pool pool(ctx.get_executor());
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "t").string();
  test::write_pattern_file(path, 4096, 1);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(4096);
  op_result r;
  pool.async_read(fd.get(), in.span(), 0, r.handler());
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK(r.thread == std::this_thread::get_id());
  CHECK(r.n == 4096);
  CHECK(test::matches_pattern(in.span(), 1));
}

TEST_CASE("a queued pool read cancelled completes with operation_aborted; a running one cannot be stopped",
          "[io][pread][cancel]") {
  asio::io_context ctx;
  io::pread_pool_options o;
  o.threads = 1;
  io::pread_pool pool(ctx.get_executor(), o);
  test::pipe_pair busy;   // parks the only worker
  test::pipe_pair other;  // the read that stays queued
  aligned_buffer a = aligned_buffer_of(64, std::byte{0x10});
  aligned_buffer b = aligned_buffer_of(64, std::byte{0x20});
  asio::cancellation_signal sig_a;
  asio::cancellation_signal sig_b;
  op_result ra;
  op_result rb;
  pool.async_read(busy.read_end.get(), a.span(), 0, asio::bind_cancellation_slot(sig_a.slot(), ra.handler()));
  pool.async_read(other.read_end.get(), b.span(), 0, asio::bind_cancellation_slot(sig_b.slot(), rb.handler()));

  sig_b.emit(asio::cancellation_type::terminal);
  REQUIRE(test::run_until(ctx, [&] { return rb.calls > 0; }));
  CHECK(rb.ec == asio::error::operation_aborted);
  CHECK(rb.n == 0);

  // The first read may still be queued or already on the worker: cancel it only when it
  // is running (a queued one would simply be aborted, which the lines above cover).
  REQUIRE(::write(other.write_end.get(), "kept", 4) == 4);
  sig_a.emit(asio::cancellation_type::terminal);
  test::poll(ctx);
  if (ra.calls == 0) {
    // Running: the cancel could not stop it; it completes when data arrives.
    REQUIRE(::write(busy.write_end.get(), "data", 4) == 4);
    REQUIRE(test::run_until(ctx, [&] { return ra.calls > 0; }));
    CHECK_FALSE(ra.ec);
    CHECK(ra.n == 4);
  } else {
    CHECK(ra.ec == asio::error::operation_aborted);
  }
  CHECK(ra.calls == 1);
  CHECK(rb.calls == 1);
  CHECK(test::all_bytes(b.span(), std::byte{0x20}));  // the cancelled read never touched it
  char back[8] = {};
  CHECK(::read(other.read_end.get(), back, sizeof back) == 4);
}

TEST_CASE("pool shutdown aborts queued reads, lets the running one finish, and refuses new ones",
          "[io][pread][shutdown]") {
  asio::io_context ctx;
  io::pread_pool_options o;
  o.threads = 1;
  auto pool = std::make_unique<io::pread_pool>(ctx.get_executor(), o);
  test::pipe_pair p;
  std::vector<aligned_buffer> bufs;
  for (int i = 0; i < 5; ++i) bufs.push_back(aligned_buffer_of(64, std::byte{0x55}));
  std::vector<op_result> r(6);
  for (int i = 0; i < 5; ++i) pool->async_read(p.read_end.get(), bufs[i].span(), 0, r[i].handler());
  pool->shutdown();
  pool->async_read(p.read_end.get(), bufs[0].span(), 0, r[5].handler());
  REQUIRE(::write(p.write_end.get(), "one", 3) == 3);  // frees the read the worker may be running
  pool.reset();  // joins the worker
  test::poll(ctx);
  int aborted = 0;
  int completed = 0;
  for (int i = 0; i < 5; ++i) {
    CHECK(r[i].calls == 1);
    if (r[i].ec == asio::error::operation_aborted) ++aborted;
    else if (!r[i].ec && r[i].n == 3) ++completed;
  }
  CHECK(aborted + completed == 5);
  CHECK(completed <= 1);
  CHECK(r[5].calls == 1);
  CHECK(r[5].ec == errc::shutting_down);
}

TEST_CASE("many pool operations from coroutines on two threads each complete exactly once",
          "[io][pread][concurrency]") {
  asio::io_context ctx(2);
  io::pread_pool_options o;
  o.threads = 4;
  io::pread_pool pool(ctx.get_executor(), o);
  test::temp_dir dir("kvtier-io");
  constexpr std::size_t blocks = 512;
  const std::string path = (dir.path() / "c").string();
  test::write_pattern_file(path, blocks * 4096, 13);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | O_DIRECT);
  aligned_buffer mem(blocks * 4096);
  std::atomic<int> ok{0};
  std::atomic<int> aborted{0};
  std::atomic<int> wrong{0};
  std::atomic<int> finished{0};
  for (int c = 0; c < 8; ++c) {
    auto strand = asio::make_strand(ctx);
    asio::co_spawn(strand, [&, c, strand]() -> asio::awaitable<void> {
      std::mt19937 rng(static_cast<unsigned>(c));
      for (std::size_t i = static_cast<std::size_t>(c); i < blocks; i += 8) {
        asio::cancellation_signal sig;
        auto op = pool.async_read(fd.get(), mem.span().subspan(i * 4096, 4096), i * 4096,
                                  asio::bind_cancellation_slot(sig.slot(), asio::as_tuple(asio::use_awaitable)));
        if (rng() % 3 == 0) {
          // Cancel from the coroutine's own strand, racing the workers.
          asio::post(strand, [&sig] { sig.emit(asio::cancellation_type::terminal); });
        }
        auto [ec, n] = co_await std::move(op);
        if (!ec && n == 4096) ++ok;
        else if (ec == asio::error::operation_aborted) ++aborted;
        else ++wrong;
      }
      ++finished;
    }, asio::detached);
  }
  std::thread t([&] { ctx.run(); });
  ctx.run();
  t.join();
  CHECK(finished.load() == 8);
  CHECK(wrong.load() == 0);
  CHECK(ok.load() + aborted.load() == static_cast<int>(blocks));
  CHECK(pool.stats().ops_completed.load() == blocks);
  CHECK(pool.stats().ops_cancelled.load() == static_cast<std::uint64_t>(aborted.load()));
  CHECK(pool.in_flight() == 0);
}
