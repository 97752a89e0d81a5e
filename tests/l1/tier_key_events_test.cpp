// L1's key events (bus::tier_keys_stored, tier_keys_removed, tier l1_tier): a subscriber that
// applies them in queue order holds exactly what for_each_object lists, once no write is in
// flight (a write in flight is listed, write-locked, and announced only when it becomes
// readable), whatever removed the objects; and a bus that wants none gets none.
#include <kvtier/l1/tier.hpp>

#include <kvtier/bus/null_bus.hpp>
#include <kvtier/l1/policy/lru.hpp>

#include "l1/support.hpp"
#include "support/key_collector.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <random>
#include <set>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_tier_key_events_test {

using namespace kvtier;
using namespace kvtier::l1;
using kvtier::l1::test::key;
using kvtier::l1::test::keys;
using kvtier::l1::test::manual_clock;
using kvtier::test::key_collector;
using kvtier::test::key_ledger;
using std::chrono::seconds;

namespace {

// The L1 metrics recorder beside the key collector: the count events must not change.
using keyed_bus = bus::basic_event_bus<l1::test::l1_recorder, key_collector>;
using keyed_tier = tier<lru, keyed_bus>;

std::vector<status> all(std::size_t n, status s) { return std::vector<status>(n, s); }

struct fixture {
  explicit fixture(std::size_t slots = 8, double watermark = 1.0, double target = 0.5) {
    options.slot_bytes = 4096;
    options.slot_count = slots;
    options.eviction_watermark = watermark;
    options.eviction_target = target;
    options.clock = clock;
    l1 = std::make_unique<keyed_tier>(options, bus);
  }

  std::vector<status> write(const std::vector<chunk_key>& ks, write_options o = {}) {
    std::vector<status> out(ks.size());
    l1->reserve_write(ks, 1000, o, out);
    return out;
  }
  std::vector<status> finish(const std::vector<chunk_key>& ks) {
    std::vector<status> out(ks.size());
    l1->finish_write(ks, out);
    return out;
  }
  std::vector<status> finish_and_read(const std::vector<chunk_key>& ks, std::uint32_t extra = 0,
                                      lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->finish_write_and_reserve_read(ks, extra, l, out);
    return out;
  }
  std::vector<status> read(const std::vector<chunk_key>& ks, lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->reserve_read(ks, 0, l, out);
    return out;
  }
  std::vector<status> unread(const std::vector<chunk_key>& ks, lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->finish_read(ks, 0, l, out);
    return out;
  }
  std::vector<status> abandon(const std::vector<chunk_key>& ks) {
    std::vector<status> out(ks.size());
    l1->abandon_write(ks, out);
    return out;
  }
  std::vector<status> remove(const std::vector<chunk_key>& ks, bool force = false) {
    std::vector<status> out(ks.size());
    l1->remove(ks, force, out);
    return out;
  }
  void make_ready(const std::vector<chunk_key>& ks) {
    REQUIRE(write(ks) == all(ks.size(), status::success));
    REQUIRE(finish(ks) == all(ks.size(), status::success));
  }

  /// What for_each_object lists: every object, or only the readable ones.
  std::set<chunk_key> listed(bool readable_only = false) {
    std::set<chunk_key> s;
    l1->for_each_object([&](const chunk_key& k, std::size_t, object_state st) {
      if (!readable_only || st == object_state::ready || st == object_state::read_locked) s.insert(k);
    });
    return s;
  }
  /// The keys the events announce, after delivering what is queued.
  const std::set<chunk_key>& announced() {
    bus.drain();
    return ledger->of(bus::l1_tier);
  }
  /// No write in flight: the events hold exactly the listing, and never broke the contract.
  void check_exact() {
    CHECK(announced() == listed());
    CHECK(ledger->unknown_removals == 0);
    CHECK(ledger->repeated_stores == 0);
    CHECK(ledger->empty_events == 0);
    CHECK(bus.dropped() == 0);
  }

  manual_clock clock;
  l1::test::l1_recorder recorder;
  std::shared_ptr<l1::test::l1_counts> counts = recorder.c;
  key_collector collector;
  std::shared_ptr<key_ledger> ledger = collector.ledger;
  keyed_bus bus{kvtier::test::large_queue(), recorder, collector};
  tier_options options;
  std::unique_ptr<keyed_tier> l1;
};

}  // namespace

