#pragma once
// fixed_buffers: the registered (fixed) buffers of io::uring_context. register_regions() hands
// memory regions to the kernel (io_uring_register_buffers(3), each region split into 1 GiB
// buffers, the kernel's limit) and index_of() tells whether a read or write lies in one, so
// it can use READ_FIXED / WRITE_FIXED with that buffer's index. add_region() registers one
// more region next to those already registered (a sparse table, then one update per
// buffer: io_uring_register_buffers_sparse(3), io_uring_register_buffers_update_tag(3)), so
// a large arena can be registered a piece at a time: the kernel pins every page it
// registers, ~40-60 ms per GiB here, all on the ring's thread. A refusal (ENOMEM under
// RLIMIT_MEMLOCK without CAP_IPC_LOCK, EFAULT for memory the kernel cannot pin) is logged
// once with what to change, and counted; the memory is then used with plain reads.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <liburing.h>
#include <sys/resource.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

/// The kernel's limit on one registered buffer (io_uring rejects a longer iovec with
/// EFAULT, measured on 6.18): a larger region is registered as several buffers.
inline constexpr std::size_t max_fixed_buffer_bytes = std::size_t{1} << 30;
/// IORING_MAX_REG_BUFFERS.
inline constexpr std::size_t max_fixed_buffers = 16384;

