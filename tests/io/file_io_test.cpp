// The file_io conformance suite: the same behaviour from every implementation (uring_context,
// pread_pool, any_file_io both ways), and the object helpers (async_run_parts, async_read_all /
// async_write_all) on each.
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/object_io.hpp>
#include <kvtier/io/parts.hpp>

#include "io_test_support.hpp"

#include <support/asio.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace asio = boost::asio;
using namespace kvtier;
using kvtier::test::aligned_buffer_of;

static_assert(io::file_io<io::file_io_archetype>);
static_assert(io::file_io<io::uring_context>);
static_assert(io::file_io<io::pread_pool>);
static_assert(io::file_io<io::any_file_io>);

using test::size_result;
using test::void_result;

}  // namespace

TEMPLATE_TEST_CASE("a written block reads back the same bytes, through O_DIRECT and through the page cache",
                   "[io][conformance]", KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const bool direct = GENERATE(true, false);
  INFO(TestType::name << (direct ? " O_DIRECT" : " buffered"));
  const std::string path = (dir.path() / "data").string();
  test::unique_fd fd = test::open_or_throw(path, O_RDWR | O_CREAT | (direct ? O_DIRECT : 0));

  aligned_buffer out(64 * 1024);
  test::fill_pattern(out.span(), 7);
  size_result w;
  f.file_io().async_write(fd.get(), std::span<const std::byte>(out.span()), 8192, w.handler());
  CHECK(w.calls == 0);  // never inline in the initiating call
  REQUIRE(test::run_until(f.io, [&] { return w.calls > 0; }));
  CHECK(w.calls == 1);
  CHECK_FALSE(w.ec);
  CHECK(w.n == out.size());

  aligned_buffer in = aligned_buffer_of(out.size(), std::byte{0});
  size_result r;
  f.file_io().async_read(fd.get(), in.span(), 8192, r.handler());
  REQUIRE(test::run_until(f.io, [&] { return r.calls > 0; }));
  CHECK(r.calls == 1);
  CHECK_FALSE(r.ec);
  CHECK(r.n == in.size());
  CHECK(test::matches_pattern(in.span(), 7));
}

TEMPLATE_TEST_CASE("a read past the end of the file comes back short, then empty", "[io][conformance]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "short").string();
  test::write_pattern_file(path, 10000, 3);  // not a multiple of 4 KiB: O_DIRECT's last block is short
  const bool direct = GENERATE(true, false);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | (direct ? O_DIRECT : 0));

  aligned_buffer in = aligned_buffer_of(16384, std::byte{0xee});
  aligned_buffer past = aligned_buffer_of(4096, std::byte{0xee});
  size_result a;
  size_result b;
  f.file_io().async_read(fd.get(), in.span(), 0, a.handler());
  f.file_io().async_read(fd.get(), past.span(), 12288, b.handler());
  REQUIRE(test::run_until(f.io, [&] { return a.calls > 0 && b.calls > 0; }));
  CHECK_FALSE(a.ec);
  CHECK(a.n == 10000);
  CHECK(test::matches_pattern(in.span().first(10000), 3));
  // Past the count the buffer is unspecified: ext4 O_DIRECT zero-fills the rest of the
  // request (a hole past EOF), buffered reads leave it alone.
  if (!direct) CHECK(test::all_bytes(in.span().subspan(10000), std::byte{0xee}));
  CHECK_FALSE(b.ec);
  CHECK(b.n == 0);
  CHECK(test::all_bytes(past.span(), std::byte{0xee}));
}

