// kvtier_bench_copy_pool: what the server's worker pool buys, and what the I/O thread still
// answers while it is saturated (issue 17, "copies off the I/O thread").
//
// An in-process server::server with worker_threads = W (1, then 2, interleaved repeats) and
// one stored 10k-token request (39 chunks of 256 tokens, 0.5B shape: 3 MiB chunks, 117 MiB)
// in L1. C engine clients (threads, each its own connection and its own sealed memfd region
// of the same model) retrieve it over and over for S seconds: lookup, query_prefetch,
// retrieve into their own blocks (a random permutation: a long-running engine's free list),
// end_request. Throughput is the bytes retrieved by all clients over the S seconds. Beside
// them, a ping client on its own connection sends a ping, waits for the answer, sleeps
// 1 ms, and so on: the ping round trips measured under that load say how late the I/O
// thread answers the control path while every copy worker is busy.
//
//   kvtier_bench_copy_pool [--quick] [--repeats=N] [--seconds=S] [--clients=C]
//
// Defaults: 5 repeats, 2 s, 4 clients (--quick: 3 repeats of 1 s). Ends with RESULT lines:
//   copy_pool_gbps_1, copy_pool_gbps_2       medians (GB/s = 1e9 bytes/s, all clients)
//   copy_pool_2_vs_1                         median of the per-repeat ratios (interleaved pairs)
//   stream_copy_2_vs_1                       the machine's ceiling for that ratio: a plain
//                                            streaming copy on 2 threads over 1 (each repeat,
//                                            after its pair; memory bandwidth, not cores, may
//                                            cap it: 1.45-1.8 on the dev VM)
//   copy_pool_2_vs_1_vs_stream_copy          median of per-repeat copy_pool / stream ratios
//   ping_p99_under_copy_load_ms_1, _2        p99 of the ping round trips in those runs (all
//                                            repeats pooled), and its median p50 beside it
//   ping_p99_under_copy_load_ms              the larger of the two
//   ping_p99_idle_ms                         the same pings with no copy load, same server
#include <kvtier/server/server.hpp>

#include <kvtier/core/token_hasher.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/protocol/codec.hpp>

#include <common/protocol_client.hpp>
#include <common/results.hpp>
#include <common/server_config.hpp>
#include <common/stream_copy.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kvtier;
namespace p = protocol;
using clock_type = std::chrono::steady_clock;
using client = kvtier::bench::protocol_client;

constexpr std::uint32_t chunk_tokens = 256;
constexpr std::uint32_t block_size = 16;
constexpr std::size_t chunks = 39;  // 9984 of 10k tokens: full chunks only
constexpr std::uint32_t bpc = chunk_tokens / block_size;
constexpr std::uint32_t num_blocks = chunks * bpc + 16;
const model_shape shape{24, 2, 64, dtype_kind::bf16, attention_kind::mha};  // 0.5B: 3 MiB chunks

struct run_result {
  double gbps = 0;
  std::vector<double> ping_ms;  ///< every ping's round trip under the load
  std::vector<double> idle_ping_ms;
};

p::register_kv_request registration(std::uint64_t instance, const kv_region& region) {
  return p::register_kv_request{instance, 0, 1, "bench/copy-pool", shape, block_size, num_blocks, chunk_tokens,
                                region.bytes()};
}

kv_region filled_region(const paged_kv_layout& layout, std::uint64_t seed) {
  auto region = kv_region::create(layout).value();
  std::mt19937_64 rng(seed);
  for (auto* l : region.layers())
    for (std::size_t i = 0; i < layout.layer_bytes(); i += 8) {
      const std::uint64_t v = rng();
      std::memcpy(l + i, &v, 8);
    }
  return region;
}

