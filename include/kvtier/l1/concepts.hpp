#pragma once
// The contract of an L1 eviction policy (`eviction_policy`) and its archetype.
//
// A policy orders the ready objects of one l1::tier and picks victims. It is intrusive, in
// the style of CacheLib's MMContainers: the policy declares a `hook` type, the tier embeds
// one hook in each of its entries (the entry derives from P::hook), and the policy links
// hooks into its own lists. No per-key node is allocated by the policy; the memory of a
// policy is its hooks plus bounded side structures (ghost fingerprints).
//
// The tier calls a policy only under its own mutex: policies need no synchronisation.
//
// Life of a hook, as the tier drives it:
//   on_insert(h, key)   the object became ready for the first time (finish_write or
//                       finish_write_and_reserve_read). The key is given once; a policy that
//                       needs it later (ghost fingerprints) keeps what it needs in the hook.
//   on_access(h)        the object was read (reserve_read) or touched.
//   select_victims(n, pred, out)
//                       append to `out` at most n hooks, each one for which pred(hook) is
//                       true (unlocked objects), none twice, none already removed. The tier
//                       then removes every returned hook and calls on_remove for it before
//                       any other call, so a policy may already detach the victims and do
//                       its eviction bookkeeping (ghost entries) here. The cost must be
//                       O(victims + hooks skipped), never a full scan per victim: the tier
//                       calls it while holding the lock readers need.
//   on_remove(h)        the object left the tier (evicted, deleted, freed as temporary) or
//                       was removed while locked. Called exactly once per on_insert, also
//                       for hooks select_victims already detached.
//
// Optional: `p.set_capacity(objects)`, called once by the tier before any insert, with the
// number of objects the tier holds at its eviction watermark (policies size their queues
// and ghost lists from it).

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::l1 {

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

}  // namespace kvtier::inline KVTIER_ABI_TAG::l1
