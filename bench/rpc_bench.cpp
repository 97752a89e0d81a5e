// kvtier_bench_rpc: the round trip of a lookup over the server's Unix socket, next to a raw
// Unix-socket ping-pong between two processes moving the same bytes, measured in the same
// run, interleaved.
//
//   lookup  a protocol client (the blocking client of bench/common/protocol_client.hpp)
//           sends lookup_request for a 10k-token prompt (39 chunk hashes, all in L1, so the
//           server also read-locks them and releases the previous lookup of the same request
//           key) to a kvtier-server process and waits for the reply;
//   raw     a forked child echoes over a socketpair: the parent writes as many bytes as the
//           encoded lookup frame and reads as many as the encoded reply, with blocking
//           send/read, the client's own calls (the floor: two context switches and two
//           copies per direction).
//
// Three placements: the unpinned repeats first (before anything is pinned: a process keeps
// the CPU it was last pinned to until the scheduler moves it), then the two pinned ones
// interleaved in each repeat:
//   unpinned   client, server and echo process may run on any CPU (the scheduler decides;
//              on a 2-CPU VM the server tends to land on the other CPU while the echo child
//              stays with the client, so this ratio compares a cross-CPU lookup with a
//              same-CPU ping-pong);
//   same_cpu   client, every server thread and the echo process pinned to one CPU;
//   cross_cpu  the client on one CPU, every server thread and the echo process on another
//              (skipped when the process may run on one CPU only).
// Pinning is sched_setaffinity of this thread and of every thread of the other processes
// (/proc/<pid>/task); 20 calls of each kind after each re-pinning are not counted. Within a
// placement, each repeat interleaves lookup, raw and query calls.
//
//   kvtier_bench_rpc [--server PATH] [--repeats N] [--calls N] [--quick]
//
// Ends with RESULT lookup_rtt_us, raw_rtt_us, query_rtt_us (query_prefetch, the engine's
// poll) and lookup_rtt_vs_raw = median over repeats of (median lookup RTT / median raw
// RTT), unpinned; the same with the suffix _same_cpu and _cross_cpu (lookup_rtt_same_cpu_us,
// lookup_rtt_vs_raw_same_cpu, ...). Targets: at most 2 unpinned, at most 1.5 pinned.
#include <kvtier_program/process.hpp>

#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/protocol/codec.hpp>

#include <common/protocol_client.hpp>
#include <common/results.hpp>

#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace kvtier;
namespace p = protocol;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t chunk_tokens = 256;
constexpr std::uint32_t block_size = 16;
constexpr std::size_t chunks = 39;  // 9984 of 10k tokens
constexpr std::uint32_t bpc = chunk_tokens / block_size;

// The echo process: reads `in` bytes, answers `out` bytes, until EOF.
[[noreturn]] void echo_child(int fd, std::size_t in, std::size_t out) {
  std::vector<std::byte> buf(std::max(in, out));
  while (bench::read_all(fd, std::span(buf).first(in)))
    if (!bench::send_all(fd, std::span(buf).first(out))) break;
  ::_exit(0);
}

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

/// The CPUs this process may run on.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

cpu_set_t cpu_set_of(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return set;
}

/// Pins thread `tid` (0: the calling thread) to `cpus`.
void pin_thread(pid_t tid, const std::vector<int>& cpus) {
  const cpu_set_t set = cpu_set_of(cpus);
  if (::sched_setaffinity(tid, sizeof set, &set) != 0 && !(tid != 0 && errno == ESRCH))  // ESRCH: it just ended
    throw std::runtime_error("sched_setaffinity(" + std::to_string(tid) + "): " + std::strerror(errno));
}

/// Pins every thread of process `pid` to `cpus`.
void pin_process(pid_t pid, const std::vector<int>& cpus) {
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec))
    pin_thread(static_cast<pid_t>(std::stol(t.path().filename().string())), cpus);
  if (ec) throw std::runtime_error("cannot list the threads of process " + std::to_string(pid) + ": " + ec.message());
}

struct placement {
  std::string suffix;                      ///< of the RESULT names
  std::vector<int> client;                 ///< CPUs of this thread
  std::vector<int> peer;                   ///< CPUs of the server's threads and of the echo process
  std::vector<double> lookup, raw, query;  ///< per repeat: median RTT (us)
};

}  // namespace

