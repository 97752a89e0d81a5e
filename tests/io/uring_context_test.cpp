// What only uring_context does: batched submission, the pending queue, fixed buffers
// and their fallback, kernel-side cancellation, teardown with ops in flight, the task-running
// modes, no allocation per op, executors other than the ring's.
#include <kvtier/io/uring_context.hpp>

#include "io_test_support.hpp"
#include "support/allocation_probe.hpp"
#include "support/captured_log.hpp"

#include <kvtier/io/object_io.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <support/asio.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace asio = boost::asio;
using namespace kvtier;
using kvtier::test::captured_log;
using test::aligned_buffer_of;

using op_result = test::size_result;

}  // namespace

TEST_CASE("one io_uring_enter submits every operation started in the same turn", "[io][uring]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "batch").string();
  test::write_pattern_file(path, 32 * 4096, 1);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(32 * 4096);
  std::vector<op_result> r(32);

  const auto enters_before = ring.stats().enter_calls.load();
  for (std::size_t i = 0; i < 32; ++i) ring.async_read(fd.get(), in.span().subspan(i * 4096, 4096), i * 4096, r[i].handler());
  CHECK(ring.stats().enter_calls.load() == enters_before);  // preparing an SQE never enters the kernel
  REQUIRE(test::run_until(ctx, [&] { return r[31].calls > 0 && ring.in_flight() == 0; }));
  const auto enters = ring.stats().enter_calls.load() - enters_before;
  INFO("io_uring_enter calls for 32 reads: " << enters);
  CHECK(ring.stats().sqes_submitted.load() == 32);
  CHECK(enters >= 1);
  CHECK(enters <= 2);
  for (const auto& x : r) CHECK(x.n == 4096);
  CHECK(test::matches_pattern(in.span(), 1));
}

TEST_CASE("max_bounded_workers raises io-wq's bounded-worker limit; 0 keeps the kernel's", "[io][uring]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context plain(ctx.get_executor());
  const unsigned kernel_default = plain.bounded_workers_limit();
  if (kernel_default == 0) {
    WARN("this kernel cannot report io-wq limits (before 5.15): skipped");
    CHECK(plain.bounded_workers_limit() == 0);
    return;
  }
  io::uring_options o;
  o.max_bounded_workers = kernel_default + 37;
  io::uring_context raised(ctx.get_executor(), o);
  CHECK(raised.bounded_workers_limit() == kernel_default + 37);
  // The raised ring still works.
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "f").string();
  test::write_pattern_file(path, 4096, 3);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(4096);
  op_result r;
  raised.async_read(fd.get(), in.span(), 0, r.handler());
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0 && raised.in_flight() == 0; }));
  CHECK(r.n == 4096);
  CHECK(test::matches_pattern(in.span(), 3));
}

TEST_CASE("operations beyond the completion queue wait in the ring and all complete", "[io][uring]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_options o;
  o.entries = 4;  // CQ of 8
  io::uring_context ring(ctx.get_executor(), o);
  CHECK(ring.sq_entries() == 4);
  CHECK(ring.cq_entries() == 8);
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "q").string();
  test::write_pattern_file(path, 100 * 4096, 2);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | O_DIRECT);
  aligned_buffer in(100 * 4096);
  int done = 0;
  for (std::size_t i = 0; i < 100; ++i)
    ring.async_read(fd.get(), in.span().subspan(i * 4096, 4096), i * 4096, [&](error_code ec, std::size_t n) {
      CHECK_FALSE(ec);
      CHECK(n == 4096);
      ++done;
    });
  CHECK(ring.in_flight() == 100);
  REQUIRE(test::run_until(ctx, [&] { return done == 100; }));
  CHECK(test::matches_pattern(in.span(), 2));
  CHECK(ring.stats().sqes_submitted.load() == 100);
}

