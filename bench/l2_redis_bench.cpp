// kvtier_bench_l2_redis: load throughput from a standalone Redis through the prefetch
// pipeline (tiered_cache lookups that miss L1 and load from l2::redis_backend) next to
// redis-benchmark's GET throughput for values of the same size, same number of connections,
// no pipelining on redis-benchmark's side (-P 1), measured in the same run, interleaved.
//
//   kvtier_bench_l2_redis --port=P [--objects=N] [--object-bytes=B] [--connections=C]
//                         [--lookup-keys=K] [--requests=M] [--repeats=R] [--quick]
//     --port          a running redis-server on 127.0.0.1 (bench/l2_redis.sh starts one);
//                     it is FLUSHALLed
//     --objects       objects in each key space (default 128)
//     --object-bytes  payload bytes per object (default 3 MiB = 3145728)
//     --connections   connections: redis_backend connections_per_node and redis-benchmark -c (4)
//     --lookup-keys   keys per tiered_cache lookup (default 8: an 8-chunk prompt); the
//                     prefetch pipeline keeps up to 8 lookups in flight (its default)
//     --requests      redis-benchmark -n (default 2 x objects); our side loads as many
//                     objects per repeat (whole sweeps over the key space)
//     --repeats       interleaved repeats (default 7; --quick: 3)
//     --max-inflight-bytes  the backend's max_inflight_bytes_per_connection (default: its
//                     default, 4 MiB: one 3 MiB GET in flight per connection)
//
// Setup: N objects stored through the backend (our key space), and N values of the same
// size under redis-benchmark's names key:000000000000 .. (its -r N key space), so every GET
// of either side returns a value of B bytes (+72 header bytes on ours). One warm-up of each.
// One repeat: ours (start all lookups of a sweep, wait for all, release them: the prefetched
// L1 objects are temporary and freed, so the next sweep loads from Redis again; bytes =
// chunks hit x B), then `redis-benchmark -t get -n M -r N -c C -P 1 --csv` (requests/s x B).
//
// RESULT l2_redis_load_gbps, redis_benchmark_get_gbps (medians, GB/s = 1e9 bytes/s) and
// l2_redis_vs_redis_benchmark (median over repeats of ours_i / theirs_i).
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/l2/redis/redis_backend.hpp>

#include <common/results.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <hiredis.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace kvtier;
namespace asio = boost::asio;
using clock_type = std::chrono::steady_clock;

struct bench_config {
  int port = 0;
  std::size_t objects = 128;
  std::size_t object_bytes = 3 * 1024 * 1024;
  std::size_t connections = 4;
  std::size_t lookup_keys = 8;
  std::size_t requests = 0;
  std::size_t repeats = 7;
  std::size_t max_inflight_bytes = 0;  ///< 0: the backend's default
};

bench_config parse(int argc, char** argv) {
  bench_config c;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&](std::string_view name) -> std::optional<std::size_t> {
      if (!a.starts_with(name) || a.size() <= name.size() || a[name.size()] != '=') return std::nullopt;
      return std::stoull(std::string(a.substr(name.size() + 1)));
    };
    if (auto v = value("--port"))
      c.port = static_cast<int>(*v);
    else if (auto v2 = value("--objects"))
      c.objects = *v2;
    else if (auto v3 = value("--object-bytes"))
      c.object_bytes = *v3;
    else if (auto v4 = value("--connections"))
      c.connections = *v4;
    else if (auto v5 = value("--lookup-keys"))
      c.lookup_keys = *v5;
    else if (auto v6 = value("--requests"))
      c.requests = *v6;
    else if (auto v7 = value("--repeats"))
      c.repeats = *v7;
    else if (auto v8 = value("--max-inflight-bytes"))
      c.max_inflight_bytes = *v8;
    else if (a == "--quick")
      c.repeats = 3;
    else
      throw std::invalid_argument("unknown argument: " + std::string(a));
  }
  if (c.port <= 0) throw std::invalid_argument("--port=P is required (bench/l2_redis.sh starts a redis-server)");
  if (c.requests == 0) c.requests = 2 * c.objects;
  if (c.objects % c.lookup_keys != 0) throw std::invalid_argument("--objects must be a multiple of --lookup-keys");
  return c;
}

