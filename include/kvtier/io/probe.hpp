#pragma once
// The run-time choice of the file I/O: io_uring or the pread thread pool. io_uring is checked,
// not assumed: a kernel may lack it (ENOSYS), forbid it (kernel.io_uring_disabled, EPERM), or
// a seccomp filter (the default one of Docker since 2023, gVisor) may refuse its syscalls. probe_uring() sets up a
// small ring, checks every opcode kvtier uses, registers an eventfd and runs one NOP through
// it; select_file_io() combines that with what the caller and the environment ask for.
//
// KVTIER_IO_BACKEND=pread forces the thread-pool fallback (tests and benchmarks use it);
// =uring forces io_uring (an error where the kernel refuses it); =auto, or unset, probes.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

/// What the configuration asks for.
enum class file_io_choice : std::uint8_t {
  automatic,  ///< io_uring where the probe says it works, else the pread pool
  uring,      ///< io_uring or an error
  pread,      ///< the pread pool, without probing
};

[[nodiscard]] constexpr std::string_view to_string(file_io_choice c) noexcept {
  switch (c) {
    case file_io_choice::automatic: return "auto";
    case file_io_choice::uring: return "uring";
    case file_io_choice::pread: return "pread";
  }
  return "?";
}

/// The environment variable that overrides an automatic choice.
inline constexpr const char* file_io_env_var = "KVTIER_IO_BACKEND";

/// Parses "auto", "uring" (or "io_uring"), "pread".
[[nodiscard]] constexpr std::optional<file_io_choice> parse_file_io_choice(std::string_view s) noexcept {
  if (s == "auto" || s.empty()) return file_io_choice::automatic;
  if (s == "uring" || s == "io_uring") return file_io_choice::uring;
  if (s == "pread") return file_io_choice::pread;
  return std::nullopt;
}

/// The choice KVTIER_IO_BACKEND asks for (automatic when unset). Throws
/// std::invalid_argument on another value.
[[nodiscard]] inline file_io_choice file_io_choice_from_env() {
  const char* v = std::getenv(file_io_env_var);
  if (v == nullptr) return file_io_choice::automatic;
  if (auto c = parse_file_io_choice(v)) return *c;
  throw std::invalid_argument(std::string(file_io_env_var) + "='" + v + "': use auto, uring or pread");
}

/// What probe_uring() found.
struct uring_probe_result {
  error_code error;    ///< empty when io_uring works
  std::string detail;  ///< one line saying what works or what failed, for the log
  [[nodiscard]] bool available() const noexcept { return !error; }
};

namespace detail {

[[nodiscard]] inline std::optional<int> read_int_file(const char* path) noexcept {
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return std::nullopt;
  int v = 0;
  const bool ok = std::fscanf(f, "%d", &v) == 1;
  std::fclose(f);
  return ok ? std::optional<int>(v) : std::nullopt;
}

[[nodiscard]] inline uring_probe_result probe_failure(int err, std::string detail) {
  return {error_code(err, boost::system::system_category()), std::move(detail)};
}

}  // namespace detail

