#include <kvtier/l1/concepts.hpp>

#include <kvtier/l1/policy/arc.hpp>
#include <kvtier/l1/policy/detail/ghost_fifo.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l1/policy/s3fifo.hpp>
#include <kvtier/l1/tier.hpp>

#include "l1/support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <deque>
#include <random>
#include <set>
#include <unordered_map>
#include <vector>

using namespace kvtier;
using namespace kvtier::l1;
using kvtier::l1::test::key;
using kvtier::l1::test::keys;

namespace {

// Policies that take a victim whenever an unlocked object exists.
template <class P>
constexpr bool evicts = !std::is_same_v<P, noop> && !std::is_same_v<P, eviction_policy_archetype>;

// Drives a policy the way l1::tier does: items embed the hook, every selected victim is
// removed (on_remove) before the next call. Checks the select_victims contract each time.
template <class P>
struct harness {
  struct item : P::hook {
    std::uint64_t id = 0;
    bool present = false;
    bool locked = false;
  };

  explicit harness(std::size_t items, std::size_t capacity = 64) : all(items) {
    if constexpr (capacity_aware_policy<P>) policy.set_capacity(capacity);
    for (std::size_t i = 0; i < items; ++i) all[i].id = i;
  }

  void insert(std::uint64_t id) {
    REQUIRE_FALSE(all[id].present);
    all[id].present = true;
    policy.on_insert(all[id], key(id));
  }
  void access(std::uint64_t id) { policy.on_access(all[id]); }
  void remove(std::uint64_t id) {
    REQUIRE(all[id].present);
    policy.on_remove(all[id]);
    all[id].present = false;
  }
  [[nodiscard]] std::size_t unlocked_present() const {
    return static_cast<std::size_t>(
        std::count_if(all.begin(), all.end(), [](const item& i) { return i.present && !i.locked; }));
  }

  // select_victims(n), checked: at most n, distinct, present, unlocked; then removed.
  std::vector<std::uint64_t> select(std::size_t n) {
    std::vector<typename P::hook*> out;
    const auto pred = [](const typename P::hook& h) { return !static_cast<const item&>(h).locked; };
    policy.select_victims(n, pred, out);
    CHECK(out.size() <= n);
    std::vector<std::uint64_t> ids;
    std::set<std::uint64_t> distinct;
    for (auto* h : out) {
      auto& it = static_cast<item&>(*h);
      CHECK(it.present);
      CHECK_FALSE(it.locked);
      CHECK(distinct.insert(it.id).second);
      ids.push_back(it.id);
    }
    for (auto id : ids) remove(id);
    return ids;
  }

  P policy;
  std::vector<item> all;
};

}  // namespace

TEMPLATE_TEST_CASE("a policy's victims are at most n distinct, present, unlocked objects", "[l1][policy]", lru, s3fifo,
                   arc, noop, eviction_policy_archetype) {
  harness<TestType> h(300, 64);
  std::mt19937_64 rng(42);
  std::size_t selected = 0;
  for (int step = 0; step < 20'000; ++step) {
    const std::uint64_t id = rng() % h.all.size();
    auto& it = h.all[id];
    switch (rng() % 6) {
      case 0:
      case 1:
        if (!it.present)
          h.insert(id);
        else
          h.access(id);
        break;
      case 2:
        if (it.present) it.locked = !it.locked;
        break;
      case 3:
        if (it.present && rng() % 4 == 0) {
          it.locked = false;
          h.remove(id);
        }
        break;
      default: {
        const std::size_t n = 1 + rng() % 8;
        const std::size_t can = h.unlocked_present();
        const auto v = h.select(n);
        selected += v.size();
        if constexpr (evicts<TestType>)
          REQUIRE(v.size() == std::min(n, can));
        else
          REQUIRE(v.empty());
      }
    }
  }
  if constexpr (evicts<TestType>) CHECK(selected > 1000);
}

TEMPLATE_TEST_CASE("an evicting policy finds a victim behind many locked objects", "[l1][policy]", lru, s3fifo, arc) {
  harness<TestType> h(100, 50);
  for (std::uint64_t i = 0; i < 100; ++i) h.insert(i);
  for (std::uint64_t i = 0; i < 100; i += 3) h.access(i);
  for (auto& it : h.all) it.locked = it.id != 57;
  CHECK(h.select(5) == std::vector<std::uint64_t>{57});
  CHECK(h.select(5).empty());
}