// Blocking admin connection (setup only).
struct admin {
  redisContext* c;
  explicit admin(int port) : c(redisConnect("127.0.0.1", port)) {
    if (c == nullptr || c->err) throw std::runtime_error("cannot connect to redis on port " + std::to_string(port));
  }
  ~admin() { redisFree(c); }
  void run(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& x : args) {
      argv.push_back(x.data());
      lens.push_back(x.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr || r->type == REDIS_REPLY_ERROR)
      throw std::runtime_error("redis: " + args[0] + " failed" + (r ? std::string(": ") + r->str : std::string()));
    freeReplyObject(r);
  }
};

struct traits : cache::default_traits {
  using wait_policy = pipeline::wait_complete;
};

// Runs io until the awaitable made by f completes; returns its value.
template <class F>
auto run(asio::io_context& io, F f) {
  using T = typename decltype(f())::value_type;
  std::optional<T> out;
  std::exception_ptr error;
  asio::co_spawn(io, f(), [&](std::exception_ptr e, T v) {
    error = e;
    out.emplace(std::move(v));
    io.stop();
  });
  io.restart();
  io.run();
  if (error) std::rethrow_exception(error);
  return std::move(*out);
}

chunk_key key_of(std::size_t i) { return chunk_key{0x5eed, 1, 0, hash128{i * 2654435761u + 1, i}}; }

// redis-benchmark GET requests/s (its --csv output: a header line, then "GET","rps",...).
double redis_benchmark_rps(const bench_config& c) {
  const std::string cmd = "redis-benchmark -h 127.0.0.1 -p " + std::to_string(c.port) + " -t get -d " +
                          std::to_string(c.object_bytes) + " -n " + std::to_string(c.requests) + " -r " +
                          std::to_string(c.objects) + " -c " + std::to_string(c.connections) + " -P 1 --csv";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run redis-benchmark");
  std::string out;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  if (::pclose(p) != 0) throw std::runtime_error("redis-benchmark failed: " + out);
  const auto at = out.find("\"GET\",\"");
  if (at == std::string::npos) throw std::runtime_error("unexpected redis-benchmark output: " + out);
  return std::stod(out.substr(at + 7));
}

}  // namespace

