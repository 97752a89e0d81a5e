#pragma once
// kvtier_fault_tolerance: the six phases (main.cpp's header comment lists them), each a
// function of the test bed that returns its result.

#include "test_bed.hpp"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace fault_tolerance {

/// One request per document of A (cache hits once warm), then one per document of B (new),
/// ids "<a_tag>-<d>" and "<b_tag>-<d>".
inline std::vector<mini_engine::request_spec> docs_a_then_b(const test_bed& bed, const std::string& a_tag,
                                                            const std::string& b_tag) {
  auto specs = mini_engine::round_of(bed.docs_a(), a_tag);
  auto more = mini_engine::round_of(bed.docs_b(), b_tag);
  specs.insert(specs.end(), more.begin(), more.end());
  return specs;
}

/// Phase 1: a server, an engine, one round over documents A (which fills the cache).
inline phase_result warmup(test_bed& bed) {
  phase_result r{.name = "warmup"};
  bed.start_server();
  mini_engine::engine e(bed.engine_config());
  const auto rep = e.run(mini_engine::round_of(bed.docs_a(), "warm"));
  bed.warmup_s = rep.duration_s;
  r.ok = check_run(r, rep, bed.options().documents, "warmup") && e.healthy();
  fill_ttft(r, {rep});
  return r;
}

/// Phase 2: the same documents (cache hits) plus as many new ones, so the run lasts about as
/// long as the warmup; the server is SIGKILLed at max(kill_min, 0.4 x warmup) into it.
inline phase_result server_killed(test_bed& bed) {
  const auto& o = bed.options();
  phase_result r{.name = "server killed (SIGKILL)"};
  if (!bed.server_running()) bed.start_server();
  if (bed.warmup_s == 0) bed.warmup_s = o.documents * o.tokens / o.tokens_per_second;
  mini_engine::engine e(bed.engine_config());
  const auto specs = docs_a_then_b(bed, "kill-hit", "kill-new");
  const double kill_at = std::max(o.kill_min_s, 0.4 * bed.warmup_s);
  const auto run = run_with_fault(
      e, std::chrono::duration_cast<steady::duration>(seconds_d(kill_at)), [&] { bed.server().signal(SIGKILL); }, {},
      [&] { return e.run(specs); });
  bed.stop_server();
  r.detect_s = run.detect_s;
  r.ok = check_run(r, run.report, specs.size(), "run") && run.fault_during_run && run.detect_s.has_value();
  if (!run.fault_during_run) r.detail += "the run ended before the kill at " + std::to_string(kill_at) + " s; ";
  if (!run.detect_s) r.detail += "the connector never noticed the kill; ";
  fill_ttft(r, {run.report});
  return r;
}

/// Phase 3: no server at all, the connector runs degraded; its throughput against an engine
/// with no connector, interleaved repeats, median ratio.
inline phase_result no_server(test_bed& bed) {
  const auto& o = bed.options();
  phase_result r{.name = "no server (degraded)"};
  bed.stop_server();
  std::error_code ec;
  fs::remove(bed.socket(), ec);
  auto degraded_cfg = bed.engine_config();
  degraded_cfg.connect_wait = std::chrono::milliseconds(0);
  mini_engine::engine degraded(degraded_cfg);
  mini_engine::engine nocache(bed.engine_config(false));
  std::vector<double> ratios;
  std::vector<mini_engine::run_report> reps;
  bool ok = true;
  for (int i = 0; i < o.baseline_repeats; ++i) {
    const auto base = nocache.run(mini_engine::round_of(bed.docs_a(), "base" + std::to_string(i)));
    const auto deg = degraded.run(mini_engine::round_of(bed.docs_a(), "deg" + std::to_string(i)));
    ok = check_run(r, base, o.documents, "no connector") && ok;
    ok = check_run(r, deg, o.documents, "degraded") && ok;
    ratios.push_back(deg.throughput_tokens_per_s() / base.throughput_tokens_per_s());
    reps.push_back(deg);
  }
  bed.degraded_vs_nocache = kvtier::program::percentile(ratios, 0.5);
  r.ok = ok && !degraded.healthy();
  r.detail += "degraded/no-connector throughput " + std::to_string(*bed.degraded_vs_nocache) + "; ";
  fill_ttft(r, reps);
  return r;
}

/// Phase 4: SIGSTOP with retrieves (hits) and stores (new documents) in flight, SIGCONT
/// after the connector noticed, then a run over the same documents that verifies every hit.
inline phase_result server_stopped(test_bed& bed) {
  const auto& o = bed.options();
  phase_result r{.name = "server stopped (SIGSTOP) and continued"};
  bed.start_server();
  mini_engine::engine e(bed.engine_config());
  bool ok = check_run(r, e.run(mini_engine::round_of(bed.docs_a(), "stop-fill")), o.documents, "fill");
  const auto specs = docs_a_then_b(bed, "stop-hit", "stop-new");
  const auto run = run_with_fault(
      e, std::chrono::milliseconds(300), [&] { bed.server().signal(SIGSTOP); },
      [&] {
        std::this_thread::sleep_for(std::chrono::seconds(2));  // the server stays frozen a while
        bed.server().signal(SIGCONT);
      },
      [&] { return e.run(specs); });
  ok = check_run(r, run.report, specs.size(), "run") && ok;
  // The server woke up: whatever it holds must be right. Every hit is verified. The checker
  // waits longer for its connection than an engine of the other phases: the server may still
  // be working off what piled up while it was stopped, and this phase checks what it holds,
  // not how fast it answers (the detection time above is that figure).
  auto checker_cfg = bed.engine_config();
  checker_cfg.connect_wait = std::chrono::seconds(20);
  mini_engine::engine checker(checker_cfg);
  const auto again = docs_a_then_b(bed, "stop-verify", "stop-verify-b");
  const auto verify = checker.run(again);
  ok = check_run(r, verify, again.size(), "verification run") && ok;
  if (verify.tokens_from_cache == 0) {
    ok = false;
    r.detail += "no cache hit after the server continued; ";
  }
  r.detect_s = run.detect_s;
  r.ok = ok && run.detect_s.has_value();
  if (!run.detect_s) r.detail += "the connector never noticed the stop; ";
  fill_ttft(r, {run.report});
  return r;
}

