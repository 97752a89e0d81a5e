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
#include <kvtier_program/process.hpp>
#include <kvtier_program/stats.hpp>
#include "../mini_engine/engine.hpp"
#include "../mini_engine/workload.hpp"

#include <kvtier/protocol/messages.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using steady = std::chrono::steady_clock;
using seconds_d = std::chrono::duration<double>;

struct harness_options {
  std::string server;
  std::string engine_binary;
  std::size_t documents = 50;
  std::size_t tokens = 10'000;
  double tokens_per_second = 50'000;
  double kill_min_s = 3.0;
  double reap_timeout_s = 5.0;
  std::size_t l1_mb = 4096;
  std::set<int> phases{1, 2, 3, 4, 5, 6};
  std::string json_path;
  bool keep = false;
  int baseline_repeats = 3;
};

struct phase_result {
  int number = 0;
  std::string name;
  bool ok = false;
  double duration_s = 0;
  std::optional<double> detect_s{};  ///< failure injected -> connector (or server) noticed
  double ttft_mean_s = 0, ttft_p50_s = 0, ttft_p99_s = 0;
  std::size_t completed = 0, expected = 0;
  std::string detail{};
};

using kvtier::program::percentile;

void fill_ttft(phase_result& r, const std::vector<mini_engine::run_report>& runs) {
  std::vector<double> t;
  for (const auto& rep : runs)
    for (const auto& q : rep.requests) t.push_back(q.ttft_s);
  if (t.empty()) return;
  r.ttft_mean_s = std::accumulate(t.begin(), t.end(), 0.0) / static_cast<double>(t.size());
  r.ttft_p50_s = percentile(t, 0.5);
  r.ttft_p99_s = percentile(t, 0.99);
}

// Adds a run's checks to a phase: every request completed, every output right, no corrupt
// block, no duplicate finished report.
bool check_run(phase_result& r, const mini_engine::run_report& rep, std::size_t expected, const char* what) {
  r.completed += rep.completed;
  r.expected += expected;
  const bool ok = rep.all_ok(expected);
  if (!ok)
    r.detail += std::string(what) + ": completed " + std::to_string(rep.completed) + "/" + std::to_string(expected) +
                ", wrong outputs " + std::to_string(rep.wrong_outputs) + ", corrupt rows " +
                std::to_string(rep.corrupt_rows) + ", duplicate finished " + std::to_string(rep.duplicate_finished) +
                "; ";
  return ok;
}

class harness {
 public:
  explicit harness(harness_options o) : o_(std::move(o)) {
    std::string templ = (fs::temp_directory_path() / "kvtier-ft-XXXXXX").string();
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
    dir_ = templ;
    socket_ = (dir_ / "kvtier.sock").string();
    docs_a_ = mini_engine::make_documents(o_.documents, o_.tokens, 1);
    docs_b_ = mini_engine::make_documents(o_.documents, o_.tokens, 2);
  }
  ~harness() {
    server_.reset();
    std::error_code ec;
    if (!o_.keep) fs::remove_all(dir_, ec);
  }

