#pragma once
// histogram: a distribution over fixed bucket bounds (Prometheus style), sharded per thread
// like counter. observe() finds the bucket by linear search (latency bucket lists are short)
// and does two owner-only updates on this thread's own cache lines; snapshot() sums the
// shards. _count is derived from the buckets, so it always equals the +Inf bucket.

#include <kvtier/config.hpp>
#include <kvtier/telemetry/detail/thread_shard.hpp>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

/// Default latency buckets in seconds: 100 us to 10 s.
inline const std::vector<double>& latency_buckets_seconds() {
  static const std::vector<double> b = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                        0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
  return b;
}

class histogram {
 public:
  struct snapshot_t {
    std::vector<double> bounds;         ///< upper bounds, ascending, without +Inf
    std::vector<std::uint64_t> counts;  ///< per bucket (not cumulative); the last is +Inf
    double sum = 0;
    [[nodiscard]] std::uint64_t count() const noexcept {
      std::uint64_t n = 0;
      for (auto c : counts) n += c;
      return n;
    }
  };

  /// bounds must be finite and strictly increasing; throws std::invalid_argument otherwise.
  explicit histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
    for (std::size_t i = 0; i < bounds_.size(); ++i) {
      if (!std::isfinite(bounds_[i]) || (i > 0 && bounds_[i] <= bounds_[i - 1]))
        throw std::invalid_argument("kvtier::telemetry::histogram: bounds must be finite and increasing");
    }
    // One row per shard, on its own cache lines: bucket counts (+Inf last), then the sum's bits.
    const std::size_t words = bounds_.size() + 2;
    stride_ = (words + words_per_line - 1) / words_per_line * words_per_line;
    const std::size_t n = stride_ * (detail::max_shards + 1);
    cells_ = static_cast<std::atomic<std::uint64_t>*>(
        ::operator new(n * sizeof(std::atomic<std::uint64_t>), std::align_val_t{config::cache_line_size}));
    for (std::size_t i = 0; i < n; ++i) new (&cells_[i]) std::atomic<std::uint64_t>(0);
  }

  histogram(const histogram&) = delete;
  histogram& operator=(const histogram&) = delete;
  ~histogram() { ::operator delete(cells_, std::align_val_t{config::cache_line_size}); }

  void observe(double v) noexcept {
    const std::size_t s = detail::this_thread_shard();
    std::atomic<std::uint64_t>* row = cells_ + s * stride_;
    std::size_t b = 0;
    while (b < bounds_.size() && v > bounds_[b]) ++b;
    detail::add_to_cell(row[b], s, 1);
    std::atomic<std::uint64_t>& sum = row[bounds_.size() + 1];
    if (s < detail::max_shards) {
      sum.store(std::bit_cast<std::uint64_t>(std::bit_cast<double>(sum.load(std::memory_order_relaxed)) + v),
                std::memory_order_relaxed);
    } else {
      std::uint64_t old = sum.load(std::memory_order_relaxed);
      while (!sum.compare_exchange_weak(old, std::bit_cast<std::uint64_t>(std::bit_cast<double>(old) + v),
                                        std::memory_order_relaxed)) {
      }
    }
  }

  [[nodiscard]] const std::vector<double>& bounds() const noexcept { return bounds_; }

  [[nodiscard]] snapshot_t snapshot() const {
    snapshot_t out;
    out.bounds = bounds_;
    out.counts.assign(bounds_.size() + 1, 0);
    for (std::size_t s = 0; s < detail::max_shards + 1; ++s) {
      const std::atomic<std::uint64_t>* row = cells_ + s * stride_;
      for (std::size_t b = 0; b <= bounds_.size(); ++b) out.counts[b] += row[b].load(std::memory_order_relaxed);
      out.sum += std::bit_cast<double>(row[bounds_.size() + 1].load(std::memory_order_relaxed));
    }
    return out;
  }

 private:
  static constexpr std::size_t words_per_line = config::cache_line_size / sizeof(std::uint64_t);

  std::vector<double> bounds_;
  std::size_t stride_ = 0;
  std::atomic<std::uint64_t>* cells_ = nullptr;
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
