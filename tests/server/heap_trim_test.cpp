// heap_trim.hpp: heap_usage() tells memory in use from memory the allocator keeps, and
// heap_trimmer gives the kept pages back (the soak's RSS growth, docs/performance.md "Soak").
#include <kvtier/server/heap_trim.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

using namespace kvtier::server;

namespace {

/// RssAnon of this process (KiB): its private resident memory.
long rss_anon_kib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "RssAnon:") {
      long v = 0;
      in >> v;
      return v;
    }
    std::getline(in, key);
  }
  return -1;
}

/// 48 MiB in 16 KiB chunks (below the mmap threshold: arena memory, every page touched),
/// each followed by a small chunk kept alive, so that freeing the large ones leaves holes in
/// the middle of the arena that the top-of-heap trim cannot return.
struct fragmented_heap {
  std::vector<std::unique_ptr<char[]>> large;
  std::vector<std::unique_ptr<char[]>> pins;

  fragmented_heap() {
    for (int i = 0; i < 3072; ++i) {
      large.emplace_back(new char[16384]);
      std::fill_n(large.back().get(), 16384, static_cast<char>(i));
      pins.emplace_back(new char[64]);
      pins.back()[0] = 1;
    }
  }
};

}  // namespace

TEST_CASE("heap_trimmer gives back the pages of memory freed in the middle of the heap", "[server][heap]") {
  if (!heap_usage().known) {
    WARN("malloc is not glibc's (>= 2.33; ASan's under the sanitizer build): heap_usage() is unknown and nothing is trimmed");
    CHECK_FALSE(heap_trimmer(0, std::chrono::seconds(0)).maybe_trim(std::chrono::steady_clock::now()));
    return;
  }
  fragmented_heap h;
  const heap_usage_info before = heap_usage();
  h.large.clear();  // 48 MiB free, pinned between small chunks
  const heap_usage_info freed = heap_usage();
  CHECK(freed.in_use_bytes + (std::size_t{40} << 20) < before.in_use_bytes);
  CHECK(freed.free_bytes >= std::size_t{40} << 20);
  const long resident_freed = rss_anon_kib();

  heap_trimmer trimmer(std::size_t{4} << 20, std::chrono::seconds(10));
  const auto t0 = std::chrono::steady_clock::now() + std::chrono::hours(1);  // past the first interval
  // Requests in flight: no trim now, and the next idle tick trims (the busy one did not
  // count as a check).
  CHECK_FALSE(trimmer.maybe_trim(t0, false));
  CHECK(trimmer.trims() == 0);
  REQUIRE(trimmer.maybe_trim(t0 + std::chrono::seconds(1), true));
  CHECK(trimmer.trims() == 1);
  CHECK(trimmer.trim_seconds() > 0.0);
  const long resident_trimmed = rss_anon_kib();
  INFO("RssAnon after free " << resident_freed << " KiB, after trim " << resident_trimmed << " KiB");
  CHECK(resident_trimmed + 40 * 1024 < resident_freed);  // the freed pages left RSS
  // Nothing in use moved (give or take the test's own strings).
  CHECK(heap_usage().in_use_bytes < freed.in_use_bytes + (std::size_t{64} << 10));

  // At most once per interval, whatever is free.
  CHECK_FALSE(trimmer.maybe_trim(t0 + std::chrono::seconds(6)));
  CHECK(trimmer.trims() == 1);
}

TEST_CASE("heap_trimmer leaves a heap with little free memory alone", "[server][heap]") {
  heap_trimmer trimmer(std::size_t{1} << 40, std::chrono::seconds(10));  // threshold 1 TiB
  CHECK_FALSE(trimmer.maybe_trim(std::chrono::steady_clock::now() + std::chrono::hours(1)));
  CHECK(trimmer.trims() == 0);
}
