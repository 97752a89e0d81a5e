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
// Through the engine's connector (engine::connector, its own thread, one call per lookup since
// protocol 3):
//   l1 hit     a scheduler's connector on the same server looks the same prompt up (all in
//              L1), in the unpinned repeats, interleaved with the calls above: the time from
//              lookup() to its answer (connector.lookup.completed's duration);
//   l2 hit     a second server with a disk L2 backend (--l2-store-policy skip_l1, eviction
//              noop: L1 stays empty) holds the prompt on disk only; per repeat a worker's
//              connector looks it up and retrieves it into its region (lookup() to its
//              answer plus retrieve() to its completion: the KV is in the engine's blocks).
//              Each hit is one pair: its object files are read with O_DIRECT, 1 MiB reads, 16
//              in flight (the disk backend's depth), into memory in huge pages spread like the
//              server's L1 (kvtier_program/disk_probe.hpp), right before and right after it,
//              in opposite orders that alternate between repeats. The disk time of a pair is
//              the mean of its two reads; a pair whose reads differ by more than 1.5x is left
//              out of the disk figures (the disk changed speed around the hit) and counted.
//              The added latency is the hit's latency less its pair's disk time.
//
//   kvtier_bench_rpc [--server PATH] [--repeats N] [--calls N] [--quick]
//
// Ends with RESULT lookup_rtt_us, raw_rtt_us, query_rtt_us (query_prefetch) and
// lookup_rtt_vs_raw = median over repeats of (median lookup RTT / median raw RTT), unpinned;
// the same with the suffix _same_cpu and _cross_cpu (lookup_rtt_same_cpu_us,
// lookup_rtt_vs_raw_same_cpu, ...). Targets: at most 2 unpinned, at most 1.5 pinned. Then
// lookup_rtt_l1_hit_us (the connector's L1-hit lookup, median over repeats of the median over
// calls), l2_hit_lookup_us, l2_hit_latency_us (lookup + retrieve), l2_hit_split_pairs, and over
// the agreeing pairs l2_hit_disk_time_us and l2_hit_added_latency_us = median of (L2-hit
// latency - the pair's disk time).
#include <kvtier_program/disk_probe.hpp>
#include <kvtier_program/process.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/engine/connector.hpp>
#include <kvtier/protocol/codec.hpp>

#include <common/protocol_client.hpp>
#include <common/results.hpp>

#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace kvtier;
namespace p = protocol;
namespace disk_probe = examples::disk_probe;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t chunk_tokens = 256;
constexpr std::uint32_t block_size = 16;
constexpr std::size_t chunks = 39;  // 9984 of 10k tokens
constexpr std::uint32_t bpc = chunk_tokens / block_size;
/// The 0.5B shape (Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, bf16): 3 MiB per chunk.
constexpr model_shape shape{.num_layers = 24, .num_kv_heads = 2, .head_dim = 64, .dtype = dtype_kind::bf16};

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

/// Hands the connector's lookup and retrieve completions (duration, chunks) to the bench's
/// thread. Copies share one state (the bus takes its subscribers by value).
class completions {
 public:
  using done = std::pair<std::uint64_t, std::uint32_t>;  ///< (duration_ns, hit or retrieved chunks)

  void on(const bus::connector_lookup_completed& e) { push(s_->lookups, {e.duration_ns, e.hit_chunks}); }
  void on(const bus::connector_retrieve_completed& e) { push(s_->retrieves, {e.duration_ns, e.retrieved_chunks}); }

  /// The next lookup (retrieve) completion; throws after a minute without one.
  done next_lookup() { return pop(s_->lookups); }
  done next_retrieve() { return pop(s_->retrieves); }

 private:
  struct state {
    std::mutex m;
    std::condition_variable cv;
    std::deque<done> lookups, retrieves;
  };
  void push(std::deque<done>& q, done d) {
    std::lock_guard g(s_->m);
    q.push_back(d);
    s_->cv.notify_all();
  }
  done pop(std::deque<done>& q) {
    std::unique_lock l(s_->m);
    if (!s_->cv.wait_for(l, std::chrono::minutes(1), [&] { return !q.empty(); }))
      throw std::runtime_error("the connector did not complete a call within a minute");
    const done d = q.front();
    q.pop_front();
    return d;
  }
  std::shared_ptr<state> s_ = std::make_shared<state>();
};
using completions_bus = bus::basic_event_bus<completions>;

engine::connector_options connector_options_for(const std::string& socket) {
  engine::connector_options o;
  o.socket_path = socket;
  o.model_name = "bench/rpc";
  o.chunk_tokens = chunk_tokens;
  return o;
}

