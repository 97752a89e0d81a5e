#pragma once
// The server's store and prefetch-wait policies, chosen by configuration at run time. The
// shipped policies (pipeline/policies.hpp) are separate types, which would make the
// server's cache a template instantiation per combination; these differ only in a flag and
// a few numbers, so one type each covers them (server/make_cache.hpp instantiates only the eviction
// policies).

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/server/config/server_config.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// write_through or skip_l1, chosen at run time: every admitted key to every backend; L1
/// keeps it or drops it once every backend stored it.
struct runtime_store_policy {
  bool keep = true;
  void select_targets(std::span<const chunk_key> keys, std::size_t backends, std::vector<bitmap>& targets) {
    targets.assign(backends, bitmap(keys.size(), true));
  }
  [[nodiscard]] bool keep_in_l1() const noexcept { return keep; }
};
static_assert(pipeline::store_policy<runtime_store_policy>);

/// best_effort, wait_complete or timeout, chosen at run time (pipeline/policies.hpp has the
/// same three as separate types).
struct runtime_wait_policy {
  prefetch_wait_kind kind = prefetch_wait_kind::timeout;
  std::chrono::nanoseconds base = std::chrono::seconds(2);
  std::chrono::nanoseconds per_1k_tokens = std::chrono::milliseconds(100);
  std::chrono::nanoseconds cap = std::chrono::seconds(30);

  [[nodiscard]] std::chrono::nanoseconds wait_budget(std::size_t tokens) const noexcept {
    switch (kind) {
      case prefetch_wait_kind::best_effort:
        return {};
      case prefetch_wait_kind::wait_complete:
        return cap;
      case prefetch_wait_kind::timeout:
        break;
    }
    return std::min(base + per_1k_tokens * static_cast<std::int64_t>(tokens) / 1024, cap);
  }
};
static_assert(pipeline::prefetch_wait_policy<runtime_wait_policy>);

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
