#include <kvtier/engine/quarantine.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_quarantine_test {

using kvtier::engine::quarantine;
using blocks = std::vector<std::uint32_t>;

TEST_CASE("a failed call's blocks stay quarantined until its late reply", "[engine][quarantine]") {
  quarantine q(16);
  CHECK(q.hold(7, 1, blocks{2, 3, 4}) == 3);
  CHECK(q.contains(2));
  CHECK(q.contains(4));
  CHECK_FALSE(q.contains(5));
  CHECK(q.size() == 3);
  CHECK(q.holds_call(7));
  CHECK(q.holds_epoch(1));
  CHECK(q.blocks() == blocks{2, 3, 4});
  CHECK(q.release_call(8) == 0);  // another call's reply releases nothing
  CHECK(q.release_epoch(2) == 0); // another connection's process going away neither
  CHECK(q.size() == 3);
  CHECK(q.release_call(7) == 3);
  CHECK(q.empty());
  CHECK_FALSE(q.holds_call(7));
  CHECK(q.release_call(7) == 0);  // released once
}

TEST_CASE("the server process going away releases every call of its connection", "[engine][quarantine]") {
  quarantine q(16);
  q.hold(1, 10, blocks{0, 1});
  q.hold(2, 10, blocks{2});
  q.hold(3, 11, blocks{3});
  CHECK(q.calls() == 3);
  CHECK(q.release_epoch(10) == 3);
  CHECK(q.blocks() == blocks{3});
  CHECK_FALSE(q.holds_epoch(10));
  CHECK(q.holds_epoch(11));
}

TEST_CASE("a block named by two failed calls is released with the last of them", "[engine][quarantine]") {
  quarantine q(8);
  CHECK(q.hold(1, 1, blocks{5, 6}) == 2);
  CHECK(q.hold(2, 1, blocks{6, 7}) == 1);  // 6 was already quarantined
  CHECK(q.size() == 3);
  CHECK(q.release_call(1) == 1);  // 5 leaves, 6 is still held by call 2
  CHECK(q.contains(6));
  CHECK(q.release_call(2) == 2);
  CHECK(q.empty());
}

TEST_CASE("holding a call twice adds nothing", "[engine][quarantine]") {
  quarantine q(8);
  CHECK(q.hold(1, 1, blocks{1}) == 1);
  CHECK(q.hold(1, 1, blocks{2}) == 0);
  CHECK(q.blocks() == blocks{1});
}

TEST_CASE("the optional limit releases only calls held longer than it", "[engine][quarantine]") {
  using namespace std::chrono_literals;
  quarantine q(8);
  const auto t0 = quarantine::clock::time_point{} + 1h;
  q.hold(1, 1, blocks{1}, t0);
  q.hold(2, 1, blocks{2}, t0 + 10s);
  CHECK(q.release_held_before(t0 + 5s) == 1);
  CHECK(q.blocks() == blocks{2});
}

TEST_CASE("block ids beyond the region are refused", "[engine][quarantine]") {
  quarantine q(4);
  CHECK_THROWS_AS(q.hold(1, 1, blocks{4}), std::out_of_range);
  CHECK(q.empty());
  CHECK_FALSE(q.contains(100));
}

}  // namespace file_quarantine_test
