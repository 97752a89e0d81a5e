#pragma once
// The contract of an L1 eviction policy (`eviction_policy`) and its archetype. A policy
// orders the ready objects of one l1::tier and picks victims; it is intrusive (CacheLib's
// MMContainers): the tier's entries derive from the policy's `hook`, so the policy allocates
// no per-key node. The tier calls it only under its own mutex. docs/l1.md, "Writing your own
// policy", holds the life of a hook and the contract of select_victims.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

/// A victim predicate as select_victims receives it: callable with a const hook&, true when
/// the object may be evicted now. The tier passes a lambda; policies take it as a template
/// parameter (or a std::function).
template <class Hook>
struct victim_predicate_archetype {
  [[nodiscard]] bool operator()(const Hook&) const noexcept { return true; }
};

// clang-format 14 mis-indents requires-expressions.
// clang-format off
template <class P>
concept eviction_policy =
    std::is_class_v<typename P::hook> && !std::is_final_v<typename P::hook> &&
    std::default_initializable<typename P::hook> && std::move_constructible<P> &&
    requires(P& p, typename P::hook& h, const chunk_key& key, std::size_t n,
             const victim_predicate_archetype<typename P::hook>& pred, std::vector<typename P::hook*>& out) {
      { P::name } -> std::convertible_to<std::string_view>;
      p.on_insert(h, key);
      p.on_access(h);
      p.on_remove(h);
      p.select_victims(n, pred, out);
    };
// clang-format on

/// True when P takes the optional capacity hint.
template <class P>
concept capacity_aware_policy = eviction_policy<P> && requires(P& p, std::size_t objects) {
  p.set_capacity(objects);
};

/// The smallest type that models eviction_policy: never evicts, keeps nothing.
struct eviction_policy_archetype {
  struct hook {};
  static constexpr std::string_view name = "archetype";
  void on_insert(hook&, const chunk_key&) noexcept {}
  void on_access(hook&) noexcept {}
  void on_remove(hook&) noexcept {}
  template <class Pred>
  void select_victims(std::size_t, const Pred&, std::vector<hook*>&) noexcept {}
};
static_assert(eviction_policy<eviction_policy_archetype>);
static_assert(!capacity_aware_policy<eviction_policy_archetype>);

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