TEMPLATE_TEST_CASE("errors come back as error codes: EBADF for a bad descriptor, EINVAL for unaligned O_DIRECT",
                   "[io][conformance]", KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "d").string();
  test::write_pattern_file(path, 65536, 1);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | O_DIRECT);
  aligned_buffer in = aligned_buffer_of(16384, std::byte{0x5a});

  size_result bad_fd;
  size_result bad_offset;
  size_result bad_buffer;
  size_result bad_length;
  f.file_io().async_read(-1, in.span(), 0, bad_fd.handler());
  f.file_io().async_read(fd.get(), in.span().first(4096), 100, bad_offset.handler());
  f.file_io().async_read(fd.get(), in.span().subspan(1, 4096), 0, bad_buffer.handler());
  f.file_io().async_read(fd.get(), in.span().first(1000), 0, bad_length.handler());
  REQUIRE(test::run_until(f.io, [&] {
    return bad_fd.calls && bad_offset.calls && bad_buffer.calls && bad_length.calls;
  }));
  CHECK(bad_fd.ec == boost::system::errc::bad_file_descriptor);
  CHECK(bad_offset.ec == boost::system::errc::invalid_argument);
  CHECK(bad_buffer.ec == boost::system::errc::invalid_argument);
  CHECK(bad_length.ec == boost::system::errc::invalid_argument);
  CHECK(bad_fd.n == 0);
  CHECK(test::all_bytes(in.span(), std::byte{0x5a}));
  CHECK(f.file_io().stats().ops_failed.load() == 4);
}

TEMPLATE_TEST_CASE("many operations started at once all complete, each exactly once", "[io][conformance]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "many").string();
  constexpr std::size_t blocks = 300;  // more than the ring's 256 SQEs
  test::write_pattern_file(path, blocks * 4096, 9);
  const bool direct = GENERATE(true, false);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | (direct ? O_DIRECT : 0));

  aligned_buffer in = aligned_buffer_of(blocks * 4096, std::byte{0});
  std::vector<size_result> results(blocks);
  std::size_t done = 0;
  for (std::size_t i = 0; i < blocks; ++i) {
    // Backwards, so each read is checked against its own offset.
    const std::size_t b = blocks - 1 - i;
    f.file_io().async_read(fd.get(), in.span().subspan(b * 4096, 4096), b * 4096,
                           [&, h = results[b].handler()](error_code ec, std::size_t n) mutable {
                             h(ec, n);
                             ++done;
                           });
  }
  REQUIRE(test::run_until(f.io, [&] { return done == blocks; }));
  for (std::size_t b = 0; b < blocks; ++b) {
    INFO("block " << b);
    CHECK(results[b].calls == 1);
    CHECK_FALSE(results[b].ec);
    CHECK(results[b].n == 4096);
  }
  CHECK(test::matches_pattern(in.span(), 9));
  CHECK(f.file_io().in_flight() == 0);
  CHECK(f.file_io().stats().ops_started.load() == blocks);
}

TEMPLATE_TEST_CASE("readv and writev move scattered buffers", "[io][conformance]", KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  test::unique_fd fd = test::open_or_throw((dir.path() / "v").string(), O_RDWR | O_CREAT | O_DIRECT);
  aligned_buffer head(4096);
  aligned_buffer body(3 * 4096);
  test::fill_pattern(head.span(), 2, 0);
  test::fill_pattern(body.span(), 2, 4096);
  const std::array<::iovec, 2> out{::iovec{head.data(), head.size()}, ::iovec{body.data(), body.size()}};
  size_result w;
  f.file_io().async_writev(fd.get(), std::span<const ::iovec>(out), 0, w.handler());
  REQUIRE(test::run_until(f.io, [&] { return w.calls > 0; }));
  CHECK_FALSE(w.ec);
  CHECK(w.n == 4 * 4096);

  aligned_buffer a = aligned_buffer_of(8192, std::byte{0});
  aligned_buffer b = aligned_buffer_of(8192, std::byte{0});
  const std::array<::iovec, 2> in{::iovec{a.data(), a.size()}, ::iovec{b.data(), b.size()}};
  size_result r;
  f.file_io().async_readv(fd.get(), std::span<const ::iovec>(in), 0, r.handler());
  REQUIRE(test::run_until(f.io, [&] { return r.calls > 0; }));
  CHECK_FALSE(r.ec);
  CHECK(r.n == 4 * 4096);
  CHECK(test::matches_pattern(a.span(), 2, 0));
  CHECK(test::matches_pattern(b.span(), 2, 8192));
}

