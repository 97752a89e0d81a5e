#pragma once
// bitmap: a dynamically sized bit set with the prefix queries the prefetch planner needs
// (count_leading_ones, find_first_unset). Standard library only.

#include <kvtier/config.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

class bitmap {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  bitmap() = default;
  explicit bitmap(std::size_t size, bool value = false)
      : words_((size + 63) / 64, value ? ~std::uint64_t{0} : 0), size_(size) {
    trim();
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  [[nodiscard]] bool test(std::size_t i) const {
    check(i);
    return (words_[i / 64] >> (i % 64)) & 1U;
  }
  [[nodiscard]] bool operator[](std::size_t i) const { return test(i); }

  bitmap& set(std::size_t i, bool value = true) {
    check(i);
    const std::uint64_t m = std::uint64_t{1} << (i % 64);
    if (value) words_[i / 64] |= m;
    else words_[i / 64] &= ~m;
    return *this;
  }
  bitmap& reset(std::size_t i) { return set(i, false); }

  /// Sets bits [first, last) to value.
  bitmap& set_range(std::size_t first, std::size_t last, bool value = true) {
    if (first > last || last > size_) throw std::out_of_range("kvtier::bitmap::set_range");
    for (std::size_t i = first; i < last; ++i) set(i, value);
    return *this;
  }

  /// Clears every bit from `from` to the end (used to drop the tail after a hole).
  bitmap& clear_from(std::size_t from) {
    if (from < size_) set_range(from, size_, false);
    return *this;
  }

  void resize(std::size_t size, bool value = false) {
    const std::size_t old = size_;
    words_.resize((size + 63) / 64, 0);
    size_ = size;
    if (size > old && value) set_range(old, size, true);
    trim();
  }

  /// Number of set bits.
  [[nodiscard]] std::size_t count() const noexcept {
    std::size_t n = 0;
    for (auto w : words_) n += static_cast<std::size_t>(std::popcount(w));
    return n;
  }

  /// Length of the run of set bits starting at bit 0 (the contiguous prefix).
  [[nodiscard]] std::size_t count_leading_ones() const noexcept {
    std::size_t n = 0;
    for (auto w : words_) {
      const auto run = static_cast<std::size_t>(std::countr_one(w));
      n += run;
      if (run < 64) break;
    }
    return std::min(n, size_);
  }

  /// Index of the first clear bit, or npos when every bit is set.
  [[nodiscard]] std::size_t find_first_unset() const noexcept {
    const std::size_t n = count_leading_ones();
    return n == size_ ? npos : n;
  }

  [[nodiscard]] bool all() const noexcept { return count_leading_ones() == size_; }
  [[nodiscard]] bool none() const noexcept {
    return std::all_of(words_.begin(), words_.end(), [](auto w) { return w == 0; });
  }
  [[nodiscard]] bool any() const noexcept { return !none(); }

  bitmap& operator&=(const bitmap& o) {
    same_size(o);
    for (std::size_t i = 0; i < words_.size(); ++i) words_[i] &= o.words_[i];
    return *this;
  }
  bitmap& operator|=(const bitmap& o) {
    same_size(o);
    for (std::size_t i = 0; i < words_.size(); ++i) words_[i] |= o.words_[i];
    return *this;
  }
  /// Clears the bits that are set in `o` (set difference).
  bitmap& subtract(const bitmap& o) {
    same_size(o);
    for (std::size_t i = 0; i < words_.size(); ++i) words_[i] &= ~o.words_[i];
    return *this;
  }
  friend bitmap operator&(bitmap a, const bitmap& b) { return a &= b; }
  friend bitmap operator|(bitmap a, const bitmap& b) { return a |= b; }
  friend bool operator==(const bitmap&, const bitmap&) = default;

  /// "1101..." with bit 0 first, for test messages and logs.
  [[nodiscard]] std::string to_string() const {
    std::string s(size_, '0');
    for (std::size_t i = 0; i < size_; ++i)
      if (test(i)) s[i] = '1';
    return s;
  }

  /// The backing words, bit i in word i/64 at position i%64; bits past size() are zero.
  [[nodiscard]] std::span<const std::uint64_t> words() const noexcept { return words_; }

 private:
  void check(std::size_t i) const {
    if (i >= size_) throw std::out_of_range("kvtier::bitmap index " + std::to_string(i));
  }
  void same_size(const bitmap& o) const {
    if (o.size_ != size_) throw std::invalid_argument("kvtier::bitmap: sizes differ");
  }
  void trim() noexcept {
    if (size_ % 64 != 0 && !words_.empty()) words_.back() &= (std::uint64_t{1} << (size_ % 64)) - 1;
  }

  std::vector<std::uint64_t> words_;
  std::size_t size_ = 0;
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
