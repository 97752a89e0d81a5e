// kvtier_bench_cache_ops: the cost per key of the cache operations one engine request makes,
// from 1k to 1M tokens of context, to show they are linear (issue 13: the server's I/O
// thread must never spend O(n*m) on a long context: a 1M-token retrieve at TP=8 once took
// ~10^8 key comparisons in release()).
//
// Per request, as the server's sessions drive tiered_cache for an engine at tensor-parallel
// world size 8 with 256-token chunks (every chunk in L1, no L2: only the bookkeeping is
// measured):
//   start_lookup(all chunks x 8 shards)  -> answered at once from L1 (read holds)
//   per rank: pin_for_copy(its shards) + unpin_after_copy  (the retrieve, without the copy)
//             release(lookup, its shards)                  (the retrieve gives its holds back)
//   release_all(lookup)                                    (end_request)
// Figure: ns per key (chunk shard) of the whole sequence, the median of --repeats rounds,
// the sizes interleaved (1k, 10k, 100k, 1M, 1k, ...).
//
//   RESULT cache_ops_ns_per_key_<tokens>=...   for tokens 1000, 10000, 100000, 1000000
//   RESULT cache_ops_per_key_1m_vs_1k=...      median over rounds of ns/key at 1M / at 1k (~1: flat)
//
//   kvtier_bench_cache_ops [--repeats N]   (default 5)
#include <kvtier/cache/tiered_cache.hpp>

#include <common/results.hpp>

#include <boost/asio/io_context.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace kvtier;

constexpr std::size_t world_size = 8;
constexpr std::size_t chunk_tokens = 256;
constexpr std::size_t object_bytes = 4096;  // the smallest slot: only bookkeeping is measured

struct one_size {
  std::size_t tokens = 0;
  std::size_t chunks = 0;
  std::vector<chunk_key> keys;                    // chunk-major: chunk c = keys [c*8, c*8+8)
  std::vector<std::vector<chunk_key>> rank_keys;  // each rank's shards, in chunk order
};

// splitmix64: chunk hashes look like the token hasher's (uniform), so the L1 index behaves
// as in production.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

one_size make_size(std::size_t tokens, std::uint64_t salt) {
  one_size s;
  s.tokens = tokens;
  s.chunks = tokens / chunk_tokens;
  s.rank_keys.resize(world_size);
  for (std::size_t c = 0; c < s.chunks; ++c)
    for (std::size_t r = 0; r < world_size; ++r) {
      const chunk_key k{0xbe7c, static_cast<std::uint16_t>(world_size), static_cast<std::uint16_t>(r),
                        hash128{mix(salt << 32 | c), mix(~(salt << 32 | c))}};
      s.keys.push_back(k);
      s.rank_keys[r].push_back(k);
    }
  return s;
}

// One request over size s; returns the seconds it took.
double one_request(cache::tiered_cache<>& cache, const one_size& s) {
  std::vector<l1::status> st(s.chunks);
  std::vector<std::span<const std::byte>> views(s.chunks);
  const auto t0 = std::chrono::steady_clock::now();
  cache::lookup_request r;
  r.keys = s.keys;
  r.group = world_size;
  r.object_bytes = object_bytes;
  r.chunk_tokens = chunk_tokens;
  const auto id = cache.start_lookup(r);
  for (std::size_t rank = 0; rank < world_size; ++rank) {
    const auto& mine = s.rank_keys[rank];
    cache.pin_for_copy(mine, st, views);
    cache.unpin_after_copy(mine);
    cache.release(id, mine);
  }
  cache.release_all(id);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--repeats") == 0 && i + 1 < argc)
      repeats = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--repeats N]\n", argv[0]);
      return 2;
    }
  }
  const std::vector<std::size_t> sizes = {1000, 10000, 100000, 1000000};
  std::vector<one_size> all;
  std::size_t total_keys = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    all.push_back(make_size(sizes[i], i + 1));
    total_keys += all.back().keys.size();
  }

  boost::asio::io_context io;
  cache::cache_options o;
  o.l1.slot_bytes = object_bytes;
  o.l1.slot_count = total_keys;
  o.l1.eviction_watermark = 1.0;
  o.l1.eviction_target = 0.9;
  bus::null_bus events;
  cache::tiered_cache<> cache(io.get_executor(), o, events, {});
  // Every key of every size in L1 (written once, as stores from the engine would).
  for (const auto& s : all) {
    std::vector<l1::status> st(s.keys.size());
    std::vector<std::span<std::byte>> buf(s.keys.size());
    if (cache.reserve_write(s.keys, object_bytes, st, buf) != s.keys.size()) {
      std::fprintf(stderr, "kvtier_bench_cache_ops: L1 refused the keys\n");
      return 1;
    }
    cache.finish_write(s.keys, {}, st);
  }
  io.poll();  // whatever the writes queued (nothing without L2) runs before measuring

  std::vector<std::vector<double>> ns_per_key(all.size());
  for (int rep = 0; rep < repeats; ++rep)
    for (std::size_t i = 0; i < all.size(); ++i) {
      const double s = one_request(cache, all[i]);
      ns_per_key[i].push_back(s * 1e9 / static_cast<double>(all[i].keys.size()));
    }
  for (std::size_t i = 0; i < all.size(); ++i) {
    std::fprintf(stderr, "%8zu tokens: %6zu keys, %.1f ns per key (median of %d)\n", all[i].tokens, all[i].keys.size(),
                 bench::median(ns_per_key[i]), repeats);
    bench::print_result("cache_ops_ns_per_key_" + std::to_string(all[i].tokens), bench::median(ns_per_key[i]));
  }
  bench::print_result("cache_ops_per_key_1m_vs_1k", bench::median_ratio(ns_per_key.back(), ns_per_key.front()));
  return 0;
}
