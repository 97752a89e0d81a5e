#pragma once
// Runs the registered Google Benchmark benchmarks several times, interleaved (a, b, c, a, b,
// c, ...), and collects each benchmark's time per iteration for every repeat, so figures can
// be reported as medians and ratios over paired repeats.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace kvtier::bench {

class repeat_collector : public benchmark::ConsoleReporter {
 public:
  // Plain tables: no colour codes in logs and pipes.
  repeat_collector() : ConsoleReporter(OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred) continue;
      times_ns_[r.benchmark_name()].push_back(r.GetAdjustedRealTime() * to_ns(r.time_unit));
    }
    ConsoleReporter::ReportRuns(runs);
  }

  /// Time per iteration in ns, one entry per repeat, by benchmark name.
  [[nodiscard]] const std::map<std::string, std::vector<double>>& times_ns() const { return times_ns_; }

 private:
  static double to_ns(benchmark::TimeUnit u) {
    switch (u) {
      case benchmark::kNanosecond: return 1;
      case benchmark::kMicrosecond: return 1e3;
      case benchmark::kMillisecond: return 1e6;
      case benchmark::kSecond: return 1e9;
    }
    return 1;
  }
  std::map<std::string, std::vector<double>> times_ns_;
};

/// Initializes Google Benchmark from argv, then runs every benchmark `repeats` times in turn.
inline const std::map<std::string, std::vector<double>>& run_interleaved(int argc, char** argv, int repeats,
                                                                        repeat_collector& collector) {
  benchmark::Initialize(&argc, argv);
  for (int i = 0; i < repeats; ++i) {
    std::fprintf(stderr, "-- repeat %d of %d\n", i + 1, repeats);
    benchmark::RunSpecifiedBenchmarks(&collector);
  }
  return collector.times_ns();
}

}  // namespace kvtier::bench
