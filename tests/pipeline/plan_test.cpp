#include <kvtier/pipeline/plan.hpp>

#include <kvtier/pipeline/policies.hpp>

#include <catch2/catch.hpp>

#include <cstring>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_plan_test {

using namespace kvtier;
using namespace kvtier::pipeline;

namespace {
bitmap bits(const char* s) {
  bitmap b(std::strlen(s));
  for (std::size_t i = 0; s[i]; ++i)
    if (s[i] == '1') b.set(i);
  return b;
}
}  // namespace

TEST_CASE("a full L2 hit plans every key from the backend that has it", "[pipeline][plan]") {
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("11111")};
  auto p = make_plan(policy, found, 5);
  CHECK(p.l2_prefix == 5);
  CHECK(p.submitted() == 5);
  CHECK(p.tasks() == 1);
  CHECK(count_trimmed(p) == 0);
  CHECK(unpins_for(found, p)[0].none());
}

TEST_CASE("an L2 hole trims the plan to the contiguous prefix", "[pipeline][plan]") {
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("11011")};  // LMCache's example: {0,1,3,4} loads {0,1}
  auto p = make_plan(policy, found, 5);
  CHECK(p.l2_prefix == 2);
  CHECK(p.per_backend[0].to_string() == "11000");
  CHECK(count_trimmed(p) == 2);
  CHECK(unpins_for(found, p)[0].to_string() == "00011");
}

TEST_CASE("keys are planned from the first backend that has them; the rest are unpinned", "[pipeline][plan]") {
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("1010"), bits("0111")};
  auto p = make_plan(policy, found, 4);
  CHECK(p.l2_prefix == 4);
  CHECK(p.per_backend[0].to_string() == "1010");
  CHECK(p.per_backend[1].to_string() == "0101");
  CHECK(p.tasks() == 2);
  const auto u = unpins_for(found, p);
  CHECK(u[0].none());
  CHECK(u[1].to_string() == "0010");  // key 2 is loaded from backend 0
  CHECK(count_trimmed(p) == 0);
}

TEST_CASE("a missing first key means no L2 prefix at all", "[pipeline][plan]") {
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("0111")};
  auto p = make_plan(policy, found, 4);
  CHECK(p.l2_prefix == 0);
  CHECK(p.submitted() == 0);
  CHECK(p.tasks() == 0);
  CHECK(count_trimmed(p) == 3);
  CHECK(unpins_for(found, p)[0].to_string() == "0111");
}

TEST_CASE("an L1 reservation hole trims again: submitted and trimmed counts follow", "[pipeline][plan]") {
  // The review example of LMCache PR #2913: plan {0,1,2,3}, key 1 out of L1 memory.
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("1111")};
  auto p = make_plan(policy, found, 4);
  REQUIRE(p.l2_prefix == 4);  // the pure L2 hit count, before reservation
  const std::size_t reserved_prefix = 1;
  trim_plan(p, reserved_prefix);
  CHECK(p.submitted() == 1);       // not 3: only key 0 is handed to the backend
  CHECK(count_trimmed(p) == 3);    // keys 1..3 were found but dropped
  CHECK(unpins_for(found, p)[0].to_string() == "0111");
  CHECK(p.l2_prefix == 4);         // the lookup hit count is not changed by the reservation
}

TEST_CASE("plan_backends keeps keys past an L2 hole; restrict_plan keeps what one request loads", "[pipeline][plan]") {
  // Key 1 is in no backend (L1 may have it): the walk with L1 bridges the hole, so the plan
  // must still know where keys 2 and 3 come from.
  first_backend_plan policy;
  const std::vector<bitmap> found = {bits("1011"), bits("0001")};
  auto p = plan_backends(policy, found, 4);
  CHECK(p.l2_prefix == 1);  // the pure L2 prefix, as before
  CHECK(p.per_backend[0].to_string() == "1011");
  CHECK(p.per_backend[1].to_string() == "0000");
  CHECK(planned_keys(p, 4).to_string() == "1011");
  restrict_plan(p, bits("1010"));  // key 3 came from elsewhere (L1, or another request's load)
  CHECK(p.submitted() == 2);
  CHECK(unpins_for(found, p)[0].to_string() == "0001");
  CHECK(unpins_for(found, p)[1].to_string() == "0001");
}

TEST_CASE("no backend and no keys plan nothing", "[pipeline][plan]") {
  first_backend_plan policy;
  auto p = make_plan(policy, std::span<const bitmap>{}, 3);
  CHECK(p.l2_prefix == 0);
  CHECK(p.found_any == 0);
  auto q = make_plan(policy, std::vector<bitmap>{bitmap(0)}, 0);
  CHECK(q.submitted() == 0);
}

namespace {
// A careless policy that plans every key everywhere: the planner must mask it.
struct greedy_plan {
  void plan(std::span<const bitmap> found, std::vector<bitmap>& plan) {
    plan.assign(found.size(), bitmap(found.empty() ? 0 : found[0].size(), true));
  }
};
}  // namespace

TEST_CASE("a policy cannot plan a key no backend found", "[pipeline][plan]") {
  greedy_plan policy;
  const std::vector<bitmap> found = {bits("1100")};
  auto p = make_plan(policy, found, 4);
  CHECK(p.per_backend[0].to_string() == "1100");
  CHECK(p.l2_prefix == 2);
}

TEST_CASE("selective stores a key the K-th time it is offered", "[pipeline][policies]") {
  selective<2> s;
  const std::vector<chunk_key> keys = {chunk_key{1, 1, 0, {1, 1}}, chunk_key{1, 1, 0, {2, 2}}};
  std::vector<bitmap> t;
  s.select_targets(std::span(keys).first(1), 2, t);
  CHECK(t[0].none());
  s.select_targets(keys, 2, t);
  CHECK(t[0].to_string() == "10");
  CHECK(t[1].to_string() == "10");
  s.select_targets(keys, 1, t);
  CHECK(t[0].to_string() == "01");  // key 0 already went (third sighting does not store again)
}

TEST_CASE("selective forgets the oldest half when its table is full", "[pipeline][policies]") {
  selective<3> s(4);
  std::vector<bitmap> t;
  for (std::uint64_t i = 0; i < 10; ++i) {
    const chunk_key k{1, 1, 0, {i, i}};
    s.select_targets(std::span(&k, 1), 1, t);
  }
  CHECK(s.tracked() <= 4);
}

TEST_CASE("wait policies give the budgets of SGLang's prefetch policies", "[pipeline][policies]") {
  using namespace std::chrono_literals;
  CHECK(best_effort{}.wait_budget(100000) == 0ns);
  CHECK(wait_complete{}.wait_budget(1) == 60s);
  CHECK(timeout_wait{}.wait_budget(10240) == 3s);            // 2 s + 10 x 0.1 s
  CHECK(timeout_wait{}.wait_budget(10'000'000) == 30s);      // capped
  CHECK(write_through{}.keep_in_l1());
  CHECK_FALSE(skip_l1{}.keep_in_l1());
}

}  // namespace file_plan_test