TEST_CASE("reads and writes inside registered buffers use the fixed opcodes", "[io][uring][fixed]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  aligned_buffer arena(16 * 4096);  // stands for the L1 slot arena
  const io::buffer_region regions[] = {arena.span()};
  const error_code reg = ring.register_buffers(regions);
  if (reg) {
    // Unprivileged with a small RLIMIT_MEMLOCK: the fallback test below covers this path.
    WARN("registering 64 KiB failed here (" << reg.message() << "), fixed path not exercised");
    CHECK(ring.stats().fixed_buffer_registration_failures.load() == 1);
    return;
  }
  CHECK(ring.fixed_buffers_active());
  CHECK(ring.stats().fixed_buffer_bytes.load() == arena.size());
  test::temp_dir dir("kvtier-io");
  test::unique_fd fd = test::open_or_throw((dir.path() / "fx").string(), O_RDWR | O_CREAT | O_DIRECT);

  auto slot = [&](std::size_t i) { return arena.span().subspan(i * 4096, 4096); };
  test::fill_pattern(slot(0), 3);
  op_result w;
  ring.async_write(fd.get(), std::span<const std::byte>(slot(0)), 0, w.handler());
  REQUIRE(test::run_until(ctx, [&] { return w.calls > 0; }));
  CHECK_FALSE(w.ec);
  op_result r;
  ring.async_read(fd.get(), slot(5), 0, r.handler());
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK_FALSE(r.ec);
  CHECK(r.n == 4096);
  CHECK(test::matches_pattern(slot(5), 3));
  CHECK(ring.stats().fixed_ops.load() == 2);

  // Outside the arena, or straddling its end: plain READ.
  aligned_buffer other = aligned_buffer_of(8192, std::byte{0});
  op_result r2;
  ring.async_read(fd.get(), other.span().first(4096), 0, r2.handler());
  REQUIRE(test::run_until(ctx, [&] { return r2.calls > 0; }));
  CHECK(r2.n == 4096);
  CHECK(test::matches_pattern(other.span().first(4096), 3));
  CHECK(ring.stats().fixed_ops.load() == 2);

  ring.unregister_buffers();
  CHECK_FALSE(ring.fixed_buffers_active());
  CHECK(ring.stats().fixed_buffer_bytes.load() == 0);
}

TEST_CASE("an arena registered a piece at a time: each piece next to the others, reads in every piece fixed",
          "[io][uring][fixed]") {
  // The server registers a large L1 in pieces, one per turn of its I/O thread (pinning a
  // whole 8 GiB arena at once held that thread 0.3-0.7 s).
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  aligned_buffer arena(16 * 4096);
  auto slot = [&](std::size_t i) { return arena.span().subspan(i * 4096, 4096); };
  const error_code first = ring.add_buffers(arena.span().subspan(8 * 4096));  // the second half first
  if (first == errc::unsupported) {
    WARN("this kernel has no sparse buffer table (Linux 5.19): add_buffers is refused, register_buffers works");
    return;
  }
  if (first) {
    WARN("registering 32 KiB failed here (" << first.message() << "), fixed path not exercised");
    return;
  }
  CHECK(ring.fixed_buffers_active());
  CHECK(ring.stats().fixed_buffer_bytes.load() == 8 * 4096);
  REQUIRE_FALSE(ring.add_buffers(arena.span().first(8 * 4096)));
  CHECK(ring.stats().fixed_buffer_bytes.load() == arena.size());

  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "data").string();
  test::write_pattern_file(path, 4096, 6);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | O_DIRECT);
  for (std::size_t i : {1, 12}) {  // one slot in each piece
    op_result r;
    ring.async_read(fd.get(), slot(i), 0, r.handler());
    REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
    CHECK_FALSE(r.ec);
    CHECK(r.n == 4096);
    CHECK(test::matches_pattern(slot(i), 6));
  }
  CHECK(ring.stats().fixed_ops.load() == 2);
  // Straddling the two pieces: one registered buffer does not hold it all, a plain READ.
  op_result r;
  ring.async_read(fd.get(), arena.span().subspan(7 * 4096, 8192), 0, r.handler());
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK(ring.stats().fixed_ops.load() == 2);

  // After a whole registration, pieces are refused; after unregistering, both work again.
  const io::buffer_region regions[] = {arena.span()};
  REQUIRE_FALSE(ring.register_buffers(regions));
  CHECK(ring.add_buffers(slot(0)) == errc::invalid_argument);
  ring.unregister_buffers();
  CHECK_FALSE(ring.fixed_buffers_active());
  CHECK(ring.stats().fixed_buffer_bytes.load() == 0);
  CHECK_FALSE(ring.add_buffers(slot(0)));
  CHECK(ring.stats().fixed_buffer_bytes.load() == 4096);
}

