#pragma once
// slot_allocator: fixed-size, 4 KiB-aligned slots carved from one arena, handed out in
// all-or-nothing batches. The L1 tier keeps one chunk object per slot. Standard library only.
//
// Not thread-safe: the owner (l1::tier) serialises calls under its own lock. The arena is one
// contiguous range, so it can be registered once with io_uring or cudaHostRegister; from
// 2 MiB on it starts on a huge-page boundary (huge_page_bytes), so huge pages can cover its
// first slot too.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

/// Index of a slot in its allocator.
using slot_id = std::uint32_t;

class slot_allocator {
 public:
  /// slot_bytes is rounded up to 4 KiB. Throws std::invalid_argument on a zero size or count
  /// and std::bad_alloc when the arena cannot be allocated.
  slot_allocator(std::size_t slot_bytes, std::size_t slot_count)
      : slot_bytes_(align_up(slot_bytes)), slot_count_(slot_count), in_use_(slot_count, false) {
    if (slot_bytes == 0 || slot_count == 0)
      throw std::invalid_argument("kvtier::slot_allocator: slot size and slot count must be > 0");
    if (slot_count > UINT32_MAX) throw std::invalid_argument("kvtier::slot_allocator: too many slots");
    const std::size_t bytes = slot_bytes_ * slot_count_;
    arena_ = aligned_buffer(bytes, bytes >= huge_page_bytes ? huge_page_bytes : buffer_alignment);
    free_.reserve(slot_count_);
    // LIFO free list, lowest index on top, so recently freed (cache-warm) slots are reused first.
    for (std::size_t i = slot_count_; i-- > 0;) free_.push_back(static_cast<slot_id>(i));
  }

  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  [[nodiscard]] std::size_t slot_count() const noexcept { return slot_count_; }
  [[nodiscard]] std::size_t free_count() const noexcept { return free_.size(); }
  [[nodiscard]] std::size_t used_count() const noexcept { return slot_count_ - free_.size(); }
  [[nodiscard]] std::size_t bytes_capacity() const noexcept { return slot_bytes_ * slot_count_; }
  [[nodiscard]] std::size_t bytes_used() const noexcept { return slot_bytes_ * used_count(); }

  /// Appends n slot ids to `out` and returns true, or returns false and changes nothing when
  /// fewer than n slots are free (all-or-nothing). n == 0 succeeds trivially.
  [[nodiscard]] bool allocate(std::size_t n, std::vector<slot_id>& out) {
    if (n > free_.size()) return false;
    out.reserve(out.size() + n);
    for (std::size_t i = 0; i < n; ++i) {
      const slot_id s = free_.back();
      free_.pop_back();
      in_use_[s] = true;
      out.push_back(s);
    }
    return true;
  }

  /// Returns a slot to the free list. Releasing a slot that is not allocated is misuse
  /// (a double free) and throws std::logic_error, leaving the allocator unchanged.
  void release(slot_id s) {
    if (s >= slot_count_ || !in_use_[s])
      throw std::logic_error("kvtier::slot_allocator: release of a free or unknown slot " +
                             std::to_string(s));
    in_use_[s] = false;
    free_.push_back(s);
  }

  void release(std::span<const slot_id> slots) {
    for (auto s : slots) release(s);
  }

  [[nodiscard]] bool is_allocated(slot_id s) const noexcept { return s < slot_count_ && in_use_[s]; }

  /// The memory of slot s: slot_bytes() bytes, 4 KiB-aligned.
  [[nodiscard]] std::byte* data(slot_id s) noexcept { return arena_.data() + std::size_t{s} * slot_bytes_; }
  [[nodiscard]] const std::byte* data(slot_id s) const noexcept {
    return arena_.data() + std::size_t{s} * slot_bytes_;
  }
  [[nodiscard]] std::span<std::byte> slot(slot_id s) noexcept { return {data(s), slot_bytes_}; }

  /// The whole arena, for one-time registration (io_uring fixed buffers, cudaHostRegister).
  [[nodiscard]] std::span<std::byte> arena() noexcept { return arena_.span(); }

  /// True when p points into the arena.
  [[nodiscard]] bool owns(const std::byte* p) const noexcept {
    return p >= arena_.data() && p < arena_.data() + arena_.size();
  }

 private:
  std::size_t slot_bytes_;
  std::size_t slot_count_;
  aligned_buffer arena_;
  std::vector<slot_id> free_;
  std::vector<bool> in_use_;
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