  std::vector<phase_result> run() {
    std::vector<phase_result> out;
    for (int p : o_.phases) {
      std::fprintf(stderr, "== phase %d\n", p);
      phase_result r;
      const auto t0 = steady::now();
      try {
        switch (p) {
          case 1: r = warmup(); break;
          case 2: r = server_killed(); break;
          case 3: r = no_server(); break;
          case 4: r = server_stopped(); break;
          case 5: r = server_restarted(); break;
          case 6: r = engine_killed(); break;
          default: r.name = "unknown phase"; r.detail = "no such phase";
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
    server_.reset();
    return out;
  }

  std::optional<double> degraded_vs_nocache;

 private:
  // --- the server ----------------------------------------------------------------------
  void start_server() {
    server_.reset();
    std::vector<std::string> args = {"--socket", socket_, "--l1-size-mb", std::to_string(o_.l1_mb),
                                     "--client-reap-timeout", std::to_string(o_.reap_timeout_s), "--log-level", "warn"};
    server_ = std::make_unique<examples::child_process>(o_.server, args, dir_, "server" + std::to_string(++starts_));
    if (!examples::wait_listening(*server_, socket_, std::chrono::seconds(30)))
      throw std::runtime_error("kvtier-server did not start:\n" + server_->stderr_text());
  }

  mini_engine::engine_config engine_config(bool connector = true) const {
    mini_engine::engine_config c;
    c.tokens_per_second = o_.tokens_per_second;
    if (connector) c.socket_path = socket_;
    c.num_blocks = static_cast<std::uint32_t>(std::max<std::size_t>(4096, (o_.tokens / 16 + 2) * 6));
    return c;
  }

  // How long after `since` the engine's connector reported unhealthy (polled every 0.5 ms
  // while `running`); nullopt when it never did.
  static std::optional<double> time_to_unhealthy(mini_engine::engine& e, steady::time_point since,
                                                 const std::atomic<bool>& running) {
    while (running.load()) {
      if (!e.healthy()) return seconds_d(steady::now() - since).count();
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    return std::nullopt;
  }

  // Clients of a status answer that hold a registration (the status query's own connection
  // is listed too, unregistered).
  static std::size_t registered_clients(const nlohmann::json& status) {
    std::size_t n = 0;
    for (const auto& c : status["clients"]) n += c.value("registered", false) ? 1 : 0;
    return n;
  }

  // --- phases --------------------------------------------------------------------------
  phase_result warmup() {
    phase_result r{.name = "warmup"};
    start_server();
    mini_engine::engine e(engine_config());
    const auto rep = e.run(mini_engine::round_of(docs_a_, "warm"));
    warmup_s_ = rep.duration_s;
    r.ok = check_run(r, rep, o_.documents, "warmup") && e.healthy();
    fill_ttft(r, {rep});
    return r;
  }

  // The same documents (cache hits) plus as many new ones, so the run lasts about as long as
  // the warmup; the server is SIGKILLed at max(kill_min, 0.4 x warmup) into it.
  phase_result server_killed() {
    phase_result r{.name = "server killed (SIGKILL)"};
    if (!server_ || !server_->running()) start_server();
    if (warmup_s_ == 0) warmup_s_ = o_.documents * o_.tokens / o_.tokens_per_second;
    mini_engine::engine e(engine_config());
    auto specs = mini_engine::round_of(docs_a_, "kill-hit");
    auto fresh = mini_engine::round_of(docs_b_, "kill-new");
    specs.insert(specs.end(), fresh.begin(), fresh.end());
    const double kill_at = std::max(o_.kill_min_s, 0.4 * warmup_s_);
    std::optional<double> detect;
    bool killed_mid_run = false;
    std::atomic<bool> running{true};
    const auto t0 = steady::now();
    std::thread killer([&] {
      std::this_thread::sleep_until(t0 + std::chrono::duration_cast<steady::duration>(seconds_d(kill_at)));
      killed_mid_run = running.load();
      const auto when = steady::now();
      server_->signal(SIGKILL);
      detect = time_to_unhealthy(e, when, running);
    });
    const auto rep = e.run(specs);
    running.store(false);
    killer.join();
    server_.reset();
    r.detect_s = detect;
    r.ok = check_run(r, rep, specs.size(), "run") && killed_mid_run && detect.has_value();
    if (!killed_mid_run) r.detail += "the run ended before the kill at " + std::to_string(kill_at) + " s; ";
    if (!detect) r.detail += "the connector never noticed the kill; ";
    fill_ttft(r, {rep});
    return r;
  }

  // No server at all: the connector runs degraded; its throughput against an engine with no
  // connector, interleaved repeats, median ratio.
  phase_result no_server() {
    phase_result r{.name = "no server (degraded)"};
    server_.reset();
    std::error_code ec;
    fs::remove(socket_, ec);
    auto degraded_cfg = engine_config();
    degraded_cfg.connect_wait = std::chrono::milliseconds(0);
    mini_engine::engine degraded(degraded_cfg);
    mini_engine::engine nocache(engine_config(false));
    std::vector<double> ratios;
    std::vector<mini_engine::run_report> reps;
    bool ok = true;
    for (int i = 0; i < o_.baseline_repeats; ++i) {
      const auto base = nocache.run(mini_engine::round_of(docs_a_, "base" + std::to_string(i)));
      const auto deg = degraded.run(mini_engine::round_of(docs_a_, "deg" + std::to_string(i)));
      ok = check_run(r, base, o_.documents, "no connector") && ok;
      ok = check_run(r, deg, o_.documents, "degraded") && ok;
      ratios.push_back(deg.throughput_tokens_per_s() / base.throughput_tokens_per_s());
      reps.push_back(deg);
    }
    degraded_vs_nocache = percentile(ratios, 0.5);
    r.ok = ok && !degraded.healthy();
    r.detail += "degraded/no-connector throughput " + std::to_string(*degraded_vs_nocache) + "; ";
    fill_ttft(r, reps);
    return r;
  }

  // SIGSTOP with retrieves (hits) and stores (new documents) in flight, SIGCONT after the
  // connector noticed, then a run over the same documents that verifies every hit.
  phase_result server_stopped() {
    phase_result r{.name = "server stopped (SIGSTOP) and continued"};
    start_server();
    mini_engine::engine e(engine_config());
    bool ok = check_run(r, e.run(mini_engine::round_of(docs_a_, "stop-fill")), o_.documents, "fill");
    auto specs = mini_engine::round_of(docs_a_, "stop-hit");
    auto fresh = mini_engine::round_of(docs_b_, "stop-new");
    specs.insert(specs.end(), fresh.begin(), fresh.end());
    std::optional<double> detect;
    std::atomic<bool> running{true};
    const auto t0 = steady::now();
    std::thread stopper([&] {
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(300));
      const auto when = steady::now();
      server_->signal(SIGSTOP);
      detect = time_to_unhealthy(e, when, running);
      std::this_thread::sleep_for(std::chrono::seconds(2));  // the server stays frozen a while
      server_->signal(SIGCONT);
    });
    const auto rep = e.run(specs);
    running.store(false);
    stopper.join();
    ok = check_run(r, rep, specs.size(), "run") && ok;
    // The server woke up: whatever it holds must be right. Every hit is verified.
    mini_engine::engine checker(engine_config());
    auto again = mini_engine::round_of(docs_a_, "stop-verify");
    auto again_b = mini_engine::round_of(docs_b_, "stop-verify-b");
    again.insert(again.end(), again_b.begin(), again_b.end());
    const auto verify = checker.run(again);
    ok = check_run(r, verify, again.size(), "verification run") && ok;
    if (verify.tokens_from_cache == 0) {
      ok = false;
      r.detail += "no cache hit after the server continued; ";
    }
    r.detect_s = detect;
    r.ok = ok && detect.has_value();
    if (!detect) r.detail += "the connector never noticed the stop; ";
    fill_ttft(r, {rep});
    return r;
  }

  // The server is killed and started again on the same socket mid-run; the connector
  // reconnects (new boot token), registers again, and the next run hits the cache.
  phase_result server_restarted() {
    phase_result r{.name = "server restarted"};
    start_server();
    mini_engine::engine e(engine_config());
    std::atomic<bool> restarted{false};
    std::atomic<bool> running{true};
    std::optional<double> detect;
    const auto t0 = steady::now();
    std::thread restarter([&] {
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(500));
      const auto when = steady::now();
      server_->signal(SIGKILL);
      detect = time_to_unhealthy(e, when, running);
      server_->wait_exit(std::chrono::seconds(10));
      start_server();
      restarted.store(true);
    });
    const auto rep = e.run(mini_engine::round_of(docs_b_, "restart-run"));
    running.store(false);
    restarter.join();
    bool ok = check_run(r, rep, o_.documents, "run");
    // Wait (bounded) for the reconnection, then run the same documents twice: the second
    // round must hit what the first stored in the restarted server.
    const auto deadline = steady::now() + std::chrono::seconds(30);
    while (!e.healthy() && steady::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!e.healthy()) {
      ok = false;
      r.detail += "the connector did not reconnect; ";
    }
    const auto first = e.run(mini_engine::round_of(docs_a_, "restart-a1"));
    const auto second = e.run(mini_engine::round_of(docs_a_, "restart-a2"));
    ok = check_run(r, first, o_.documents, "after restart, first") && ok;
    ok = check_run(r, second, o_.documents, "after restart, second") && ok;
    const auto restarts = e.metrics().value("kvtier_connector_server_restarts_total").value_or(0);
    if (second.tokens_from_cache == 0) {
      ok = false;
      r.detail += "no cache hit after the restart; ";
    }
    if (restarts < 1) {
      ok = false;
      r.detail += "the connector did not see the restart (boot token); ";
    }
    r.detect_s = detect;
    r.ok = ok && restarted.load();
    fill_ttft(r, {second});
    return r;
  }

  // A separate engine process is SIGKILLed mid-run; the server must drop its registration and
  // every lock it held (read through the status request) within the reap timeout.
  // An engine process is SIGKILLed mid-run (the server sees EOF), then another one is
  // SIGSTOPped mid-run (its socket stays open and silent): the server must drop each one's
  // registration and every lock it held (read through the status request) within the reap
  // timeout. detect_s is the longer of the two clean-up times.
  phase_result engine_killed() {
    phase_result r{.name = "engine killed (SIGKILL) / frozen (SIGSTOP)"};
    if (o_.engine_binary.empty()) {
      r.detail = "kvtier_mini_engine not found next to the harness";
      return r;
    }
    start_server();
    const auto killed = engine_cleanup(SIGKILL, r);
    const auto frozen = killed ? engine_cleanup(SIGSTOP, r) : std::nullopt;
    if (killed && frozen) r.detect_s = std::max(*killed, *frozen);
    r.ok = killed && frozen && server_->running();
    return r;
  }

  // Runs an engine child until it is registered and holds lookups, sends it `sig`, and waits
  // until the server holds nothing of it; the seconds that took, or nullopt (reason in r).
  std::optional<double> engine_cleanup(int sig, phase_result& r) {
    const char* what = sig == SIGKILL ? "killed" : "stopped";
    examples::child_process eng(o_.engine_binary,
                                {"--socket", socket_, "--documents", std::to_string(o_.documents), "--tokens",
                                 std::to_string(o_.tokens), "--rounds", "3", "--tokens-per-second",
                                 std::to_string(o_.tokens_per_second)},
                                dir_, std::string("engine-") + what);
    const auto deadline = steady::now() + std::chrono::seconds(60);
    bool busy = false;
    while (!busy && steady::now() < deadline && eng.running()) {
      if (auto s = examples::server_status(socket_)) busy = registered_clients(*s) > 0 && (*s)["lookups"].get<int>() > 0;
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
    const auto limit = when + std::chrono::duration_cast<steady::duration>(seconds_d(1.5 * o_.reap_timeout_s + 3.0));
    bool clean = false;
    nlohmann::json last;
    while (!clean && steady::now() < limit) {
      if (auto s = examples::server_status(socket_)) {
        last = *s;
        clean = registered_clients(*s) == 0 && (*s)["lookups"].get<int>() == 0;
      }
      if (!clean) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const double took = seconds_d(steady::now() - when).count();
    if (sig != SIGKILL) eng.signal(SIGKILL);
    std::fprintf(stderr, "   engine %s: the server freed its state %s %.3f s later\n", what,
                 clean ? "" : "NOT", took);
    if (!clean) {
      r.detail += std::string("the server still holds the ") + what + " engine's state: " + last.dump() + "; ";
      return std::nullopt;
    }
    return took;
  }

  harness_options o_;
  fs::path dir_;
  std::string socket_;
  std::vector<std::vector<kvtier::token_id>> docs_a_, docs_b_;
  std::unique_ptr<examples::child_process> server_;
  int starts_ = 0;
  double warmup_s_ = 0;
};

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
  harness h(o);
  const auto results = h.run();
  bool all = true;
  nlohmann::json j = nlohmann::json::array();
  std::printf("\n%-3s %-42s %-5s %9s %10s %10s %10s %10s\n", "#", "phase", "ok", "time_s", "detect_s", "ttft_mean",
              "ttft_p50", "ttft_p99");
  for (const auto& r : results) {
    all = all && r.ok;
    std::printf("%-3d %-42s %-5s %9.2f %10s %10.3f %10.3f %10.3f\n", r.number, r.name.c_str(), r.ok ? "PASS" : "FAIL",
                r.duration_s, r.detect_s ? std::to_string(*r.detect_s).substr(0, 6).c_str() : "-", r.ttft_mean_s,
                r.ttft_p50_s, r.ttft_p99_s);
    j.push_back({{"phase", r.number}, {"name", r.name}, {"ok", r.ok}, {"duration_s", r.duration_s},
                 {"detect_s", r.detect_s ? nlohmann::json(*r.detect_s) : nlohmann::json(nullptr)},
                 {"completed", r.completed}, {"expected", r.expected}, {"ttft_mean_s", r.ttft_mean_s},
                 {"ttft_p50_s", r.ttft_p50_s}, {"ttft_p99_s", r.ttft_p99_s}, {"detail", r.detail}});
  }
  if (!o.json_path.empty()) std::ofstream(o.json_path) << j.dump(2) << "\n";
  std::printf("%s\n", all ? "all phases passed" : "SOME PHASES FAILED");
  if (h.degraded_vs_nocache) std::printf("RESULT degraded_vs_nocache=%.4f\n", *h.degraded_vs_nocache);
  return all ? 0 : 1;
}