TEMPLATE_TEST_CASE("openat, fsync, fdatasync, renameat, unlinkat and close work on real files", "[io][conformance]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  test::unique_fd dfd = test::open_or_throw(dir.path().string(), O_RDONLY | O_DIRECTORY);
  auto& e = f.file_io();

  test::run_sync(f.io, [&]() -> asio::awaitable<void> {
    auto tok = asio::as_tuple(asio::use_awaitable);
    auto [oec, fd] = co_await e.async_openat(dfd.get(), "obj.tmp", O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600, tok);
    REQUIRE_FALSE(oec);
    REQUIRE(fd >= 0);
    aligned_buffer data(4096);
    test::fill_pattern(data.span(), 4);
    auto [wec, wn] = co_await e.async_write(fd, std::span<const std::byte>(data.span()), 0, tok);
    CHECK_FALSE(wec);
    CHECK(wn == 4096);
    auto [sec] = co_await e.async_fdatasync(fd, tok);
    CHECK_FALSE(sec);
    auto [fsec] = co_await e.async_fsync(fd, tok);
    CHECK_FALSE(fsec);
    auto [cec] = co_await e.async_close(fd, tok);
    CHECK_FALSE(cec);

    auto [rec] = co_await e.async_renameat(dfd.get(), "obj.tmp", dfd.get(), "obj", RENAME_NOREPLACE, tok);
    CHECK_FALSE(rec);
    auto [o2ec, fd2] = co_await e.async_openat(dfd.get(), "other", O_WRONLY | O_CREAT | O_CLOEXEC, 0600, tok);
    REQUIRE_FALSE(o2ec);
    auto [c2ec] = co_await e.async_close(fd2, tok);
    CHECK_FALSE(c2ec);
    auto [exists] = co_await e.async_renameat(dfd.get(), "other", dfd.get(), "obj", RENAME_NOREPLACE, tok);
    CHECK(exists == boost::system::errc::file_exists);

    auto [uec] = co_await e.async_unlinkat(dfd.get(), "other", 0, tok);
    CHECK_FALSE(uec);
    auto [missing, mfd] = co_await e.async_openat(dfd.get(), "other", O_RDONLY | O_CLOEXEC, 0, tok);
    CHECK(missing == boost::system::errc::no_such_file_or_directory);
    CHECK(mfd == -1);
    auto [badclose] = co_await e.async_close(-1, tok);
    CHECK(badclose == boost::system::errc::bad_file_descriptor);
  }());

  struct ::stat st {};
  REQUIRE(::stat((dir.path() / "obj").c_str(), &st) == 0);
  CHECK(st.st_size == 4096);
  CHECK(::access((dir.path() / "obj.tmp").c_str(), F_OK) != 0);
}

TEMPLATE_TEST_CASE("operations started after shutdown complete with shutting_down", "[io][conformance]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "s").string();
  test::write_pattern_file(path, 4096, 5);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  f.file_io().shutdown();
  aligned_buffer in = aligned_buffer_of(4096, std::byte{0});
  size_result r;
  void_result s;
  f.file_io().async_read(fd.get(), in.span(), 0, r.handler());
  f.file_io().async_fsync(fd.get(), s.handler());
  CHECK(r.calls == 0);
  REQUIRE(test::run_until(f.io, [&] { return r.calls > 0 && s.calls > 0; }));
  CHECK(r.ec == errc::shutting_down);
  CHECK(s.ec == errc::shutting_down);
  CHECK(test::all_bytes(in.span(), std::byte{0}));
}

TEMPLATE_TEST_CASE("coroutines co_await operations and resume on their executor", "[io][conformance]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "co").string();
  test::write_pattern_file(path, 8192, 6);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  auto& e = f.file_io();
  const std::size_t n = test::run_sync(f.io, [&]() -> asio::awaitable<std::size_t> {
    aligned_buffer in(8192);
    std::size_t total = 0;
    for (int i = 0; i < 4; ++i) {
      // The plain use_awaitable form throws on error and returns the byte count.
      total += co_await e.async_read(fd.get(), in.span(), 0, asio::use_awaitable);
      CHECK(f.io.get_executor().running_in_this_thread());
    }
    CHECK(test::matches_pattern(in.span(), 6));
    try {
      (void)co_await e.async_read(-1, in.span(), 0, asio::use_awaitable);
      FAIL("a read of fd -1 must throw");
    } catch (const boost::system::system_error& err) {
      CHECK(err.code() == boost::system::errc::bad_file_descriptor);
    }
    co_return total;
  }());
  CHECK(n == 4 * 8192);
}