TEST_CASE("a refused registration is logged once, counted, and the memory still works with plain reads",
          "[io][uring][fixed]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  captured_log cap(telemetry::log_level::debug);
  io::uring_context ring(ctx.get_executor(), {}, &cap.log);
  test::temp_dir dir("kvtier-io");
  const std::string backing = (dir.path() / "backing").string();
  test::write_pattern_file(backing, 65536, 0);
  test::unique_fd bfd = test::open_or_throw(backing, O_RDWR);
  // A shared mapping of an ext4/tmpfs file: the kernel refuses to pin it for io_uring
  // (EFAULT on 6.18), which takes the same path as ENOMEM under RLIMIT_MEMLOCK.
  void* map = ::mmap(nullptr, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, bfd.get(), 0);
  REQUIRE(map != MAP_FAILED);
  const std::span<std::byte> mem(static_cast<std::byte*>(map), 65536);
  const io::buffer_region regions[] = {mem};
  const error_code ec = ring.register_buffers(regions);
  if (!ec) {
    WARN("this kernel registered a shared file mapping; the refusal path is not exercised");
    CHECK(ring.fixed_buffers_active());
    ::munmap(map, 65536);
    return;
  }
  CHECK_FALSE(ring.fixed_buffers_active());
  CHECK(ring.stats().fixed_buffer_registration_failures.load() == 1);
  CHECK(ring.register_buffers(regions));
  CHECK(ring.stats().fixed_buffer_registration_failures.load() == 2);
  CHECK(cap.count("as fixed buffers failed") == 1);  // logged once (then at debug level)
  CHECK(cap.count("RLIMIT_MEMLOCK") == 1);

  const std::string path = (dir.path() / "data").string();
  test::write_pattern_file(path, 8192, 4);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  op_result r;
  ring.async_read(fd.get(), mem.first(8192), 0, r.handler());
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK_FALSE(r.ec);
  CHECK(r.n == 8192);
  CHECK(test::matches_pattern(mem.first(8192), 4));
  CHECK(ring.stats().fixed_ops.load() == 0);
  ::munmap(map, 65536);

  io::uring_options off;
  off.fixed_buffers = false;
  io::uring_context plain(ctx.get_executor(), off);
  aligned_buffer arena(4096);
  const io::buffer_region ok[] = {arena.span()};
  CHECK(plain.register_buffers(ok) == errc::unsupported);
  CHECK(plain.stats().fixed_buffer_registration_failures.load() == 0);
}

TEST_CASE("a read blocked on an empty pipe, cancelled, completes once with operation_aborted and never writes its buffer",
          "[io][uring][cancel]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::pipe_pair p;
  aligned_buffer in = aligned_buffer_of(4096, std::byte{0xab});
  asio::cancellation_signal sig;
  op_result r;
  ring.async_read(p.read_end.get(), in.span(), 0, asio::bind_cancellation_slot(sig.slot(), r.handler()));
  const bool in_kernel = GENERATE(true, false);
  INFO((in_kernel ? "cancelled while waiting in the kernel" : "cancelled before its SQE was submitted"));
  if (in_kernel) {
    test::poll(ctx);  // the turn submits it; the kernel parks it on the pipe
    CHECK(r.calls == 0);
    CHECK(ring.stats().sqes_submitted.load() == 1);
  }
  sig.emit(asio::cancellation_type::terminal);
  CHECK(r.calls == 0);  // completes from the ring, never inside emit()
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK(r.ec == asio::error::operation_aborted);
  CHECK(r.n == 0);
  CHECK(ring.stats().ops_cancelled.load() == 1);
  CHECK(ring.in_flight() == 0);

  // Data that arrives afterwards stays in the pipe: nothing reads into the old buffer.
  REQUIRE(::write(p.write_end.get(), "hello", 5) == 5);
  test::poll(ctx);
  CHECK(test::all_bytes(in.span(), std::byte{0xab}));
  char back[8] = {};
  CHECK(::read(p.read_end.get(), back, sizeof back) == 5);
  CHECK(std::string(back, 5) == "hello");
  CHECK(r.calls == 1);
}