/// Phase 5: the server is killed and started again on the same socket mid-run; the
/// connector reconnects (new boot token), registers again, and the next run hits the cache.
inline phase_result server_restarted(test_bed& bed) {
  const auto& o = bed.options();
  phase_result r{.name = "server restarted"};
  bed.start_server();
  mini_engine::engine e(bed.engine_config());
  std::atomic<bool> restarted{false};
  const auto run = run_with_fault(
      e, std::chrono::milliseconds(500), [&] { bed.server().signal(SIGKILL); },
      [&] {
        bed.server().wait_exit(std::chrono::seconds(10));
        bed.start_server();
        restarted.store(true);
      },
      [&] { return e.run(mini_engine::round_of(bed.docs_b(), "restart-run")); });
  bool ok = check_run(r, run.report, o.documents, "run");
  // Wait (bounded) for the reconnection, then run the same documents twice: the second
  // round must hit what the first stored in the restarted server.
  const auto deadline = steady::now() + std::chrono::seconds(30);
  while (!e.healthy() && steady::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!e.healthy()) {
    ok = false;
    r.detail += "the connector did not reconnect; ";
  }
  const auto first = e.run(mini_engine::round_of(bed.docs_a(), "restart-a1"));
  const auto second = e.run(mini_engine::round_of(bed.docs_a(), "restart-a2"));
  ok = check_run(r, first, o.documents, "after restart, first") && ok;
  ok = check_run(r, second, o.documents, "after restart, second") && ok;
  const auto restarts = e.metrics().value("kvtier_connector_server_restarts_total").value_or(0);
  if (second.tokens_from_cache == 0) {
    ok = false;
    r.detail += "no cache hit after the restart; ";
  }
  if (restarts < 1) {
    ok = false;
    r.detail += "the connector did not see the restart (boot token); ";
  }
  r.detect_s = run.detect_s;
  r.ok = ok && restarted.load();
  fill_ttft(r, {second});
  return r;
}

/// Phase 6, one engine: runs a mini engine process until it is registered and holds lookups,
/// sends it `sig`, and waits until the server holds nothing of it; the seconds that took, or
/// nullopt (reason in r).
inline std::optional<double> engine_cleanup(test_bed& bed, int sig, phase_result& r) {
  const auto& o = bed.options();
  const char* what = sig == SIGKILL ? "killed" : "stopped";
  examples::child_process eng(
      o.engine_binary,
      {"--socket", bed.socket(), "--documents", std::to_string(o.documents), "--tokens", std::to_string(o.tokens),
       "--rounds", "3", "--tokens-per-second", std::to_string(o.tokens_per_second)},
      bed.dir(), std::string("engine-") + what);
  const auto deadline = steady::now() + std::chrono::seconds(60);
  bool busy = false;
  while (!busy && steady::now() < deadline && eng.running()) {
    if (auto s = examples::server_status(bed.socket()))
      busy = registered_clients(*s) > 0 && (*s)["lookups"].get<int>() > 0;
    if (!busy) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!busy) {
    r.detail += std::string("the engine process to be ") + what + " never held a lookup:\n" + eng.stderr_text();
    return std::nullopt;
  }
  const auto when = steady::now();
  eng.signal(sig);
  if (sig == SIGKILL) eng.wait_exit(std::chrono::seconds(10));
  // The reaper acts 1.0-1.25x the timeout after the last frame; the margin is for a busy machine.
  const auto limit = when + std::chrono::duration_cast<steady::duration>(seconds_d(1.5 * o.reap_timeout_s + 3.0));
  bool clean = false;
  nlohmann::json last;
  while (!clean && steady::now() < limit) {
    if (auto s = examples::server_status(bed.socket())) {
      last = *s;
      clean = registered_clients(*s) == 0 && (*s)["lookups"].get<int>() == 0;
    }
    if (!clean) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double took = seconds_d(steady::now() - when).count();
  if (sig != SIGKILL) eng.signal(SIGKILL);
  std::fprintf(stderr, "   engine %s: the server freed its state %s %.3f s later\n", what, clean ? "" : "NOT", took);
  if (!clean) {
    r.detail += std::string("the server still holds the ") + what + " engine's state: " + last.dump() + "; ";
    return std::nullopt;
  }
  return took;
}

/// Phase 6: an engine process is SIGKILLed mid-run (the server sees EOF), then another one
/// is SIGSTOPped mid-run (its socket stays open and silent): the server must drop each one's
/// registration and every lock it held (read through the status request) within the reap
/// timeout. detect_s is the longer of the two clean-up times.
inline phase_result engine_killed(test_bed& bed) {
  phase_result r{.name = "engine killed (SIGKILL) / frozen (SIGSTOP)"};
  if (bed.options().engine_binary.empty()) {
    r.detail = "kvtier_mini_engine not found next to the harness";
    return r;
  }
  bed.start_server();
  const auto killed = engine_cleanup(bed, SIGKILL, r);
  const auto frozen = killed ? engine_cleanup(bed, SIGSTOP, r) : std::nullopt;
  if (killed && frozen) r.detect_s = std::max(*killed, *frozen);
  r.ok = killed && frozen && bed.server_running();
  return r;
}

}  // namespace fault_tolerance