class fixed_buffers {
 public:
  /// Registers `regions` with `ring` (after unregistering what was there). Returns the
  /// kernel's refusal, errc::invalid_argument for more than max_fixed_buffers buffers.
  error_code register_regions(::io_uring& ring, std::span<const buffer_region> regions, io_stats& stats,
                              telemetry::logger* log) {
    unregister(ring, stats);
    table_ = table::whole;  // set before the kernel call: unregister() then always asks it
    std::vector<::iovec> iov;
    std::size_t total = 0;
    for (const auto& r : regions) {
      for (std::size_t off = 0; off < r.size(); off += max_fixed_buffer_bytes) {
        const std::size_t n = std::min(max_fixed_buffer_bytes, r.size() - off);
        iov.push_back(::iovec{r.data() + off, n});
        total += n;
      }
    }
    if (iov.empty() || iov.size() > max_fixed_buffers) {
      table_ = table::none;
      return iov.empty() ? error_code{} : make_error_code(errc::invalid_argument);
    }
    const int r = ::io_uring_register_buffers(&ring, iov.data(), static_cast<unsigned>(iov.size()));
    if (r < 0) {
      table_ = table::none;
      const error_code ec(-r, boost::system::system_category());
      bump_owned(stats.fixed_buffer_registration_failures);
      log_failure(log, ec, total);
      return ec;
    }
    regions_.reserve(iov.size());
    for (std::size_t i = 0; i < iov.size(); ++i) {
      const auto b = reinterpret_cast<std::uintptr_t>(iov[i].iov_base);
      regions_.push_back(region{b, b + iov[i].iov_len, static_cast<int>(i)});
    }
    std::sort(regions_.begin(), regions_.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    bytes_ = total;
    stats.fixed_buffer_bytes.store(total, std::memory_order_relaxed);
    if (log != nullptr) log->info("io_uring: registered {} bytes as {} fixed buffers", total, iov.size());
    return {};
  }

  /// Registers `region` (split into 1 GiB buffers) next to the buffers add_region()
  /// registered before, without touching them: the first call registers a sparse table of
  /// max_fixed_buffers entries (IORING_REGISTER_BUFFERS2, Linux 5.19), each buffer then takes
  /// the next entry (IORING_REGISTER_BUFFERS_UPDATE). Only this region's pages are pinned.
  /// errc::unsupported where the kernel has no sparse table (register everything at once
  /// with register_regions instead), errc::invalid_argument after register_regions or past
  /// max_fixed_buffers, else the kernel's refusal as for register_regions (the region is
  /// then not registered; those before stay).
  error_code add_region(::io_uring& ring, buffer_region r, io_stats& stats, telemetry::logger* log) {
    if (table_ == table::whole) return make_error_code(errc::invalid_argument);
    if (table_ == table::none) {
      const int rc = ::io_uring_register_buffers_sparse(&ring, static_cast<unsigned>(max_fixed_buffers));
      if (rc == -EINVAL) return make_error_code(errc::unsupported);  // before Linux 5.19
      if (rc < 0) return error_code(-rc, boost::system::system_category());
      table_ = table::sparse;
    }
    for (std::size_t off = 0; off < r.size(); off += max_fixed_buffer_bytes) {
      if (next_index_ >= max_fixed_buffers) return make_error_code(errc::invalid_argument);
      const std::size_t n = std::min(max_fixed_buffer_bytes, r.size() - off);
      ::iovec iov{r.data() + off, n};
      __u64 tag = 0;
      const int rc = ::io_uring_register_buffers_update_tag(&ring, static_cast<unsigned>(next_index_), &iov, &tag, 1);
      if (rc < 0) {
        const error_code ec(-rc, boost::system::system_category());
        bump_owned(stats.fixed_buffer_registration_failures);
        log_failure(log, ec, n);
        return ec;
      }
      const auto b = reinterpret_cast<std::uintptr_t>(iov.iov_base);
      const region added{b, b + n, static_cast<int>(next_index_++)};
      regions_.insert(std::upper_bound(regions_.begin(), regions_.end(), added,
                                       [](const region& x, const region& y) { return x.begin < y.begin; }),
                      added);
      bytes_ += n;
      stats.fixed_buffer_bytes.store(bytes_, std::memory_order_relaxed);
    }
    return {};
  }

  void unregister(::io_uring& ring, io_stats& stats) noexcept {
    if (table_ == table::none) return;
    (void)::io_uring_unregister_buffers(&ring);
    regions_.clear();
    table_ = table::none;
    next_index_ = 0;
    bytes_ = 0;
    stats.fixed_buffer_bytes.store(0, std::memory_order_relaxed);
  }

  [[nodiscard]] bool active() const noexcept { return !regions_.empty(); }

  /// The index of the registered buffer that holds all of [p, p + n), or -1.
  [[nodiscard]] int index_of(const void* p, std::size_t n) const noexcept {
    if (regions_.empty() || n == 0) return -1;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = std::upper_bound(regions_.begin(), regions_.end(), a,
                               [](std::uintptr_t x, const region& r) { return x < r.begin; });
    if (it == regions_.begin()) return -1;
    --it;
    return (a >= it->begin && a < it->end && n <= it->end - a) ? it->index : -1;
  }

 private:
  struct region {
    std::uintptr_t begin;
    std::uintptr_t end;
    int index;
  };

  void log_failure(telemetry::logger* log, const error_code& ec, std::size_t bytes) {
    if (log == nullptr) return;
    if (failure_logged_) {
      log->debug("io_uring: registering {} bytes of fixed buffers failed again: {}", bytes, ec.message());
      return;
    }
    failure_logged_ = true;
    ::rlimit lim{};
    ::getrlimit(RLIMIT_MEMLOCK, &lim);
    log->warn(
        "io_uring: registering {} bytes as fixed buffers failed ({}); reads and writes use plain "
        "READ/WRITE into the same memory. RLIMIT_MEMLOCK is {} bytes: raise it (ulimit -l, "
        "LimitMEMLOCK=) or grant CAP_IPC_LOCK to use fixed buffers",
        bytes, ec.message(), lim.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(lim.rlim_cur));
  }

  /// What the kernel holds: nothing, one table of register_regions, or add_region's sparse one.
  enum class table : std::uint8_t { none, whole, sparse };

  std::vector<region> regions_;  // sorted by begin
  table table_ = table::none;
  std::size_t next_index_ = 0;  ///< add_region: the next free entry of the sparse table
  std::size_t bytes_ = 0;       ///< registered
  bool failure_logged_ = false;
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
