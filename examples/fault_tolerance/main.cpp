// kvtier_fault_tolerance: proves that an engine keeps serving correct outputs when the cache
// server dies, hangs, restarts, or is not there at all, and that the server cleans up after
// an engine that dies. The scenario of LMCache's fault-tolerance CI (docs/fault-tolerance.md),
// made stricter: every output and every retrieved block is
// verified, duplicate finished reports are counted, detection times are measured.
//
//   kvtier_fault_tolerance                 every phase, defaults (50 requests of 10,000 tokens)
//   kvtier_fault_tolerance --quick         the shortened version CI runs
//   kvtier_fault_tolerance --phases 2,4    some phases only
//
// Phases: 1 warmup; 2 server killed (SIGKILL) mid-run at max(3 s, 0.4 x warmup time);
// 3 no server at all (degraded) next to no connector at all; 4 server stopped (SIGSTOP)
// with retrieves and stores in flight, continued later, then a run that verifies every hit;
// 5 server restarted mid-run: the connector reconnects and hits again; 6 engine killed
// mid-run: the server frees its registration and locks within the reap timeout.
// Exit status 0 when every phase passed. Ends with RESULT degraded_vs_nocache=<ratio>.
//
// The parts: test_bed.hpp (options, a phase's result and checks, the temporary directory, the
// documents and the server process, a run with a fault injected part-way), phases.hpp (the
// six phases); here, the command line, the phases in order and the summary.
#include <kvtier_program/process.hpp>
#include "phases.hpp"
#include "test_bed.hpp"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace fault_tolerance;

/// Runs the phases of bed.options() in order, each timed, its exceptions turned into a
/// failure; every server is gone at the end.
std::vector<phase_result> run_phases(test_bed& bed) {
  std::vector<phase_result> out;
  for (int p : bed.options().phases) {
    std::fprintf(stderr, "== phase %d\n", p);
    phase_result r;
    const auto t0 = steady::now();
    try {
      switch (p) {
        case 1:
          r = warmup(bed);
          break;
        case 2:
          r = server_killed(bed);
          break;
        case 3:
          r = no_server(bed);
          break;
        case 4:
          r = server_stopped(bed);
          break;
        case 5:
          r = server_restarted(bed);
          break;
        case 6:
          r = engine_killed(bed);
          break;
        default:
          r.name = "unknown phase";
          r.detail = "no such phase";
      }
    } catch (const std::exception& e) {
      r.ok = false;
      r.detail += std::string("exception: ") + e.what();
    }
    r.number = p;
    r.duration_s = seconds_d(steady::now() - t0).count();
    std::fprintf(stderr, "   %s: %s in %.1f s%s%s\n", r.name.c_str(), r.ok ? "PASS" : "FAIL", r.duration_s,
                 r.detect_s ? (", detected in " + std::to_string(*r.detect_s) + " s").c_str() : "",
                 r.detail.empty() ? "" : ("\n   " + r.detail).c_str());
    out.push_back(r);
  }
  bed.stop_server();
  return out;
}

/// The summary table (stdout) and, with a path, the JSON report; true when every phase
/// passed.
bool report(const std::vector<phase_result>& results, const std::string& json_path) {
  bool all = true;
  nlohmann::json j = nlohmann::json::array();
  std::printf("\n%-3s %-42s %-5s %9s %10s %10s %10s %10s\n", "#", "phase", "ok", "time_s", "detect_s", "ttft_mean",
              "ttft_p50", "ttft_p99");
  for (const auto& r : results) {
    all = all && r.ok;
    std::printf("%-3d %-42s %-5s %9.2f %10s %10.3f %10.3f %10.3f\n", r.number, r.name.c_str(), r.ok ? "PASS" : "FAIL",
                r.duration_s, r.detect_s ? std::to_string(*r.detect_s).substr(0, 6).c_str() : "-", r.ttft_mean_s,
                r.ttft_p50_s, r.ttft_p99_s);
    j.push_back({{"phase", r.number},
                 {"name", r.name},
                 {"ok", r.ok},
                 {"duration_s", r.duration_s},
                 {"detect_s", r.detect_s ? nlohmann::json(*r.detect_s) : nlohmann::json(nullptr)},
                 {"completed", r.completed},
                 {"expected", r.expected},
                 {"ttft_mean_s", r.ttft_mean_s},
                 {"ttft_p50_s", r.ttft_p50_s},
                 {"ttft_p99_s", r.ttft_p99_s},
                 {"detail", r.detail}});
  }
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  std::printf("%s\n", all ? "all phases passed" : "SOME PHASES FAILED");
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtier fault-tolerance harness: the engine keeps serving correct outputs through server failures"};
  harness_options o;
  bool quick = false;
  std::vector<int> phases;
  app.add_option("--server", o.server, "Path of kvtier-server (default: found next to this program)");
  app.add_flag("--quick", quick, "The shortened version (CI): fewer, shorter requests");
  app.add_option("--documents", o.documents, "Requests per round")->capture_default_str();
  app.add_option("--tokens", o.tokens, "Tokens per request")->capture_default_str();
  app.add_option("--tokens-per-second", o.tokens_per_second, "The mini engine's prefill speed")->capture_default_str();
  app.add_option("--reap-timeout", o.reap_timeout_s, "The server's client reap timeout (s)")->capture_default_str();
  app.add_option("--phases", phases, "Phases to run (1-6); default all")->delimiter(',');
  app.add_option("--json", o.json_path, "Write the report as JSON here");
  app.add_flag("--keep", o.keep, "Keep the temporary directory (logs) at the end");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    // About as long per phase as the full run's warmup is short: enough for a kill mid-run.
    if (app.count("--documents") == 0) o.documents = 8;
    if (app.count("--tokens") == 0) o.tokens = 4096;
    if (app.count("--tokens-per-second") == 0) o.tokens_per_second = 10'000;
    o.kill_min_s = 1.0;
    o.baseline_repeats = 2;
    if (app.count("--reap-timeout") == 0) o.reap_timeout_s = 2.0;
  }
  if (!phases.empty()) o.phases = std::set<int>(phases.begin(), phases.end());
  if (o.server.empty()) o.server = examples::find_program("kvtier-server", argv[0]);
  o.engine_binary = examples::find_program("kvtier_mini_engine", argv[0]);
  if (o.server.empty()) {
    std::fprintf(stderr, "kvtier_fault_tolerance: kvtier-server not found next to this program: pass --server PATH\n");
    return 2;
  }
  test_bed bed(o);
  const bool all = report(run_phases(bed), o.json_path);
  if (bed.degraded_vs_nocache) std::printf("RESULT degraded_vs_nocache=%.4f\n", *bed.degraded_vs_nocache);
  return all ? 0 : 1;
}