// Pings every ~1 ms until `stop`, returning each round trip in ms.
std::vector<double> ping_until(const std::string& socket, const std::atomic<bool>& stop) {
  client c(socket);
  std::vector<double> rtt;
  while (!stop.load(std::memory_order_relaxed)) {
    const auto t0 = clock_type::now();
    (void)c.call(p::ping_request{});
    rtt.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return rtt;
}

run_result run_once(std::uint32_t workers, int clients, double seconds, std::uint64_t seed) {
  const chunk_layout chunk{shape, chunk_tokens};
  const std::size_t object = chunk.object_bytes();
  const paged_kv_layout layout{shape, block_size, num_blocks};
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvtier-bench-copy-pool-" + std::to_string(::getpid()) + "-" + std::to_string(seed));
  std::filesystem::create_directories(dir);
  server::server_config cfg = bench::one_request_server_config(dir, chunk_tokens, object, chunks);
  cfg.worker_threads = workers;
  server::server srv(cfg);
  srv.start();
  std::thread io([&] { srv.run(); });

  run_result res;
  {
    // The request every client retrieves: stored once, from a region of its own.
    std::mt19937_64 rng(seed);
    std::vector<token_id> tokens(chunks * chunk_tokens);
    for (auto& t : tokens) t = static_cast<token_id>(rng());
    const auto hashes = token_hasher(chunk_tokens).chunk_hashes(tokens);
    auto source = filled_region(layout, seed);
    client sc(cfg.socket_path);
    const auto reg = sc.call(registration(1000, source), source.fd());
    std::vector<std::uint32_t> src(chunks * bpc);
    std::iota(src.begin(), src.end(), 0u);
    p::store_request st{"store", 0, 0, hashes, src, {}};
    for (auto b : src) st.block_generations.push_back(source.generation(b));
    if (sc.call(st).stored != chunks) throw std::runtime_error("the store stored less than the request");

    // Idle pings first (no load), then the load with pings beside it.
    {
      std::atomic<bool> stop{false};
      std::thread pinger([&] { res.idle_ping_ms = ping_until(cfg.socket_path, stop); });
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      stop = true;
      pinger.join();
    }

    std::vector<kv_region> regions;
    for (int i = 0; i < clients; ++i) regions.push_back(filled_region(layout, seed + 1 + static_cast<std::uint64_t>(i)));
    std::atomic<bool> stop{false};
    std::atomic<int> ready{0};
    std::vector<std::size_t> copied(static_cast<std::size_t>(clients), 0);
    std::vector<std::thread> threads;
    std::exception_ptr failure;
    std::mutex failure_mutex;
    for (int i = 0; i < clients; ++i)
      threads.emplace_back([&, i] {
        try {
          client c(cfg.socket_path);
          auto& region = regions[static_cast<std::size_t>(i)];
          (void)c.call(registration(2000 + static_cast<std::uint64_t>(i), region), region.fd());
          std::mt19937_64 r(seed * 31 + static_cast<std::uint64_t>(i));
          std::vector<std::uint32_t> all(num_blocks);
          std::iota(all.begin(), all.end(), 0u);
          ready.fetch_add(1);
          while (ready.load() < clients) std::this_thread::yield();
          for (std::uint64_t n = 0; !stop.load(std::memory_order_relaxed); ++n) {
            std::shuffle(all.begin(), all.end(), r);
            const std::string key = "c" + std::to_string(i) + "-" + std::to_string(n);
            (void)c.call(p::lookup_request{key, reg.model_id, 1, hashes});
            const auto q = c.call(p::query_prefetch_request{key});
            if (q.hit_chunks != chunks) throw std::runtime_error("the lookup missed chunks held in L1");
            p::retrieve_request rt{key, 0, 0, hashes, {all.begin(), all.begin() + chunks * bpc}, 0};
            const auto got = c.call(rt);
            if (got.retrieved_chunks != chunks) throw std::runtime_error("a retrieve came back short");
            (void)c.call(p::end_request_request{key});
            if (!stop.load(std::memory_order_relaxed)) copied[static_cast<std::size_t>(i)] += chunks * object;
          }
        } catch (...) {
          std::lock_guard g(failure_mutex);
          failure = std::current_exception();
          stop = true;
        }
      });
    while (ready.load() < clients && !stop.load()) std::this_thread::yield();
    std::thread pinger([&] { res.ping_ms = ping_until(cfg.socket_path, stop); });
    const auto t0 = clock_type::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop = true;
    const double elapsed = std::chrono::duration<double>(clock_type::now() - t0).count();
    for (auto& t : threads) t.join();
    pinger.join();
    if (failure) std::rethrow_exception(failure);
    // Only retrieves that ended before `stop` count, over the time until `stop`.
    res.gbps = static_cast<double>(std::accumulate(copied.begin(), copied.end(), std::size_t{0})) / elapsed / 1e9;
  }
  srv.stop();
  io.join();
  std::filesystem::remove_all(dir);
  return res;
}

/// The machine's own 2-vs-1 ceiling: a plain streaming copy (common/stream_copy.hpp) of 64 MiB
/// buffers, 8 times over, on one thread and then on two at once, each thread its own pair.
/// Returns (GB/s on 1 thread, GB/s on 2 threads together).
std::pair<double, double> stream_copy_1_and_2() {
  constexpr std::size_t n = std::size_t{64} << 20;
  constexpr int passes = 8;
  static std::vector<std::vector<std::byte>> buf = [] {
    std::vector<std::vector<std::byte>> b(4, std::vector<std::byte>(n, std::byte{1}));  // touched: resident
    return b;
  }();
  auto run = [&](int threads) {
    const auto t0 = clock_type::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        for (int k = 0; k < passes; ++k) bench::stream_copy(buf[2 * t + 1].data(), buf[2 * t].data(), n);
      });
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    return static_cast<double>(threads) * passes * static_cast<double>(n) / s / 1e9;
  };
  // The best of 3 each, alternated: a ceiling, not a typical figure (the previous run's server
  // may still be giving its memory back when the first one starts).
  double one = 0, two = 0;
  for (int i = 0; i < 3; ++i) {
    one = std::max(one, run(1));
    two = std::max(two, run(2));
  }
  return {one, two};
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5, clients = 4;
  double seconds = 2.0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      repeats = 3;
      seconds = 1.0;
    } else if (a.starts_with("--repeats=")) {
      repeats = std::max(1, std::atoi(a.c_str() + 10));
    } else if (a.starts_with("--seconds=")) {
      seconds = std::max(0.1, std::atof(a.c_str() + 10));
    } else if (a.starts_with("--clients=")) {
      clients = std::max(1, std::atoi(a.c_str() + 10));
    } else {
      std::fprintf(stderr, "usage: kvtier_bench_copy_pool [--quick] [--repeats=N] [--seconds=S] [--clients=C]\n");
      return 2;
    }
  }
  std::vector<double> gbps1, gbps2, ratio, machine_ratio, vs_machine;
  std::vector<double> ping1, ping2, idle;
  try {
    for (int rep = 0; rep < repeats; ++rep) {
      // Interleaved, and the order alternates, so a drift of the machine hits both alike.
      run_result a, b;
      const auto seed = static_cast<std::uint64_t>(rep + 1) * 7;
      if (rep % 2 == 0) {
        a = run_once(1, clients, seconds, seed);
        b = run_once(2, clients, seconds, seed + 1);
      } else {
        b = run_once(2, clients, seconds, seed + 1);
        a = run_once(1, clients, seconds, seed);
      }
      gbps1.push_back(a.gbps);
      gbps2.push_back(b.gbps);
      ratio.push_back(b.gbps / a.gbps);
      const auto [m1, m2] = stream_copy_1_and_2();
      machine_ratio.push_back(m2 / m1);
      vs_machine.push_back((b.gbps / a.gbps) / (m2 / m1));
      ping1.insert(ping1.end(), a.ping_ms.begin(), a.ping_ms.end());
      ping2.insert(ping2.end(), b.ping_ms.begin(), b.ping_ms.end());
      idle.insert(idle.end(), a.idle_ping_ms.begin(), a.idle_ping_ms.end());
      idle.insert(idle.end(), b.idle_ping_ms.begin(), b.idle_ping_ms.end());
      std::printf(
          "repeat %d: 1 worker %.2f GB/s, 2 workers %.2f GB/s (%.2fx); streaming copy 1 / 2 threads %.1f / %.1f GB/s "
          "(%.2fx); ping p99 %.2f / %.2f ms\n",
          rep, a.gbps, b.gbps, b.gbps / a.gbps, m1, m2, m2 / m1, bench::percentile(a.ping_ms, 0.99),
          bench::percentile(b.ping_ms, 0.99));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier_bench_copy_pool: %s\n", e.what());
    return 1;
  }
  std::printf("%d clients, %d repeats of %.1f s; %zu + %zu pings under load, %zu idle; %u cores\n", clients, repeats,
              seconds, ping1.size(), ping2.size(), idle.size(), std::thread::hardware_concurrency());
  bench::print_result("copy_pool_gbps_1", bench::median(gbps1));
  bench::print_result("copy_pool_gbps_2", bench::median(gbps2));
  bench::print_result("copy_pool_2_vs_1", bench::median(ratio));
  bench::print_result("stream_copy_2_vs_1", bench::median(machine_ratio));
  bench::print_result("copy_pool_2_vs_1_vs_stream_copy", bench::median(vs_machine));
  bench::print_result("ping_p50_under_copy_load_ms_1", bench::percentile(ping1, 0.5));
  bench::print_result("ping_p50_under_copy_load_ms_2", bench::percentile(ping2, 0.5));
  bench::print_result("ping_p99_under_copy_load_ms_1", bench::percentile(ping1, 0.99));
  bench::print_result("ping_p99_under_copy_load_ms_2", bench::percentile(ping2, 0.99));
  bench::print_result("ping_p99_under_copy_load_ms", std::max(bench::percentile(ping1, 0.99), bench::percentile(ping2, 0.99)));
  bench::print_result("ping_p99_idle_ms", bench::percentile(idle, 0.99));
  return 0;
}
