// kvtier_bench_checksum: the object checksum's XXH3 kernels (core/detail/xxhash.hpp) in GB/s,
// fed 1 MiB at a time as the disk backend feeds them (one update per landed or issued part):
//   in cache  the same 1 MiB hashed over and over (the kernels' own speed);
//   cold      a 256 MiB buffer hashed once per repeat (what a load or store hashes: bytes
//             just written by the device or by a streaming copy, not in any cache).
// The kernels run interleaved within each repeat; each figure is the median over repeats.
//
//   RESULT xxh3_best_gbps, xxh3_portable_gbps, xxh3_best_vs_portable          (in cache)
//   RESULT xxh3_best_cold_gbps, xxh3_portable_cold_gbps, xxh3_best_vs_portable_cold
//   RESULT xxh3_best_is_portable   1 when this CPU (or this build) has no faster kernel
//
//   kvtier_bench_checksum [--repeats N]   (default 7)
#include <kvtier/core/detail/xxhash.hpp>

#include <common/results.hpp>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t part_bytes = std::size_t{1} << 20;

/// GB/s of `k` over `rounds` passes of `bytes` (1 MiB updates); the digest goes to `sink`.
double hash_gbps(const kvtier::detail::xxh3_kernel& k, const std::vector<unsigned char>& bytes, int rounds,
                 std::uint64_t& sink) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  const auto t0 = clock_type::now();
  for (int r = 0; r < rounds; ++r)
    for (std::size_t at = 0; at < bytes.size(); at += part_bytes) k.update(&state, bytes.data() + at, part_bytes);
  const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
  sink ^= XXH3_64bits_digest(&state);
  return static_cast<double>(bytes.size()) * rounds / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) try {
  int repeats = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) repeats = std::stoi(argv[++i]);
    else throw std::invalid_argument("unknown argument " + a + " (use --repeats N)");
  }
  if (repeats < 1) throw std::invalid_argument("--repeats must be positive");
  const auto kernels = kvtier::detail::xxh3_kernels();
  const kvtier::detail::xxh3_kernel& best = kernels.front();
  const kvtier::detail::xxh3_kernel& portable = kernels.back();
  std::printf("checksum_bench: kernels:");
  for (const auto& k : kernels) std::printf(" %s", k.name);
  std::printf(" (best first)\n");

  std::vector<unsigned char> warm(part_bytes), cold(std::size_t{256} << 20);
  for (std::size_t i = 0; i < warm.size(); ++i) warm[i] = static_cast<unsigned char>(i * 131 + 7);
  std::vector<unsigned char> evict(std::size_t{64} << 20);  // rewritten between cold passes
  std::vector<double> best_warm, portable_warm, best_cold, portable_cold;
  std::uint64_t sink = 0;
  for (int r = 0; r < repeats; ++r) {
    // Alternate which kernel goes first, so drift favours neither.
    const bool best_first = r % 2 == 0;
    for (int turn = 0; turn < 2; ++turn) {
      const bool run_best = (turn == 0) == best_first;
      const auto& k = run_best ? best : portable;
      (run_best ? best_warm : portable_warm).push_back(hash_gbps(k, warm, 256, sink));
      std::memset(cold.data(), r + turn, cold.size());  // fresh bytes, then out of the caches
      std::memset(evict.data(), r, evict.size());
      (run_best ? best_cold : portable_cold).push_back(hash_gbps(k, cold, 1, sink));
    }
    std::printf("  repeat %d: in cache %s %.2f, portable %.2f GB/s; cold %s %.2f, portable %.2f GB/s\n", r, best.name,
                best_warm.back(), portable_warm.back(), best.name, best_cold.back(), portable_cold.back());
  }
  std::printf("(digests, xored: %016llx)\n", static_cast<unsigned long long>(sink));
  using kvtier::bench::median;
  using kvtier::bench::median_ratio;
  using kvtier::bench::print_result;
  print_result("xxh3_best_gbps", median(best_warm));
  print_result("xxh3_portable_gbps", median(portable_warm));
  print_result("xxh3_best_vs_portable", median_ratio(best_warm, portable_warm));
  print_result("xxh3_best_cold_gbps", median(best_cold));
  print_result("xxh3_portable_cold_gbps", median(portable_cold));
  print_result("xxh3_best_vs_portable_cold", median_ratio(best_cold, portable_cold));
  print_result("xxh3_best_is_portable", &best == &portable ? 1 : 0);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvtier_bench_checksum: %s\n", e.what());
  return 1;
}