TEST_CASE("a coroutine racing a read against a timer cancels the read when the timer wins", "[io][uring][cancel]") {
  KVTIER_REQUIRE_URING();
  using namespace asio::experimental::awaitable_operators;
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::pipe_pair p;
  aligned_buffer in = aligned_buffer_of(4096, std::byte{0x11});
  const std::size_t winner = test::run_sync(ctx, [&]() -> asio::awaitable<std::size_t> {
    asio::steady_timer deadline(ctx, std::chrono::milliseconds(20));
    auto read = ring.async_read(p.read_end.get(), in.span(), 0, asio::use_awaitable);
    auto timeout = deadline.async_wait(asio::use_awaitable);
    auto r = co_await (std::move(read) || std::move(timeout));
    co_return r.index();
  }());
  CHECK(winner == 1);  // the timer
  CHECK(ring.stats().ops_cancelled.load() == 1);
  CHECK(ring.in_flight() == 0);
  REQUIRE(::write(p.write_end.get(), "x", 1) == 1);
  test::poll(ctx);
  CHECK(test::all_bytes(in.span(), std::byte{0x11}));
}

TEST_CASE("cancelling async_read_all cancels its parts in the kernel and completes once",
          "[io][uring][cancel][object_io]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::pipe_pair p;  // every part waits on the empty pipe
  aligned_buffer in = aligned_buffer_of(6 << 20, std::byte{0x66});
  io::object_io_options o;
  o.part_bytes = 1 << 20;
  o.max_parts_in_flight = 4;
  asio::cancellation_signal sig;
  op_result r;
  io::async_read_all(ring, p.read_end.get(), in.span(), 0, o, asio::bind_cancellation_slot(sig.slot(), r.handler()));
  test::poll(ctx);
  CHECK(ring.in_flight() == 4);
  sig.emit(asio::cancellation_type::terminal);
  REQUIRE(test::run_until(ctx, [&] { return r.calls > 0; }));
  CHECK(r.calls == 1);
  CHECK(r.ec == asio::error::operation_aborted);
  CHECK(r.n == 0);
  CHECK(ring.in_flight() == 0);
  CHECK(ring.stats().ops_cancelled.load() == 4);
  CHECK(ring.stats().ops_started.load() == 4);  // the last two parts never started
  REQUIRE(::write(p.write_end.get(), "after", 5) == 5);
  test::poll(ctx);
  CHECK(test::all_bytes(in.span(), std::byte{0x66}));
  CHECK(r.calls == 1);
}

TEST_CASE("an operation cancelled while queued in the ring never reaches the kernel", "[io][uring][cancel]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_options o;
  o.entries = 4;  // CQ 8: at most 5 ops get an SQE, the rest queue
  io::uring_context ring(ctx.get_executor(), o);
  test::pipe_pair p;
  std::vector<aligned_buffer> bufs;
  for (int i = 0; i < 7; ++i) bufs.push_back(aligned_buffer_of(4096, std::byte{0x22}));
  std::vector<op_result> r(7);
  asio::cancellation_signal sig;
  for (int i = 0; i < 6; ++i) ring.async_read(p.read_end.get(), bufs[i].span(), 0, r[i].handler());
  ring.async_read(p.read_end.get(), bufs[6].span(), 0, asio::bind_cancellation_slot(sig.slot(), r[6].handler()));
  test::poll(ctx);
  const auto submitted = ring.stats().sqes_submitted.load();
  CHECK(submitted == 5);
  sig.emit(asio::cancellation_type::terminal);
  REQUIRE(test::run_until(ctx, [&] { return r[6].calls > 0; }));
  CHECK(r[6].ec == asio::error::operation_aborted);
  CHECK(ring.stats().sqes_submitted.load() == submitted);  // no SQE, not even a cancel
  CHECK(ring.in_flight() == 6);

  ring.shutdown();
  REQUIRE(test::run_until(ctx, [&] { return ring.in_flight() == 0; }));
  for (int i = 0; i < 7; ++i) {
    CHECK(r[i].calls == 1);
    CHECK(r[i].ec == asio::error::operation_aborted);
    CHECK(test::all_bytes(bufs[i].span(), std::byte{0x22}));
  }
}

