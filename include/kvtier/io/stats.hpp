#pragma once
// io_stats: what a file I/O implementation did, as relaxed atomics that a metrics scrape
// (another thread) may read at any time. uring_context and pread_pool each own one through a
// shared_ptr, so a registry callback that holds it stays valid after they are gone. They become the
// kvtier_io_* metrics (docs/io.md) through telemetry::collect_io.

#include <kvtier/config.hpp>

#include <atomic>
#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

struct io_stats {
  /// Operations started (every async_xxx call, including those refused after shutdown).
  std::atomic<std::uint64_t> ops_started{0};
  /// Operations whose handler has been released (successful or not).
  std::atomic<std::uint64_t> ops_completed{0};
  /// Operations that completed with operation_aborted (cancelled or shut down).
  std::atomic<std::uint64_t> ops_cancelled{0};
  /// Operations that completed with an error other than operation_aborted.
  std::atomic<std::uint64_t> ops_failed{0};
  /// Operations now started and not completed.
  std::atomic<std::int64_t> ops_in_flight{0};

  // --- io_uring only ----------------------------------------------------------------------
  /// io_uring_enter calls made to submit SQEs or to fetch completions (the batching factor
  /// is sqes_submitted / enter_calls).
  std::atomic<std::uint64_t> enter_calls{0};
  /// SQEs the kernel accepted (operations plus the ring's own cancel requests).
  std::atomic<std::uint64_t> sqes_submitted{0};
  /// Read/write operations that used a registered buffer (READ_FIXED / WRITE_FIXED).
  std::atomic<std::uint64_t> fixed_ops{0};
  /// register_buffers calls the kernel refused (ENOMEM under RLIMIT_MEMLOCK, EFAULT...).
  std::atomic<std::uint64_t> fixed_buffer_registration_failures{0};
  /// Bytes registered as fixed buffers now.
  std::atomic<std::uint64_t> fixed_buffer_bytes{0};
  /// Operation states that had to come from the heap (the per-ring cache was empty): flat
  /// after warm-up, which is how "no allocation per op" is checked.
  std::atomic<std::uint64_t> op_heap_allocations{0};
};

namespace detail {

/// Adds n to a statistic written by one thread only: a relaxed load and store, no locked
/// instruction (readers on other threads still see whole values).
inline void bump_owned(std::atomic<std::uint64_t>& a, std::uint64_t n = 1) noexcept {
  a.store(a.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}
inline void bump_owned(std::atomic<std::int64_t>& a, std::int64_t n) noexcept {
  a.store(a.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

/// Adds n to a statistic written by several threads.
inline void bump_shared(std::atomic<std::uint64_t>& a, std::uint64_t n = 1) noexcept {
  a.fetch_add(n, std::memory_order_relaxed);
}
inline void bump_shared(std::atomic<std::int64_t>& a, std::int64_t n) noexcept {
  a.fetch_add(n, std::memory_order_relaxed);
}

}  // namespace detail

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
