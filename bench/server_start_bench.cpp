// kvtier_bench_server_start: how soon a (re)started kvtier-server answers an engine. The time
// from spawning the program to its first answered lookup, with a small L1 and a large one: the
// server listens first and faults L1 in behind the first requests (docs/server.md,
// "Start-up"), so the figure must not grow with L1 (target: at most 100 ms with any size).
//
// Each run: posix_spawn kvtier-server (--l1-size-gb N, a disk L2 backend in a fresh
// directory so that L1 is registered as io_uring fixed buffers, --log-level info); connect
// every millisecond until the socket accepts; register as a scheduler (no region); one
// lookup of 39 chunk hashes with answer_when_decided (a miss: decided at once); the time
// is taken when its answer arrives. Then the run waits for the server's "L1 prefaulted"
// log line: the time from the spawn to it is when a server that faulted L1 in before
// listening (kvtier before issue 25) would have answered first. The "L1 registered ... in
// N ms" line gives the registration's time, which the I/O thread spends once (~50 ms per
// GiB). SIGTERM ends the run. The sizes are interleaved within each repeat.
//
//   kvtier_bench_server_start [--server PATH] [--repeats N] [--sizes-gb 1,8] [--quick] [--no-l2]
//
// A size larger than the memory available now (less 2 GiB) is skipped, with a line saying so.
// --quick: sizes 1 and 4. Ends with, per size S (1gib, 8gib, ...), medians over the repeats:
//   RESULT server_start_to_first_lookup_<S>_ms     spawn -> first lookup answered
//   RESULT server_start_to_l1_prefaulted_<S>_ms    spawn -> the prefault's log line (old start-up)
//   RESULT l1_register_<S>_ms                      the registration with the disk backend
// and RESULT server_start_to_first_lookup_ms: the largest of the per-size medians.
#include <kvtier_program/process.hpp>

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/messages.hpp>

#include <common/protocol_client.hpp>
#include <common/results.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kvtier;
namespace p = protocol;
namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

double ms_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// MemAvailable of /proc/meminfo in bytes (0 when unknown).
std::uint64_t memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib << 10;
  return 0;
}

struct run_figures {
  double connected_ms = 0;     ///< the socket accepted a connection (the backlog: maybe before serving)
  double registered_ms = 0;    ///< the registration was answered (the server serves)
  double first_lookup_ms = 0;
  double prefaulted_ms = 0;
  std::optional<double> register_ms;
};

/// The first match of `re` in the file's text, group 1, or nullopt.
std::optional<std::string> find_in(const std::string& text, const std::regex& re) {
  std::smatch m;
  if (std::regex_search(text, m, re)) return m[1].str();
  return std::nullopt;
}

