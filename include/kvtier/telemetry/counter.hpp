#pragma once
// counter: a monotonically increasing count for hot paths. inc() is a relaxed load and store
// on this thread's own cache line (see detail/thread_shard.hpp); value() sums the shards.
// Exact: no increment is ever lost, and a scrape sees every increment that happened before it.

#include <kvtier/config.hpp>
#include <kvtier/telemetry/detail/thread_shard.hpp>

#include <array>
#include <atomic>
#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

class counter {
 public:
  counter() = default;
  counter(const counter&) = delete;
  counter& operator=(const counter&) = delete;

  void inc(std::uint64_t n = 1) noexcept {
    const std::size_t s = detail::this_thread_shard();
    detail::add_to_cell(cells_[s].value, s, n);
  }

  [[nodiscard]] std::uint64_t value() const noexcept {
    std::uint64_t sum = 0;
    for (const auto& c : cells_) sum += c.value.load(std::memory_order_relaxed);
    return sum;
  }

 private:
  std::array<detail::counter_cell, detail::max_shards + 1> cells_{};
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