TEST_CASE("shutdown cancels every operation in flight, each completes exactly once", "[io][uring][shutdown]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::pipe_pair p;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "f").string();
  test::write_pattern_file(path, 4096, 1);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in = aligned_buffer_of(8 * 4096, std::byte{0});
  std::vector<op_result> r(9);
  for (std::size_t i = 0; i < 8; ++i) ring.async_read(p.read_end.get(), in.span().subspan(i * 4096, 4096), 0, r[i].handler());
  test::poll(ctx);
  CHECK(ring.in_flight() == 8);
  ring.shutdown();
  ring.shutdown();  // idempotent
  REQUIRE(test::run_until(ctx, [&] { return ring.in_flight() == 0; }));
  for (std::size_t i = 0; i < 8; ++i) {
    CHECK(r[i].calls == 1);
    CHECK(r[i].ec == asio::error::operation_aborted);
  }
  ring.async_read(fd.get(), in.span().first(4096), 0, r[8].handler());
  REQUIRE(test::run_until(ctx, [&] { return r[8].calls > 0; }));
  CHECK(r[8].ec == errc::shutting_down);
  CHECK(test::all_bytes(in.span(), std::byte{0}));
}

TEST_CASE("destroying the ring with operations in flight waits for the kernel and posts every handler",
          "[io][uring][shutdown]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  auto ring = std::make_unique<io::uring_context>(ctx.get_executor());
  test::pipe_pair p;
  aligned_buffer in = aligned_buffer_of(4 * 4096, std::byte{0x33});
  std::vector<op_result> r(4);
  for (std::size_t i = 0; i < 3; ++i) ring->async_read(p.read_end.get(), in.span().subspan(i * 4096, 4096), 0, r[i].handler());
  test::poll(ctx);  // in the kernel now
  ring->async_read(p.read_end.get(), in.span().subspan(3 * 4096), 0, r[3].handler());  // only prepared
  ring.reset();
  for (const auto& x : r) CHECK(x.calls == 0);  // posted, not run inside the destructor
  test::poll(ctx);
  for (const auto& x : r) {
    CHECK(x.calls == 1);
    CHECK(x.ec == asio::error::operation_aborted);
  }
  REQUIRE(::write(p.write_end.get(), "late", 4) == 4);
  CHECK(test::all_bytes(in.span(), std::byte{0x33}));
}

TEST_CASE("every task-running mode delivers O_DIRECT and pipe completions through the eventfd", "[io][uring]") {
  KVTIER_REQUIRE_URING();
  const io::taskrun_mode mode = GENERATE(io::taskrun_mode::coop, io::taskrun_mode::defer, io::taskrun_mode::interrupt);
  INFO("mode " << io::to_string(mode));
  asio::io_context ctx;
  io::uring_options o;
  o.taskrun = mode;
  io::uring_context ring(ctx.get_executor(), o);
  CHECK(ring.mode() == mode);  // 6.18 accepts all three
  test::temp_dir dir("kvtier-io");
  test::unique_fd fd = test::open_or_throw((dir.path() / "m").string(), O_RDWR | O_CREAT | O_DIRECT);
  aligned_buffer out(1 << 20);
  test::fill_pattern(out.span(), 12);
  aligned_buffer in = aligned_buffer_of(1 << 20, std::byte{0});
  test::pipe_pair p;
  std::array<std::byte, 3> pipe_in{};

  test::run_sync(ctx, [&]() -> asio::awaitable<void> {
    auto tok = asio::as_tuple(asio::use_awaitable);
    auto [wec, wn] = co_await io::async_write_all(ring, fd.get(), std::span<const std::byte>(out.span()), 0, tok);
    CHECK_FALSE(wec);
    CHECK(wn == out.size());
    auto [rec, rn] = co_await io::async_read_all(ring, fd.get(), in.span(), 0, tok);
    CHECK_FALSE(rec);
    CHECK(rn == in.size());
    // A completion that needs the kernel's task work: a pipe read fed by another thread
    // once the read is parked.
    std::thread writer;
    // Started two turns later, after the ring's turn has parked the read on the pipe.
    asio::post(ctx, [&] {
      asio::post(ctx, [&] { writer = std::thread([&] { (void)::write(p.write_end.get(), "abc", 3); }); });
    });
    auto [pec, pn] = co_await ring.async_read(p.read_end.get(), std::span<std::byte>(pipe_in), 0, tok);
    writer.join();
    CHECK_FALSE(pec);
    CHECK(pn == 3);
  }());
  CHECK(test::matches_pattern(in.span(), 12));
  CHECK(pipe_in[0] == std::byte{'a'});
}