int main(int argc, char** argv) try {
  const bench_config c = parse(argc, argv);
  std::printf("kvtier_bench_l2_redis: %zu objects of %zu bytes, %zu connections, %zu keys per lookup, %zu repeats\n",
              c.objects, c.object_bytes, c.connections, c.lookup_keys, c.repeats);

  admin adm(c.port);
  adm.run({"FLUSHALL"});
  // redis-benchmark's key space: key:000000000000 .. key:<objects-1>, values of object_bytes.
  {
    const std::string value(c.object_bytes, 'x');
    for (std::size_t i = 0; i < c.objects; ++i) {
      char name[32];
      std::snprintf(name, sizeof name, "key:%012zu", i);
      adm.run({"SET", name, value});
    }
  }

  asio::io_context io;
  l2::redis_backend_options ro;
  ro.nodes = {"127.0.0.1:" + std::to_string(c.port)};
  ro.connections_per_node = static_cast<std::uint32_t>(c.connections);
  if (c.max_inflight_bytes > 0) ro.max_inflight_bytes_per_connection = c.max_inflight_bytes;
  auto redis = std::make_shared<l2::redis_backend>(io.get_executor(), ro);

  // Our key space, stored through the backend.
  std::vector<chunk_key> keys;
  for (std::size_t i = 0; i < c.objects; ++i) keys.push_back(key_of(i));
  {
    std::vector<std::byte> payload(c.object_bytes);
    for (std::size_t j = 0; j < payload.size(); ++j) payload[j] = static_cast<std::byte>(j * 7 + (j >> 12));
    for (std::size_t i = 0; i < c.objects; i += 8) {
      const std::size_t n = std::min<std::size_t>(8, c.objects - i);
      std::vector<std::span<const std::byte>> src(n, payload);
      auto [ec, r] = run(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
        co_return co_await redis->async_store(std::span(keys).subspan(i, n), src,
                                              l2::clock::now() + std::chrono::seconds(60),
                                              asio::as_tuple(asio::use_awaitable));
      });
      if (ec || r.count(l2::key_outcome::ok) != n) throw std::runtime_error("filling Redis failed: " + ec.message());
    }
  }

  bus::null_bus events;
  cache::cache_options co;
  co.l1.slot_bytes = c.object_bytes;
  co.l1.slot_count = c.objects;  // one sweep fits: every lookup misses L1 and loads from Redis
  co.l1.eviction_watermark = 1.0;
  co.l1.eviction_target = 0.9;
  cache::tiered_cache<traits> tc(io.get_executor(), co, events, std::vector<l2::any_backend>{l2::any_backend(redis)});

  const std::size_t sweeps = std::max<std::size_t>(1, (c.requests + c.objects - 1) / c.objects);
  // One sweep: all lookups started at once (the pipeline admits 8 at a time), then awaited.
  auto sweep = [&]() -> std::size_t {
    std::vector<cache::tiered_cache<traits>::lookup_id> ids;
    for (std::size_t i = 0; i < c.objects; i += c.lookup_keys) {
      cache::lookup_request r;
      r.keys = std::span(keys).subspan(i, c.lookup_keys);
      r.object_bytes = c.object_bytes;
      r.chunk_tokens = 256;
      ids.push_back(tc.start_lookup(r));
    }
    std::size_t chunks = 0;
    run(io, [&]() -> asio::awaitable<int> {
      for (auto id : ids) {
        auto [ec, st] = co_await tc.async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
        if (!ec) chunks += st.chunks;
      }
      co_return 0;
    });
    for (auto id : ids) tc.release_all(id);
    if (tc.status().l1.objects != 0)
      throw std::runtime_error("L1 kept prefetched objects: the next sweep would hit L1");
    return chunks;
  };

  // Warm-up: first-touch of the L1 arena, connections, Redis's allocator.
  if (sweep() != c.objects) throw std::runtime_error("warm-up: not every object was loaded");
  redis_benchmark_rps(c);

  std::vector<double> ours, theirs;
  for (std::size_t r = 0; r < c.repeats; ++r) {
    const auto t0 = clock_type::now();
    std::size_t chunks = 0;
    for (std::size_t s = 0; s < sweeps; ++s) chunks += sweep();
    const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
    const double our_bps = static_cast<double>(chunks) * static_cast<double>(c.object_bytes) / secs;
    const double their_bps = redis_benchmark_rps(c) * static_cast<double>(c.object_bytes);
    if (chunks != sweeps * c.objects)
      std::printf("  (repeat %zu: %zu of %zu objects loaded)\n", r, chunks, sweeps * c.objects);
    std::printf("  repeat %zu: kvtier %.3f GB/s, redis-benchmark %.3f GB/s, ratio %.3f\n", r, our_bps / 1e9,
                their_bps / 1e9, our_bps / their_bps);
    ours.push_back(our_bps);
    theirs.push_back(their_bps);
  }
  bench::print_result("l2_redis_load_gbps", bench::median(ours) / 1e9);
  bench::print_result("redis_benchmark_get_gbps", bench::median(theirs) / 1e9);
  bench::print_result("l2_redis_vs_redis_benchmark", bench::median_ratio(ours, theirs));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvtier_bench_l2_redis: %s\n", e.what());
  return 1;
}
