#pragma once
// ghost_fifo: a bounded FIFO of key fingerprints with O(1) membership, for the ghost lists of
// S3-FIFO and ARC (keys recently evicted, remembered without their data).
//
// Memory is fixed at construction: a ring of 2 * capacity (fingerprint, sequence) pairs and
// an open-addressing table of at least 2 * capacity slots (16 bytes each), so a ghost list
// the size of a 20,000-object cache costs about 1 MiB and never allocates afterwards.
// Erasing (a ghost hit) leaves a stale ring item that is skipped when it reaches the front;
// when the ring fills with stale items it is compacted in one pass, O(1) amortised.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {
namespace detail {

/// A 64-bit fingerprint of a key, never 0 (0 marks an empty table slot). Collisions (2^-64
/// per pair) only make a ghost hit wrong, never an answer of the tier.
[[nodiscard]] inline std::uint64_t fingerprint(const chunk_key& k) noexcept {
  std::uint64_t h = chunk_key_hash{}(k);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 29;
  return h == 0 ? 1 : h;
}

/// Open-addressing map from non-zero fingerprints to a 64-bit value; linear probing with
/// backward-shift deletion (no tombstones), load factor at most 1/2.
class fingerprint_table {
 public:
  explicit fingerprint_table(std::size_t max_entries)
      : slots_(std::bit_ceil(std::max<std::size_t>(8, 2 * max_entries))), mask_(slots_.size() - 1) {}

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  [[nodiscard]] const std::uint64_t* find(std::uint64_t fp) const noexcept {
    for (std::size_t i = home(fp);; i = (i + 1) & mask_) {
      if (slots_[i].fp == fp) return &slots_[i].value;
      if (slots_[i].fp == 0) return nullptr;
    }
  }

  /// Inserts or overwrites. The caller keeps size() below max_entries.
  void assign(std::uint64_t fp, std::uint64_t value) noexcept {
    for (std::size_t i = home(fp);; i = (i + 1) & mask_) {
      if (slots_[i].fp == fp) {
        slots_[i].value = value;
        return;
      }
      if (slots_[i].fp == 0) {
        slots_[i] = {fp, value};
        ++size_;
        return;
      }
    }
  }

  bool erase(std::uint64_t fp) noexcept {
    std::size_t i = home(fp);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].fp == 0) return false;
      if (slots_[i].fp == fp) break;
    }
    // Backward shift: pull later members of the probe run into the hole when their home
    // position does not lie cyclically in (hole, their position].
    for (std::size_t j = (i + 1) & mask_; slots_[j].fp != 0; j = (j + 1) & mask_) {
      const std::size_t k = home(slots_[j].fp);
      const bool stays = i <= j ? (k > i && k <= j) : (k > i || k <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].fp = 0;
    --size_;
    return true;
  }

  void clear() noexcept {
    for (auto& s : slots_) s.fp = 0;
    size_ = 0;
  }

 private:
  struct slot {
    std::uint64_t fp = 0;
    std::uint64_t value = 0;
  };
  [[nodiscard]] std::size_t home(std::uint64_t fp) const noexcept {
    return static_cast<std::size_t>((fp * 0x9e3779b97f4a7c15ULL) >> 17) & mask_;
  }

  std::vector<slot> slots_;
  std::size_t mask_;
  std::size_t size_ = 0;
};

class ghost_fifo {
 public:
  /// Remembers at most `capacity` fingerprints; 0 disables the list.
  explicit ghost_fifo(std::size_t capacity = 0) : capacity_(capacity), ring_(2 * capacity), table_(capacity) {}

  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t size() const noexcept { return table_.size(); }
  [[nodiscard]] bool contains(std::uint64_t fp) const noexcept { return table_.find(fp) != nullptr; }

  /// Appends fp as the newest entry (moving it there if present); drops the oldest entry
  /// when full.
  void push(std::uint64_t fp) {
    if (capacity_ == 0) return;
    table_.erase(fp);
    if (table_.size() == capacity_) pop_oldest();
    if (count_ == ring_.size()) compact();
    ring_[(first_ + count_) % ring_.size()] = {fp, ++seq_};
    ++count_;
    table_.assign(fp, seq_);
  }

  /// Forgets fp; true when it was there (a ghost hit).
  bool erase(std::uint64_t fp) noexcept { return table_.erase(fp); }

  /// Drops the oldest entry; false when empty.
  bool pop_oldest() noexcept {
    while (count_ > 0) {
      const item it = ring_[first_];
      first_ = (first_ + 1) % ring_.size();
      --count_;
      if (const auto* seq = table_.find(it.fp); seq != nullptr && *seq == it.seq) {
        table_.erase(it.fp);
        return true;
      }
    }
    return false;
  }

  void clear() noexcept {
    table_.clear();
    first_ = count_ = 0;
  }

 private:
  struct item {
    std::uint64_t fp = 0;
    std::uint64_t seq = 0;
  };

  // Keeps the live items, oldest first, at the start of the ring. Called when the ring is
  // full (count_ == ring size), so rotating the whole ring puts the oldest item at index 0
  // and the forward pass never overwrites an item it has not read.
  void compact() noexcept {
    std::rotate(ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(first_), ring_.end());
    std::size_t out = 0;
    for (std::size_t i = 0; i < count_; ++i) {
      const item it = ring_[i];
      const auto* seq = table_.find(it.fp);
      if (seq != nullptr && *seq == it.seq) ring_[out++] = it;
    }
    first_ = 0;
    count_ = out;
  }

  std::size_t capacity_;
  std::vector<item> ring_;
  fingerprint_table table_;
  std::size_t first_ = 0;
  std::size_t count_ = 0;
  std::uint64_t seq_ = 0;
};

}  // namespace detail
}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