/// Checks that io_uring works here with everything kvtier uses. Costs one small ring setup
/// and teardown (tens of microseconds).
[[nodiscard]] inline uring_probe_result probe_uring() {
  if (detail::read_int_file("/proc/sys/kernel/io_uring_disabled").value_or(0) == 2)
    return detail::probe_failure(EPERM, "io_uring is disabled by sysctl kernel.io_uring_disabled=2");

  ::io_uring ring{};
  if (const int r = ::io_uring_queue_init(4, &ring, 0); r < 0) {
    std::string why = "io_uring_setup failed: " + std::string(std::strerror(-r));
    if (r == -ENOSYS) why += " (a kernel without io_uring, or a seccomp filter refusing it)";
    else if (r == -EPERM) why += " (kernel.io_uring_disabled=1 without privilege, or a seccomp filter)";
    return detail::probe_failure(-r, std::move(why));
  }
  struct ring_guard {
    ::io_uring* r;
    ~ring_guard() { ::io_uring_queue_exit(r); }
  } guard{&ring};

  ::io_uring_probe* probe = ::io_uring_get_probe_ring(&ring);
  if (probe == nullptr) return detail::probe_failure(ENOSYS, "io_uring cannot list its opcodes (kernel before 5.6)");
  struct needed_op {
    int op;
    const char* name;
  };
  static constexpr needed_op needed[] = {
      {IORING_OP_NOP, "NOP"},         {IORING_OP_READ, "READ"},         {IORING_OP_WRITE, "WRITE"},
      {IORING_OP_READ_FIXED, "READ_FIXED"}, {IORING_OP_WRITE_FIXED, "WRITE_FIXED"}, {IORING_OP_READV, "READV"},
      {IORING_OP_WRITEV, "WRITEV"},   {IORING_OP_FSYNC, "FSYNC"},       {IORING_OP_ASYNC_CANCEL, "ASYNC_CANCEL"},
      {IORING_OP_OPENAT, "OPENAT"},   {IORING_OP_CLOSE, "CLOSE"},       {IORING_OP_RENAMEAT, "RENAMEAT"},
      {IORING_OP_UNLINKAT, "UNLINKAT"},
  };
  std::string missing;
  for (const auto& n : needed) {
    if (::io_uring_opcode_supported(probe, n.op) == 0) missing += std::string(missing.empty() ? "" : ", ") + n.name;
  }
  ::io_uring_free_probe(probe);
  if (!missing.empty()) return detail::probe_failure(ENOSYS, "io_uring lacks opcodes " + missing);

  const int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) return detail::probe_failure(errno, "eventfd failed: " + std::string(std::strerror(errno)));
  const int er = ::io_uring_register_eventfd(&ring, efd);
  if (er < 0) {
    ::close(efd);
    return detail::probe_failure(-er, "io_uring_register_eventfd failed: " + std::string(std::strerror(-er)));
  }

  ::io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
  ::io_uring_prep_nop(sqe);
  ::io_uring_sqe_set_data64(sqe, 1);
  int sr = ::io_uring_submit_and_wait(&ring, 1);
  ::io_uring_cqe* cqe = nullptr;
  if (sr >= 0) sr = ::io_uring_peek_cqe(&ring, &cqe);
  ::close(efd);
  if (sr < 0 || cqe == nullptr || cqe->res < 0)
    return detail::probe_failure(sr < 0 ? -sr : EIO, "an io_uring NOP did not complete: " +
                                                         std::string(std::strerror(sr < 0 ? -sr : EIO)));
  return {{}, "io_uring works (setup, opcodes, eventfd, NOP round trip)"};
}

/// The file I/O to use, and why.
struct file_io_selection {
  file_io_kind kind = file_io_kind::pread;
  file_io_choice requested = file_io_choice::automatic;  ///< after the environment override
  std::optional<uring_probe_result> uring;           ///< nullopt when pread was forced (no probe)
  std::string reason;                                  ///< one line for the log
};

/// Picks the file I/O: `choice` when it is not automatic, else KVTIER_IO_BACKEND, else io_uring
/// where probe_uring() says it works, else pread. Throws std::runtime_error when io_uring
/// is required but refused, std::invalid_argument on a bad KVTIER_IO_BACKEND.
[[nodiscard]] inline file_io_selection select_file_io(file_io_choice choice = file_io_choice::automatic) {
  file_io_selection s;
  const bool from_env = choice == file_io_choice::automatic;
  s.requested = from_env ? file_io_choice_from_env() : choice;
  const std::string origin =
      from_env ? std::string(file_io_env_var) + "=" + std::string(to_string(s.requested)) : "the configuration";
  if (s.requested == file_io_choice::pread) {
    s.kind = file_io_kind::pread;
    s.reason = "forced by " + origin;
    return s;
  }
  s.uring = probe_uring();
  if (s.uring->available()) {
    s.kind = file_io_kind::uring;
    s.reason = s.uring->detail;
    return s;
  }
  if (s.requested == file_io_choice::uring)
    throw std::runtime_error("kvtier::io: io_uring is required by " + origin + " but unavailable: " + s.uring->detail +
                             ". Use auto or pread to fall back to the thread pool.");
  s.kind = file_io_kind::pread;
  s.reason = "io_uring unavailable: " + s.uring->detail;
  return s;
}

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
