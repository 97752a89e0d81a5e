#pragma once
// Program support: the order statistics our programs report (medians of repeats,
// percentiles of latencies), one implementation for the examples, the benchmarks and the
// tests. Both answer 0 for no samples (a phase that ran no request); the benchmarks'
// bench::median refuses that instead (bench/common/results.hpp).

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvtier::program {

/// The median of `v` (the mean of the two middle values for an even count); 0 when empty.
[[nodiscard]] inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// The q-quantile (0 <= q <= 1) of `v`, nearest rank: percentile(v, 0.99) is the p99; 0
/// when empty.
[[nodiscard]] inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::clamp(q, 0.0, 1.0) * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace kvtier::program
