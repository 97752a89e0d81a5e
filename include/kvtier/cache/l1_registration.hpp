#pragma once
// l1_registration: L1's arena registered with the L2 backends that read into registered
// memory faster (any_backend::add_buffers / register_buffers: the disk backend's io_uring
// fixed buffers, READ_FIXED, so a 1 MiB read pins no pages), a piece at a time so that no
// call holds the thread long. tiered_cache::register_l1() registers all of it at once;
// tiered_cache::register_l1_in_pieces() hands out this stepper, which the cache server runs a
// step per turn of its I/O thread, behind its first requests (docs/server.md, "Start-up").
// Registering pins every page, ~40-60 ms per GiB here: 8 GiB at once held a thread 0.3-0.7 s.
// A backend the kernel refuses (RLIMIT_MEMLOCK without CAP_IPC_LOCK) reads as before, and
// the report names it.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/any_backend.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

/// The piece of L1 one registration step pins: ~10-15 ms of a thread here.
inline constexpr std::size_t l1_register_piece_bytes = std::size_t{256} << 20;
/// Where pieces are cut: the huge page (x86-64's 2 MiB). io_uring coalesces a registered
/// buffer into huge-page segments only when every page of it is in a huge page; the arena's
/// unaligned head and tail are in 4 KiB pages, and a piece holding them would make every
/// 1 MiB read into it 256 segments, which virtio-blk (254) splits into two requests
/// (docs/performance.md, "A burst refilled at once"). So the head and the tail are pieces of
/// their own, and the pieces between them start and end on huge-page boundaries.
/// (An L1 arena from slot_allocator starts on one, so it has no head piece.)
inline constexpr std::size_t l1_register_align_bytes = huge_page_bytes;

/// The end (an offset into `arena`) of the registration piece that starts at `from`: the
/// unaligned head up to the first huge-page boundary, then l1_register_piece_bytes at a time
/// up to the last boundary, then the unaligned tail.
[[nodiscard]] inline std::size_t l1_register_piece_end(std::span<std::byte> arena, std::size_t from) noexcept {
  constexpr std::uintptr_t align = l1_register_align_bytes;
  const auto base = reinterpret_cast<std::uintptr_t>(arena.data());
  const std::uintptr_t end = base + arena.size();
  const std::uintptr_t head_end = std::min(end, (base + align - 1) / align * align);
  const std::uintptr_t tail_begin = std::max(head_end, end / align * align);
  const std::uintptr_t at = base + from;
  const std::uintptr_t stop = at < head_end     ? head_end
                              : at < tail_begin ? std::min<std::uintptr_t>(at + l1_register_piece_bytes, tail_begin)
                                                : end;
  return static_cast<std::size_t>(stop - base);
}

/// What a registration of L1 did.
struct l1_registration_report {
  double register_ms = 0;      ///< the steps together
  double longest_step_ms = 0;  ///< the longest of them
  std::size_t steps = 0;
  std::vector<std::string> registered;  ///< backends that took the arena
  std::vector<std::string> refused;     ///< "name: reason" of backends that refused it
};

/// The registration of an arena with L2 backends, a piece of up to l1_register_piece_bytes
/// per step() (l1_register_piece_end: cut on huge-page boundaries; any_backend::add_buffers);
/// a backend that cannot take pieces (errc::unsupported: before Linux 5.19) gets the whole
/// arena at its first step (register_buffers, not coalesced where it holds 4 KiB pages); one that
/// has nothing to register (a memory backend) is left alone. Call step() on the thread of
/// the backends' io_uring rings (the cache's executor), or before it runs anything. The
/// arena and the backends must outlive it.
class l1_registration {
 public:
  l1_registration(std::span<std::byte> arena, std::span<l2::any_backend> backends)
      : arena_(arena), backends_(backends), state_(backends.size(), state::pieces) {}

  /// Registers the next piece with every backend still taking pieces; records who took the
  /// arena and who refused it in `r` once done. Returns false when nothing is left to do.
  bool step(l1_registration_report& r) {
    if (next_ >= arena_.size()) return false;
    const auto t0 = std::chrono::steady_clock::now();
    const std::span<std::byte> piece = arena_.subspan(next_, l1_register_piece_end(arena_, next_) - next_);
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

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
