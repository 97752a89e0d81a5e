// The run-time choice of the file I/O: the probe, KVTIER_IO_BACKEND, and what any_file_io says
// about its choice (log line, kvtier_io_* metrics).
#include <kvtier/io/any_file_io.hpp>

#include "io_test_support.hpp"
#include "support/captured_log.hpp"

#include <kvtier/io/probe.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/io_context.hpp>

#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace asio = boost::asio;
using namespace kvtier;
using kvtier::test::captured_log;

/// Sets an environment variable for the scope of a test, restoring the old value after.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("file I/O choices parse from their names", "[io][probe]") {
  CHECK(io::parse_file_io_choice("auto") == io::file_io_choice::automatic);
  CHECK(io::parse_file_io_choice("") == io::file_io_choice::automatic);
  CHECK(io::parse_file_io_choice("uring") == io::file_io_choice::uring);
  CHECK(io::parse_file_io_choice("io_uring") == io::file_io_choice::uring);
  CHECK(io::parse_file_io_choice("pread") == io::file_io_choice::pread);
  CHECK_FALSE(io::parse_file_io_choice("threads").has_value());
  CHECK(io::to_string(io::file_io_kind::uring) == "io_uring");
  CHECK(io::to_string(io::file_io_kind::pread) == "pread");
}

TEST_CASE("the probe says whether io_uring works here, and why", "[io][probe]") {
  const auto p = io::probe_uring();
  CHECK_FALSE(p.detail.empty());
  if (!p.available()) {
    WARN("io_uring is unavailable on this machine: " << p.detail);
    CHECK(p.error.value() != 0);
    return;
  }
  CHECK(p.detail.find("works") != std::string::npos);
  const scoped_env env(io::file_io_env_var, nullptr);
  const auto s = io::select_file_io();
  CHECK(s.kind == io::file_io_kind::uring);
  CHECK(s.requested == io::file_io_choice::automatic);
  REQUIRE(s.uring.has_value());
  CHECK(s.uring->available());
}

TEST_CASE("KVTIER_IO_BACKEND forces the file I/O of an automatic choice, and only of an automatic one", "[io][probe]") {
  {
    const scoped_env env(io::file_io_env_var, "pread");
    const auto s = io::select_file_io();
    CHECK(s.kind == io::file_io_kind::pread);
    CHECK(s.requested == io::file_io_choice::pread);
    CHECK_FALSE(s.uring.has_value());  // forced: not even probed
    CHECK(s.reason.find("KVTIER_IO_BACKEND=pread") != std::string::npos);
    if (test::uring_probe().available()) {
      const auto explicit_choice = io::select_file_io(io::file_io_choice::uring);
      CHECK(explicit_choice.kind == io::file_io_kind::uring);
    }
  }
  {
    const scoped_env env(io::file_io_env_var, "bogus");
    CHECK_THROWS_AS(io::select_file_io(), std::invalid_argument);
    CHECK(io::select_file_io(io::file_io_choice::pread).kind == io::file_io_kind::pread);
  }
  {
    const scoped_env env(io::file_io_env_var, "uring");
    if (test::uring_probe().available()) CHECK(io::select_file_io().kind == io::file_io_kind::uring);
    else CHECK_THROWS_AS(io::select_file_io(), std::runtime_error);
  }
}