TEMPLATE_TEST_CASE("async_write_all and async_read_all move a 5 MiB object in parts", "[io][conformance][object_io]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const bool direct = GENERATE(true, false);
  test::unique_fd fd = test::open_or_throw((dir.path() / "obj").string(), O_RDWR | O_CREAT | (direct ? O_DIRECT : 0));
  constexpr std::size_t size = 5 * 1024 * 1024 + 12288;  // 5 full parts and a short last one
  aligned_buffer out(size);
  test::fill_pattern(out.span(), 8);
  io::object_io_options opts;
  opts.part_bytes = 1 << 20;
  opts.max_parts_in_flight = 4;

  size_result w;
  io::async_write_all(f.file_io(), fd.get(), std::span<const std::byte>(out.span()), 4096, opts, w.handler());
  CHECK(w.calls == 0);
  REQUIRE(test::run_until(f.io, [&] { return w.calls > 0; }));
  CHECK(w.calls == 1);
  CHECK_FALSE(w.ec);
  CHECK(w.n == size);
  CHECK(f.file_io().stats().ops_completed.load() == 6);

  aligned_buffer in = aligned_buffer_of(size, std::byte{0});
  size_result r;
  io::async_read_all(f.file_io(), fd.get(), in.span(), 4096, r.handler());
  REQUIRE(test::run_until(f.io, [&] { return r.calls > 0; }));
  CHECK(r.calls == 1);
  CHECK_FALSE(r.ec);
  CHECK(r.n == size);
  CHECK(test::matches_pattern(in.span(), 8));
  test::poll(f.io);
  CHECK(f.file_io().in_flight() == 0);
}

TEMPLATE_TEST_CASE("async_read_all reports a file that ends early as eof with the bytes it has",
                   "[io][conformance][object_io]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "trunc").string();
  constexpr std::size_t on_disk = 2 * 1024 * 1024 + 4096 + 100;  // ends inside the third 1 MiB part
  test::write_pattern_file(path, on_disk, 11);
  const bool direct = GENERATE(true, false);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY | (direct ? O_DIRECT : 0));
  aligned_buffer in = aligned_buffer_of(4 * 1024 * 1024, std::byte{0});
  const std::size_t part = GENERATE(std::size_t{1} << 20, std::size_t{256} << 10);
  io::object_io_options opts;
  opts.part_bytes = part;

  const auto [ec, n] = test::run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, std::size_t>> {
    co_return co_await io::async_read_all(f.file_io(), fd.get(), in.span(), 0, opts,
                                          asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(ec == asio::error::eof);
  CHECK(n == on_disk);
  CHECK(test::matches_pattern(in.span().first(on_disk), 11));

  aligned_buffer empty;
  const auto [ec0, n0] = test::run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, std::size_t>> {
    co_return co_await io::async_read_all(f.file_io(), fd.get(), empty.span(), 0, asio::as_tuple(asio::use_awaitable));
  }());
  CHECK_FALSE(ec0);
  CHECK(n0 == 0);
}

TEMPLATE_TEST_CASE("async_read_all reports the first failing part's error", "[io][conformance][object_io]",
                   KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  size_result r;
  aligned_buffer in(3 << 20);
  io::async_read_all(f.file_io(), -1, in.span(), 0, r.handler());
  REQUIRE(test::run_until(f.io, [&] { return r.calls > 0; }));
  CHECK(r.calls == 1);
  CHECK(r.ec == boost::system::errc::bad_file_descriptor);
  CHECK(r.n == 0);
  CHECK_THROWS_AS(io::async_read_all(f.file_io(), -1, in.span(), 0, io::object_io_options{0, 4}, r.handler()),
                  std::invalid_argument);
  CHECK_THROWS_AS(io::async_read_all(f.file_io(), -1, in.span(), 0, io::object_io_options{4096, 257}, r.handler()),
                  std::invalid_argument);
}

