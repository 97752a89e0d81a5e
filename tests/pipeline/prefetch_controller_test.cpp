// prefetch_controller on its own (pipeline/prefetch_controller.hpp), on the pipeline fixture
// (pipeline_fixtures.hpp). A prefetch brings the keys L2 has into L1 with their bytes and
// hands them held (for a caller that waits, temporary: freed with the last hold); the prefix ends at the first key no tier has and what lies past it is
// neither loaded nor left pinned in L2; a prefix split between L1 and L2 is served whole;
// two prefetches of the same keys share one load; a failed load ends the prefix there and
// leaves nothing of that key in L1; stop answers operation_aborted.
#include <kvtier/pipeline/policies.hpp>
#include <kvtier/pipeline/prefetch_controller.hpp>

#include "pipeline/pipeline_fixtures.hpp"

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_prefetch_controller_test {

using namespace kvtier;
using namespace kvtier::test;

namespace {

struct fixture : pipeline_fixture {
  std::unique_ptr<pipeline::prefetch_controller<test_tier, pipeline::first_backend_plan, test_bus>> prefetch;

  fixture() {
    prefetch = std::make_unique<pipeline::prefetch_controller<test_tier, pipeline::first_backend_plan, test_bus>>(
        io.get_executor(), *l1, backends, bus, tracker);
  }
  ~fixture() {
    prefetch->stop();
    run_until(io, [&] { return tracker.idle(); });
  }

  struct answer {
    error_code ec;
    pipeline::prefetch_result r;
  };

  /// Starts a prefetch of `keys` (waiting for every load: no on_key).
  void start(const std::vector<chunk_key>& keys, std::optional<answer>& out) {
    pipeline::prefetch_request req;
    req.keys = keys;
    req.object_bytes = object_bytes;
    req.wait_budget = std::chrono::seconds(30);
    prefetch->async_prefetch(std::move(req), [&out](error_code ec, pipeline::prefetch_result r) {
      out = answer{ec, std::move(r)};
    });
  }
  answer run(const std::vector<chunk_key>& keys) {
    std::optional<answer> a;
    start(keys, a);
    REQUIRE(run_until(io, [&] { return a.has_value(); }));
    return std::move(*a);
  }

  /// Gives back the caller's holds on the first `n` keys.
  void release(const std::vector<chunk_key>& keys, std::size_t n) {
    std::vector<l1::status> st(n);
    CHECK(l1->finish_read(std::span(keys).first(n), 0, l1::lock_lifetime::pinned, st) == n);
  }
};

}  // namespace

TEST_CASE("a prefetch loads what L2 has into L1 with its bytes and hands it held", "[pipeline]") {
  fixture f;
  const auto keys = keys_of(0, 6);
  f.put(0, keys);
  const auto a = f.run(keys);
  REQUIRE_FALSE(a.ec);
  CHECK(a.r.prefix == 6);
  CHECK(a.r.l2_prefix == 6);
  CHECK(a.r.from_l2.count() == 6);
  // Held for the caller: L1 may not remove them until the holds are given back.
  std::vector<l1::status> st(keys.size());
  CHECK(f.l1->remove(keys, false, st) == 0);
  CHECK(f.l1_has(keys) == 6);
  f.release(keys, 6);
  // The caller waited for them, so they were loaded for it alone (temporary): gone with
  // their last hold.
  for (const auto& k : keys) CHECK_FALSE(f.l1->contains(k));
  REQUIRE(f.events().load_submitted.size() == 1);
  CHECK(f.events().load_submitted[0].key_count == 6);
  REQUIRE(run_until(f.io, [&] { return f.events().load_completed.size() == 1; }));
  CHECK(f.events().load_completed[0].loaded_count == 6);
  CHECK(f.events().load_completed[0].failed_count == 0);
}

TEST_CASE("the prefix ends at the first key no tier has; what lies past it is not loaded or left pinned",
          "[pipeline]") {
  fixture f;
  const auto keys = keys_of(100, 6);
  f.put(0, {keys[0], keys[1], keys[2], keys[4], keys[5]});  // key 3 is nowhere
  const auto a = f.run(keys);
  REQUIRE_FALSE(a.ec);
  CHECK(a.r.prefix == 3);
  CHECK(a.r.l2_prefix == 3);
  CHECK(f.l1_has(keys) == 3);
  for (std::size_t i = 3; i < keys.size(); ++i) CHECK_FALSE(f.l1->contains(keys[i]));
  REQUIRE(run_until(f.io, [&] { return f.prefetch->active() == 0; }));
  for (const auto& k : keys) CHECK(f.a->pins(k) == 0);  // unpinned past the prefix, and after the loads
  f.release(keys, 3);
}

TEST_CASE("a prefix split between L1 and L2 is served whole, L1's keys read and the rest loaded", "[pipeline]") {
  fixture f;
  const auto keys = keys_of(200, 6);
  f.write_l1({keys[0], keys[1], keys[4]});
  f.put(0, {keys[2], keys[3], keys[5]});
  const auto a = f.run(keys);
  REQUIRE_FALSE(a.ec);
  CHECK(a.r.prefix == 6);
  CHECK(a.r.from_l2.to_string() == "001101");
  CHECK(f.l1_has(keys) == 6);
  REQUIRE(f.events().load_submitted.size() == 1);
  CHECK(f.events().load_submitted[0].key_count == 3);
  f.release(keys, 6);
  // L1's own keys stay; the loaded ones were the caller's alone (temporary).
  for (std::size_t i = 0; i < keys.size(); ++i) CHECK(f.l1->contains(keys[i]) == !a.r.from_l2.test(i));
}

TEST_CASE("two prefetches of the same keys share one load and both get the keys held", "[pipeline]") {
  fixture f;
  const auto keys = keys_of(300, 5);
  f.put(0, keys);
  std::optional<fixture::answer> x, y;
  f.start(keys, x);
  f.start(keys, y);
  REQUIRE(run_until(f.io, [&] { return x.has_value() && y.has_value(); }));
  REQUIRE_FALSE(x->ec);
  REQUIRE_FALSE(y->ec);
  CHECK(x->r.prefix == 5);
  CHECK(y->r.prefix == 5);
  std::uint64_t submitted = 0;
  for (const auto& e : f.events().load_submitted) submitted += e.key_count;
  CHECK(submitted == 5);  // each key read from L2 once
  CHECK(f.l1_has(keys) == 5);
  f.release(keys, 5);
  std::vector<l1::status> st(keys.size());
  CHECK(f.l1->remove(keys, false, st) == 0);  // the second caller's holds remain
  CHECK(f.l1_has(keys) == 5);
  f.release(keys, 5);
  for (const auto& k : keys) CHECK_FALSE(f.l1->contains(k));  // temporary: gone with the last hold
}

TEST_CASE("a failed load ends the prefix at that key and leaves nothing of it in L1", "[pipeline]") {
  fixture f;
  const auto keys = keys_of(400, 5);
  f.put(1, keys);  // only b has them; b fails key 402's load
  l2::fault bad;
  bad.op = l2::fault_op::load;
  bad.kind = l2::fault_kind::fail;
  bad.match = [](const chunk_key& k) { return k.hash.lo == 402; };
  f.faulty_b->inject(bad);
  const auto a = f.run(keys);
  REQUIRE_FALSE(a.ec);
  CHECK(a.r.prefix == 2);
  CHECK(f.l1_has({keys[0], keys[1]}) == 2);
  CHECK_FALSE(f.l1->contains(keys[2]));
  REQUIRE(run_until(f.io, [&] { return f.events().load_completed.size() == 1; }));
  CHECK(f.events().load_completed[0].failed_count >= 1);
  f.release(keys, 2);
}

TEST_CASE("after stop a prefetch is answered with operation_aborted and holds nothing", "[pipeline]") {
  fixture f;
  const auto keys = keys_of(500, 3);
  f.put(0, keys);
  f.prefetch->stop();
  const auto a = f.run(keys);
  CHECK(a.ec == boost::asio::error::operation_aborted);
  CHECK(a.r.prefix == 0);
  for (const auto& k : keys) CHECK_FALSE(f.l1->contains(k));
}

}  // namespace file_prefetch_controller_test
