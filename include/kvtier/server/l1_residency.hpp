#pragma once
// L1 residency: the server's one-time set-up of its L1 arena ("l1_prefault", default on),
// done behind the first requests (docs/server.md, "Start-up", step 3):
//   1. populate_l1: every page of the arena faulted in (MADV_POPULATE_WRITE in 4 MiB
//      slices) on a thread of its own at nice 10; it changes no byte, so it runs while
//      slots are in use. Without MADV_POPULATE_WRITE (before Linux 5.14) the fallback
//      writes every page, so it runs before the server accepts anything;
//   2. once every page is in, on the I/O thread (the disk backend's ring's thread), the
//      arena registered with the L2 backends that read into registered memory faster, a
//      piece of 256 MiB per turn of the I/O thread (l1_registration: 8 GiB at once held
//      the thread 0.3-0.7 s, past a connector's ping timeout from ~16 GiB).
// Status "l1.residency", the gauges kvtier_server_l1_resident and
// kvtier_server_l1_prefaulted_bytes, and one log line say where it stands.

#include <kvtier/config.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/any_backend.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// The prefault's slice: MADV_POPULATE_WRITE holds the process's mmap lock (for reading)
/// through a slice, so an mmap, munmap or brk of the I/O thread waits for the slice to end,
/// and its page faults queue behind that writer. 4 MiB is ~1.5-4 ms of populating here
/// (32 MiB slices were 12-30 ms, and a first lookup served during them 10-20 ms later).
inline constexpr std::size_t l1_prefault_slice_bytes = std::size_t{4} << 20;
/// The prefault thread's nice value: behind the I/O thread and the worker pool (nice 0) when
/// the cores are busy, at full speed when they are not.
inline constexpr int l1_prefault_nice = 10;

/// The piece of L1 one registration step pins: ~10-15 ms of the I/O thread here.
inline constexpr std::size_t l1_register_piece_bytes = std::size_t{256} << 20;

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
  double register_ms = 0;        ///< the registration's steps together (on the I/O thread)
  double longest_step_ms = 0;    ///< the longest of them
  std::size_t steps = 0;
  std::vector<std::string> registered;  ///< backends that took the arena
  std::vector<std::string> refused;     ///< "name: reason" of backends that refused it
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

/// The registration of L1 with the L2 backends, a piece of l1_register_piece_bytes per
/// step() (any_backend::add_buffers), so that no call holds the thread long; a backend that
/// cannot take pieces (errc::unsupported: before Linux 5.19) gets the whole arena at its
/// first step (register_buffers). Call step() on the thread of the backends' io_uring rings
/// (the server's I/O thread, one step per turn), or before it runs anything. The arena and
/// the backends must outlive it.
class l1_registration {
 public:
  l1_registration(std::span<std::byte> arena, std::span<l2::any_backend> backends)
      : arena_(arena), backends_(backends), state_(backends.size(), state::pieces) {}

  /// Registers the next piece with every backend still taking pieces; records who took the
  /// arena and who refused it in `r` once done. Returns false when nothing is left to do.
  bool step(l1_residency_report& r) {
    if (next_ >= arena_.size()) return false;
    const auto t0 = std::chrono::steady_clock::now();
    const std::span<std::byte> piece = arena_.subspan(next_, std::min(l1_register_piece_bytes, arena_.size() - next_));
    for (std::size_t i = 0; i < backends_.size(); ++i) {
      if (state_[i] != state::pieces) continue;
      l2::any_backend& b = backends_[i];
      error_code ec = b.add_buffers(piece);
      if (ec == make_error_code(errc::unsupported) && next_ == 0) {
        ec = b.register_buffers(arena_);  // all at once
        if (!ec) state_[i] = state::whole;
      }
      if (ec == make_error_code(errc::unsupported)) {
        state_[i] = state::none;  // nothing to register (a memory backend)
      } else if (ec) {
        state_[i] = state::refused;
        r.refused.push_back(std::string(b.name()) + ": " + ec.message());
      }
    }
    next_ += piece.size();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    r.register_ms += ms;
    r.longest_step_ms = std::max(r.longest_step_ms, ms);
    ++r.steps;
    if (next_ < arena_.size()) return true;
    for (std::size_t i = 0; i < backends_.size(); ++i)
      if (state_[i] == state::pieces || state_[i] == state::whole) r.registered.emplace_back(backends_[i].name());
    return false;
  }

 private:
  enum class state : std::uint8_t { pieces, whole, none, refused };
  std::span<std::byte> arena_;
  std::span<l2::any_backend> backends_;
  std::vector<state> state_;
  std::size_t next_ = 0;  ///< the next piece's offset
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
