#pragma once
// Benchmark output helpers: medians and percentiles, and the `RESULT name=value` lines every benchmark ends
// with (docs/performance.md: lower_snake_case name, plain decimal value, unit in the name; a ratio
// a_vs_b is the median over interleaved repeats of a_i / b_i).

#include <kvtier_program/stats.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier::bench {

/// The median of `v` (program::median); a benchmark that measured nothing is a bug: throws.
[[nodiscard]] inline double median(std::vector<double> v) {
  if (v.empty()) throw std::invalid_argument("median of nothing");
  return program::median(std::move(v));
}

/// The q-quantile (0 <= q <= 1) of `v`, nearest rank: percentile(v, 0.99) is the p99.
[[nodiscard]] inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) throw std::invalid_argument("percentile of nothing");
  return program::percentile(std::move(v), q);
}

/// The median of a_i / b_i over repeats measured in the same run, interleaved.
[[nodiscard]] inline double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size() || a.empty()) throw std::invalid_argument("median_ratio: repeats differ");
  std::vector<double> r;
  for (std::size_t i = 0; i < a.size(); ++i) r.push_back(a[i] / b[i]);
  return median(r);
}

/// Prints `RESULT name=value` (value with up to 6 significant decimals, never in e-notation).
inline void print_result(std::string_view name, double value) {
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
      throw std::invalid_argument("RESULT names are lower_snake_case: " + std::string(name));
  if (!std::isfinite(value)) throw std::invalid_argument("RESULT value is not finite: " + std::string(name));
  const double mag = std::fabs(value);
  const int decimals = mag >= 1000 ? 1 : mag >= 1 ? 4 : 6;
  std::printf("RESULT %.*s=%.*f\n", static_cast<int>(name.size()), name.data(), decimals, value);
  std::fflush(stdout);
}

}  // namespace kvtier::bench
