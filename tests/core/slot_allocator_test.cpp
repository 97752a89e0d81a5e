#include <kvtier/core/slot_allocator.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <set>
#include <stdexcept>
#include <vector>

using kvtier::slot_allocator;
using kvtier::slot_id;

TEST_CASE("slots are 4 KiB aligned and sized in whole pages", "[core][slot_allocator]") {
  slot_allocator a(5000, 4);
  CHECK(a.slot_bytes() == 8192);
  CHECK(a.bytes_capacity() == 4 * 8192);
  std::vector<slot_id> s;
  REQUIRE(a.allocate(4, s));
  std::set<const std::byte*> distinct;
  for (auto id : s) {
    CHECK(reinterpret_cast<std::uintptr_t>(a.data(id)) % 4096 == 0);
    CHECK(a.owns(a.data(id)));
    distinct.insert(a.data(id));
  }
  CHECK(distinct.size() == 4);
}

TEST_CASE("an arena of a huge page or more starts on a huge-page boundary", "[core][slot_allocator]") {
  // Transparent huge pages cover an arena from its first byte only when it starts on a 2 MiB
  // boundary; a 4 KiB-aligned one leaves its first slot partly in 4 KiB pages (the first slot
  // handed out), whose 1 MiB reads virtio-blk splits in two and whose io_uring registration
  // is not coalesced. Several allocations, so a lucky address cannot pass it.
  constexpr std::size_t huge = kvtier::huge_page_bytes;
  static_assert(huge == std::size_t{2} << 20);
  std::vector<slot_allocator> arenas;
  for (int i = 0; i < 4; ++i) {
    arenas.emplace_back(std::size_t{3} << 20, 3);  // 9 MiB: not a multiple of 2 MiB either
    CHECK(reinterpret_cast<std::uintptr_t>(arenas.back().arena().data()) % huge == 0);
    CHECK(arenas.back().arena().size() == std::size_t{9} << 20);
  }
  slot_allocator small(8192, 16);  // 128 KiB: no huge page to cover, 4 KiB alignment as before
  CHECK(reinterpret_cast<std::uintptr_t>(small.arena().data()) % 4096 == 0);
}

TEST_CASE("an aligned_buffer takes a larger alignment and frees with it", "[core][buffer]") {
  for (std::size_t alignment : {std::size_t{4096}, std::size_t{65536}, std::size_t{2} << 20}) {
    kvtier::aligned_buffer b(5000, alignment);
    CHECK(b.size() == 8192);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % alignment == 0);
    kvtier::aligned_buffer moved(std::move(b));  // released once, with its own alignment
    CHECK(reinterpret_cast<std::uintptr_t>(moved.data()) % alignment == 0);
    CHECK(b.data() == nullptr);
  }
  CHECK_THROWS_AS(kvtier::aligned_buffer(4096, 3 << 12), std::invalid_argument);  // not a power of two
  CHECK_THROWS_AS(kvtier::aligned_buffer(4096, 512), std::invalid_argument);      // below 4 KiB
}

TEST_CASE("batch allocation is all or nothing", "[core][slot_allocator]") {
  slot_allocator a(4096, 8);
  std::vector<slot_id> first;
  REQUIRE(a.allocate(5, first));
  CHECK(a.used_count() == 5);
  std::vector<slot_id> second{99};  // existing content must stay untouched on failure
  CHECK_FALSE(a.allocate(4, second));
  CHECK(second == std::vector<slot_id>{99});
  CHECK(a.used_count() == 5);
  CHECK(a.free_count() == 3);
  second.clear();
  CHECK(a.allocate(3, second));
  CHECK(a.free_count() == 0);
  CHECK(a.bytes_used() == a.bytes_capacity());
}

TEST_CASE("an exhausted allocator recovers after release", "[core][slot_allocator]") {
  slot_allocator a(4096, 2);
  std::vector<slot_id> s;
  REQUIRE(a.allocate(2, s));
  std::vector<slot_id> none;
  CHECK_FALSE(a.allocate(1, none));
  a.release(s[0]);
  CHECK(a.allocate(1, none));
  CHECK(none.front() == s[0]);  // LIFO: the warm slot comes back first
  CHECK(a.allocate(0, none));   // an empty batch always succeeds
}

TEST_CASE("double free and unknown slots are rejected", "[core][slot_allocator]") {
  slot_allocator a(4096, 2);
  std::vector<slot_id> s;
  REQUIRE(a.allocate(1, s));
  a.release(s[0]);
  CHECK_THROWS_AS(a.release(s[0]), std::logic_error);
  CHECK_THROWS_AS(a.release(slot_id{7}), std::logic_error);
  CHECK(a.free_count() == 2);
  CHECK_THROWS_AS(slot_allocator(0, 1), std::invalid_argument);
  CHECK_THROWS_AS(slot_allocator(4096, 0), std::invalid_argument);
}
