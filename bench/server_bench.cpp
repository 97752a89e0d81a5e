// kvtier_bench_server: how long the server takes for the copies of one 10k-token request
// (the copies run on the server's worker pool, worker_threads; kvtier_bench_copy_pool measures
// what the pool's size buys). An in-process server::server and a protocol client on a
// sealed memfd region, as an engine worker would use them:
//
//   store     39 chunks of 256 tokens (9984 tokens) from the region into L1 (gather)
//   retrieve  the same 39 chunks from L1 into other blocks of the region (scatter)
//
// Each is one request; its time is the client's round trip (request to reply), which is
// the time the server is busy with it (the protocol part is ~50 us of it). Blocks are
// a random permutation of the region (a long-running engine's free list), so block ids are
// rarely consecutive. Next to each, one memcpy of the same bytes (region -> buffer), as the
// physical limit, interleaved: store, memcpy, retrieve, memcpy, ...
//
// Shapes (bf16, block size 16): 05b = 24 layers, 2 KV heads, head dim 64 (3 MiB chunks,
// 117 MiB per request); 8b = 32 layers, 8 KV heads, head dim 128 (32 MiB chunks, 1.22 GiB
// per request; needs ~4 GB of memory, skipped with --quick).
//
//   kvtier_bench_server [--quick] [--repeats=N]
//
// Ends with RESULT lines: server_{store,retrieve}_10k_tokens_<shape>_ms (medians),
// server_{store,retrieve}_<shape>_gbps, server_{store,retrieve}_vs_memcpy_<shape>.
#include <kvtier/server/server.hpp>

#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <common/protocol_client.hpp>
#include <common/results.hpp>
#include <common/server_config.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kvtier;
namespace asio = boost::asio;
namespace p = protocol;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t chunk_tokens = 256;
constexpr std::uint32_t block_size = 16;
constexpr std::size_t chunks = 39;  // 9984 of 10k tokens: full chunks only
constexpr std::uint32_t bpc = chunk_tokens / block_size;

using client = kvtier::bench::protocol_client;

struct shape_result {
  std::vector<double> store_ms, retrieve_ms, memcpy_ms_s, memcpy_ms_r;
  std::size_t bytes = 0;
};

