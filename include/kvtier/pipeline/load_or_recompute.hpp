#pragma once
// Load or recompute: what the prefetch offers from L2 when the engine could compute the same
// tokens faster (an 8B model's L2 hit on a 1-1.5 GB/s disk is slower than a 50,000 tokens/s
// prefill). bandwidth_meter measures what each backend's loads delivered lately;
// best_prefix picks the prefix of a lookup that saves the engine the most time.
// docs/pipelines.md, "Load or recompute: the gate that learns", holds the arithmetic, the
// probes that keep it learning, and its threading.

#include <kvtier/config.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

/// What the gate knows of one backend's loads.
struct load_estimate {
  bool known = false;            ///< false before its first load task: counted as free
  double seconds_per_byte = 0;   ///< seconds of loading per byte asked for
  double landed_share = 1;       ///< share of the bytes asked for that landed
};

class bandwidth_meter {
 public:
  /// Weight of the newest task (the sums of the older ones decay by 1 - alpha per task).
  static constexpr double alpha = 0.3;

  explicit bandwidth_meter(std::size_t backends) : n_(backends), b_(std::make_unique<sums[]>(backends)) {}

  /// One completed load task of backend b: `asked` bytes were submitted, `landed` of them
  /// landed, in `elapsed`. A task that landed nothing counts (with its time); a task that
  /// asked nothing or took no time is ignored.
  void record(std::size_t b, std::uint64_t asked, std::uint64_t landed, std::chrono::nanoseconds elapsed) noexcept {
    if (b >= n_ || asked == 0 || elapsed.count() <= 0) return;
    sums& s = b_[b];
    const auto decay = [](std::atomic<double>& v, double add) {
      v.store(v.load(std::memory_order_relaxed) * (1 - alpha) + add, std::memory_order_relaxed);
    };
    decay(s.asked, static_cast<double>(asked));
    decay(s.landed, static_cast<double>(landed < asked ? landed : asked));
    decay(s.seconds, std::chrono::duration<double>(elapsed).count());
  }

  /// Bytes backend b delivered per second of loading lately; 0 before its first load task
  /// (and, near 0, for a backend whose recent tasks landed nothing).
  [[nodiscard]] double bytes_per_second(std::size_t b) const noexcept {
    if (b >= n_) return 0;
    const double sec = b_[b].seconds.load(std::memory_order_relaxed);
    return sec > 0 ? b_[b].landed.load(std::memory_order_relaxed) / sec : 0.0;
  }

  /// What the gate uses: time per asked byte and the share that landed.
  [[nodiscard]] load_estimate estimate(std::size_t b) const noexcept {
    load_estimate e;
    if (b >= n_) return e;
    const double asked = b_[b].asked.load(std::memory_order_relaxed);
    if (asked <= 0) return e;
    e.known = true;
    e.seconds_per_byte = b_[b].seconds.load(std::memory_order_relaxed) / asked;
    e.landed_share = b_[b].landed.load(std::memory_order_relaxed) / asked;
    return e;
  }

  [[nodiscard]] std::size_t size() const noexcept { return n_; }

 private:
  struct sums {
    std::atomic<double> asked{0};    ///< decayed bytes asked for
    std::atomic<double> landed{0};   ///< decayed bytes landed (<= asked)
    std::atomic<double> seconds{0};  ///< decayed seconds the tasks took
  };
  std::size_t n_;
  std::unique_ptr<sums[]> b_;
};

/// Seconds saved (positive) or lost (negative) by loading one key of `object_bytes` from a
/// backend of estimate `e` instead of computing it in `compute_seconds`, when the keys before
/// it land with probability `reach`: reach times the key's landed share times the compute
/// time, minus the load time (paid whether it lands or not). An unknown backend is free.
[[nodiscard]] inline double load_gain(const load_estimate& e, double compute_seconds, std::size_t object_bytes,
                                      double reach = 1) noexcept {
  if (!e.known) return reach * compute_seconds;
  return reach * e.landed_share * compute_seconds - static_cast<double>(object_bytes) * e.seconds_per_byte;
}

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
/// prefix); `estimates[b]` what the meter knows of backend b (unknown: counted as free).
[[nodiscard]] inline prefix_choice best_prefix(std::span<const int> sources, const recompute_rate& r,
                                               std::span<const load_estimate> estimates) noexcept {
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
  double reach = 1;  // the chance that every key before this one lands
  for (std::size_t i = 0; i < end; ++i) {
    double gain = reach * compute_key;
    const int s = sources[i];
    if (s >= 0 && static_cast<std::size_t>(s) < estimates.size()) {
      const load_estimate& e = estimates[static_cast<std::size_t>(s)];
      gain = load_gain(e, compute_key, r.object_bytes, reach);
      if (e.known) reach *= e.landed_share;
    }
    sum += gain;
    if ((i + 1) % g == 0 && sum >= best) {
      best = sum;
      c.keys = i + 1;
    }
  }
  return c;
}

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