TEST_CASE("any_file_io says which implementation it chose, in the log and in kvtier_io_uring_enabled",
          "[io][any_file_io]") {
  const scoped_env env(io::file_io_env_var, nullptr);
  asio::io_context ctx;
  const bool force_pread = GENERATE(false, true);
  telemetry::registry reg;
  captured_log cap;
  io::any_file_io_options o;
  if (force_pread) o.choice = io::file_io_choice::pread;
  io::any_file_io fio(ctx.get_executor(), o, &cap.log);
  telemetry::collect_io(reg, fio.kind() == io::file_io_kind::uring, fio.shared_stats());

  const bool uring = !force_pread && test::uring_probe().available();
  CHECK(fio.kind() == (uring ? io::file_io_kind::uring : io::file_io_kind::pread));
  CHECK((fio.uring() != nullptr) == uring);
  CHECK((fio.pool() != nullptr) == !uring);
  CHECK(reg.value("kvtier_io_uring_enabled") == (uring ? 1.0 : 0.0));
  CHECK(reg.value("kvtier_io_fixed_buffer_registration_failures_total") == 0.0);
  CHECK(reg.value("kvtier_io_ops_total") == 0.0);
  CHECK(reg.value("kvtier_io_uring_enter_calls_total") == 0.0);
  CHECK(reg.value("kvtier_io_in_flight") == 0.0);
  bool logged = false;
  for (const auto& l : cap.lines) {
    if (uring) logged = logged || l.find("file I/O on io_uring") != std::string::npos;
    else logged = logged || l.find("pread thread pool") != std::string::npos;
  }
  CHECK(logged);

  // The counters follow the fio.
  test::temp_dir dir("kvtier-io");
  const std::string path = (dir.path() / "m").string();
  test::write_pattern_file(path, 4096, 3);
  test::unique_fd fd = test::open_or_throw(path, O_RDONLY);
  aligned_buffer in(4096);
  int calls = 0;
  fio.async_read(fd.get(), in.span(), 0, [&](error_code ec, std::size_t n) {
    CHECK_FALSE(ec);
    CHECK(n == 4096);
    ++calls;
  });
  fio.async_read(-1, in.span(), 0, [&](error_code ec, std::size_t) {
    CHECK(ec == boost::system::errc::bad_file_descriptor);
    ++calls;
  });
  REQUIRE(test::run_until(ctx, [&] { return calls == 2; }));
  CHECK(reg.value("kvtier_io_ops_total") == 2.0);
  CHECK(reg.value("kvtier_io_failed_ops_total") == 1.0);
  CHECK(reg.value("kvtier_io_uring_sqes_total") == (uring ? 2.0 : 0.0));
  CHECK(test::matches_pattern(in.span(), 3));

  // The exposition is valid text and names every metric of docs/io.md.
  const std::string text = telemetry::prometheus_text(reg);
  for (const char* name :
       {"kvtier_io_uring_enabled", "kvtier_io_ops_total", "kvtier_io_cancelled_ops_total", "kvtier_io_failed_ops_total",
        "kvtier_io_uring_enter_calls_total", "kvtier_io_uring_sqes_total", "kvtier_io_fixed_ops_total",
        "kvtier_io_fixed_buffer_registration_failures_total", "kvtier_io_fixed_buffer_bytes", "kvtier_io_in_flight"}) {
    INFO(name);
    CHECK(text.find(std::string("# TYPE ") + name) != std::string::npos);
  }
}

TEST_CASE("the metrics of an any_file_io stay readable after it is gone", "[io][any_file_io]") {
  telemetry::registry reg;
  {
    asio::io_context ctx;
    io::any_file_io_options o;
    o.choice = io::file_io_choice::pread;
    io::any_file_io fio(ctx.get_executor(), o);
    telemetry::collect_io(reg, fio.kind() == io::file_io_kind::uring, fio.shared_stats());
  }
  CHECK(reg.value("kvtier_io_uring_enabled") == 0.0);
  CHECK(reg.value("kvtier_io_ops_total") == 0.0);
}

TEST_CASE("any_file_io counts a refused fixed-buffer registration in its metric", "[io][any_file_io][fixed]") {
  KVTIER_REQUIRE_URING();
  asio::io_context ctx;
  telemetry::registry reg;
  io::any_file_io_options o;
  o.choice = io::file_io_choice::uring;
  io::any_file_io fio(ctx.get_executor(), o);
  telemetry::collect_io(reg, true, fio.shared_stats());
  // Read-only memory cannot be pinned for the kernel to write into: EFAULT.
  void* ro = ::mmap(nullptr, 65536, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(ro != MAP_FAILED);
  const io::buffer_region regions[] = {std::span<std::byte>(static_cast<std::byte*>(ro), 65536)};
  const error_code ec = fio.register_buffers(regions);
  ::munmap(ro, 65536);
  CHECK(ec);
  CHECK_FALSE(fio.fixed_buffers_active());
  CHECK(reg.value("kvtier_io_fixed_buffer_registration_failures_total") == 1.0);
}
