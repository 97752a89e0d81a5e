#pragma once
// The policies of the pipelines, as concepts (the mission's "templated L1/L2 tier policies"),
// with an archetype each. Models live in pipeline/policies.hpp; an engine plugs its own in
// through cache::tiered_cache's Traits without touching the library.
//
//   prefetch_plan_policy  which backend each key is loaded from, given the lookup bitmaps
//   store_policy          which keys go to which backend, and whether L1 keeps them
//   admission_policy      whether a written chunk is admitted to L2 at all
//   prefetch_wait_policy  how long a lookup waits for L2 before answering the engine

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

/// What a store or an admission decision knows about the chunks being written.
struct write_context {
  std::uint64_t request_id = 0;    ///< the cache's id of the engine request (0: unknown)
  std::uint32_t prompt_tokens = 0; ///< tokens of the whole prompt the chunks belong to (0: unknown)
  std::uint32_t first_chunk = 0;   ///< index in the prompt of the first chunk written
};

/// Picks, for each key, the backend to load it from: plan[b] has bit i set when key i is
/// loaded from backend b. `found[b]` is what backend b's lookup found (and pinned). The plan
/// must be disjoint and within found.
template <class P>
concept prefetch_plan_policy = requires(P& p, std::span<const bitmap> found, std::vector<bitmap>& plan) {
  p.plan(found, plan);
};

/// Decides the L2 targets of a batch of written keys: targets[b] bit i = store key i to
/// backend b. `keep_in_l1()` false means delete from L1 once every target stored the key
/// (LMCache's skip_l1: L1 as a write buffer).
template <class P>
concept store_policy = requires(P& p, const P& cp, std::span<const chunk_key> keys, std::size_t backends,
                                std::vector<bitmap>& targets) {
  p.select_targets(keys, backends, targets);
  { cp.keep_in_l1() } -> std::convertible_to<bool>;
};

/// Admits (true) or refuses a chunk to L2, before the store policy sees it.
template <class P>
concept admission_policy = requires(P& p, const chunk_key& k, const write_context& ctx) {
  { p.admit(k, ctx) } -> std::convertible_to<bool>;
};

/// How long a lookup may wait for its L2 prefetch before answering (0: answer with what L1
/// has; the loads go on and stay in L1 for later requests).
template <class P>
concept prefetch_wait_policy = requires(const P& p, std::size_t tokens) {
  { p.wait_budget(tokens) } -> std::convertible_to<std::chrono::nanoseconds>;
};

// Archetypes: the smallest models, for checking the concepts.
struct prefetch_plan_archetype {
  void plan(std::span<const bitmap>, std::vector<bitmap>&) {}
};
struct store_policy_archetype {
  void select_targets(std::span<const chunk_key>, std::size_t, std::vector<bitmap>&) {}
  [[nodiscard]] bool keep_in_l1() const { return true; }
};
struct admission_archetype {
  bool admit(const chunk_key&, const write_context&) { return true; }
};
struct prefetch_wait_archetype {
  [[nodiscard]] std::chrono::nanoseconds wait_budget(std::size_t) const { return {}; }
};
static_assert(prefetch_plan_policy<prefetch_plan_archetype>);
static_assert(store_policy<store_policy_archetype>);
static_assert(admission_policy<admission_archetype>);
static_assert(prefetch_wait_policy<prefetch_wait_archetype>);

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
