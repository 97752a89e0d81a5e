#include <kvtier/core/detail/xxhash.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

// The object checksums' run-time kernel choice (core/detail/xxhash.hpp) must give the digest
// of xxHash's own one-shot function: every stored object's checksum depends on it.

namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

std::vector<kvtier::detail::xxh3_kernel> kernels() {
  const auto k = kvtier::detail::xxh3_kernels();
  return {k.begin(), k.end()};
}

}  // namespace

TEST_CASE("every XXH3 kernel streams to the one-shot digest, whatever the split", "[core][xxhash]") {
  const std::vector<std::size_t> lengths = {
      0, 1, 63, 64, 240, 241, 1024, 4095, 4096, 65537, (std::size_t{1} << 20) + 17, std::size_t{3} << 20};
  std::mt19937_64 rng(7);
  for (const auto& k : kernels()) {
    for (const std::size_t len : lengths) {
      const auto bytes = random_bytes(len, len + 1);
      const std::uint64_t want = XXH3_64bits(bytes.data(), bytes.size());
      for (int split = 0; split < 4; ++split) {
        INFO("kernel " << k.name << ", " << len << " bytes, split " << split);
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        std::size_t at = 0;
        while (at < len) {
          // split 0: one call; else pieces of random size (1 byte to 1.5 MiB).
          const std::size_t piece = split == 0 ? len : std::min<std::size_t>(len - at, 1 + rng() % (3 << 19));
          k.update(&state, bytes.data() + at, piece);
          at += piece;
        }
        CHECK(XXH3_64bits_digest(&state) == want);
      }
    }
  }
}

TEST_CASE("xxh3_64 is XXH3_64bits and the kernel list ends with the portable one", "[core][xxhash]") {
  for (const std::size_t len : {std::size_t{0}, std::size_t{4095}, std::size_t{4096}, std::size_t{5} << 20}) {
    const auto bytes = random_bytes(len, 99);
    CHECK(kvtier::detail::xxh3_64(bytes.data(), bytes.size()) == XXH3_64bits(bytes.data(), bytes.size()));
  }
  const auto k = kernels();
  REQUIRE(!k.empty());
  CHECK(std::string(k.back().name) == "portable");
  CHECK(std::string(kvtier::detail::xxh3_best().name) == k.front().name);
#if KVTIER_DETAIL_XXH3_DISPATCH
  // Dispatch compiled in: a CPU with AVX2 gets the AVX2 kernel first.
  if (__builtin_cpu_supports("avx2")) CHECK(std::string(k.front().name) == "avx2");
#endif
}