/// Polls the server's status until `done(status)`; throws after `what` took a minute.
template <class Pred>
void wait_status(const std::string& socket, const char* what, Pred done) {
  const auto deadline = clock_type::now() + std::chrono::minutes(1);
  for (;;) {
    const auto st = examples::server_status(socket);
    if (st && !st->is_discarded() && done(*st)) return;
    if (clock_type::now() >= deadline) throw std::runtime_error(std::string("timed out waiting for ") + what);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

/// Whether the server has faulted its L1 in and registered it (status l1.residency): no
/// repeat is timed while it does that behind the first requests, on the same two cores.
bool l1_settled(const nlohmann::json& s) {
  const std::string r = s["l1"].value("residency", "");
  return r != "faulting" && r != "registering";
}

struct l2_hit_figures {
  std::vector<double> lookup_us, latency_us;  ///< per repeat
  /// Per repeat whose two probes agree: the disk time (the mean of the probe before and the
  /// probe after the hit) and the hit's latency less it.
  std::vector<double> disk_us, added_us;
  std::size_t split = 0;           ///< repeats whose probes differ by more than max_probe_disagreement
  std::size_t disk_bytes = 0;      ///< read by each disk probe
  double huge_fraction = 0;        ///< of the probes' memory, in huge pages
};

/// Two probes of one hit that differ by more than this factor: the disk changed around the
/// hit, so which of its speeds the hit saw is unknown (long_doc_qa's io_bound.hpp, the same).
constexpr double max_probe_disagreement = 1.5;

/// The L2-hit repeats against a server with a disk L2 backend (see the header comment).
l2_hit_figures measure_l2_hit(const std::string& server_path, const std::filesystem::path& dir,
                              const std::vector<token_id>& tokens, int repeats) {
  const std::string socket = (dir / "kvtier-l2.sock").string();
  const std::filesystem::path l2_dir = dir / "l2";
  const std::string backend = R"({"type":"disk","path":")" + l2_dir.string() + R"(","capacity_gb":2})";
  examples::child_process server(server_path,
                                 {"--socket", socket, "--l1-size-mb", "512", "--log-level", "warn", "--l2-backend",
                                  backend, "--l2-store-policy", "skip_l1", "--eviction-policy", "noop"},
                                 dir, "server-l2");
  if (!examples::wait_listening(server, socket, std::chrono::seconds(30)))
    throw std::runtime_error("the L2 server did not start: " + server.stderr_text());
  wait_status(socket, "the L2 server's L1 prefault to end", l1_settled);
  const std::uint32_t num_blocks = chunks * bpc + 16;
  auto region = kv_region::create(paged_kv_layout{shape, block_size, num_blocks}).value();
  completions done;
  completions_bus b{done};
  engine::connector<completions_bus> worker(connector_options_for(socket), region, b);
  if (!worker.wait_ready(std::chrono::milliseconds(30000))) throw std::runtime_error(worker.last_error());
  std::vector<std::uint32_t> blocks(chunks * bpc);
  std::iota(blocks.begin(), blocks.end(), 0u);
  worker.store("l2-fill", tokens, 0, chunks, blocks);
  const auto no_l1 = [](const nlohmann::json& s) {
    return s["store"]["inflight_tasks"] == 0 && s["store"]["pending_keys"] == 0 && s["prefetch"]["active"] == 0 &&
           s["l1"]["objects"] == 0;
  };
  wait_status(socket, "the store to reach the disk",
              [&](const nlohmann::json& s) { return no_l1(s) && s["backends"][0]["objects"] == chunks; });
  l2_hit_figures f;
  // The probes: the object files' O_DIRECT reads at the backend's depth (16), into memory in
  // huge pages spread like the server's L1 slots (its L1 is in huge pages too), right before
  // and right after each hit, in opposite orders, alternating from repeat to repeat.
  const disk_probe::probe_files files(l2_dir, std::numeric_limits<std::size_t>::max());
  const disk_probe::probe_memory spread(files.bytes);
  f.disk_bytes = files.bytes;
  f.huge_fraction = spread.huge_fraction();
  const auto probe_us = [&](bool backward) {
    const double bps = disk_probe::disk_read_bandwidth(files, backward, 16, spread.region());
    if (bps <= 0) throw std::runtime_error("an O_DIRECT read of the disk backend's files failed");
    return static_cast<double>(files.bytes) / bps * 1e6;
  };
  for (int r = -1; r < repeats; ++r) {  // r = -1: warm-up, not counted
    wait_status(socket, "L1 to be empty", no_l1);
    const bool backward = r % 2 != 0;
    const double before = probe_us(backward);
    const std::string key = "l2-hit-" + std::to_string(r);
    worker.lookup(key, tokens);
    const auto [lookup_ns, hit] = done.next_lookup();
    if (hit != chunks) throw std::runtime_error("the L2 lookup hit " + std::to_string(hit) + " chunks, not all");
    worker.retrieve(key, tokens, 0, blocks);
    const auto [retrieve_ns, landed] = done.next_retrieve();
    if (landed != chunks) throw std::runtime_error("the L2 retrieve landed " + std::to_string(landed) + " chunks");
    worker.end_request(key);
    (void)worker.get_finished(std::vector<std::string>{key});
    const double after = probe_us(!backward);
    if (r < 0) continue;
    const double latency = static_cast<double>(lookup_ns + retrieve_ns) / 1e3;
    f.lookup_us.push_back(static_cast<double>(lookup_ns) / 1e3);
    f.latency_us.push_back(latency);
    if (std::max(before, after) > max_probe_disagreement * std::min(before, after)) {
      ++f.split;
      continue;
    }
    const double disk = (before + after) / 2;
    f.disk_us.push_back(disk);
    f.added_us.push_back(latency - disk);
  }
  return f;
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
    wait_status(socket, "the server's L1 prefault to end", l1_settled);
    // Register a region (0.5B shape) and store the prompt's chunks, so every lookup hits L1.
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
    // The scheduler's connector of the L1-hit figure (unpinned repeats only): its lookups
    // (connector.lookup.completed's duration) join each call's interleaving.
    std::optional<completions> l1_done;
    std::optional<completions_bus> l1_bus;
    std::optional<engine::connector<completions_bus>> sched;
    std::vector<double> connector_l1;  ///< per repeat: median of the connector's lookups (us)
    auto connector_lookup = [&]() -> double {
      sched->lookup_hashes("rpc-connector", hashes);
      const auto [ns, hit] = l1_done->next_lookup();
      if (hit != chunks) throw std::runtime_error("the connector's lookup did not hit every chunk");
      sched->end_request("rpc-connector");
      return static_cast<double>(ns) / 1e3;
    };
    auto one_round = [&](int n, std::vector<double>& l, std::vector<double>& w, std::vector<double>& qq,
                         std::vector<double>* cl = nullptr) {
      for (int i = 0; i < n; ++i) {
        if (cl != nullptr) cl->push_back(connector_lookup());
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
    l1_done.emplace();
    l1_bus.emplace(*l1_done);
    auto so = connector_options_for(socket);
    so.model = shape;  // a scheduler: one rank's shape, what the region registered
    sched.emplace(so, *l1_bus);
    if (!sched->wait_ready(std::chrono::milliseconds(30000))) throw std::runtime_error(sched->last_error());
    for (int r = -1; r < repeats; ++r) {  // r = -1: warm-up, not counted
      std::vector<double> l, w, qq, cl;
      one_round(calls, l, w, qq, &cl);
      if (r < 0) continue;
      places[0].lookup.push_back(bench::median(l));
      places[0].raw.push_back(bench::median(w));
      places[0].query.push_back(bench::median(qq));
      connector_l1.push_back(bench::median(cl));
    }
    sched.reset();                        // its thread and pings stay out of the pinned placements
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
    bench::print_result("lookup_rtt_l1_hit_us", bench::median(connector_l1));
    if (!server.stop(SIGTERM, std::chrono::seconds(10))) rc = 1;
  }
  {
    const l2_hit_figures f = measure_l2_hit(server_path, dir, tokens, repeats);
    std::printf(
        "L2 hit: %zu chunks (%.1f MiB of object files) from disk, %d repeats, each between two O_DIRECT reads of "
        "its object files (into memory %.0f%% in huge pages); %zu repeats whose reads differ by more than %.1fx "
        "left out of the disk figures\n",
        chunks, static_cast<double>(f.disk_bytes) / (1 << 20), repeats, f.huge_fraction * 100, f.split,
        max_probe_disagreement);
    bench::print_result("l2_hit_lookup_us", bench::median(f.lookup_us));
    bench::print_result("l2_hit_latency_us", bench::median(f.latency_us));
    bench::print_result("l2_hit_split_pairs", static_cast<double>(f.split));
    if (!f.disk_us.empty()) {
      bench::print_result("l2_hit_disk_time_us", bench::median(f.disk_us));
      bench::print_result("l2_hit_added_latency_us", bench::median(f.added_us));
    }
  }
  ::close(sv[0]);
  ::waitpid(echo, nullptr, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