TEST_CASE("in steady state an operation takes no heap allocation", "[io][uring][alloc]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_context ring(ctx.get_executor());
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "a").string();
  test::write_pattern_file(path, 16 * 4096, 5);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(16 * 4096);

  std::size_t allocations = 0;
  std::uint64_t op_heap_delta = 0;
  test::run_sync(ctx, [&]() -> asio::awaitable<void> {
    auto read_all_blocks = [&]() -> asio::awaitable<void> {
      for (std::size_t i = 0; i < 16; ++i) {
        auto [ec, n] = co_await ring.async_read(fd.get(), in.span().subspan(i * 4096, 4096), i * 4096,
                                                asio::as_tuple(asio::use_awaitable));
        if (ec || n != 4096) throw std::runtime_error("read failed");
      }
    };
    for (int warm = 0; warm < 4; ++warm) co_await read_all_blocks();
    const auto heap_before = ring.stats().op_heap_allocations.load();
    test::count_allocations(true);
    for (int round = 0; round < 50; ++round) co_await read_all_blocks();
    allocations = test::counted_allocations();
    test::count_allocations(false);
    op_heap_delta = ring.stats().op_heap_allocations.load() - heap_before;
  }());
  INFO("operator new calls for 800 co_awaited reads: " << allocations);
  CHECK(op_heap_delta == 0);
  if (test::allocation_counting_available()) CHECK(allocations == 0);
  else WARN("sanitizer build: operator new is not counted, only the ring's own op cache is checked");
  CHECK(test::matches_pattern(in.span(), 5));
}

TEST_CASE("a handler bound to another executor runs on that executor", "[io][uring][concurrency]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  asio::io_context other;
  auto guard = asio::make_work_guard(other);
  std::thread other_thread([&] { other.run(); });
  io::uring_context ring(ctx.get_executor());
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "x").string();
  test::write_pattern_file(path, 4096, 6);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(4096);
  std::atomic<int> calls{0};
  std::atomic<bool> on_other{false};
  ring.async_read(fd.get(), in.span(), 0, asio::bind_executor(other, [&](error_code ec, std::size_t n) {
                    on_other = other.get_executor().running_in_this_thread() && !ec && n == 4096;
                    ++calls;
                  }));
  const bool done = test::run_until(ctx, [&] { return calls.load() > 0; });
  guard.reset();
  other_thread.join();
  REQUIRE(done);
  CHECK(calls.load() == 1);
  CHECK(on_other.load());
  CHECK(test::matches_pattern(in.span(), 6));
}

TEST_CASE("a ring on a strand of a two-thread io_context serves coroutines on that strand", "[io][uring][concurrency]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx(2);
  auto strand = asio::make_strand(ctx);
  io::uring_context ring(strand);
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "s").string();
  constexpr std::size_t blocks = 64;
  test::write_pattern_file(path, blocks * 4096, 7);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | O_DIRECT);
  aligned_buffer in(blocks * 4096);
  std::atomic<int> finished{0};
  std::atomic<int> failures{0};
  for (int c = 0; c < 4; ++c) {
    asio::co_spawn(strand, [&, c]() -> asio::awaitable<void> {
      for (std::size_t i = c; i < blocks; i += 4) {
        auto [ec, n] = co_await ring.async_read(fd.get(), in.span().subspan(i * 4096, 4096), i * 4096,
                                                asio::as_tuple(asio::use_awaitable));
        if (ec || n != 4096) ++failures;
      }
      ++finished;
    }, asio::detached);
  }
  std::thread t([&] { ctx.run(); });
  ctx.run();
  t.join();
  CHECK(finished.load() == 4);
  CHECK(failures.load() == 0);
  CHECK(test::matches_pattern(in.span(), 7));
}

