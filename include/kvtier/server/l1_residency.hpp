#pragma once
// L1 residency: the server's one-time set-up of its L1 arena ("l1_prefault", default on),
// done behind the first requests (docs/server.md, "Start-up", step 3):
//   1. populate_l1: every page of the arena faulted in (MADV_POPULATE_WRITE in 4 MiB
//      slices) on a thread of its own at nice 10; it changes no byte, so it runs while
//      slots are in use. Without MADV_POPULATE_WRITE (before Linux 5.14) the fallback
//      writes every page, so it runs before the server accepts anything;
//   2. once every page is in, on the I/O thread (the disk backend's ring's thread), the
//      arena registered with the L2 backends that read into registered memory faster:
//      tiered_cache::register_l1_in_pieces (cache/l1_registration.hpp), a piece of 256 MiB
//      per turn of the I/O thread (at once, 8 GiB held the thread 0.3-0.7 s, past a
//      connector's ping timeout from ~16 GiB).
// Status "l1.residency", the gauges kvtier_server_l1_resident and
// kvtier_server_l1_prefaulted_bytes, and one log line say where it stands.

#include <kvtier/cache/l1_registration.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/error.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The prefault's slice: MADV_POPULATE_WRITE holds the process's mmap lock (for reading)
/// through a slice, so an mmap, munmap or brk of the I/O thread waits for the slice to end,
/// and its page faults queue behind that writer. 4 MiB is ~1.5-4 ms of populating here
/// (32 MiB slices were 12-30 ms, and a first lookup served during them 10-20 ms later).
inline constexpr std::size_t l1_prefault_slice_bytes = std::size_t{4} << 20;
/// The prefault thread's nice value: behind the I/O thread and the worker pool (nice 0) when
/// the cores are busy, at full speed when they are not.
inline constexpr int l1_prefault_nice = 10;

/// Where the L1 arena stands (status "l1.residency").
enum class l1_residency_state : std::uint8_t {
  off,          ///< l1_prefault false: pages come on first use, nothing is registered
  faulting,     ///< the background prefault runs (the server serves meanwhile)
  registering,  ///< every page is in; the registration with the L2 backends goes on
  resident,     ///< every page is in, and the backends that take registered memory have it
  first_use,    ///< the prefault failed or was stopped: the other pages come on first use
};

[[nodiscard]] constexpr std::string_view name(l1_residency_state s) noexcept {
  switch (s) {
    case l1_residency_state::off: return "off";
    case l1_residency_state::faulting: return "faulting";
    case l1_residency_state::registering: return "registering";
    case l1_residency_state::resident: return "resident";
    case l1_residency_state::first_use: return "first_use";
  }
  return "?";
}

/// What the L1 set-up did, for its log lines.
struct l1_residency_report {
  std::size_t bytes = 0;             ///< the arena
  std::size_t prefaulted_bytes = 0;  ///< faulted in by the prefault
  double prefault_ms = 0;
  bool populated = false;        ///< MADV_POPULATE_WRITE did it (false: the write loop, or not all)
  bool behind_requests = false;  ///< in the background, while the server served
  std::string error;             ///< why the pages were left to first use (empty: they were not)
  /// "l1_huge_pages": "off", "asked" (madvise(MADV_HUGEPAGE) took the arena) or why the
  /// kernel refused it ("refused: <strerror>")
  std::string huge_pages = "off";
  cache::l1_registration_report registration;  ///< the registration's steps (on the I/O thread)
};

/// How populate_l1 ended.
struct l1_prefault_outcome {
  std::size_t bytes = 0;  ///< faulted in
  std::chrono::nanoseconds elapsed{};
  bool complete = false;  ///< the whole arena (else: stopped or failed)
  int error = 0;          ///< the errno of a failed madvise (0: none)
};

/// Faults `arena` in with MADV_POPULATE_WRITE, slice by slice, until done, a failure, or
/// `stop`; `progress` holds the bytes faulted in so far. Any thread, any time: it changes no
/// byte, so slots may be in use meanwhile.
inline l1_prefault_outcome populate_l1(std::span<std::byte> arena, const std::atomic<bool>& stop,
                                       std::atomic<std::size_t>& progress) {
  l1_prefault_outcome o;
  const auto t0 = std::chrono::steady_clock::now();
  while (o.bytes < arena.size() && !stop.load(std::memory_order_acquire)) {
    const std::size_t n = std::min(l1_prefault_slice_bytes, arena.size() - o.bytes);
    o.error = kv_region::populate(arena.data() + o.bytes, n);
    if (o.error != 0) break;
    o.bytes += n;
    progress.store(o.bytes, std::memory_order_relaxed);
  }
  o.complete = o.bytes == arena.size();
  o.elapsed = std::chrono::steady_clock::now() - t0;
  return o;
}

/// madvise(MADV_HUGEPAGE) over the arena's whole 2 MiB pages, before any of them is faulted
/// in ("l1_huge_pages"): with transparent huge pages in "madvise" mode (Debian's default) the
/// prefault then faults 2 MiB pages, so an L1 slot is physically contiguous and one 1 MiB
/// O_DIRECT read into it is one block-layer segment instead of up to 256 (docs/performance.md,
/// "L1 in huge pages"). "asked", or "refused: <why>" (a kernel without THP: EINVAL).
inline std::string advise_l1_huge_pages(std::span<std::byte> arena) {
  constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<std::uintptr_t>(arena.data()) + huge - 1) & ~(huge - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(arena.data()) + arena.size()) & ~(huge - 1);
  if (end <= begin) return "refused: L1 is smaller than one 2 MiB page";
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) != 0)
    return std::string("refused: ") + std::strerror(errno);
  return "asked";
}

/// Bytes of the mappings that hold `arena` backed by transparent huge pages (/proc/self/smaps,
/// "AnonHugePages" of every mapping that overlaps it; the arena's own mapping is all of L1 but
/// for malloc's header page). -1 when smaps cannot be read.
inline long long l1_huge_page_bytes(std::span<const std::byte> arena) {
  std::FILE* f = std::fopen("/proc/self/smaps", "re");
  if (f == nullptr) return -1;
  const auto lo = reinterpret_cast<std::uintptr_t>(arena.data());
  const auto hi = lo + arena.size();
  long long total = 0;
  bool inside = false;
  char line[512];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long b = 0, e = 0, kib = 0;
    // A mapping's first line is "start-end perms ..."; its fields are "Name: value kB" (no
    // field name parses as two hex numbers joined by '-').
    if (std::sscanf(line, "%llx-%llx", &b, &e) == 2)
      inside = b < hi && e > lo;
    else if (inside && std::sscanf(line, "AnonHugePages: %llu kB", &kib) == 1)
      total += static_cast<long long>(kib) * 1024;
  }
  std::fclose(f);
  return total;
}

/// The fallback of kernels without MADV_POPULATE_WRITE: a write to every page. Only while
/// nothing is in L1 (before the server accepts a connection): it overwrites what is there.
inline l1_residency_report prefault_l1_by_writing(std::span<std::byte> arena) {
  l1_residency_report r;
  r.bytes = r.prefaulted_bytes = arena.size();
  const auto t0 = std::chrono::steady_clock::now();
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::size_t step = page > 0 ? static_cast<std::size_t>(page) : 4096;
  volatile std::byte* p = arena.data();
  for (std::size_t off = 0; off < arena.size(); off += step) p[off] = std::byte{0};
  r.prefault_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
