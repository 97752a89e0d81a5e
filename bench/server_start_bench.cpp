// kvtier_bench_server_start: how soon a (re)started kvtier-server answers an engine. The time
// from spawning the program to its first answered lookup, with a small L1 and a large one: the
// server listens first and faults L1 in behind the first requests (docs/server.md,
// "Start-up"), so the figure must not grow with L1 (target: at most 100 ms with any size).
//
// Each run: posix_spawn kvtier-server (--l1-size-gb N, --log-level info); connect every
// millisecond until the socket accepts; register as a scheduler (no region); one lookup of
// 39 chunk hashes with answer_when_decided (a miss: decided at once); the time is taken when
// its answer arrives. Two kinds of run, interleaved with the sizes in each repeat:
//   plain  no L2 backend: the server's own start; SIGTERM right after the lookup;
//   disk   a disk L2 backend (its directory made by the first run, found by the next ones,
//          as after a restart), so that L1 gets registered as io_uring fixed buffers. The
//          run then waits for the server's "L1 prefaulted" log line: the time from the spawn
//          to it is when a server that faulted L1 in before listening (kvtier before issue
//          25) answered first. The "L1 registered ... in N ms (S steps, the longest M ms)"
//          line gives the registration's time (~50 ms per GiB here), spread over turns of the
//          I/O thread in pieces of 256 MiB: M is the longest the I/O thread was held.
// Before each run the bench waits (up to 60 s) until the memory the previous server had is
// available again: a killed server's io_uring ring, its pinned L1 with it, is torn down by
// the kernel after the process has gone, and that work slowed the next start by 100+ ms.
//
//   kvtier_bench_server_start [--server PATH] [--repeats N] [--sizes-gb 1,8] [--quick]
//
// A size larger than the memory available at start (less 2 GiB) is skipped, with a line
// saying so. --quick: sizes 1 and 4. Ends with, per size S (1gib, 8gib, ...), medians over
// the repeats:
//   RESULT server_start_to_first_lookup_<S>_ms        plain: spawn -> first lookup answered
//   RESULT server_start_to_first_lookup_disk_<S>_ms   the same with the disk backend
//   RESULT server_start_to_l1_prefaulted_<S>_ms       disk: spawn -> the prefault's log line
//   RESULT l1_register_<S>_ms                         disk: the registration's time
//   RESULT l1_register_longest_step_<S>_ms            disk: its longest step (an I/O-thread stall)
// and RESULT server_start_to_first_lookup_ms: the largest of the first-lookup medians (every
// size, both kinds).
#include <kvtier_program/process.hpp>

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/messages.hpp>

#include <common/meminfo.hpp>
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
std::uint64_t memory_available() { return kvtier::bench::meminfo_field("MemAvailable:").value_or(0) << 10; }

