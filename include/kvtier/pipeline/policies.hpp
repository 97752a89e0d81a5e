#pragma once
// The shipped pipeline policies (models of pipeline/concepts.hpp).
//
//   first_backend_plan   each key from the lowest-index backend that has it (LMCache default)
//   write_through        every admitted key to every backend, L1 keeps it
//   skip_l1              same targets, then L1 drops the key once every backend has it
//                        (L1 as a write buffer; pair it with the noop eviction policy)
//   selective<K>         a key goes to L2 only once it has been seen K times (written or hit
//                        in L1), SGLang HiCache's write_through_selective
//   admit_all            every chunk is admitted to L2
//   best_effort / wait_complete / timeout_wait   how long a lookup waits for L2 (SGLang's
//                        prefetch policies; timeout = base + per 1024 tokens, capped)

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/pipeline/concepts.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

struct first_backend_plan {
  void plan(std::span<const bitmap> found, std::vector<bitmap>& plan) {
    const std::size_t n = found.empty() ? 0 : found[0].size();
    plan.assign(found.size(), bitmap(n));
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t b = 0; b < found.size(); ++b)
        if (found[b].test(i)) {
          plan[b].set(i);
          break;
        }
  }
};
static_assert(prefetch_plan_policy<first_backend_plan>);

struct write_through {
  void select_targets(std::span<const chunk_key> keys, std::size_t backends, std::vector<bitmap>& targets) {
    targets.assign(backends, bitmap(keys.size(), true));
  }
  [[nodiscard]] bool keep_in_l1() const noexcept { return true; }
};
static_assert(store_policy<write_through>);

struct skip_l1 {
  void select_targets(std::span<const chunk_key> keys, std::size_t backends, std::vector<bitmap>& targets) {
    targets.assign(backends, bitmap(keys.size(), true));
  }
  [[nodiscard]] bool keep_in_l1() const noexcept { return false; }
};
static_assert(store_policy<skip_l1>);

/// Stores a key the K-th time it is offered (written to L1, or hit there: the cache offers
/// hits to a policy whose wants_hits() is true). Counts live in a bounded table; when it is
/// full the oldest half is dropped (a key may then need K more sightings).
template <std::uint32_t K>
class selective {
 public:
  static_assert(K >= 1);
  explicit selective(std::size_t max_tracked = 1 << 20) : max_tracked_(max_tracked) {}

  void select_targets(std::span<const chunk_key> keys, std::size_t backends, std::vector<bitmap>& targets) {
    targets.assign(backends, bitmap(keys.size()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (seen_.size() >= max_tracked_) forget_half();
      auto& entry = seen_[keys[i]];
      entry.last = ++tick_;
      if (++entry.count == K)
        for (auto& t : targets) t.set(i);
    }
  }
  [[nodiscard]] bool keep_in_l1() const noexcept { return true; }
  [[nodiscard]] static constexpr bool wants_hits() noexcept { return true; }
  [[nodiscard]] std::size_t tracked() const noexcept { return seen_.size(); }

 private:
  struct entry {
    std::uint32_t count = 0;
    std::uint64_t last = 0;
  };
  void forget_half() {
    std::vector<std::uint64_t> ticks;
    ticks.reserve(seen_.size());
    for (const auto& [k, e] : seen_) ticks.push_back(e.last);
    auto mid = ticks.begin() + static_cast<std::ptrdiff_t>(ticks.size() / 2);
    std::nth_element(ticks.begin(), mid, ticks.end());
    const std::uint64_t cut = *mid;
    std::erase_if(seen_, [cut](const auto& kv) { return kv.second.last < cut; });
  }

  std::size_t max_tracked_;
  std::uint64_t tick_ = 0;
  std::unordered_map<chunk_key, entry, chunk_key_hash> seen_;
};
static_assert(store_policy<selective<2>>);

struct admit_all {
  bool admit(const chunk_key&, const write_context&) const noexcept { return true; }
};
static_assert(admission_policy<admit_all>);

/// Answer at once with what L1 has; L2 loads go on and stay in L1 for later requests.
struct best_effort {
  [[nodiscard]] std::chrono::nanoseconds wait_budget(std::size_t) const noexcept { return {}; }
};
/// Wait until the prefetch completes (capped, so a hung backend cannot hold an engine).
struct wait_complete {
  std::chrono::nanoseconds cap = std::chrono::seconds(60);
  [[nodiscard]] std::chrono::nanoseconds wait_budget(std::size_t) const noexcept { return cap; }
};
/// Wait up to base + per_1k_tokens * tokens / 1024, capped (SGLang's defaults since PR #23309:
/// 2 s, 0.1 s per Ki tokens, 30 s cap).
struct timeout_wait {
  std::chrono::nanoseconds base = std::chrono::seconds(2);
  std::chrono::nanoseconds per_1k_tokens = std::chrono::milliseconds(100);
  std::chrono::nanoseconds cap = std::chrono::seconds(30);
  [[nodiscard]] std::chrono::nanoseconds wait_budget(std::size_t tokens) const noexcept {
    const auto t = base + per_1k_tokens * static_cast<std::int64_t>(tokens) / 1024;
    return std::min(t, cap);
  }
};
static_assert(prefetch_wait_policy<best_effort>);
static_assert(prefetch_wait_policy<wait_complete>);
static_assert(prefetch_wait_policy<timeout_wait>);

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
