#pragma once
// kvtier_long_doc_qa: the rounds of the workload (the order of a query round, the TTFT
// summary of a round) and the wait for the server to go idle between them.

#include <kvtier_program/process.hpp>
#include "../mini_engine/engine.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace long_doc_qa {

using nlohmann::json;

struct ttft_stats {
  double mean = 0, p50 = 0, p99 = 0, max = 0;
};

// Nearest-rank percentiles.
inline ttft_stats stats_of(std::vector<double> v) {
  ttft_stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  auto pct = [&](double p) {
    const auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
    return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
  };
  s.p50 = pct(50);
  s.p99 = pct(99);
  s.max = v.back();
  return s;
}

/// One round (warmup or query) as the report shows it.
struct round_summary {
  std::string name;
  std::size_t requests = 0;
  double round_time_s = 0;
  ttft_stats ttft;
  std::size_t tokens_total = 0;
  std::size_t tokens_from_cache = 0;
  bool ok = false;

  [[nodiscard]] json to_json() const {
    return {{"name", name},
            {"requests", requests},
            {"round_time_s", round_time_s},
            {"ttft_mean_s", ttft.mean},
            {"ttft_p50_s", ttft.p50},
            {"ttft_p99_s", ttft.p99},
            {"ttft_max_s", ttft.max},
            {"tokens_total", tokens_total},
            {"tokens_from_cache", tokens_from_cache},
            {"ok", ok}};
  }
  void print() const {
    std::fprintf(stderr,
                 "%-6s %4zu requests in %7.3f s: TTFT mean %.4f s, p50 %.4f s, p99 %.4f s; %zu of %zu tokens from the "
                 "cache%s\n",
                 name.c_str(), requests, round_time_s, ttft.mean, ttft.p50, ttft.p99, tokens_from_cache, tokens_total,
                 ok ? "" : "  (FAILED: see the engine's report)");
  }
};

inline round_summary summarize(const std::string& name, const mini_engine::run_report& rep, std::size_t expected) {
  round_summary s;
  s.name = name;
  s.requests = rep.requests.size();
  s.round_time_s = rep.duration_s;
  std::vector<double> t;
  for (const auto& r : rep.requests) t.push_back(r.ttft_s);
  s.ttft = stats_of(std::move(t));
  s.tokens_total = rep.tokens_total;
  s.tokens_from_cache = rep.tokens_from_cache;
  s.ok = rep.all_ok(expected);
  return s;
}

// The query round's order of warm document indices (main.cpp's header comment: --mode).
inline std::vector<std::size_t> query_order(std::size_t n, std::size_t repeat, const std::string& mode,
                                            std::uint64_t seed) {
  std::vector<std::size_t> out;
  if (mode == "interleave") {
    for (std::size_t d = 0; d < n; ++d)
      for (std::size_t r = 0; r < repeat; ++r) out.push_back(d);
  } else {
    for (std::size_t r = 0; r < repeat; ++r)
      for (std::size_t d = 0; d < n; ++d) out.push_back(d);
    if (mode == "random") {
      std::mt19937_64 rng(seed);
      std::shuffle(out.begin(), out.end(), rng);
    }
  }
  return out;
}

// Polls the server's status until `done(status)` or the deadline; returns the last status.
template <class Pred>
std::optional<json> wait_status(const std::string& socket, std::chrono::seconds timeout, Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<json> last;
  for (;;) {
    last = examples::server_status(socket);
    if (last && !last->is_discarded() && done(*last)) return last;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// No store in flight or pending, no prefetch active.
inline bool store_idle(const json& s) {
  return s["store"]["inflight_tasks"] == 0 && s["store"]["pending_keys"] == 0 && s["prefetch"]["active"] == 0;
}

/// The server's L1 set-up (prefault, then registration with the L2 backends) has ended, or
/// never ran (status l1.residency: docs/server.md, "Start-up").
inline bool l1_settled(const json& s) {
  const auto r = s["l1"].value("residency", std::string("resident"));
  return r != "faulting" && r != "registering";
}

}  // namespace long_doc_qa