int main(int argc, char** argv) {
  std::string server_path;
  int repeats = 15;
  int calls = 400;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--server")
      server_path = value();
    else if (a == "--repeats")
      repeats = std::stoi(value());
    else if (a == "--calls")
      calls = std::stoi(value());
    else if (a == "--quick")
      repeats = 5, calls = 200;
    else {
      std::fprintf(stderr, "usage: kvtier_bench_rpc [--server PATH] [--repeats N] [--calls N] [--quick]\n");
      return 2;
    }
  }
  if (server_path.empty()) server_path = examples::find_program("kvtier-server", argv[0]);
  if (server_path.empty()) {
    std::fprintf(stderr, "kvtier_bench_rpc: kvtier-server not found: pass --server PATH\n");
    return 2;
  }

  // The frames the lookup exchanges, to give the raw ping-pong the same sizes.
  std::mt19937_64 rng(7);
  std::vector<token_id> tokens(chunks * chunk_tokens);
  for (auto& t : tokens) t = static_cast<token_id>(rng());
  const auto hashes = token_hasher(chunk_tokens).chunk_hashes(tokens);
  const std::string key = "rpc-bench";
  const std::size_t request_bytes = p::encode_frame(1, p::lookup_request{key, 1, 1, hashes}).value().size();
  const std::size_t reply_bytes = p::encode_frame(1, p::lookup_response{}).value().size();

  // Fork the echo child first, before any thread exists.
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("socketpair");
    return 1;
  }
  const pid_t echo = ::fork();
  if (echo == 0) {
    ::close(sv[0]);
    echo_child(sv[1], request_bytes, reply_bytes);
  }
  ::close(sv[1]);

  const auto dir = std::filesystem::temp_directory_path() / ("kvtier-bench-rpc-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string socket = (dir / "kvtier.sock").string();
  int rc = 0;
  {
    examples::child_process server(server_path, {"--socket", socket, "--l1-size-mb", "512", "--log-level", "warn"}, dir,
                                   "server");
    if (!examples::wait_listening(server, socket, std::chrono::seconds(30))) {
      std::fprintf(stderr, "kvtier_bench_rpc: kvtier-server did not start:\n%s\n", server.stderr_text().c_str());
      return 1;
    }
    // Register a region (0.5B shape) and store the prompt's chunks, so every lookup hits L1.
    const model_shape shape{.num_layers = 24, .num_kv_heads = 2, .head_dim = 64, .dtype = dtype_kind::bf16};
    const std::uint32_t num_blocks = chunks * bpc + 16;
    auto region = kv_region::create(paged_kv_layout{shape, block_size, num_blocks}).value();
    bench::protocol_client c(socket);
    const auto reg = c.call(p::register_kv_request{static_cast<std::uint64_t>(::getpid()), 0, 1, "bench/rpc", shape,
                                                   block_size, num_blocks, chunk_tokens, region.bytes()},
                            region.fd());
    std::vector<std::uint32_t> blocks(chunks * bpc);
    std::iota(blocks.begin(), blocks.end(), 0u);
    p::store_request st{"rpc-fill", 0, 0, hashes, blocks, {}};
    for (auto b : blocks) st.block_generations.push_back(region.generation(b));
    if (c.call(st).stored != chunks) throw std::runtime_error("the store did not take every chunk");
    const p::lookup_request lookup{key, reg.model_id, 1, hashes};
    c.call(lookup);
    const auto q = c.call(p::query_prefetch_request{key});
    if (q.state != p::prefetch_state::done || q.hit_chunks != chunks)
      throw std::runtime_error("the warm-up lookup did not hit every chunk");

    std::vector<std::byte> req(request_bytes, std::byte{1}), rep(reply_bytes);
    const std::vector<int> cpus = allowed_cpus();
    std::vector<placement> places{{"", cpus, cpus, {}, {}, {}}};
    if (!cpus.empty()) places.push_back({"_same_cpu", {cpus[0]}, {cpus[0]}, {}, {}, {}});
    if (cpus.size() >= 2)
      places.push_back({"_cross_cpu", {cpus[0]}, {cpus[1]}, {}, {}, {}});
    else
      std::printf("one CPU allowed: no cross_cpu placement\n");
    auto one_round = [&](int n, std::vector<double>& l, std::vector<double>& w, std::vector<double>& qq) {
      for (int i = 0; i < n; ++i) {
        auto t0 = clock_type::now();
        c.call(lookup);
        l.push_back(us_since(t0));
        t0 = clock_type::now();
        if (!bench::send_all(sv[0], req) || !bench::read_all(sv[0], rep))
          throw std::runtime_error("the echo process went away");
        w.push_back(us_since(t0));
        t0 = clock_type::now();
        c.call(p::query_prefetch_request{key});
        qq.push_back(us_since(t0));
      }
    };
    // The unpinned repeats first, before anything was pinned (a process keeps the CPU it was
    // last pinned to until the scheduler moves it: after a pinned round, "unpinned" would
    // inherit that placement); then the pinned placements, interleaved.
    for (int r = -1; r < repeats; ++r) {  // r = -1: warm-up, not counted
      std::vector<double> l, w, qq;
      one_round(calls, l, w, qq);
      if (r < 0) continue;
      places[0].lookup.push_back(bench::median(l));
      places[0].raw.push_back(bench::median(w));
      places[0].query.push_back(bench::median(qq));
    }
    for (int r = -1; r < repeats; ++r) {  // r = -1: warm-up, not counted
      for (std::size_t k = 1; k < places.size(); ++k) {
        auto& pl = places[k];
        pin_thread(0, pl.client);
        pin_process(server.pid(), pl.peer);
        pin_process(echo, pl.peer);
        std::vector<double> l, w, qq;
        one_round(20, l, w, qq);  // after the migration: not counted
        l.clear(), w.clear(), qq.clear();
        one_round(calls, l, w, qq);
        if (r < 0) continue;
        pl.lookup.push_back(bench::median(l));
        pl.raw.push_back(bench::median(w));
        pl.query.push_back(bench::median(qq));
      }
    }
    pin_thread(0, cpus);
    c.call(p::end_request_request{key});
    std::printf("frames: lookup %zu bytes, reply %zu bytes; %d repeats of %d calls each, interleaved; CPUs",
                request_bytes, reply_bytes, repeats, calls);
    for (int cpu : cpus) std::printf(" %d", cpu);
    std::printf("\n");
    for (const auto& pl : places) {
      bench::print_result("lookup_rtt" + pl.suffix + "_us", bench::median(pl.lookup));
      bench::print_result("query_rtt" + pl.suffix + "_us", bench::median(pl.query));
      bench::print_result("raw_rtt" + pl.suffix + "_us", bench::median(pl.raw));
      bench::print_result("lookup_rtt_vs_raw" + pl.suffix, bench::median_ratio(pl.lookup, pl.raw));
    }
    if (!server.stop(SIGTERM, std::chrono::seconds(10))) rc = 1;
  }
  ::close(sv[0]);
  ::waitpid(echo, nullptr, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
