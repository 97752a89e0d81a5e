#pragma once
// Test support for io/: one fixture per file_io implementation (the conformance suite runs
// over all of them), temp files, pipes, and a bounded event loop that waits on a condition.
//
// Tests that need io_uring call KVTIER_REQUIRE_URING(): where the kernel refuses io_uring,
// the test WARNs with the probe's reason and passes on a CHECK of that answer (Catch2 v2
// has no SKIP); on machines where io_uring works (the build machine) it really runs.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/io/any_file_io.hpp>
#include <kvtier/io/pread_pool.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/io/uring_context.hpp>

#include <support/asio.hpp>
#include <support/process.hpp>

#include <boost/asio/io_context.hpp>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::test {

/// The probe's answer, computed once per test binary.
inline const io::uring_probe_result& uring_probe() {
  static const io::uring_probe_result r = io::probe_uring();
  return r;
}

#define KVTIER_REQUIRE_URING()                                                           \
  do {                                                                                   \
    if (!::kvtier::test::uring_probe().available()) {                                    \
      WARN("io_uring is unavailable here, test skipped: " << ::kvtier::test::uring_probe().detail); \
      CHECK_FALSE(::kvtier::test::uring_probe().detail.empty());                         \
      return;                                                                            \
    }                                                                                    \
  } while (false)

/// An owned file descriptor.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~unique_fd() { reset(); }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  [[nodiscard]] int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

inline unique_fd open_or_throw(const std::string& path, int flags, ::mode_t mode = 0600) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
  return unique_fd(fd);
}

/// A pipe: reads of `read_end` wait until something is written to `write_end`.
struct pipe_pair {
  unique_fd read_end;
  unique_fd write_end;
  pipe_pair() {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    read_end = unique_fd(p[0]);
    write_end = unique_fd(p[1]);
  }
};

/// Byte i of the test pattern of `seed`.
inline std::byte pattern_byte(std::size_t i, unsigned seed) noexcept {
  return static_cast<std::byte>((i * 131 + seed * 17 + (i >> 12)) & 0xff);
}

inline void fill_pattern(std::span<std::byte> s, unsigned seed, std::size_t start = 0) noexcept {
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = pattern_byte(start + i, seed);
}

[[nodiscard]] inline bool matches_pattern(std::span<const std::byte> s, unsigned seed, std::size_t start = 0) noexcept {
  for (std::size_t i = 0; i < s.size(); ++i)
    if (s[i] != pattern_byte(start + i, seed)) return false;
  return true;
}

[[nodiscard]] inline bool all_bytes(std::span<const std::byte> s, std::byte v) noexcept {
  for (auto b : s)
    if (b != v) return false;
  return true;
}

/// A 4 KiB-aligned buffer of `bytes` set to `fill`.
inline aligned_buffer aligned_buffer_of(std::size_t bytes, std::byte fill) {
  aligned_buffer b(bytes);
  b.fill(fill);
  return b;
}

/// Writes `bytes` of pattern `seed` to a new file with plain syscalls.
inline void write_pattern_file(const std::string& path, std::size_t bytes, unsigned seed) {
  unique_fd fd = open_or_throw(path, O_WRONLY | O_CREAT | O_TRUNC);
  std::vector<std::byte> data(bytes);
  fill_pattern(data, seed);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd.get(), data.data() + done, bytes - done);
    if (n <= 0) throw std::runtime_error("write failed");
    done += static_cast<std::size_t>(n);
  }
}

/// What a callback of void(error_code, std::size_t) saw: how many times it ran, its last
/// arguments and the thread it ran on.
struct size_result {
  int calls = 0;
  error_code ec;
  std::size_t n = 0;
  std::thread::id thread;
  auto handler() {
    return [this](error_code e, std::size_t bytes) {
      ++calls;
      ec = e;
      n = bytes;
      thread = std::this_thread::get_id();
    };
  }
};

/// The same for void(error_code).
struct void_result {
  int calls = 0;
  error_code ec;
  auto handler() {
    return [this](error_code e) {
      ++calls;
      ec = e;
    };
  }
};

// --- one fixture per file_io implementation: owns an io_context and the implementation ----

struct uring_fixture {
  static constexpr const char* name = "uring_context";
  static bool available() { return uring_probe().available(); }
  boost::asio::io_context io;
  std::unique_ptr<io::uring_context> e;
  uring_fixture() {
    if (available()) e = std::make_unique<io::uring_context>(io.get_executor());
  }
  io::uring_context& file_io() { return *e; }
};

struct pread_fixture {
  static constexpr const char* name = "pread_pool";
  static bool available() { return true; }
  boost::asio::io_context io;
  std::unique_ptr<io::pread_pool> e = std::make_unique<io::pread_pool>(io.get_executor());
  io::pread_pool& file_io() { return *e; }
};

/// any_file_io with the choice Choice asks for; `automatic` stands for what the probe says
/// (not the environment: the conformance suite must cover io_uring where it exists).
template <io::file_io_choice Choice>
struct any_file_io_fixture {
  static constexpr const char* name = Choice == io::file_io_choice::pread ? "any_file_io(pread)" : "any_file_io(auto)";
  static bool available() { return true; }
  boost::asio::io_context io;
  std::unique_ptr<io::any_file_io> e = std::make_unique<io::any_file_io>(io.get_executor(), options());
  io::any_file_io& file_io() { return *e; }
  static io::any_file_io_options options() {
    io::any_file_io_options o;
    o.choice = Choice != io::file_io_choice::automatic ? Choice
               : uring_probe().available()             ? io::file_io_choice::uring
                                                       : io::file_io_choice::pread;
    return o;
  }
};
using any_file_io_auto_fixture = any_file_io_fixture<io::file_io_choice::automatic>;
using any_file_io_pread_fixture = any_file_io_fixture<io::file_io_choice::pread>;

#define KVTIER_FILE_IO_FIXTURES                                                                     \
  kvtier::test::uring_fixture, kvtier::test::pread_fixture, kvtier::test::any_file_io_auto_fixture, \
      kvtier::test::any_file_io_pread_fixture

/// For fixtures that may be unavailable: WARN and pass where the implementation cannot run here.
#define KVTIER_REQUIRE_FIXTURE(F)                                                                  \
  do {                                                                                             \
    if (!F::available()) {                                                                         \
      WARN(F::name << " is unavailable here, test skipped: " << ::kvtier::test::uring_probe().detail); \
      CHECK_FALSE(::kvtier::test::uring_probe().available());                                      \
      return;                                                                                      \
    }                                                                                              \
  } while (false)

}  // namespace kvtier::test
