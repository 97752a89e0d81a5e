#pragma once
// The planning arithmetic of the prefetch pipeline (docs/pipelines.md),
// as pure functions so every trimming case is testable on its own:
//
//   1. plan_backends: the policy picks a backend per key, untrimmed; l2_prefix is the
//      contiguous prefix of keys some backend has: the pure L2 hit count (what
//      l2.prefetch.lookup.completed reports). The prefetch controller walks this plan
//      together with L1 (a key L1 holds bridges an L2 hole: a prefix split between the tiers
//      is served whole), then keeps only what it will load: restrict_plan.
//      make_plan: the same, trimmed to the L2 prefix (L2 hole: {0,1,3,4} loads {0,1}).
//   2. trim_plan: trimmed to a reserved prefix (a key that could not be reserved is a hole).
//   3. unpins_for: what each backend must unpin because its pinned key will not be loaded
//      from it (found but not planned there, or trimmed away).
//   4. count_trimmed: keys some backend found that are not submitted (their own counter).

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/pipeline/concepts.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

struct prefetch_plan {
  std::vector<bitmap> per_backend;  ///< disjoint; bit i of [b]: load key i from backend b
  std::size_t l2_prefix = 0;        ///< leading keys some backend has (before L1 reservation)
  std::size_t found_any = 0;        ///< keys some backend has, anywhere

  /// Keys to submit for loading (over all backends).
  [[nodiscard]] std::size_t submitted() const noexcept {
    std::size_t n = 0;
    for (const auto& b : per_backend) n += b.count();
    return n;
  }
  /// Backends with at least one key to load (the load tasks).
  [[nodiscard]] std::size_t tasks() const noexcept {
    std::size_t n = 0;
    for (const auto& b : per_backend) n += b.any() ? 1 : 0;
    return n;
  }
};

/// Keeps only bits [0, n) of every backend's plan.
inline void trim_plan(prefetch_plan& p, std::size_t n) {
  for (auto& b : p.per_backend) b.clear_from(n);
}

/// Keeps only the keys set in `keep` in every backend's plan.
inline void restrict_plan(prefetch_plan& p, const bitmap& keep) {
  for (auto& b : p.per_backend) b &= keep;
}

/// The keys some backend's plan loads (the union of per_backend).
[[nodiscard]] inline bitmap planned_keys(const prefetch_plan& p, std::size_t keys) {
  bitmap any(keys);
  for (const auto& b : p.per_backend) any |= b;
  return any;
}

/// Step 1, untrimmed: plan with `policy` (masked to what was found); l2_prefix is the
/// contiguous prefix of planned keys.
template <prefetch_plan_policy Policy>
[[nodiscard]] prefetch_plan plan_backends(Policy& policy, std::span<const bitmap> found, std::size_t keys) {
  prefetch_plan p;
  std::vector<bitmap> sized;
  for (const auto& f : found) {
    bitmap b = f;
    b.resize(keys);
    sized.push_back(std::move(b));
  }
  policy.plan(sized, p.per_backend);
  bitmap any(keys);
  for (const auto& f : sized) any |= f;
  p.found_any = any.count();
  bitmap planned(keys);
  for (auto& b : p.per_backend) {
    b.resize(keys);
    b &= any;  // a policy cannot plan a key nobody found
    planned |= b;
  }
  p.l2_prefix = planned.count_leading_ones();
  return p;
}

/// Step 1: plan with `policy`, then trim to the contiguous union prefix.
template <prefetch_plan_policy Policy>
[[nodiscard]] prefetch_plan make_plan(Policy& policy, std::span<const bitmap> found, std::size_t keys) {
  prefetch_plan p = plan_backends(policy, found, keys);
  trim_plan(p, p.l2_prefix);
  return p;
}

/// Step 3: per backend, the found keys it will not load (found minus its final plan).
[[nodiscard]] inline std::vector<bitmap> unpins_for(std::span<const bitmap> found, const prefetch_plan& p) {
  std::vector<bitmap> out;
  for (std::size_t b = 0; b < found.size(); ++b) {
    bitmap u = found[b];
    if (b < p.per_backend.size()) u.subtract(p.per_backend[b]);
    out.push_back(std::move(u));
  }
  return out;
}

/// Step 4: keys found in L2 that are not submitted (dropped by an L2 hole or an L1 reservation).
[[nodiscard]] inline std::size_t count_trimmed(const prefetch_plan& p) noexcept {
  return p.found_any - p.submitted();
}

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
