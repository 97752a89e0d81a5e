#pragma once
// noop: never evicts. L1 as a pure write buffer (the skip-L1 store policy): objects leave only
// when deleted, freed as temporary, or dropped after their write; a full tier answers
// out_of_memory instead of evicting.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/concepts.hpp>

#include <cstddef>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

class noop {
 public:
  struct hook {};

  static constexpr std::string_view name = "noop";

  void on_insert(hook&, const chunk_key&) noexcept {}
  void on_access(hook&) noexcept {}
  void on_remove(hook&) noexcept {}
  template <class Pred>
  void select_victims(std::size_t, const Pred&, std::vector<hook*>&) noexcept {}
};

static_assert(eviction_policy<noop>);

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
