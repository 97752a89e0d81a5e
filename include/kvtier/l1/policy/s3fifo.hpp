#pragma once
// s3fifo: S3-FIFO (Yang, Zhang, Qiu, Yue, Vinayak, "FIFO queues are all you need for cache
// eviction", SOSP 2023). Three FIFO queues:
//   small  (S, 10% of the capacity): every new object enters here;
//   main   (M, the rest): objects read while in S, and objects whose key is in the ghost;
//   ghost  (G, fingerprints only, as many as M holds): keys recently evicted from S.
// Each object has a 2-bit read counter (saturating at 3). Eviction from S moves objects
// read at least `promote_threshold` times to M and evicts the others into G ("quick
// demotion": most objects are read never or once, and leave after a short stay). Eviction
// from M is CLOCK-like: an object with a non-zero counter is reinserted at the head with
// the counter decremented, one with zero is evicted. S is drained while it holds at least
// its share of the capacity, M otherwise.
//
// Adapted to a tier that evicts in batches and has locked objects: victims are taken with
// cursors that skip locked objects without moving them (a locked object with enough reads is
// still promoted: moving is not evicting), and one selection of n victims is
// O(n + objects passed), at most about 4 visits per object of M (the counter only goes down).
// Where the paper's pseudocode and its text differ on the promotion threshold (freq > 1 vs
// "accessed at least once"), the default follows the text and the option chooses.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/policy/detail/ghost_fifo.hpp>
#include <kvtier/l1/policy/detail/intrusive_list.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

struct s3fifo_options {
  double small_ratio = 0.1;            ///< share of the capacity for S, in (0, 1)
  std::uint8_t promote_threshold = 1;  ///< reads while in S that move an object to M, 1..3
  double ghost_ratio = 1.0;            ///< ghost entries per object of M's capacity, >= 0
  std::size_t capacity = 1024;         ///< objects, until the tier calls set_capacity
};

class s3fifo {
 public:
  struct hook : detail::list_node {
    std::uint64_t fingerprint = 0;
    std::uint8_t freq = 0;   ///< reads since insertion (or since the last M reinsertion), 0..3
    std::uint8_t queue = 0;  ///< queue_none, queue_small or queue_main
  };

  static constexpr std::string_view name = "s3fifo";
  static constexpr std::uint8_t queue_none = 0;
  static constexpr std::uint8_t queue_small = 1;
  static constexpr std::uint8_t queue_main = 2;

  explicit s3fifo(s3fifo_options options = {}) : options_(options) {
    if (!(options_.small_ratio > 0.0 && options_.small_ratio < 1.0))
      throw std::invalid_argument("kvtier::l1::s3fifo: small_ratio must be in (0, 1); the paper uses 0.1");
    if (options_.promote_threshold < 1 || options_.promote_threshold > 3)
      throw std::invalid_argument("kvtier::l1::s3fifo: promote_threshold must be 1, 2 or 3");
    if (!(options_.ghost_ratio >= 0.0)) throw std::invalid_argument("kvtier::l1::s3fifo: ghost_ratio must be >= 0");
    set_capacity(options_.capacity);
  }

  /// Sizes S and the ghost for a cache of `objects` objects. Call before inserting.
  void set_capacity(std::size_t objects) {
    capacity_ = std::max<std::size_t>(objects, 1);
    small_target_ = std::max<std::size_t>(
        1, static_cast<std::size_t>(std::llround(static_cast<double>(capacity_) * options_.small_ratio)));
    const std::size_t main_capacity = capacity_ > small_target_ ? capacity_ - small_target_ : 1;
    ghost_ = detail::ghost_fifo(
        static_cast<std::size_t>(std::llround(static_cast<double>(main_capacity) * options_.ghost_ratio)));
  }

  void on_insert(hook& h, const chunk_key& key) {
    h.fingerprint = detail::fingerprint(key);
    h.freq = 0;
    if (ghost_.erase(h.fingerprint)) {
      main_.push_front(h);
      h.queue = queue_main;
    } else {
      small_.push_front(h);
      h.queue = queue_small;
    }
  }

  void on_access(hook& h) noexcept {
    if (h.freq < 3) ++h.freq;
  }

  void on_remove(hook& h) noexcept { detach(h); }

  template <class Pred>
  void select_victims(std::size_t n, const Pred& pred, std::vector<hook*>& out) {
    detail::list_node* s_cur = small_.back();
    detail::list_node* m_cur = nullptr;
    bool m_started = false;
    bool s_done = s_cur == nullptr;
    bool m_done = false;
    std::size_t taken = 0;
    while (taken < n && !(s_done && m_done)) {
      if (!s_done && (small_.size() >= small_target_ || m_done)) {
        // evict_small: promote read objects to M, evict the first unlocked cold one into G.
        bool evicted = false;
        while (s_cur != nullptr && !evicted) {
          auto& h = static_cast<hook&>(*s_cur);
          s_cur = small_.newer(s_cur);
          if (h.freq >= options_.promote_threshold) {
            small_.erase(h);
            main_.push_front(h);
            h.queue = queue_main;
            if (m_started && m_done) {  // M's walk had ended: resume it at this object
              m_done = false;
              m_cur = &h;
            }
          } else if (pred(static_cast<const hook&>(h))) {
            detach(h);
            ghost_.push(h.fingerprint);
            out.push_back(&h);
            ++taken;
            evicted = true;
          }
        }
        if (!evicted) s_done = true;
      } else {
        if (!m_started) {
          m_started = true;
          m_cur = main_.back();
        }
        // evict_main: CLOCK over M.
        bool evicted = false;
        while (m_cur != nullptr && !evicted) {
          auto& h = static_cast<hook&>(*m_cur);
          detail::list_node* next = main_.newer(m_cur);
          if (h.freq > 0) {
            --h.freq;
            main_.move_to_front(h);
            m_cur = next != nullptr ? next : &h;  // h alone ahead: look at it again
          } else {
            m_cur = next;
            if (pred(static_cast<const hook&>(h))) {
              detach(h);
              out.push_back(&h);
              ++taken;
              evicted = true;
            }
          }
        }
        if (!evicted) m_done = true;
      }
    }
  }

  // Introspection for tests and the benchmark.
  [[nodiscard]] std::size_t small_size() const noexcept { return small_.size(); }
  [[nodiscard]] std::size_t main_size() const noexcept { return main_.size(); }
  [[nodiscard]] std::size_t ghost_size() const noexcept { return ghost_.size(); }
  [[nodiscard]] std::size_t small_target() const noexcept { return small_target_; }
  [[nodiscard]] bool in_ghost(const chunk_key& key) const noexcept { return ghost_.contains(detail::fingerprint(key)); }

 private:
  void detach(hook& h) noexcept {
    if (h.queue == queue_small)
      small_.erase(h);
    else if (h.queue == queue_main)
      main_.erase(h);
    h.queue = queue_none;
  }

  s3fifo_options options_;
  std::size_t capacity_ = 1;
  std::size_t small_target_ = 1;
  detail::intrusive_list small_;
  detail::intrusive_list main_;
  detail::ghost_fifo ghost_;
};

static_assert(capacity_aware_policy<s3fifo>);

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
