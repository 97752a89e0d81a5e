#pragma once
// Load or recompute: what the prefetch offers from L2 when the engine could compute the same
// tokens faster (issue: an 8B model's L2 hit on a 1-1.5 GB/s disk is slower than a 50,000
// tokens/s prefill).
//
//   bandwidth_meter   each backend's achieved load bandwidth, an exponentially weighted mean
//                     over its completed load tasks (bytes that landed / task duration), as
//                     the prefetch measures it while it runs; 0 until the first sample.
//   best_prefix       the prefix of a lookup that saves the engine the most time: a chunk L1
//                     holds saves its compute time, a chunk L2 must load saves its compute
//                     time minus its load time (negative when the backend is slower than the
//                     prefill); the best prefix maximises the sum, over whole chunks.
//
// Pure and thread-safe (the meter's values are relaxed atomics): the prefetch controller
// calls these on its executor and the metrics read the meter at scrape time.

#include <kvtier/config.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvtier::inline KVTIER_ABI_TAG::pipeline {

class bandwidth_meter {
 public:
  /// Weight of the newest sample.
  static constexpr double alpha = 0.3;

  explicit bandwidth_meter(std::size_t backends)
      : n_(backends), rates_(std::make_unique<std::atomic<double>[]>(backends)) {
    for (std::size_t b = 0; b < n_; ++b) rates_[b].store(0, std::memory_order_relaxed);
  }

  /// One completed load task of backend b: `bytes` landed in `elapsed`.
  void record(std::size_t b, std::uint64_t bytes, std::chrono::nanoseconds elapsed) noexcept {
    if (b >= n_ || bytes == 0 || elapsed.count() <= 0) return;
    const double sample = static_cast<double>(bytes) / std::chrono::duration<double>(elapsed).count();
    const double old = rates_[b].load(std::memory_order_relaxed);
    rates_[b].store(old == 0 ? sample : old + alpha * (sample - old), std::memory_order_relaxed);
  }

  /// Bytes per second backend b delivered lately; 0 before its first load.
  [[nodiscard]] double bytes_per_second(std::size_t b) const noexcept {
    return b < n_ ? rates_[b].load(std::memory_order_relaxed) : 0.0;
  }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }

 private:
  std::size_t n_;
  std::unique_ptr<std::atomic<double>[]> rates_;
};

/// Where the walk would take a key from: L1, a backend (its index), or nowhere (the end).
inline constexpr int source_l1 = -1;
inline constexpr int source_none = -2;

/// The engine's side of the comparison.
struct recompute_rate {
  double prefill_tokens_per_second = 0;  ///< 0: not declared (offer everything)
  std::uint32_t chunk_tokens = 0;        ///< tokens of one chunk
  std::size_t group = 1;                 ///< keys (shards) per chunk
  std::size_t object_bytes = 0;          ///< bytes of one key
};

/// The answer of best_prefix: the prefix to offer and the one available without the gate.
struct prefix_choice {
  std::size_t keys = 0;       ///< keys to offer (whole chunks)
  std::size_t available = 0;  ///< keys L1 and L2 could serve (whole chunks), >= keys
};

/// The prefix (in keys, whole groups) that saves the most time; ties keep the longer prefix.
/// `sources[i]` is where key i comes from (source_l1, a backend index, source_none: ends the
/// prefix); `bandwidth[b]` the backend's bytes per second (0: unknown, counted as free).
[[nodiscard]] inline prefix_choice best_prefix(std::span<const int> sources, const recompute_rate& r,
                                               std::span<const double> bandwidth) noexcept {
  prefix_choice c;
  const std::size_t g = r.group == 0 ? 1 : r.group;
  std::size_t end = 0;
  while (end < sources.size() && sources[end] != source_none) ++end;
  end -= end % g;
  c.available = end;
  if (r.prefill_tokens_per_second <= 0 || r.chunk_tokens == 0) {
    c.keys = end;
    return c;
  }
  const double compute_key =
      static_cast<double>(r.chunk_tokens) / (r.prefill_tokens_per_second * static_cast<double>(g));
  double sum = 0;
  double best = 0;
  for (std::size_t i = 0; i < end; ++i) {
    double gain = compute_key;
    const int s = sources[i];
    if (s >= 0) {
      const double bw = static_cast<std::size_t>(s) < bandwidth.size() ? bandwidth[static_cast<std::size_t>(s)] : 0;
      if (bw > 0) gain -= static_cast<double>(r.object_bytes) / bw;
    }
    sum += gain;
    if ((i + 1) % g == 0 && sum >= best) {
      best = sum;
      c.keys = i + 1;
    }
  }
  return c;
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::pipeline
