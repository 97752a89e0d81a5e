#pragma once
// arc: Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead
// Replacement Cache", FAST 2003).
//   T1  resident objects seen once recently (new objects);
//   T2  resident objects seen at least twice (read while resident, or re-inserted after a
//       ghost hit);
//   B1, B2  ghosts of objects evicted from T1 and T2: fingerprints only, bounded FIFOs.
// The target size p of T1 adapts: a miss whose key is in B1 says T1 was too small (p grows
// by max(1, |B2|/|B1|)), one in B2 says T2 was too small (p shrinks by max(1, |B1|/|B2|)).
// Eviction (REPLACE) takes the LRU end of T1 while |T1| > p, of T2 otherwise.
//
// Adapted to a tier that evicts in batches, separately from inserts, and has locked objects:
// REPLACE runs in select_victims, once per victim, without the paper's tie-break on the
// incoming key (there is none); a list whose unlocked objects are exhausted falls back to the
// other; ghost lists keep the paper's bounds |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2|
// <= 2c, trimmed on insert and on eviction (c = the capacity the tier gives).

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/policy/detail/ghost_fifo.hpp>
#include <kvtier/l1/policy/detail/intrusive_list.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

class arc {
 public:
  struct hook : detail::list_node {
    std::uint64_t fingerprint = 0;
    std::uint8_t list = 0;  ///< list_none, list_t1 or list_t2
  };

  static constexpr std::string_view name = "arc";
  static constexpr std::uint8_t list_none = 0;
  static constexpr std::uint8_t list_t1 = 1;
  static constexpr std::uint8_t list_t2 = 2;

  /// `capacity` objects until the tier calls set_capacity.
  explicit arc(std::size_t capacity = 1024) { set_capacity(capacity); }

  /// Sizes the ghost lists for a cache of `objects` objects and resets p. Call before inserting.
  void set_capacity(std::size_t objects) {
    c_ = std::max<std::size_t>(objects, 1);
    p_ = 0.0;
    b1_ = detail::ghost_fifo(c_);
    b2_ = detail::ghost_fifo(2 * c_);
  }

  void on_insert(hook& h, const chunk_key& key) {
    h.fingerprint = detail::fingerprint(key);
    const auto b1 = static_cast<double>(b1_.size());
    const auto b2 = static_cast<double>(b2_.size());
    if (b1_.erase(h.fingerprint)) {  // case II: T1 was too small
      p_ = std::min(static_cast<double>(c_), p_ + (b1 >= b2 ? 1.0 : b2 / b1));
      link(h, list_t2);
    } else if (b2_.erase(h.fingerprint)) {  // case III: T2 was too small
      p_ = std::max(0.0, p_ - (b2 >= b1 ? 1.0 : b1 / b2));
      link(h, list_t2);
    } else {  // case IV: a real miss
      link(h, list_t1);
      trim_ghosts();
    }
  }

  void on_access(hook& h) noexcept {  // case I: a hit moves the object to T2's MRU end
    if (h.list == list_t1) {
      t1_.erase(h);
      link(h, list_t2);
    } else if (h.list == list_t2) {
      t2_.move_to_front(h);
    }
  }

  void on_remove(hook& h) noexcept { detach(h); }

  template <class Pred>
  void select_victims(std::size_t n, const Pred& pred, std::vector<hook*>& out) {
    detail::list_node* cur1 = t1_.back();
    detail::list_node* cur2 = t2_.back();
    std::size_t taken = 0;
    while (taken < n && (cur1 != nullptr || cur2 != nullptr)) {
      const bool from_t1 = cur2 == nullptr || (cur1 != nullptr && !t1_.empty() && static_cast<double>(t1_.size()) > p_);
      detail::intrusive_list& list = from_t1 ? t1_ : t2_;
      detail::list_node*& cur = from_t1 ? cur1 : cur2;
      // The first unlocked object from the LRU end of the chosen list.
      hook* victim = nullptr;
      while (cur != nullptr && victim == nullptr) {
        auto& h = static_cast<hook&>(*cur);
        cur = list.newer(cur);
        if (pred(static_cast<const hook&>(h))) victim = &h;
      }
      if (victim == nullptr) continue;  // that list is exhausted: the other one is tried next
      detach(*victim);
      (from_t1 ? b1_ : b2_).push(victim->fingerprint);
      trim_ghosts();
      out.push_back(victim);
      ++taken;
    }
  }

  // Introspection for tests and the benchmark.
  [[nodiscard]] std::size_t t1_size() const noexcept { return t1_.size(); }
  [[nodiscard]] std::size_t t2_size() const noexcept { return t2_.size(); }
  [[nodiscard]] std::size_t b1_size() const noexcept { return b1_.size(); }
  [[nodiscard]] std::size_t b2_size() const noexcept { return b2_.size(); }
  [[nodiscard]] double target_t1() const noexcept { return p_; }
  [[nodiscard]] std::uint8_t list_of(const hook& h) const noexcept { return h.list; }

 private:
  void link(hook& h, std::uint8_t list) noexcept {
    (list == list_t1 ? t1_ : t2_).push_front(h);
    h.list = list;
  }
  void detach(hook& h) noexcept {
    if (h.list == list_t1)
      t1_.erase(h);
    else if (h.list == list_t2)
      t2_.erase(h);
    h.list = list_none;
  }
  void trim_ghosts() noexcept {
    while (t1_.size() + b1_.size() > c_ && b1_.pop_oldest()) {
    }
    while (t1_.size() + t2_.size() + b1_.size() + b2_.size() > 2 * c_ && b2_.pop_oldest()) {
    }
  }

  std::size_t c_ = 1;
  double p_ = 0.0;  ///< target size of T1, in [0, c]
  detail::intrusive_list t1_;
  detail::intrusive_list t2_;
  detail::ghost_fifo b1_;
  detail::ghost_fifo b2_;
};

static_assert(capacity_aware_policy<arc>);

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