TEMPLATE_TEST_CASE("objects removed by the tier never come back as victims", "[l1][policy]", lru, s3fifo, arc, noop,
                   eviction_policy_archetype) {
  harness<TestType> h(50, 20);
  for (std::uint64_t i = 0; i < 50; ++i) h.insert(i);
  for (std::uint64_t i = 0; i < 50; i += 2) h.remove(i);  // deleted, not evicted
  const auto v = h.select(100);
  for (auto id : v) CHECK(id % 2 == 1);
  if constexpr (evicts<TestType>) CHECK(v.size() == 25);
  CHECK(h.select(100).empty());
}

TEMPLATE_TEST_CASE("a key can come back after it was evicted or deleted", "[l1][policy]", lru, s3fifo, arc, noop,
                   eviction_policy_archetype) {
  harness<TestType> h(10, 4);
  for (std::uint64_t i = 0; i < 10; ++i) h.insert(i);
  auto v = h.select(6);
  if (h.all[9].present) h.remove(9);  // deleted rather than evicted
  for (std::uint64_t i = 0; i < 10; ++i)
    if (!h.all[i].present) h.insert(i);  // ghost hits for the evicting policies
  for (std::uint64_t i = 0; i < 10; ++i) CHECK(h.all[i].present);
  v = h.select(10);
  if constexpr (evicts<TestType>)
    CHECK(v.size() == 10);
  else
    CHECK(v.empty());
}

// ----------------------------------------------------------------------------------------
// policy-specific behaviour
// ----------------------------------------------------------------------------------------
TEST_CASE("lru evicts the least recently inserted or read object first", "[l1][policy][lru]") {
  harness<lru> h(10);
  for (std::uint64_t i = 1; i <= 5; ++i) h.insert(i);
  h.access(2);
  CHECK(h.select(3) == std::vector<std::uint64_t>{1, 3, 4});
  h.all[5].locked = true;
  CHECK(h.select(5) == std::vector<std::uint64_t>{2});
  CHECK(h.policy.size() == 1);
}

TEST_CASE("s3fifo evicts one-hit wonders from the small queue before objects read again", "[l1][policy][s3fifo]") {
  harness<s3fifo> h(20, 10);  // S target 1, M 9, ghost 9
  REQUIRE(h.policy.small_target() == 1);
  for (std::uint64_t i = 1; i <= 10; ++i) h.insert(i);
  h.access(1);
  h.access(2);
  h.access(3);
  h.access(3);
  // S drains oldest first: 1, 2, 3 were read and move to M; 4, 5, 6 go, into the ghost.
  CHECK(h.select(3) == std::vector<std::uint64_t>{4, 5, 6});
  CHECK(h.policy.main_size() == 3);
  CHECK(h.policy.small_size() == 4);
  for (std::uint64_t i : {4, 5, 6}) CHECK(h.policy.in_ghost(key(i)));
  CHECK_FALSE(h.policy.in_ghost(key(1)));

  // A ghost hit inserts straight into M.
  h.insert(4);
  CHECK(h.policy.main_size() == 4);
  CHECK_FALSE(h.policy.in_ghost(key(4)));

  // S (7..10) drains first; then M runs CLOCK: 1, 2, 3 have a read left and are
  // reinserted, 4 (never read in M) is evicted.
  CHECK(h.select(4) == std::vector<std::uint64_t>{7, 8, 9, 10});
  CHECK(h.select(1) == std::vector<std::uint64_t>{4});
  // 3 was read twice: after one more pass 1 and 2 go before it.
  CHECK(h.select(2) == std::vector<std::uint64_t>{1, 2});
  CHECK(h.select(1) == std::vector<std::uint64_t>{3});
}