TEST_CASE("random reads, writes and cancellations all complete exactly once", "[io][uring][concurrency]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  io::uring_options o;
  o.entries = 16;  // small, so the pending queue and full-SQ submissions are exercised
  io::uring_context ring(ctx.get_executor(), o);
  test::temp_dir dir("kvtier-io");
  constexpr std::size_t blocks = 256;
  const std::string path = (dir.path() / "r").string();
  test::write_pattern_file(path, blocks * 4096, 8);
  test::unique_fd fd = test::open_or_throw(path, O_RDWR | O_DIRECT);
  test::pipe_pair p;
  aligned_buffer mem = aligned_buffer_of(blocks * 4096, std::byte{0});
  std::vector<aligned_buffer> pipe_bufs;
  constexpr int pipe_reads = 64;
  for (int i = 0; i < pipe_reads; ++i) pipe_bufs.push_back(aligned_buffer_of(64, std::byte{0x44}));
  std::vector<asio::cancellation_signal> sigs(pipe_reads);
  std::vector<int> calls(blocks + pipe_reads, 0);
  std::vector<error_code> ecs(blocks + pipe_reads);
  std::vector<std::size_t> sizes(blocks + pipe_reads, 0);
  std::mt19937 rng(42);

  for (std::size_t i = 0; i < blocks; ++i) {
    auto h = [&, i](error_code ec, std::size_t) {
      ++calls[i];
      ecs[i] = ec;
    };
    if (rng() % 4 == 0) ring.async_write(fd.get(), std::span<const std::byte>(mem.span().subspan(i * 4096, 4096)),
                                         (blocks + i) * 4096, h);
    else ring.async_read(fd.get(), mem.span().subspan(i * 4096, 4096), i * 4096, h);
  }
  for (int i = 0; i < pipe_reads; ++i) {
    ring.async_read(p.read_end.get(), pipe_bufs[i].span(), 0,
                    asio::bind_cancellation_slot(sigs[i].slot(), [&, i](error_code ec, std::size_t n) {
                      ++calls[blocks + i];
                      ecs[blocks + i] = ec;
                      sizes[blocks + i] = n;
                    }));
  }
  // A writer thread feeds the pipe while the ring cancels the pipe reads in random order.
  std::thread writer([&] {
    for (int i = 0; i < pipe_reads / 2; ++i) (void)::write(p.write_end.get(), "z", 1);
  });
  std::vector<int> order(pipe_reads);
  for (int i = 0; i < pipe_reads; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::size_t next = 0;
  const bool done = test::run_until(ctx, [&] {
    if (next < order.size()) sigs[order[next++]].emit(asio::cancellation_type::terminal);
    return ring.in_flight() == 0;
  });
  writer.join();
  REQUIRE(done);
  test::poll(ctx);
  for (std::size_t i = 0; i < calls.size(); ++i) {
    INFO("op " << i);
    CHECK(calls[i] == 1);
  }
  std::size_t read_bytes = 0;
  for (int i = 0; i < pipe_reads; ++i) {
    const error_code& ec = ecs[blocks + i];
    CHECK((!ec || ec == asio::error::operation_aborted));
    if (!ec) read_bytes += sizes[blocks + i];
    else CHECK(test::all_bytes(pipe_bufs[i].span(), std::byte{0x44}));
  }
  // Every byte the writer sent was read by exactly one op, or is still in the pipe.
  REQUIRE(::fcntl(p.read_end.get(), F_SETFL, O_NONBLOCK) == 0);
  char rest[64];
  const ssize_t left = ::read(p.read_end.get(), rest, sizeof rest);
  CHECK(read_bytes + static_cast<std::size_t>(left > 0 ? left : 0) == pipe_reads / 2);
  CHECK(ring.stats().ops_completed.load() == blocks + pipe_reads);
}