/// Waits (up to 60 s) until MemAvailable is back within 512 MiB of `baseline`.
void wait_memory_back(std::uint64_t baseline) {
  const auto until = clock_type::now() + std::chrono::seconds(60);
  while (baseline != 0 && memory_available() + (std::uint64_t{512} << 20) < baseline && clock_type::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

struct run_figures {
  double connected_ms = 0;   ///< the socket accepted a connection (the backlog: maybe before serving)
  double registered_ms = 0;  ///< the registration was answered (the server serves)
  double first_lookup_ms = 0;
  std::optional<double> prefaulted_ms;  ///< disk runs
  std::optional<double> register_ms;    ///< disk runs, where a backend took the registration
  std::optional<double> longest_step_ms;
};

/// The first match of `re` in `text`, group 1, or nullopt.
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
  std::vector<std::string> args = {"--socket", socket, "--l1-size-gb", std::to_string(gb), "--log-level", "info"};
  if (disk) args.insert(args.end(), {"--l2-backend", backend});
  const auto t0 = clock_type::now();
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

  if (disk) {
    // The old start-up's figure: the prefault's log line (its time read as soon as it shows).
    static const std::regex prefaulted(R"(L1 prefaulted: \d+ MiB in (\d+) ms)");
    static const std::regex registered(R"(L1 registered with L2 backend\(s\) .* in (\d+) ms)");
    static const std::regex longest(R"(L1 registered with L2 backend\(s\) .*the longest (\d+) ms)");
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
    // The registration's line follows the prefault's, on the I/O thread.
    for (int i = 0; i < 5000 && !f.register_ms; ++i) {
      const std::string err = proc.stderr_text();
      if (auto v = find_in(err, registered)) {
        f.register_ms = std::stod(*v);
        if (auto l = find_in(err, longest)) f.longest_step_ms = std::stod(*l);
      } else
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  c.reset();
  if (!proc.stop(SIGTERM, std::chrono::seconds(60))) throw std::runtime_error("kvtier-server did not stop on SIGTERM");
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
    else {
      std::fprintf(stderr,
                   "usage: kvtier_bench_server_start [--server PATH] [--repeats N] [--sizes-gb 1,8] [--quick]\n");
      return 2;
    }
  }
  if (repeats < 1) throw std::invalid_argument("--repeats must be at least 1");
  if (server.empty()) server = examples::find_program("kvtier-server", argv[0]);
  if (server.empty()) {
    std::fprintf(stderr, "kvtier_bench_server_start: kvtier-server not found: pass --server PATH\n");
    return 2;
  }
  const std::uint64_t baseline = memory_available();
  std::vector<int> run_sizes;
  for (int gb : sizes) {
    if (baseline != 0 && (std::uint64_t(gb) << 30) + (std::uint64_t{2} << 30) > baseline)
      std::printf("L1 of %d GiB skipped: %llu MiB of memory available\n", gb,
                  static_cast<unsigned long long>(baseline >> 20));
    else
      run_sizes.push_back(gb);
  }
  if (run_sizes.empty()) throw std::runtime_error("no L1 size fits in the memory available");

  const fs::path dir = fs::temp_directory_path() / ("kvtier-bench-start-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  struct figures {
    std::vector<double> plain, disk, prefaulted, registered, longest;
  };
  std::map<int, figures> by_size;
  for (int r = 0; r < repeats; ++r)
    for (int gb : run_sizes)
      for (const bool disk : {false, true}) {
        wait_memory_back(baseline);
        const run_figures f = run_once(server, dir, gb, disk);
        std::printf(
            "repeat %d, L1 %d GiB, %s: connected after %.1f ms, registered after %.1f ms, first lookup "
            "answered after %.1f ms",
            r + 1, gb, disk ? "disk" : "plain", f.connected_ms, f.registered_ms, f.first_lookup_ms);
        if (f.prefaulted_ms) std::printf("; L1 prefaulted after %.0f ms", *f.prefaulted_ms);
        if (f.register_ms) std::printf(", registered in %.0f ms", *f.register_ms);
        if (f.longest_step_ms) std::printf(" (longest step %.0f ms)", *f.longest_step_ms);
        std::printf("\n");
        std::fflush(stdout);
        figures& s = by_size[gb];
        (disk ? s.disk : s.plain).push_back(f.first_lookup_ms);
        if (f.prefaulted_ms) s.prefaulted.push_back(*f.prefaulted_ms);
        if (f.register_ms) s.registered.push_back(*f.register_ms);
        if (f.longest_step_ms) s.longest.push_back(*f.longest_step_ms);
      }
  fs::remove_all(dir);

  double worst = 0;
  for (int gb : run_sizes) {
    const std::string s = std::to_string(gb) + "gib";
    const figures& f = by_size[gb];
    const double plain = bench::median(f.plain), disk = bench::median(f.disk);
    worst = std::max({worst, plain, disk});
    bench::print_result("server_start_to_first_lookup_" + s + "_ms", plain);
    bench::print_result("server_start_to_first_lookup_disk_" + s + "_ms", disk);
    bench::print_result("server_start_to_l1_prefaulted_" + s + "_ms", bench::median(f.prefaulted));
    if (!f.registered.empty()) bench::print_result("l1_register_" + s + "_ms", bench::median(f.registered));
    if (!f.longest.empty()) bench::print_result("l1_register_longest_step_" + s + "_ms", bench::median(f.longest));
  }
  bench::print_result("server_start_to_first_lookup_ms", worst);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvtier_bench_server_start: %s\n", e.what());
  return 1;
}
