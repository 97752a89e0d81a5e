#pragma once
// lru: least recently used first. One intrusive list: an object moves to the front when it
// becomes ready and on every read; victims are taken from the back, skipping locked objects.
// O(1) per insert/access/remove, O(victims + locked objects passed) per selection.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/policy/detail/intrusive_list.hpp>

#include <cstddef>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

class lru {
 public:
  struct hook : detail::list_node {};

  static constexpr std::string_view name = "lru";

  void on_insert(hook& h, const chunk_key&) noexcept { list_.push_front(h); }
  void on_access(hook& h) noexcept {
    if (h.linked()) list_.move_to_front(h);
  }
  void on_remove(hook& h) noexcept {
    if (h.linked()) list_.erase(h);
  }

  template <class Pred>
  void select_victims(std::size_t n, const Pred& pred, std::vector<hook*>& out) {
    std::size_t taken = 0;
    for (detail::list_node* node = list_.back(); node != nullptr && taken < n;) {
      detail::list_node* next = list_.newer(node);
      auto& h = static_cast<hook&>(*node);
      if (pred(static_cast<const hook&>(h))) {
        list_.erase(h);
        out.push_back(&h);
        ++taken;
      }
      node = next;
    }
  }

  /// Objects tracked (for tests).
  [[nodiscard]] std::size_t size() const noexcept { return list_.size(); }

 private:
  detail::intrusive_list list_;
};

static_assert(eviction_policy<lru>);

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
