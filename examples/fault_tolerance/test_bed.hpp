#pragma once
// kvtier_fault_tolerance: what every phase works with. The harness's options, a phase's
// result and its checks, the test bed (a temporary directory with the server's socket and
// logs, the two document sets, the kvtier-server process), and a run with a fault injected
// part-way through it.

#include <kvtier_program/process.hpp>
#include <kvtier_program/stats.hpp>
#include "../mini_engine/engine.hpp"
#include "../mini_engine/workload.hpp"

#include <nlohmann/json.hpp>

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace fault_tolerance {

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

/// The TTFT figures of a phase, over every request of `runs`.
inline void fill_ttft(phase_result& r, const std::vector<mini_engine::run_report>& runs) {
  using kvtier::program::percentile;
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
inline bool check_run(phase_result& r, const mini_engine::run_report& rep, std::size_t expected, const char* what) {
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

/// The phases' shared ground: a temporary directory (the server's socket and every
/// process's logs; removed at the end unless options().keep), documents A and B, and the
/// kvtier-server process, which one phase may leave running for the next.
class test_bed {
 public:
  explicit test_bed(harness_options o) : o_(std::move(o)) {
    std::string templ = (fs::temp_directory_path() / "kvtier-ft-XXXXXX").string();
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
    dir_ = templ;
    socket_ = (dir_ / "kvtier.sock").string();
    docs_a_ = mini_engine::make_documents(o_.documents, o_.tokens, 1);
    docs_b_ = mini_engine::make_documents(o_.documents, o_.tokens, 2);
  }
  ~test_bed() {
    server_.reset();
    std::error_code ec;
    if (!o_.keep) fs::remove_all(dir_, ec);
  }
  test_bed(const test_bed&) = delete;
  test_bed& operator=(const test_bed&) = delete;

  [[nodiscard]] const harness_options& options() const noexcept { return o_; }
  [[nodiscard]] const fs::path& dir() const noexcept { return dir_; }
  [[nodiscard]] const std::string& socket() const noexcept { return socket_; }
  [[nodiscard]] const std::vector<std::vector<kvtier::token_id>>& docs_a() const noexcept { return docs_a_; }
  [[nodiscard]] const std::vector<std::vector<kvtier::token_id>>& docs_b() const noexcept { return docs_b_; }

  /// Starts a fresh kvtier-server on the socket (killing the one before, if any) and waits
  /// until it listens.
  void start_server() {
    server_.reset();
    std::vector<std::string> args = {"--socket",
                                     socket_,
                                     "--l1-size-mb",
                                     std::to_string(o_.l1_mb),
                                     "--client-reap-timeout",
                                     std::to_string(o_.reap_timeout_s),
                                     "--log-level",
                                     "warn"};
    server_ = std::make_unique<examples::child_process>(o_.server, args, dir_, "server" + std::to_string(++starts_));
    if (!examples::wait_listening(*server_, socket_, std::chrono::seconds(30)))
      throw std::runtime_error("kvtier-server did not start:\n" + server_->stderr_text());
  }
  /// Kills the server (SIGKILL) and reaps it; nothing when none runs.
  void stop_server() { server_.reset(); }
  [[nodiscard]] bool server_running() { return server_ && server_->running(); }
  /// The server process (start_server first).
  [[nodiscard]] examples::child_process& server() { return *server_; }

  /// The mini engine of every phase; with `connector`, connected to the server's socket.
  [[nodiscard]] mini_engine::engine_config engine_config(bool connector = true) const {
    mini_engine::engine_config c;
    c.tokens_per_second = o_.tokens_per_second;
    if (connector) c.socket_path = socket_;
    c.num_blocks = static_cast<std::uint32_t>(std::max<std::size_t>(4096, (o_.tokens / 16 + 2) * 6));
    return c;
  }

  /// How long the warmup round took (phase 1; phase 2 times its kill from it).
  double warmup_s = 0;
  /// Phase 3's figure: degraded / no-connector throughput (RESULT degraded_vs_nocache).
  std::optional<double> degraded_vs_nocache;

 private:
  harness_options o_;
  fs::path dir_;
  std::string socket_;
  std::vector<std::vector<kvtier::token_id>> docs_a_, docs_b_;
  std::unique_ptr<examples::child_process> server_;
  int starts_ = 0;
};

// How long after `since` the engine's connector reported unhealthy (polled every 0.5 ms
// while `running`); nullopt when it never did.
inline std::optional<double> time_to_unhealthy(mini_engine::engine& e, steady::time_point since,
                                               const std::atomic<bool>& running) {
  while (running.load()) {
    if (!e.healthy()) return seconds_d(steady::now() - since).count();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return std::nullopt;
}

// Clients of a status answer that hold a registration (the status query's own connection
// is listed too, unregistered).
inline std::size_t registered_clients(const nlohmann::json& status) {
  std::size_t n = 0;
  for (const auto& c : status["clients"]) n += c.value("registered", false) ? 1 : 0;
  return n;
}

/// A run with a fault injected part-way through it.
struct faulted_run {
  mini_engine::run_report report;
  std::optional<double> detect_s;  ///< fault -> engine's connector unhealthy; nullopt: never seen
  bool fault_during_run = false;   ///< the run was still going when the fault came
};

/// Runs `run()` (the engine's run) while, on another thread, `delay` after the start,
/// `fault()` is injected, the time until `e` reports unhealthy is measured (while the run
/// lasts), then `after()` runs (recovery: continue or restart the server).
template <class Run>
faulted_run run_with_fault(mini_engine::engine& e, steady::duration delay, const std::function<void()>& fault,
                           const std::function<void()>& after, Run&& run) {
  faulted_run out;
  std::atomic<bool> running{true};
  const auto t0 = steady::now();
  std::thread injector([&] {
    std::this_thread::sleep_until(t0 + delay);
    out.fault_during_run = running.load();
    const auto when = steady::now();
    fault();
    out.detect_s = time_to_unhealthy(e, when, running);
    if (after) after();
  });
  out.report = std::forward<Run>(run)();
  running.store(false);
  injector.join();
  return out;
}

}  // namespace fault_tolerance