run_figures run_once(const std::string& server, const fs::path& dir, int gb, bool disk) {
  const std::string socket = (dir / "kvtier.sock").string();
  const fs::path l2 = dir / "l2";  // kept across runs: a restart finds its directory
  const std::string backend = R"({"type":"disk","path":")" + l2.string() + R"(","capacity_gb":1})";
  const auto deadline_after = std::chrono::seconds(600);
  run_figures f;
  const auto t0 = clock_type::now();
  std::vector<std::string> args = {"--socket", socket, "--l1-size-gb", std::to_string(gb), "--log-level", "info"};
  if (disk) args.insert(args.end(), {"--l2-backend", backend});
  examples::child_process proc(server, args, dir, "server-" + std::to_string(gb));
  std::unique_ptr<bench::protocol_client> c;
  while (!c) {
    try {
      c = std::make_unique<bench::protocol_client>(socket);
    } catch (const std::exception&) {
      if (!proc.running()) throw std::runtime_error("kvtier-server exited: " + proc.stderr_text());
      if (clock_type::now() - t0 > deadline_after) throw std::runtime_error("kvtier-server never listened");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  f.connected_ms = ms_between(t0, clock_type::now());
  p::register_kv_request reg;
  reg.instance_id = static_cast<std::uint64_t>(::getpid());
  reg.model_name = "bench/server-start";
  reg.model = model_shape{.num_layers = 24, .num_kv_heads = 2, .head_dim = 64, .dtype = dtype_kind::bf16};
  reg.chunk_tokens = 256;
  reg.region = p::region_kind::none;
  const auto r = c->call(reg);
  f.registered_ms = ms_between(t0, clock_type::now());
  std::vector<hash128> hashes;
  for (std::uint64_t i = 0; i < 39; ++i) hashes.push_back(hash128{i + 1, ~i});
  p::lookup_request lookup{"first", r.model_id, 1, hashes};
  lookup.answer_when_decided = true;
  const auto answer = c->call(lookup);
  f.first_lookup_ms = ms_between(t0, clock_type::now());
  if (answer.state != p::prefetch_state::done) throw std::runtime_error("the first lookup was not decided");

  // The old start-up's figure: the prefault's log line (its time read as soon as it shows).
  static const std::regex prefaulted(R"(L1 prefaulted: \d+ MiB in (\d+) ms)");
  static const std::regex registered(R"(L1 registered with L2 backend\(s\) .* in (\d+) ms)");
  static const std::regex not_prefaulted(R"((L1 not prefaulted.*))");
  for (;;) {
    const std::string err = proc.stderr_text();
    if (find_in(err, prefaulted)) {
      f.prefaulted_ms = ms_between(t0, clock_type::now());
      break;
    }
    if (auto why = find_in(err, not_prefaulted)) throw std::runtime_error(*why);
    if (!proc.running()) throw std::runtime_error("kvtier-server exited: " + err);
    if (clock_type::now() - t0 > deadline_after) throw std::runtime_error("no \"L1 prefaulted\" line: " + err);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The registration's line follows the prefault's on the I/O thread.
  for (int i = 0; disk && i < 5000 && !f.register_ms; ++i) {
    if (auto v = find_in(proc.stderr_text(), registered)) f.register_ms = std::stod(*v);
    else std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  c.reset();
  const auto st = proc.stop(SIGTERM, std::chrono::seconds(60));
  if (!st) throw std::runtime_error("kvtier-server did not stop on SIGTERM");
  return f;
}

std::vector<int> parse_sizes(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string server;
  int repeats = 5;
  std::vector<int> sizes = {1, 8};
  bool disk = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--server")
      server = value();
    else if (a == "--repeats")
      repeats = std::stoi(value());
    else if (a == "--sizes-gb")
      sizes = parse_sizes(value());
    else if (a == "--quick")
      sizes = {1, 4};
    else if (a == "--no-l2")
      disk = false;
    else {
      std::fprintf(stderr,
                   "usage: kvtier_bench_server_start [--server PATH] [--repeats N] [--sizes-gb 1,8] [--quick] [--no-l2]\n");
      return 2;
    }
  }
  if (repeats < 1) throw std::invalid_argument("--repeats must be at least 1");
  if (server.empty()) server = examples::find_program("kvtier-server", argv[0]);
  if (server.empty()) {
    std::fprintf(stderr, "kvtier_bench_server_start: kvtier-server not found: pass --server PATH\n");
    return 2;
  }
  std::vector<int> run_sizes;
  for (int gb : sizes) {
    const std::uint64_t avail = memory_available();
    if (avail != 0 && (std::uint64_t(gb) << 30) + (std::uint64_t{2} << 30) > avail)
      std::printf("L1 of %d GiB skipped: %llu MiB of memory available now\n", gb,
                  static_cast<unsigned long long>(avail >> 20));
    else
      run_sizes.push_back(gb);
  }
  if (run_sizes.empty()) throw std::runtime_error("no L1 size fits in the memory available");

  const fs::path dir = fs::temp_directory_path() / ("kvtier-bench-start-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::map<int, std::vector<double>> lookup, prefaulted, registered;
  for (int r = 0; r < repeats; ++r)
    for (int gb : run_sizes) {
      const run_figures f = run_once(server, dir, gb, disk);
      std::printf(
          "repeat %d, L1 %d GiB: connected after %.1f ms, registered after %.1f ms, first lookup answered after %.1f "
          "ms; L1 prefaulted after %.0f ms%s\n",
          r + 1, gb, f.connected_ms, f.registered_ms, f.first_lookup_ms, f.prefaulted_ms,
                  f.register_ms ? (", registered in " + std::to_string(static_cast<int>(*f.register_ms)) + " ms").c_str()
                                : "");
      std::fflush(stdout);
      lookup[gb].push_back(f.first_lookup_ms);
      prefaulted[gb].push_back(f.prefaulted_ms);
      if (f.register_ms) registered[gb].push_back(*f.register_ms);
    }
  fs::remove_all(dir);

  double worst = 0;
  for (int gb : run_sizes) {
    const std::string s = std::to_string(gb) + "gib";
    const double m = bench::median(lookup[gb]);
    worst = std::max(worst, m);
    bench::print_result("server_start_to_first_lookup_" + s + "_ms", m);
    bench::print_result("server_start_to_l1_prefaulted_" + s + "_ms", bench::median(prefaulted[gb]));
    if (!registered[gb].empty()) bench::print_result("l1_register_" + s + "_ms", bench::median(registered[gb]));
  }
  bench::print_result("server_start_to_first_lookup_ms", worst);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvtier_bench_server_start: %s\n", e.what());
  return 1;
}