namespace {

/// What async_run_parts did, in the order it did it: parts begun after the stop, parts in
/// flight at most.
struct run_order {
  bool stopped = false;
  std::size_t begun_after_stop = 0;
  std::size_t in_flight = 0;
  std::size_t max_in_flight = 0;
};

/// Reads 4 KiB blocks of a file; skips the blocks in `skip`, asks to stop after block
/// `stop_after`, and records the order parts began and ended.
struct block_plan {
  static constexpr bool writes = false;
  using signature = void(error_code, std::size_t);
  int fd;
  std::byte* base;
  std::size_t blocks;
  std::vector<std::size_t>* skip;
  std::size_t stop_after;
  std::vector<std::size_t>* begun;
  std::vector<std::size_t>* ended;
  run_order* order;
  std::size_t bytes = 0;

  [[nodiscard]] std::size_t part_count() const noexcept { return blocks; }
  std::optional<io::file_part> begin_part(std::size_t i) {
    if (std::find(skip->begin(), skip->end(), i) != skip->end()) return std::nullopt;
    begun->push_back(i);
    order->begun_after_stop += order->stopped ? 1 : 0;
    order->max_in_flight = std::max(order->max_in_flight, ++order->in_flight);
    return io::file_part{fd, base + i * 4096, 4096, i * 4096};
  }
  bool end_part(std::size_t i, const error_code& ec, std::size_t n) {
    ended->push_back(i);
    --order->in_flight;
    if (!ec) bytes += n;
    order->stopped = order->stopped || i == stop_after;
    return i == stop_after;
  }
  std::tuple<error_code, std::size_t> result(const io::parts_outcome& o) {
    return {o.cancelled ? error_code(asio::error::operation_aborted) : error_code{}, bytes};
  }
};
static_assert(io::part_plan<block_plan>);

}  // namespace

TEMPLATE_TEST_CASE("async_run_parts starts parts in order, skips what the plan skips and stops when it says",
                   "[io][conformance][object_io]", KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "blocks").string();
  test::write_pattern_file(path, 16 * 4096, 5);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in = aligned_buffer_of(16 * 4096, std::byte{0});
  std::vector<std::size_t> skip{1, 4};
  std::vector<std::size_t> begun, ended;
  run_order order;

  // Depth 2, stop after block 8 ends: blocks 0 2 3 5 6 7 8 start in order, at most 2 in
  // flight, and none once 8 ended. Parts after 8 may start and even end before it (a pread
  // pool completes out of order: 9 ends, 10 starts, while 8 still reads), so how many
  // started is not fixed; that none starts after 8 ended is.
  const auto [ec, n] = test::run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code, std::size_t>> {
    co_return co_await io::async_run_parts(
        f.file_io(), block_plan{fd.get(), in.data(), 16, &skip, 8, &begun, &ended, &order}, 2,
        asio::as_tuple(asio::use_awaitable));
  }());
  CHECK_FALSE(ec);
  REQUIRE(begun.size() >= 7);
  CHECK(std::vector<std::size_t>(begun.begin(), begun.begin() + 7) == std::vector<std::size_t>{0, 2, 3, 5, 6, 7, 8});
  CHECK(order.begun_after_stop == 0);
  CHECK(order.max_in_flight <= 2);
  CHECK(std::is_sorted(begun.begin(), begun.end()));
  std::vector<std::size_t> sorted_ended = ended;
  std::sort(sorted_ended.begin(), sorted_ended.end());
  CHECK(sorted_ended == begun);  // every part begun ended, once
  CHECK(n == begun.size() * 4096);
  for (std::size_t b : begun) CHECK(test::matches_pattern(in.span().subspan(b * 4096, 4096), 5, b * 4096));
  CHECK(test::all_bytes(in.span().subspan(4096, 4096), std::byte{0}));  // skipped: never read
  CHECK_THROWS_AS(io::async_run_parts(f.file_io(),
                                      block_plan{fd.get(), in.data(), 16, &skip, 8, &begun, &ended, &order}, 0,
                                      asio::detached),
                  std::invalid_argument);
}