TEST_CASE("L1 announces an object when it becomes readable, not when its write is reserved", "[l1][key_events]") {
  fixture f;
  REQUIRE(f.write(keys({1, 2, 3})) == all(3, status::success));
  CHECK(f.announced().empty());
  CHECK(f.listed(true).empty());
  CHECK(f.finish(keys({1, 2})) == all(2, status::success));
  CHECK(f.announced() == std::set<chunk_key>{key(1), key(2)});
  CHECK(f.ledger->stored_events == 1);  // one event for the batch
  CHECK(f.abandon(keys({3})) == all(1, status::success));
  f.check_exact();
  CHECK(f.ledger->removed_total() == 0);  // an abandoned write was never announced
}

TEST_CASE("L1 evictions above the watermark are announced as evicted", "[l1][key_events]") {
  fixture f(8, 0.75, 0.5);  // evicts down to 4 slots when a write would pass 6
  for (std::uint64_t i = 0; i < 6; ++i) f.make_ready(keys({i}));
  f.check_exact();
  f.make_ready(keys({10, 11}));  // 8 > 6: down to 4, then the two new ones
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) == f.counts->removed_as(bus::removal_reason::evicted));
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) > 0);
  // evict() from a timer does the same.
  f.make_ready(keys({20, 21, 22}));
  f.l1->evict();
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) == f.counts->removed_as(bus::removal_reason::evicted));
}

TEST_CASE("L1 deletions on request are announced as deleted: remove, forced remove, remove_if, clear",
          "[l1][key_events]") {
  fixture f(16);
  f.make_ready(keys({1, 2, 3, 4, 5, 6, 7, 8}));
  CHECK(f.remove(keys({1})) == all(1, status::success));
  f.check_exact();

  // A read-locked object removed by force leaves the listing at once (its memory waits).
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  CHECK(f.remove(keys({2}), true) == all(1, status::success));
  f.check_exact();
  CHECK(f.unread(keys({2})) == all(1, status::success));  // freed now: no second removal
  f.check_exact();

  // A write-locked new object removed by force was never announced: nothing to remove.
  REQUIRE(f.write(keys({9})) == all(1, status::success));
  CHECK(f.remove(keys({9}), true) == all(1, status::success));
  CHECK(f.finish(keys({9})) == all(1, status::not_found));
  f.check_exact();

  const auto r = f.l1->remove_if([](const chunk_key& k) { return k.hash.lo % 2 == 1; }, false);
  CHECK(r.removed == 3);  // 3, 5, 7
  f.check_exact();

  REQUIRE(f.read(keys({4})) == all(1, status::success));
  CHECK(f.l1->clear(false) == 2);  // 6, 8; 4 is locked
  f.check_exact();
  CHECK(f.announced() == std::set<chunk_key>{key(4)});
  CHECK(f.l1->clear(true) == 1);
  f.check_exact();
  CHECK(f.announced().empty());
  CHECK(f.ledger->removed_as(bus::key_removal::deleted) == 8);
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 9);  // the metric counts 9, never announced
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) == 0);
}

TEST_CASE("L1 temporary objects are announced when they land and removed as expired after their last reader",
          "[l1][key_events]") {
  fixture f;
  write_options tmp;
  tmp.temporary = true;
  tmp.lock = lock_lifetime::pinned;
  tmp.purpose = bus::allocation_purpose::prefetch;

  // A prefetch lands for its reader: listed (read-locked) and announced.
  REQUIRE(f.write(keys({1, 2}), tmp) == all(2, status::success));
  CHECK(f.finish_and_read(keys({1, 2})) == all(2, status::success));
  CHECK(f.listed() == std::set<chunk_key>{key(1), key(2)});
  f.check_exact();
  CHECK(f.unread(keys({1})) == all(1, status::success));  // its last reader: freed
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == 1);

  // Its expiring read hold passes its TTL: freed too.
  f.clock.advance(f.options.read_lock_ttl + seconds(1));
  f.l1->expire_locks();
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == 2);

  // A load handed to nobody goes at once: announced, then removed.
  REQUIRE(f.write(keys({3}), tmp) == all(1, status::success));
  std::vector<status> out(1);
  const std::uint32_t none[] = {0};
  CHECK(f.l1->finish_write_and_reserve_read(keys({3}), none, lock_lifetime::pinned, out) == 1);
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == 3);
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == f.counts->removed_as(bus::removal_reason::temporary));

  // A temporary object finished without readers stays listed until read and released.
  REQUIRE(f.write(keys({4}), tmp) == all(1, status::success));
  CHECK(f.finish(keys({4})) == all(1, status::success));
  f.check_exact();
  CHECK(f.announced() == std::set<chunk_key>{key(4)});
  REQUIRE(f.read(keys({4})) == all(1, status::success));
  CHECK(f.unread(keys({4})) == all(1, status::success));
  f.check_exact();
  CHECK(f.announced().empty());
}

