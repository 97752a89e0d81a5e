#include <kvtier/core/slot_allocator.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <set>

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