TEST_CASE("s3fifo's ghost is bounded by the main queue's capacity", "[l1][policy][s3fifo]") {
  harness<s3fifo> h(500, 100);  // ghost 90
  for (std::uint64_t i = 0; i < 500; ++i) h.insert(i);
  CHECK(h.select(500).size() == 500);
  CHECK(h.policy.ghost_size() == 90);
  CHECK(h.policy.in_ghost(key(499)));
  CHECK_FALSE(h.policy.in_ghost(key(0)));
}

TEST_CASE("s3fifo options are validated", "[l1][policy][s3fifo]") {
  CHECK_THROWS_AS(s3fifo(s3fifo_options{0.0}), std::invalid_argument);
  CHECK_THROWS_AS(s3fifo(s3fifo_options{0.1, 0}), std::invalid_argument);
  CHECK_THROWS_AS(s3fifo(s3fifo_options{0.1, 1, -1.0}), std::invalid_argument);
  CHECK_NOTHROW(s3fifo(s3fifo_options{0.2, 2, 0.5}));
}

TEST_CASE("arc moves a read object to T2 and adapts p on ghost hits", "[l1][policy][arc]") {
  harness<arc> h(10, 4);
  h.insert(1);
  h.insert(2);
  h.access(1);
  CHECK(h.policy.t1_size() == 1);
  CHECK(h.policy.t2_size() == 1);
  CHECK(h.policy.target_t1() == 0.0);

  // |T1| = 1 > p = 0: REPLACE takes T1's LRU object into B1.
  CHECK(h.select(1) == std::vector<std::uint64_t>{2});
  CHECK(h.policy.b1_size() == 1);
  // A miss on a B1 ghost: T1 was too small, p grows; the object enters T2.
  h.insert(2);
  CHECK(h.policy.b1_size() == 0);
  CHECK(h.policy.target_t1() == 1.0);
  CHECK(h.policy.t2_size() == 2);
  CHECK(h.policy.list_of(h.all[2]) == arc::list_t2);

  // T1 empty: REPLACE takes T2's LRU object (1) into B2; a miss on it shrinks p.
  CHECK(h.select(1) == std::vector<std::uint64_t>{1});
  CHECK(h.policy.b2_size() == 1);
  h.insert(1);
  CHECK(h.policy.target_t1() == 0.0);
  CHECK(h.policy.list_of(h.all[1]) == arc::list_t2);
}

TEST_CASE("arc keeps its ghost lists within the paper's bounds", "[l1][policy][arc]") {
  harness<arc> h(1000, 50);
  std::mt19937_64 rng(7);
  for (int step = 0; step < 20'000; ++step) {
    const std::uint64_t id = rng() % 1000;
    if (!h.all[id].present)
      h.insert(id);
    else
      h.access(id);
    if (h.policy.t1_size() + h.policy.t2_size() > 50) (void)h.select(5);
    REQUIRE(h.policy.t1_size() + h.policy.b1_size() <= 50 + 5);
    REQUIRE(h.policy.t1_size() + h.policy.t2_size() + h.policy.b1_size() + h.policy.b2_size() <= 100 + 5);
    REQUIRE(h.policy.target_t1() >= 0.0);
    REQUIRE(h.policy.target_t1() <= 50.0);
  }
}

// ----------------------------------------------------------------------------------------
// ghost structures
// ----------------------------------------------------------------------------------------
TEST_CASE("a ghost fifo remembers the newest fingerprints up to its capacity", "[l1][policy][ghost]") {
  detail::ghost_fifo g(50);
  std::deque<std::uint64_t> model;
  std::mt19937_64 rng(3);
  for (int step = 0; step < 50'000; ++step) {
    const std::uint64_t fp = 1 + rng() % 120;
    const auto where = std::find(model.begin(), model.end(), fp);
    switch (rng() % 4) {
      case 0:
      case 1:
        g.push(fp);
        if (where != model.end()) model.erase(where);
        if (model.size() == 50) model.pop_front();
        model.push_back(fp);
        break;
      case 2:
        REQUIRE(g.erase(fp) == (where != model.end()));
        if (where != model.end()) model.erase(where);
        break;
      default:
        REQUIRE(g.pop_oldest() == !model.empty());
        if (!model.empty()) model.pop_front();
    }
    REQUIRE(g.size() == model.size());
    REQUIRE(g.contains(fp) == (std::find(model.begin(), model.end(), fp) != model.end()));
  }
  detail::ghost_fifo off(0);
  off.push(5);
  CHECK_FALSE(off.contains(5));
}