TEST_CASE("L1 writes that expire or are abandoned before they are readable are neither stored nor removed",
          "[l1][key_events]") {
  fixture f;
  REQUIRE(f.write(keys({1})) == all(1, status::success));  // an expiring write lock
  f.clock.advance(f.options.write_lock_ttl + seconds(1));
  f.l1->expire_locks();
  REQUIRE(f.write(keys({2})) == all(1, status::success));
  CHECK(f.abandon(keys({2})) == all(1, status::success));
  f.check_exact();
  CHECK(f.ledger->stored_events == 0);
  CHECK(f.ledger->removed_events == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 2);  // the metric still counts them
}

TEST_CASE("L1 keeps a rewritten object announced; a rewrite abandoned or expired removes it", "[l1][key_events]") {
  fixture f;
  f.make_ready(keys({1, 2, 3}));
  write_options update;
  update.mode = write_mode::update;
  REQUIRE(f.write(keys({1, 2, 3}), update) == all(3, status::success));
  CHECK(f.announced() == f.listed());  // still listed (write-locked), still announced
  CHECK(f.finish(keys({1})) == all(1, status::success));
  CHECK(f.ledger->stored_keys == 3);                       // not announced twice
  CHECK(f.abandon(keys({2})) == all(1, status::success));  // the old object is lost with it
  f.clock.advance(f.options.write_lock_ttl + seconds(1));
  f.l1->expire_locks();  // so is 3's
  f.check_exact();
  CHECK(f.announced() == std::set<chunk_key>{key(1)});
  CHECK(f.ledger->removed_as(bus::key_removal::deleted) == 2);
}

TEST_CASE("L1 prefetches through reserve_prefix are announced as they land, evictions they cause as evicted",
          "[l1][key_events]") {
  fixture f(8, 0.75, 0.5);
  f.make_ready(keys({1, 2, 3, 4, 5, 6}));
  const auto ks = keys({1, 2, 30, 31, 32});
  std::vector<prefix_take> takes(ks.size());
  prefix_options o;
  o.object_bytes = 1000;
  o.temporary = true;
  const auto r = f.l1->reserve_prefix(
      ks, o, [](std::size_t) { return true; }, [](std::size_t) { return false; }, takes);
  REQUIRE(r.writes == 3);
  CHECK(f.announced() == f.listed(true));  // the new keys are being written: not yet announced
  CHECK(f.ledger->removed_as(bus::key_removal::evicted) > 0);
  std::vector<status> out(3);
  CHECK(f.l1->finish_write_and_reserve_read(keys({30, 31, 32}), 0, lock_lifetime::pinned, out) == 3);
  f.check_exact();
  CHECK(f.announced().contains(key(30)));
  std::vector<status> back(ks.size());
  CHECK(f.l1->finish_read(ks, 0, lock_lifetime::pinned, back) == ks.size());
  f.check_exact();
  CHECK(f.ledger->removed_as(bus::key_removal::expired) == 3);
}