namespace {

/// Reads 4 KiB blocks and says its end_part digests what landed (Plan::digests_parts): at
/// each end_part it records how many parts were in flight (this one included) and, where the
/// io counts them, how many had reached the kernel.
struct digesting_plan {
  static constexpr bool writes = false;
  static constexpr bool digests_parts = true;
  using signature = void(error_code);
  int fd;
  std::byte* base;
  std::size_t blocks;
  const io::io_stats* stats;  ///< the io's counters (sqes_submitted), when it counts submissions
  std::size_t begun = 0;
  std::size_t ended = 0;
  std::vector<std::size_t>* in_flight_at_end;
  std::vector<std::size_t>* unsubmitted_at_end;

  [[nodiscard]] std::size_t part_count() const noexcept { return blocks; }
  std::optional<io::file_part> begin_part(std::size_t i) {
    ++begun;
    return io::file_part{fd, base + i * 4096, 4096, i * 4096};
  }
  bool end_part(std::size_t, const error_code&, std::size_t) {
    in_flight_at_end->push_back(begun - ended);
    if (stats != nullptr) unsubmitted_at_end->push_back(begun - stats->sqes_submitted.load());
    ++ended;
    return false;
  }
  std::tuple<error_code> result(const io::parts_outcome&) { return {}; }
};
static_assert(io::part_plan<digesting_plan>);

}  // namespace

TEMPLATE_TEST_CASE("async_run_parts starts the next part before a digesting plan's end_part, and io_uring has it",
                   "[io][conformance][object_io]", KVTIER_FILE_IO_FIXTURES) {
  KVTIER_REQUIRE_FIXTURE(TestType);
  TestType f;
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "blocks").string();
  constexpr std::size_t blocks = 12;
  constexpr unsigned depth = 3;
  test::write_pattern_file(path, blocks * 4096, 9);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in = aligned_buffer_of(blocks * 4096, std::byte{0});
  std::vector<std::size_t> in_flight_at_end, unsubmitted_at_end;
  const bool counts_submissions = f.file_io().kind() == io::file_io_kind::uring;

  // A whole part's end_part (a checksum, in the disk backend) runs with the device's queue
  // already refilled: depth parts in flight besides the ones that landed and wait for their
  // end_part (this one included), while parts remain, and on io_uring every one of them
  // already in the kernel, not waiting for the end of the reaping turn. Parts that land
  // together (one reaping turn) are all replaced before the first of them is digested: a
  // device that completes a batch at once (a VM's virtio disk) gets the whole batch back in
  // one submission, not one read per digest.
  const auto [ec] = test::run_sync(f.io, [&]() -> asio::awaitable<std::tuple<error_code>> {
    co_return co_await io::async_run_parts(
        f.file_io(),
        digesting_plan{fd.get(), in.data(), blocks, counts_submissions ? &f.file_io().stats() : nullptr, 0, 0,
                       &in_flight_at_end, &unsubmitted_at_end},
        depth, asio::as_tuple(asio::use_awaitable));
  }());
  CHECK_FALSE(ec);
  REQUIRE(in_flight_at_end.size() == blocks);
  for (std::size_t k = 0; k < blocks; ++k) {
    INFO("end_part number " << k);
    CHECK(in_flight_at_end[k] >= std::min<std::size_t>(depth + 1, blocks - k));
    CHECK(in_flight_at_end[k] <= std::min<std::size_t>(2 * depth, blocks - k));
  }
  if (counts_submissions) {
    // The first wave (page-cache reads: io_uring completes them inline, so all three land in
    // the turn that submitted them) was replaced whole before its first end_part.
    CHECK(in_flight_at_end[0] == 2 * depth);
    REQUIRE(unsubmitted_at_end.size() == blocks);
    for (std::size_t k = 0; k < blocks; ++k) {
      INFO("end_part number " << k);
      CHECK(unsubmitted_at_end[k] == 0);
    }
  }
  CHECK(test::matches_pattern(in.span(), 9, 0));
}
