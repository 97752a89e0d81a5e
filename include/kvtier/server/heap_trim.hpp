#pragma once
// The server's C++ heap: what it holds, and giving back what it freed (docs/server.md,
// "Memory").
//
// glibc's malloc keeps memory a program frees for reuse: a chunk freed in the middle of an
// arena stays resident until reused; only the arena's top goes back by itself. As
// connections, lookups and copies of every size come and go, the arenas reach a high-water
// mark well above what is in use, and RSS grows in steps although nothing leaks
// (docs/performance.md, "Soak": 12.0-12.2 MiB in use, 10.7 -> 17.7 MiB free in 40 min).
//
//   heap_usage()   mallinfo2 over every arena: handed out, free inside the arenas, mapped;
//   heap_trimmer   on the reaper's timer, at a moment no request is in flight, at most every
//                  10 s: when the arenas hold more than `threshold` free, malloc_trim(0)
//                  gives their whole free pages back (madvise). It walks every free chunk
//                  under its arena's lock: 3-6 ms on 20,000 free chunks (19 MiB) on this
//                  2-core VM, hence the idle moment. Counted, with its time.
//
// Where malloc is not glibc's (another C library, jemalloc preloaded, a sanitizer's),
// heap_usage() says so (`known` false) and nothing is trimmed.

#include <kvtier/config.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
#include <malloc.h>
#define KVTIER_HAVE_MALLINFO2 1
#else
#define KVTIER_HAVE_MALLINFO2 0
#endif

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The C++ heap, every arena: what a leak grows (in_use_bytes) apart from what the allocator
/// keeps for reuse (free_bytes: resident until reused or trimmed, nobody's).
struct heap_usage_info {
  bool known = false;              ///< false where malloc is not glibc's (>= 2.33)
  std::size_t in_use_bytes = 0;    ///< handed out: the arenas' chunks in use + mmapped chunks
  std::size_t free_bytes = 0;      ///< free inside the arenas
  std::size_t arena_bytes = 0;     ///< the arenas' size (brk heap + thread heaps)
  std::size_t mmapped_bytes = 0;   ///< chunks mmapped on their own (large allocations)
};

/// mallinfo2(): walks every arena's bins under its lock (tens of microseconds on the
/// server's heap); for a scrape or a timer, not the data path.
[[nodiscard]] inline heap_usage_info heap_usage() noexcept {
  heap_usage_info h;
#if KVTIER_HAVE_MALLINFO2
  const struct mallinfo2 mi = ::mallinfo2();
  // Nothing at all in glibc's arenas: malloc is another allocator's (jemalloc preloaded,
  // a sanitizer's), whose memory glibc does not see.
  h.known = mi.arena != 0 || mi.hblkhd != 0;
  h.in_use_bytes = mi.uordblks + mi.hblkhd;
  h.free_bytes = mi.fordblks;
  h.arena_bytes = mi.arena;
  h.mmapped_bytes = mi.hblkhd;
#endif
  return h;
}

/// Gives the arenas' free pages back when they hold more than `threshold` bytes free, at
/// most once per `interval`. One owner calls maybe_trim (the server's I/O thread); trims()
/// may be read from any thread (the metrics scrape).
class heap_trimmer {
 public:
  static constexpr std::size_t default_threshold = std::size_t{4} << 20;
  static constexpr std::chrono::seconds default_interval{10};

  explicit heap_trimmer(std::size_t threshold = default_threshold,
                        std::chrono::steady_clock::duration interval = default_interval) noexcept
      : threshold_(threshold), interval_(interval) {}

  /// Trims when due (an interval since the last check that found the heap idle), `idle`
  /// (nothing in flight: the trim's pause delays nobody) and over the threshold; true when it
  /// trimmed. Not idle: asked again at the next tick.
  bool maybe_trim(std::chrono::steady_clock::time_point now, bool idle = true) noexcept {
    if (now - last_check_ < interval_ || !idle) return false;
    last_check_ = now;
    const heap_usage_info h = heap_usage();
    if (!h.known || h.free_bytes <= threshold_) return false;
#if KVTIER_HAVE_MALLINFO2
    const auto t0 = std::chrono::steady_clock::now();
    ::malloc_trim(0);
    const auto took = std::chrono::steady_clock::now() - t0;
    trim_ns_.fetch_add(static_cast<std::uint64_t>(std::chrono::nanoseconds(took).count()), std::memory_order_relaxed);
#endif
    trims_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  [[nodiscard]] std::uint64_t trims() const noexcept { return trims_.load(std::memory_order_relaxed); }
  /// The time the trims took, all together.
  [[nodiscard]] double trim_seconds() const noexcept {
    return static_cast<double>(trim_ns_.load(std::memory_order_relaxed)) * 1e-9;
  }

 private:
  std::size_t threshold_;
  std::chrono::steady_clock::duration interval_;
  std::chrono::steady_clock::time_point last_check_{};
  std::atomic<std::uint64_t> trims_{0};
  std::atomic<std::uint64_t> trim_ns_{0};
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