shape_result measure(const std::string& tag, model_shape shape, int repeats) {
  const chunk_layout chunk{shape, chunk_tokens};
  const std::size_t object = chunk.object_bytes();
  const std::uint32_t num_blocks = 2 * chunks * bpc + 64;  // a store set and a retrieve set, shuffled
  const paged_kv_layout layout{shape, block_size, num_blocks};

  const auto dir = std::filesystem::temp_directory_path() / ("kvtier-bench-server-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const server::server_config cfg = bench::one_request_server_config(dir, chunk_tokens, object, chunks);
  server::server srv(cfg);
  srv.start();
  std::thread io([&] { srv.run(); });

  shape_result res;
  res.bytes = chunks * object;
  {
    auto region = kv_region::create(layout).value();
    // Touch and fill every page (a real engine's cache is resident).
    std::mt19937_64 rng(42);
    for (auto* l : region.layers())
      for (std::size_t i = 0; i < layout.layer_bytes(); i += 8) {
        const std::uint64_t v = rng();
        std::memcpy(l + i, &v, 8);
      }
    std::vector<std::byte> baseline(res.bytes);
    std::memset(baseline.data(), 1, baseline.size());

    client c(cfg.socket_path);
    p::register_kv_request reg{static_cast<std::uint64_t>(::getpid()),
                               0,
                               1,
                               "bench/" + tag,
                               shape,
                               block_size,
                               num_blocks,
                               chunk_tokens,
                               region.bytes()};
    const auto r = c.call(reg, region.fd());

    std::vector<std::uint32_t> all(num_blocks);
    std::iota(all.begin(), all.end(), 0u);
    for (int rep = -1; rep < repeats; ++rep) {  // rep -1: warm-up, not counted
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<std::uint32_t> src(all.begin(), all.begin() + chunks * bpc);
      std::vector<std::uint32_t> dst(all.begin() + chunks * bpc, all.begin() + 2 * chunks * bpc);
      std::vector<token_id> tokens(chunks * chunk_tokens);
      for (auto& t : tokens) t = static_cast<token_id>(rng());
      const auto hashes = token_hasher(chunk_tokens).chunk_hashes(tokens);
      const std::string key = "bench-" + std::to_string(rep + 1);

      p::store_request st{key, 0, 0, hashes, src, {}};
      for (auto b : src) st.block_generations.push_back(region.generation(b));
      auto t0 = clock_type::now();
      const auto stored = c.call(st);
      const double store_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      if (stored.stored != chunks) throw std::runtime_error("store: " + std::to_string(stored.stored) + " stored");

      t0 = clock_type::now();
      std::memcpy(baseline.data(), region.layers()[0], std::min(res.bytes, layout.total_bytes()));
      const double memcpy_s = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();

      c.call(p::lookup_request{key, r.model_id, 1, hashes});
      const auto q = c.call(p::query_prefetch_request{key});
      if (q.state != p::prefetch_state::done || q.hit_chunks != chunks) throw std::runtime_error("lookup missed");
      p::retrieve_request rt{key, 0, 0, hashes, dst, 0};
      t0 = clock_type::now();
      const auto got = c.call(rt);
      const double retrieve_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      if (got.retrieved_chunks != chunks) throw std::runtime_error("retrieve: short");

      t0 = clock_type::now();
      std::memcpy(region.layers()[0], baseline.data(), std::min(res.bytes, layout.total_bytes()));
      const double memcpy_r = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();

      c.call(p::end_request_request{key});
      c.call(p::clear_request{true});
      if (rep >= 0) {
        res.store_ms.push_back(store_ms);
        res.retrieve_ms.push_back(retrieve_ms);
        res.memcpy_ms_s.push_back(memcpy_s);
        res.memcpy_ms_r.push_back(memcpy_r);
      }
    }
  }
  srv.stop();
  io.join();
  std::filesystem::remove_all(dir);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int repeats = 11;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      repeats = 5;
    } else if (a.starts_with("--repeats=")) {
      repeats = std::max(1, std::atoi(a.c_str() + 10));
    } else {
      std::fprintf(stderr, "usage: kvtier_bench_server [--quick] [--repeats=N]\n");
      return 2;
    }
  }
  struct shape_case {
    const char* tag;
    model_shape shape;
  };
  std::vector<shape_case> shapes = {{"05b", {24, 2, 64, dtype_kind::bf16, attention_kind::mha}}};
  if (!quick) shapes.push_back({"8b", {32, 8, 128, dtype_kind::bf16, attention_kind::mha}});
  for (const auto& s : shapes) {
    const shape_result r = measure(s.tag, s.shape, s.tag == std::string("8b") ? std::max(3, repeats / 2) : repeats);
    const double gb = static_cast<double>(r.bytes) / 1e9;
    const double st = bench::median(r.store_ms), rt = bench::median(r.retrieve_ms);
    std::printf("%s: %zu chunks, %.1f MiB per request: store %.2f ms, retrieve %.2f ms (memcpy %.2f / %.2f ms)\n",
                s.tag, chunks, static_cast<double>(r.bytes) / (1 << 20), st, rt, bench::median(r.memcpy_ms_s),
                bench::median(r.memcpy_ms_r));
    const std::string t = s.tag;
    bench::print_result("server_store_10k_tokens_" + t + "_ms", st);
    bench::print_result("server_retrieve_10k_tokens_" + t + "_ms", rt);
    bench::print_result("server_store_" + t + "_gbps", gb / (st * 1e-3));
    bench::print_result("server_retrieve_" + t + "_gbps", gb / (rt * 1e-3));
    bench::print_result("server_store_vs_memcpy_" + t, bench::median_ratio(r.memcpy_ms_s, r.store_ms));
    bench::print_result("server_retrieve_vs_memcpy_" + t, bench::median_ratio(r.memcpy_ms_r, r.retrieve_ms));
  }
  return 0;
}