TEST_CASE("L1's key events follow the index under concurrent writers, readers and removers",
          "[l1][key_events][concurrency]") {
  fixture f(64, 0.8, 0.6);
  constexpr int threads = 4;
  constexpr int rounds = 3000;
  std::atomic<bool> go{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&f, &go, t] {
      std::mt19937 rng(static_cast<unsigned>(t) * 7919U + 1U);
      std::uniform_int_distribution<std::uint64_t> pick(0, 95);
      std::uniform_int_distribution<int> op(0, 9);
      while (!go.load()) std::this_thread::yield();
      write_options tmp;
      tmp.temporary = true;
      tmp.lock = lock_lifetime::pinned;
      for (int i = 0; i < rounds; ++i) {
        const auto ks = keys({pick(rng), pick(rng)});
        std::vector<status> out(ks.size());
        switch (op(rng)) {
          case 0:
          case 1:
          case 2:
            f.l1->reserve_write(ks, 1000, {}, out);
            f.l1->finish_write(ks, out);
            break;
          case 3:
            f.l1->reserve_write(ks, 1000, {}, out);
            f.l1->abandon_write(ks, out);
            break;
          case 4:
            f.l1->reserve_write(ks, 1000, tmp, out);
            f.l1->finish_write_and_reserve_read(ks, 0, lock_lifetime::pinned, out);
            f.l1->finish_read(ks, 0, lock_lifetime::pinned, out);
            break;
          case 5:
            if (f.l1->reserve_read(ks, 0, lock_lifetime::pinned, out) > 0)
              f.l1->finish_read(ks, 0, lock_lifetime::pinned, out);
            break;
          case 6:
            f.l1->remove(ks, i % 2 == 0, out);
            break;
          case 7:
            f.l1->remove_if([&](const chunk_key& k) { return k == ks[0]; }, false);
            break;
          case 8:
            f.l1->evict();
            break;
          default:
            if (i % 50 == 0) f.l1->clear(false);
            break;
        }
      }
    });
  go.store(true);
  for (auto& t : ts) t.join();
  f.check_exact();
  CHECK(f.ledger->stored_keys > 0);
  CHECK(f.ledger->removed_total() > 0);
}

TEST_CASE("a bus that wants no key event gets none, and the L1 count events are the same", "[l1][key_events]") {
  // The same operations on two tiers, one whose collector wants the key events.
  auto run = [](fixture& f) {
    write_options tmp;
    tmp.temporary = true;
    for (std::uint64_t i = 0; i < 6; ++i) f.make_ready(keys({i}));
    REQUIRE(f.write(keys({10, 11}), tmp) == all(2, status::success));
    f.finish_and_read(keys({10, 11}));
    f.unread(keys({10, 11}));
    f.remove(keys({1}));
    f.l1->remove_if([](const chunk_key& k) { return k == key(2); }, false);
    f.make_ready(keys({20, 21, 22}));  // evicts
    f.l1->clear(false);
    f.bus.drain();
  };
  fixture on(8, 0.75, 0.5);
  fixture off(8, 0.75, 0.5);
  off.collector.enabled->store(false);
  CHECK(bus::wants_kind<bus::tier_keys_stored>(on.bus));
  CHECK_FALSE(bus::wants_kind<bus::tier_keys_stored>(off.bus));
  CHECK_FALSE(bus::wants_kind<bus::tier_keys_removed>(off.bus));
  run(on);
  run(off);
  CHECK(on.bus.delivered() > 0);
  CHECK(off.bus.delivered() == 0);  // nothing queued: only the key events are deferred here
  CHECK(off.ledger->stored_events + off.ledger->removed_events == 0);
  for (std::size_t r = 0; r < bus::removal_reason_count; ++r)
    CHECK(on.counts->removed[r].load() == off.counts->removed[r].load());
  CHECK(on.counts->write_finished.load() == off.counts->write_finished.load());
  CHECK(on.counts->finished_and_read_reserved.load() == off.counts->finished_and_read_reserved.load());
  CHECK(on.counts->write_reserved.load() == off.counts->write_reserved.load());

  // A tier on the null bus (the default) builds none: wants_kind is false at compile time.
  static_assert(!bus::null_bus::handles_event<bus::tier_keys_stored>);
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 2;
  tier<lru> quiet(o);
  std::vector<status> out(1);
  quiet.reserve_write(keys({1}), 100, {}, out);
  CHECK(quiet.finish_write(keys({1}), out) == 1);
  CHECK(quiet.clear(false) == 1);
}

}  // namespace file_tier_key_events_test