TEST_CASE("the fingerprint table agrees with a hash map", "[l1][policy][ghost]") {
  detail::fingerprint_table t(200);
  std::unordered_map<std::uint64_t, std::uint64_t> model;
  std::mt19937_64 rng(11);
  for (int step = 0; step < 100'000; ++step) {
    // Few distinct values with colliding home slots exercise the backward-shift deletion.
    const std::uint64_t fp = 1 + (rng() % 300) * 4096;
    if (rng() % 2 == 0 && model.size() < 200) {
      t.assign(fp, static_cast<std::uint64_t>(step));
      model[fp] = static_cast<std::uint64_t>(step);
    } else {
      REQUIRE(t.erase(fp) == (model.erase(fp) == 1));
    }
    REQUIRE(t.size() == model.size());
  }
  for (const auto& [fp, v] : model) {
    REQUIRE(t.find(fp) != nullptr);
    CHECK(*t.find(fp) == v);
  }
}

// ----------------------------------------------------------------------------------------
// every policy in a tier
// ----------------------------------------------------------------------------------------
TEMPLATE_TEST_CASE("a tier evicts down to its target and never takes locked objects", "[l1][policy][tier]", lru, s3fifo,
                   arc, noop) {
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 20;
  o.eviction_watermark = 0.8;  // 16 slots
  o.eviction_target = 0.5;     // 10 slots
  tier<TestType> t(o);
  std::vector<chunk_key> ks;
  for (std::uint64_t i = 0; i < 16; ++i) ks.push_back(key(i));
  std::vector<status> out(16);
  REQUIRE(t.reserve_write(ks, 100, {}, out) == 16);
  REQUIRE(t.finish_write(ks, out) == 16);
  const std::vector<chunk_key> locked(ks.begin() + 5, ks.begin() + 11);
  std::vector<status> lout(locked.size());
  REQUIRE(t.reserve_read(locked, 0, lock_lifetime::pinned, lout) == locked.size());
  std::vector<status> one(1);
  REQUIRE(t.reserve_write(keys({100}), 100, {}, one) == 1);
  for (const auto& k : locked) CHECK(t.state(k) == object_state::read_locked);
  if constexpr (evicts<TestType>) {
    CHECK(t.usage().slots_used == 10);  // 16 + 1 - 7 evicted
  } else {
    CHECK(t.usage().slots_used == 17);
    std::vector<status> three(3);
    CHECK(t.reserve_write(keys({101, 102, 103}), 100, {}, three) == 3);
    CHECK(t.reserve_write(keys({104}), 100, {}, one) == 0);
    CHECK(one[0] == status::out_of_memory);
  }
}

TEMPLATE_TEST_CASE("objects a client holds survive any amount of eviction", "[l1][policy][tier]", lru, s3fifo, arc) {
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 32;
  tier<TestType> t(o);
  std::mt19937_64 rng(5);
  std::set<std::uint64_t> held;
  std::vector<status> one(1);
  std::size_t hits = 0;
  for (int step = 0; step < 20'000; ++step) {
    const std::uint64_t id = rng() % 200;
    const auto k = keys({id});
    if (held.count(id) != 0) {
      REQUIRE(t.state(k[0]) == object_state::read_locked);
      if (rng() % 2 == 0) {
        REQUIRE(t.finish_read(k, 0, lock_lifetime::pinned, one) == 1);
        held.erase(id);
      }
      continue;
    }
    if (t.reserve_read(k, 0, lock_lifetime::pinned, one) == 1) {
      ++hits;
      if (held.size() < 8)
        held.insert(id);
      else
        REQUIRE(t.finish_read(k, 0, lock_lifetime::pinned, one) == 1);
    } else if (t.reserve_write(k, 100, {}, one) == 1) {
      REQUIRE(t.finish_write(k, one) == 1);
    }
    const auto u = t.usage();
    REQUIRE(u.slots_used == u.objects + u.removing);
    REQUIRE(u.slots_used <= t.watermark_slots());
  }
  CHECK(hits > 0);
}
