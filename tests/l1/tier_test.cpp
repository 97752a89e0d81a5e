#include <kvtier/l1/tier.hpp>

#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>

#include "l1/support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

using namespace kvtier;
using namespace kvtier::l1;
using kvtier::l1::test::key;
using kvtier::l1::test::keys;
using kvtier::l1::test::manual_clock;
using std::chrono::seconds;

namespace {

using test_tier = tier<lru, test::recording_bus>;

// A tier of `slots` 4 KiB slots with a manual clock and a bus that counts events.
struct fixture {
  explicit fixture(std::size_t slots = 8, double watermark = 1.0, double target = 0.5) {
    options.slot_bytes = 4096;
    options.slot_count = slots;
    options.eviction_watermark = watermark;
    options.eviction_target = target;
    options.clock = clock;
    l1 = std::make_unique<test_tier>(options, bus);
  }

  std::vector<status> write(const std::vector<chunk_key>& ks, write_options o = {}, std::size_t bytes = 1000) {
    std::vector<status> out(ks.size());
    l1->reserve_write(ks, bytes, o, out);
    return out;
  }
  std::vector<status> finish(const std::vector<chunk_key>& ks) {
    std::vector<status> out(ks.size());
    l1->finish_write(ks, out);
    return out;
  }
  std::vector<status> abandon(const std::vector<chunk_key>& ks) {
    std::vector<status> out(ks.size());
    l1->abandon_write(ks, out);
    return out;
  }
  std::vector<status> read(const std::vector<chunk_key>& ks, std::uint32_t extra = 0,
                           lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->reserve_read(ks, extra, l, out);
    return out;
  }
  std::vector<status> unread(const std::vector<chunk_key>& ks, std::uint32_t extra = 0,
                             lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->finish_read(ks, extra, l, out);
    return out;
  }
  std::vector<status> finish_and_read(const std::vector<chunk_key>& ks, std::uint32_t extra = 0,
                                      lock_lifetime l = lock_lifetime::expiring) {
    std::vector<status> out(ks.size());
    l1->finish_write_and_reserve_read(ks, extra, l, out);
    return out;
  }
  std::vector<status> remove(const std::vector<chunk_key>& ks, bool force = false) {
    std::vector<status> out(ks.size());
    l1->remove(ks, force, out);
    return out;
  }
  manual_clock clock;
  test::l1_recorder recorder;
  std::shared_ptr<test::l1_counts> counts = recorder.c;
  test::recording_bus bus{recorder};
  tier_options options;
  std::unique_ptr<test_tier> l1;
};

std::vector<status> all(std::size_t n, status s) { return std::vector<status>(n, s); }

void make_ready(fixture& f, const std::vector<chunk_key>& ks) {
  REQUIRE(f.write(ks) == all(ks.size(), status::success));
  REQUIRE(f.finish(ks) == all(ks.size(), status::success));
}

}  // namespace

// ----------------------------------------------------------------------------------------
// vocabulary and options
// ----------------------------------------------------------------------------------------
TEST_CASE("every status, write mode and object state has a stable name", "[l1][status]") {
  CHECK(name(status::success) == "success");
  CHECK(name(status::not_found) == "not_found");
  CHECK(name(status::not_readable) == "not_readable");
  CHECK(name(status::not_writable) == "not_writable");
  CHECK(name(status::wrong_state) == "wrong_state");
  CHECK(name(status::locked) == "locked");
  CHECK(name(status::out_of_memory) == "out_of_memory");
  CHECK(name(status::skipped) == "skipped");
  CHECK(name(static_cast<status>(200)) == "unknown");
  CHECK(name(prefix_take::wait) == "wait");
  CHECK(name(prefix_end::no_room) == "no_room");
  CHECK(name(write_mode::new_only) == "new");
  CHECK(name(write_mode::update) == "update");
  CHECK(name(write_mode::all) == "all");
  CHECK(name(lock_lifetime::pinned) == "pinned");
  CHECK(name(object_state::removing) == "removing");
}

TEST_CASE("bad tier options are refused with a message naming the field", "[l1][tier][options]") {
  auto good = [] {
    tier_options o;
    o.slot_bytes = 4096;
    o.slot_count = 4;
    return o;
  };
  auto refuses = [](const tier_options& o, const std::string& field) {
    try {
      tier<lru> t(o);
      FAIL("accepted bad options for " << field);
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains(field));
    }
  };
  CHECK_NOTHROW(tier<lru>(good()));
  auto o = good();
  o.slot_bytes = 0;
  refuses(o, "slot_bytes");
  o = good();
  o.slot_count = 0;
  refuses(o, "slot_count");
  o = good();
  o.write_lock_ttl = seconds(0);
  refuses(o, "write_lock_ttl");
  o = good();
  o.read_lock_ttl = seconds(-1);
  refuses(o, "read_lock_ttl");
  o = good();
  o.eviction_watermark = 0.0;
  refuses(o, "eviction_watermark");
  o = good();
  o.eviction_watermark = 1.5;
  refuses(o, "eviction_watermark");
  o = good();
  o.eviction_target = 0.9;  // above the default watermark 0.8
  refuses(o, "eviction_target");
  o = good();
  o.eviction_target = -0.1;
  refuses(o, "eviction_target");
  o = good();
  o.clock = nullptr;
  refuses(o, "clock");
}

TEST_CASE("slots are whole pages and the capacity is slot_count times slot_bytes", "[l1][tier]") {
  tier_options o;
  o.slot_bytes = 5000;
  o.slot_count = 10;
  tier<lru> t(o);
  CHECK(t.slot_bytes() == 8192);
  CHECK(t.arena().size() == 10 * 8192);
  CHECK(t.usage().bytes_capacity == 10 * 8192);
  CHECK(t.usage().bytes_used == 0);
  CHECK(t.watermark_slots() == 8);
  CHECK(t.target_slots() == 7);
}

TEST_CASE("misuse of the batch spans and sizes throws", "[l1][tier]") {
  fixture f;
  const auto ks = keys({1, 2});
  std::vector<status> one(1);
  CHECK_THROWS_AS(f.l1->reserve_write(ks, 100, {}, one), std::invalid_argument);
  std::vector<status> out(2);
  std::vector<std::span<std::byte>> bufs(3);
  CHECK_THROWS_AS(f.l1->reserve_write(ks, 100, {}, out, bufs), std::invalid_argument);
  CHECK_THROWS_AS(f.l1->reserve_write(ks, 0, {}, out), std::invalid_argument);
  CHECK_THROWS_AS(f.l1->reserve_write(ks, 4097, {}, out), std::invalid_argument);
  CHECK_THROWS_AS(f.l1->reserve_read(ks, test_tier::max_extra_count + 1, lock_lifetime::pinned, out),
                  std::invalid_argument);
  std::vector<std::span<const std::byte>> views(1);
  CHECK_THROWS_AS(f.l1->read_views(ks, out, views), std::invalid_argument);
  CHECK(f.l1->usage().slots_used == 0);
}

// ----------------------------------------------------------------------------------------
// the state machine
// ----------------------------------------------------------------------------------------
TEST_CASE("an object goes absent, write_locked, ready, read_locked, ready, absent", "[l1][tier]") {
  fixture f;
  const auto k = keys({1});
  CHECK(f.l1->state(k[0]) == object_state::absent);

  std::vector<status> out(1);
  std::vector<std::span<std::byte>> buf(1);
  CHECK(f.l1->reserve_write(k, 1000, {}, out, buf) == 1);
  CHECK(out[0] == status::success);
  REQUIRE(buf[0].size() == 1000);
  CHECK(reinterpret_cast<std::uintptr_t>(buf[0].data()) % 4096 == 0);
  std::memset(buf[0].data(), 0xab, buf[0].size());
  CHECK(f.l1->state(k[0]) == object_state::write_locked);
  CHECK_FALSE(f.l1->contains(k[0]));

  CHECK(f.finish(k) == all(1, status::success));
  CHECK(f.l1->state(k[0]) == object_state::ready);
  CHECK(f.l1->contains(k[0]));

  CHECK(f.read(k, 1) == all(1, status::success));  // two holds
  CHECK(f.l1->state(k[0]) == object_state::read_locked);
  std::vector<std::span<const std::byte>> views(1);
  CHECK(f.l1->read_views(k, out, views) == 1);
  REQUIRE(views[0].size() == 1000);
  CHECK(views[0][999] == std::byte{0xab});
  CHECK(f.unread(k) == all(1, status::success));
  CHECK(f.l1->state(k[0]) == object_state::read_locked);  // one hold left
  CHECK(f.unread(k) == all(1, status::success));
  CHECK(f.l1->state(k[0]) == object_state::ready);

  CHECK(f.remove(k) == all(1, status::success));
  CHECK(f.l1->state(k[0]) == object_state::absent);
  CHECK(f.l1->usage().slots_used == 0);

  const auto& c = *f.counts;
  CHECK(c.write_reserved == 1);
  CHECK(c.write_finished == 1);
  CHECK(c.read_reserved == 1);
  CHECK(c.read_finished == 2);
  CHECK(c.removed_as(bus::removal_reason::deleted) == 1);
  CHECK(c.removed_bytes[static_cast<std::size_t>(bus::removal_reason::deleted)] == 1000);
}

TEST_CASE("usage counts objects, slots, bytes and locked objects through the states", "[l1][tier]") {
  fixture f;
  REQUIRE(f.write(keys({1, 2, 3}), {}, 3000) == all(3, status::success));
  auto u = f.l1->usage();
  CHECK(u.objects == 3);
  CHECK(u.slots_used == 3);
  CHECK(u.bytes_used == 3 * 4096);
  CHECK(u.object_bytes == 9000);
  CHECK(u.evictable == 0);  // write-locked
  CHECK(u.write_locked == 3);
  CHECK(u.read_locked == 0);
  REQUIRE(f.finish(keys({1, 2})) == all(2, status::success));
  CHECK(f.l1->usage().evictable == 2);
  CHECK(f.l1->usage().write_locked == 1);
  REQUIRE(f.read(keys({1})) == all(1, status::success));
  REQUIRE(f.read(keys({1})) == all(1, status::success));  // a second hold: still one object
  u = f.l1->usage();
  CHECK(u.evictable == 1);
  CHECK(u.read_locked == 1);
  REQUIRE(f.unread(keys({1})) == all(1, status::success));
  CHECK(f.l1->usage().read_locked == 1);
  REQUIRE(f.unread(keys({1})) == all(1, status::success));
  CHECK(f.l1->usage().read_locked == 0);
  REQUIRE(f.abandon(keys({3})) == all(1, status::success));
  CHECK(f.l1->usage().write_locked == 0);
}

TEST_CASE("mode new refuses existing keys and a key repeated in the batch", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1}));
  REQUIRE(f.write(keys({2})) == all(1, status::success));  // write-locked
  CHECK(f.write(keys({1, 2, 3, 3})) ==
        std::vector<status>{status::not_writable, status::not_writable, status::success, status::not_writable});
  CHECK(f.l1->usage().objects == 3);
  CHECK(f.counts->write_reserved == 3);  // 1 (make_ready), 2, 3
  CHECK(f.counts->write_refused == 3);
}

TEST_CASE("mode update rewrites only existing writable keys", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.write(keys({3})) == all(1, status::success));  // write-locked
  REQUIRE(f.read(keys({2})) == all(1, status::success));   // read-locked
  write_options tmp;
  tmp.temporary = true;
  REQUIRE(f.write(keys({4}), tmp) == all(1, status::success));
  REQUIRE(f.finish(keys({4})) == all(1, status::success));  // a ready temporary object

  write_options upd;
  upd.mode = write_mode::update;
  std::vector<status> out(5);
  std::vector<std::span<std::byte>> buf(5);
  f.l1->reserve_write(keys({1, 2, 3, 4, 9}), 2000, upd, out, buf);
  CHECK(out == std::vector<status>{status::success, status::not_writable, status::not_writable, status::not_writable,
                                   status::not_found});
  CHECK(buf[0].size() == 2000);
  CHECK(buf[1].empty());
  CHECK(f.l1->state(key(1)) == object_state::write_locked);
  CHECK(f.l1->info(key(1))->bytes == 2000);
  CHECK(f.finish(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::ready);
  CHECK(f.l1->usage().objects == 4);  // an update allocates nothing
}

TEST_CASE("mode all creates absent keys and rewrites writable ones", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  write_options o;
  o.mode = write_mode::all;
  CHECK(f.write(keys({1, 2, 3}), o) == std::vector<status>{status::success, status::not_writable, status::success});
  CHECK(f.l1->state(key(1)) == object_state::write_locked);
  CHECK(f.l1->state(key(3)) == object_state::write_locked);
  CHECK(f.l1->usage().objects == 3);
}

TEST_CASE("finish_write answers not_found and wrong_state", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1}));
  REQUIRE(f.write(keys({2})) == all(1, status::success));
  CHECK(f.finish(keys({9, 1, 2, 2})) ==
        std::vector<status>{status::not_found, status::wrong_state, status::success, status::wrong_state});
  CHECK(f.counts->write_finished == 2);  // 1 (make_ready) and 2
}

TEST_CASE("reserve_read answers not_found and not_readable", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1}));
  REQUIRE(f.write(keys({2})) == all(1, status::success));
  CHECK(f.read(keys({9, 2, 1})) == std::vector<status>{status::not_found, status::not_readable, status::success});
  CHECK(f.counts->read_reserved == 1);
  CHECK(f.counts->read_refused == 2);
}

// The soak's books (bench/soak): the key counts of the read events do not balance when a key
// is held for several readers (extra_count, a prefetch load feeding several waiters) or
// written for none; the hold counts do: taken = released + expired + held now.
TEST_CASE("read holds balance: taken = released + expired, whatever the readers per key", "[l1][tier][books]") {
  fixture f;
  make_ready(f, keys({1, 2, 3}));
  const auto& c = *f.counts;
  REQUIRE(f.read(keys({1, 2}), 1) == all(2, status::success));  // two readers each: 4 holds
  REQUIRE(f.unread(keys({1}), 1) == all(1, status::success));
  REQUIRE(f.unread(keys({2})) == all(1, status::success));  // one reader at a time
  REQUIRE(f.unread(keys({2})) == all(1, status::success));
  CHECK(c.read_holds_taken == 4);
  CHECK(c.read_holds_released == 4);

  // A load landing for two waiters of key 4, and for nobody of key 5 (its reader gave up).
  const auto ks = keys({4, 5});
  REQUIRE(f.write(ks) == all(2, status::success));
  const std::vector<std::uint32_t> holds = {2, 0};
  std::vector<status> out(2);
  REQUIRE(f.l1->finish_write_and_reserve_read(ks, holds, lock_lifetime::expiring, out) == 2);
  REQUIRE(f.unread(keys({4})) == all(1, status::success));
  REQUIRE(f.unread(keys({4})) == all(1, status::success));
  CHECK(c.read_holds_taken == 6);
  CHECK(c.read_holds_released == 6);

  // Three expiring readers that go away: their TTL releases all three.
  REQUIRE(f.read(keys({3}), 2) == all(1, status::success));
  f.clock.advance(f.options.read_lock_ttl + seconds(1));
  f.l1->expire_locks();
  CHECK(c.read_holds_taken == 9);
  CHECK(c.read_holds_expired == 3);
  CHECK(c.read_holds_taken == c.read_holds_released + c.read_holds_expired);
  // The key counts alone: 3 keys read-locked + 2 written and read-locked, 5 released + 1 expired.
  CHECK(c.read_reserved + c.finished_and_read_reserved != c.read_finished + c.expired_as(bus::lock_kind::read));
}

TEST_CASE("finish_read releases exactly the holds of the given lifetime", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  CHECK(f.unread(keys({9, 1})) == std::vector<status>{status::not_found, status::wrong_state});
  REQUIRE(f.read(keys({1}), 2, lock_lifetime::pinned) == all(1, status::success));  // 3 pinned holds
  REQUIRE(f.read(keys({1}), 0, lock_lifetime::expiring) == all(1, status::success));
  CHECK(f.l1->info(key(1))->pinned_readers == 3);
  CHECK(f.l1->info(key(1))->expiring_readers == 1);
  CHECK(f.unread(keys({1}), 1, lock_lifetime::expiring) == all(1, status::wrong_state));  // only 1 expiring
  CHECK(f.l1->info(key(1))->expiring_readers == 1);  // nothing released on wrong_state
  CHECK(f.unread(keys({1}), 1, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.unread(keys({1}), 0, lock_lifetime::expiring) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::read_locked);
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::ready);
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::wrong_state));
}

TEST_CASE("read views serve read-locked objects only", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.write(keys({3})) == all(1, status::success));
  REQUIRE(f.read(keys({1})) == all(1, status::success));
  const auto ks = keys({1, 2, 3, 9});
  std::vector<status> out(4);
  std::vector<std::span<const std::byte>> views(4);
  CHECK(f.l1->read_views(ks, out, views) == 1);
  CHECK(out == std::vector<status>{status::success, status::wrong_state, status::not_readable, status::not_found});
  CHECK(views[0].size() == 1000);
  CHECK(views[1].empty());
  CHECK(views[2].empty());
}

TEST_CASE("remove refuses locked keys unless forced", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.write(keys({3})) == all(1, status::success));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  CHECK(f.remove(keys({1, 2, 3, 9})) ==
        std::vector<status>{status::success, status::locked, status::locked, status::not_found});
  CHECK(f.l1->state(key(2)) == object_state::read_locked);
  CHECK(f.l1->state(key(3)) == object_state::write_locked);
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 1);
}

TEST_CASE("a read-locked object removed by force stays readable to its holders until the last release", "[l1][tier]") {
  fixture f;
  const auto k = keys({1});
  std::vector<status> out(1);
  std::vector<std::span<std::byte>> buf(1);
  REQUIRE(f.l1->reserve_write(k, 1000, {}, out, buf) == 1);
  std::memset(buf[0].data(), 0x5a, 1000);
  REQUIRE(f.finish(k) == all(1, status::success));
  REQUIRE(f.read(k, 1) == all(1, status::success));

  CHECK(f.remove(k, true) == all(1, status::success));
  CHECK(f.l1->state(k[0]) == object_state::removing);
  CHECK_FALSE(f.l1->contains(k[0]));
  CHECK(f.read(k) == all(1, status::not_found));      // new lookups miss
  CHECK(f.write(k) == all(1, status::not_writable));  // the key is busy until freed
  CHECK(f.remove(k, true) == all(1, status::not_found));
  auto u = f.l1->usage();
  CHECK(u.objects == 0);
  CHECK(u.removing == 1);
  CHECK(u.slots_used == 1);  // memory not pulled from under the reader
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 1);

  std::vector<std::span<const std::byte>> views(1);
  CHECK(f.l1->read_views(k, out, views) == 1);
  CHECK(views[0][0] == std::byte{0x5a});
  CHECK(f.unread(k) == all(1, status::success));
  CHECK(f.l1->usage().slots_used == 1);
  CHECK(f.unread(k) == all(1, status::success));
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.l1->state(k[0]) == object_state::absent);
  CHECK(f.write(k) == all(1, status::success));  // free to be written again
  CHECK(f.counts->removed_total() == 1);         // counted once, at the removal
}

TEST_CASE("a write-locked object removed by force is freed when its writer ends", "[l1][tier]") {
  fixture f;
  REQUIRE(f.write(keys({1, 2, 3})) == all(3, status::success));
  CHECK(f.remove(keys({1, 2, 3}), true) == all(3, status::success));
  CHECK(f.l1->usage().slots_used == 3);
  CHECK(f.l1->state(key(1)) == object_state::removing);
  CHECK(f.finish(keys({1})) == all(1, status::not_found));  // the write was discarded
  CHECK(f.abandon(keys({2})) == all(1, status::success));
  CHECK(f.finish_and_read(keys({3})) == all(1, status::not_found));
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.l1->usage().removing == 0);
  CHECK(f.counts->write_finished == 0);
  CHECK(f.counts->finished_and_read_reserved == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 3);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 0);
}

TEST_CASE("an abandoned write is never readable and never counts as a finished write", "[l1][tier]") {
  fixture f;
  REQUIRE(f.write(keys({1, 2})) == all(2, status::success));
  CHECK(f.abandon(keys({1, 2, 9})) == std::vector<status>{status::success, status::success, status::not_found});
  CHECK(f.l1->state(key(1)) == object_state::absent);
  CHECK(f.read(keys({1})) == all(1, status::not_found));
  CHECK(f.counts->write_finished == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 2);
  CHECK(f.counts->removed_bytes[static_cast<std::size_t>(bus::removal_reason::abandoned)] == 2000);
  CHECK(f.l1->usage().slots_used == 0);

  make_ready(f, keys({3}));
  CHECK(f.abandon(keys({3})) == all(1, status::wrong_state));  // ready, not being written
  CHECK(f.l1->state(key(3)) == object_state::ready);
  CHECK(f.counts->write_finished == 1);  // key 3's own finish_write only
}

TEST_CASE("an abandoned update drops the object it was overwriting", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1}));
  write_options upd;
  upd.mode = write_mode::update;
  REQUIRE(f.write(keys({1}), upd) == all(1, status::success));
  CHECK(f.abandon(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::absent);
  CHECK(f.l1->usage().objects == 0);
  CHECK(f.l1->usage().evictable == 0);
}

// ----------------------------------------------------------------------------------------
// readers of a verified prefix (reserve_unfinished_read: the layer-wise L2 hit)
// ----------------------------------------------------------------------------------------
namespace {
std::vector<status> read_unfinished(fixture& f, const std::vector<chunk_key>& ks,
                                    std::vector<std::span<const std::byte>>& views) {
  std::vector<status> out(ks.size());
  views.assign(ks.size(), {});
  f.l1->reserve_unfinished_read(ks, out, views);
  return out;
}
}  // namespace

TEST_CASE("a key being written gives a prefix reader its memory and one pinned hold", "[l1][tier][unfinished]") {
  fixture f;
  std::vector<std::span<std::byte>> buffers(1);
  std::vector<status> st(1);
  REQUIRE(f.l1->reserve_write(keys({1}), 1000, {}, st, buffers) == 1);
  make_ready(f, keys({2}));
  std::vector<std::span<const std::byte>> views;
  CHECK(read_unfinished(f, keys({1, 2, 9}), views) ==
        std::vector<status>{status::success, status::wrong_state, status::not_found});
  CHECK(views[0].data() == buffers[0].data());
  CHECK(views[0].size() == 1000);
  CHECK(views[1].empty());
  CHECK(f.l1->state(key(1)) == object_state::write_locked);  // still being written, not readable
  CHECK(f.read(keys({1})) == all(1, status::not_readable));
  CHECK(f.counts->read_holds_taken == 1);
  // The write finishes: the object is readable and the prefix reader's hold stays on it.
  CHECK(f.finish(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::read_locked);
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::ready);
  CHECK(f.counts->read_holds_released == 1);
}

TEST_CASE("an abandoned write keeps its memory until its prefix readers let go", "[l1][tier][unfinished]") {
  fixture f(2);
  std::vector<std::span<std::byte>> buffers(1);
  std::vector<status> st(1);
  REQUIRE(f.l1->reserve_write(keys({1}), 1000, {}, st, buffers) == 1);
  std::memset(buffers[0].data(), 0x5a, 1000);
  std::vector<std::span<const std::byte>> views;
  REQUIRE(read_unfinished(f, keys({1}), views) == all(1, status::success));
  CHECK(f.abandon(keys({1})) == all(1, status::success));
  // Gone for everyone else: lookups miss, a new write of the key is refused, nothing takes the slot.
  CHECK(f.l1->state(key(1)) == object_state::removing);
  CHECK(f.read(keys({1})) == all(1, status::not_found));
  CHECK(f.write(keys({1})) == all(1, status::not_writable));
  CHECK(f.l1->usage().slots_used == 1);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 1);
  REQUIRE(f.write(keys({2})) == all(1, status::success));
  CHECK(f.write(keys({3})) == all(1, status::out_of_memory));  // the abandoned slot is still taken
  CHECK(std::all_of(views[0].begin(), views[0].end(), [](std::byte b) { return b == std::byte{0x5a}; }));
  CHECK(read_unfinished(f, keys({1}), views) == all(1, status::not_found));  // no new readers
  // The last hold frees it, counted once.
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::absent);
  CHECK(f.l1->usage().slots_used == 1);  // key 2's
  CHECK(f.l1->usage().removing == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 1);
  CHECK(f.write(keys({1})) == all(1, status::success));
}

TEST_CASE("a write with a prefix reader that expires, or is removed, is freed with the last hold",
          "[l1][tier][unfinished]") {
  fixture f;
  write_options expiring, pinned;
  expiring.lock = lock_lifetime::expiring;
  pinned.lock = lock_lifetime::pinned;
  REQUIRE(f.write(keys({1}), expiring) == all(1, status::success));
  REQUIRE(f.write(keys({2}), pinned) == all(1, status::success));
  std::vector<std::span<const std::byte>> views;
  REQUIRE(read_unfinished(f, keys({1, 2}), views) == all(2, status::success));
  f.clock.advance(f.options.write_lock_ttl + seconds(1));
  CHECK(f.l1->expire_locks() == 1);
  CHECK(f.l1->state(key(1)) == object_state::removing);
  CHECK(f.remove(keys({2}), true) == all(1, status::success));
  CHECK(f.l1->clear(true) == 0);  // neither is counted again
  CHECK(f.finish(keys({2})) == all(1, status::not_found));  // the write ends; the reader still holds it
  CHECK(f.l1->usage().slots_used == 2);
  CHECK(f.unread(keys({1, 2}), 0, lock_lifetime::pinned) == all(2, status::success));
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.l1->usage().removing == 0);
  CHECK(f.counts->removed_total() == 2);
}

TEST_CASE("finish_write_and_reserve_read is atomic and not counted as a finished write", "[l1][tier]") {
  fixture f;
  write_options o;
  o.temporary = true;
  o.lock = lock_lifetime::pinned;
  o.purpose = bus::allocation_purpose::prefetch;
  REQUIRE(f.write(keys({1, 2}), o) == all(2, status::success));
  make_ready(f, keys({3}));
  CHECK(f.finish_and_read(keys({1, 2, 3, 9}), 1) ==
        std::vector<status>{status::success, status::success, status::wrong_state, status::not_found});
  CHECK(f.l1->state(key(1)) == object_state::read_locked);
  CHECK(f.l1->info(key(1))->expiring_readers == 2);
  CHECK(f.counts->finished_and_read_reserved == 2);
  CHECK(f.counts->write_finished == 1);  // key 3's own finish_write only
}

TEST_CASE("a temporary object is freed when its last reader finishes", "[l1][tier]") {
  fixture f;
  write_options o;
  o.temporary = true;
  REQUIRE(f.write(keys({1}), o) == all(1, status::success));
  REQUIRE(f.finish_and_read(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  REQUIRE(f.read(keys({1})) == all(1, status::success));  // a second reader
  CHECK(f.l1->info(key(1))->temporary);
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::read_locked);
  CHECK(f.unread(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::absent);
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::temporary) == 1);
}

TEST_CASE("a temporary object finished without readers stays until read and released", "[l1][tier]") {
  fixture f;
  write_options o;
  o.temporary = true;
  REQUIRE(f.write(keys({1}), o) == all(1, status::success));
  REQUIRE(f.finish(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::ready);
  REQUIRE(f.read(keys({1})) == all(1, status::success));
  REQUIRE(f.unread(keys({1})) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::absent);
}

TEST_CASE("touch counts readable keys only", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.write(keys({3})) == all(1, status::success));
  CHECK(f.l1->touch(keys({1, 2, 3, 9})) == 2);
}

// ----------------------------------------------------------------------------------------
// TTL
// ----------------------------------------------------------------------------------------
TEST_CASE("an expiring write lock expires after write_lock_ttl and drops the object", "[l1][tier][ttl]") {
  fixture f;
  REQUIRE(f.write(keys({1})) == all(1, status::success));
  write_options pinned;
  pinned.lock = lock_lifetime::pinned;
  REQUIRE(f.write(keys({2}), pinned) == all(1, status::success));

  f.clock.advance(seconds(599));
  CHECK(f.l1->expire_locks() == 0);
  CHECK(f.l1->state(key(1)) == object_state::write_locked);
  f.clock.advance(seconds(1));
  CHECK(f.l1->state(key(1)) == object_state::absent);  // expiry on touch
  CHECK(f.counts->expired_as(bus::lock_kind::write) == 1);
  CHECK(f.counts->removed_as(bus::removal_reason::abandoned) == 1);
  CHECK(f.finish(keys({1})) == all(1, status::not_found));  // the late writer learns it

  f.clock.advance(std::chrono::hours(24 * 365));
  CHECK(f.l1->expire_locks() == 0);
  CHECK(f.l1->state(key(2)) == object_state::write_locked);  // pinned: never expires
  CHECK(f.finish(keys({2})) == all(1, status::success));
  CHECK(f.l1->usage().slots_used == 1);
}

TEST_CASE("expiring read holds go together read_lock_ttl after the latest acquire", "[l1][tier][ttl]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.read(keys({1, 2})) == all(2, status::success));  // t = 0
  f.clock.advance(seconds(200));
  REQUIRE(f.read(keys({1}), 1) == all(1, status::success));  // 3 expiring holds, deadline 500 s
  REQUIRE(f.read(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  f.clock.advance(seconds(100));  // t = 300: key 2's hold expires
  CHECK(f.l1->expire_locks() == 1);
  CHECK(f.l1->state(key(2)) == object_state::ready);
  CHECK(f.l1->info(key(1))->expiring_readers == 3);
  f.clock.advance(seconds(199));
  CHECK(f.l1->expire_locks() == 0);
  f.clock.advance(seconds(1));  // t = 500
  CHECK(f.l1->expire_locks() == 1);
  CHECK(f.l1->info(key(1))->expiring_readers == 0);
  CHECK(f.l1->info(key(1))->pinned_readers == 1);
  CHECK(f.l1->state(key(1)) == object_state::read_locked);
  CHECK(f.counts->expired_as(bus::lock_kind::read) == 2);
  CHECK(f.unread(keys({1})) == all(1, status::wrong_state));  // the expired holder is told
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::ready);
}

TEST_CASE("TTLs are configurable", "[l1][tier][ttl]") {
  fixture f;
  f.options.write_lock_ttl = seconds(5);
  f.options.read_lock_ttl = seconds(2);
  f.l1 = std::make_unique<test_tier>(f.options, f.bus);
  make_ready(f, keys({1}));
  REQUIRE(f.write(keys({2})) == all(1, status::success));
  REQUIRE(f.read(keys({1})) == all(1, status::success));
  f.clock.advance(seconds(2));
  CHECK(f.l1->state(key(1)) == object_state::ready);
  CHECK(f.l1->state(key(2)) == object_state::write_locked);
  f.clock.advance(seconds(3));
  CHECK(f.l1->state(key(2)) == object_state::absent);
}

TEST_CASE("an expired read lock frees a temporary object and a removed one", "[l1][tier][ttl]") {
  fixture f;
  write_options o;
  o.temporary = true;
  REQUIRE(f.write(keys({1}), o) == all(1, status::success));
  REQUIRE(f.finish_and_read(keys({1})) == all(1, status::success));
  make_ready(f, keys({2}));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  REQUIRE(f.remove(keys({2}), true) == all(1, status::success));
  REQUIRE(f.l1->usage().slots_used == 2);
  f.clock.advance(seconds(300));
  CHECK(f.l1->expire_locks() == 2);
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.l1->usage().removing == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::temporary) == 1);
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 1);
}

TEST_CASE("an expired write lock of a removed object frees its memory", "[l1][tier][ttl]") {
  fixture f;
  REQUIRE(f.write(keys({1})) == all(1, status::success));
  REQUIRE(f.remove(keys({1}), true) == all(1, status::success));
  f.clock.advance(seconds(600));
  CHECK(f.l1->expire_locks() == 1);
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.counts->removed_total() == 1);
}

TEST_CASE("an allocation short of room reclaims expired locks first", "[l1][tier][ttl]") {
  fixture f(4);
  REQUIRE(f.write(keys({1, 2, 3, 4})) == all(4, status::success));  // a client that then crashed
  CHECK(f.write(keys({5})) == all(1, status::out_of_memory));
  f.clock.advance(seconds(601));
  CHECK(f.write(keys({5, 6})) == all(2, status::success));  // no expire_locks() call needed
  CHECK(f.counts->expired_as(bus::lock_kind::write) == 4);
  CHECK(f.l1->usage().objects == 2);
}

// ----------------------------------------------------------------------------------------
// allocation and eviction
// ----------------------------------------------------------------------------------------
TEST_CASE("a batch that does not fit allocates nothing and evicts nothing", "[l1][tier][eviction]") {
  fixture f(4, 1.0, 0.5);
  make_ready(f, keys({1, 2}));
  REQUIRE(f.read(keys({1, 2})) == all(2, status::success));  // locked: not evictable
  REQUIRE(f.write(keys({3})) == all(1, status::success));
  write_options o;
  o.mode = write_mode::all;
  o.purpose = bus::allocation_purpose::prefetch;
  // Two new keys, one free slot: both out_of_memory; the existing ones answer per mode.
  CHECK(f.write(keys({4, 1, 5}), o) ==
        std::vector<status>{status::out_of_memory, status::not_writable, status::out_of_memory});
  CHECK(f.l1->state(key(4)) == object_state::absent);
  CHECK(f.l1->state(key(5)) == object_state::absent);
  CHECK(f.l1->usage().slots_used == 3);
  CHECK(f.counts->allocation_failures == 1);
  CHECK(f.counts->allocation_failed_keys[static_cast<std::size_t>(bus::allocation_purpose::prefetch)] == 2);
  CHECK(f.counts->removed_total() == 0);
  CHECK(f.write(keys({4})) == all(1, status::success));  // one still fits
}

TEST_CASE("a batch that fits only after evicting takes unlocked objects, down to the target", "[l1][tier][eviction]") {
  fixture f(10, 0.8, 0.5);  // evict above 8 slots, down to 5
  make_ready(f, keys({1, 2, 3, 4, 5, 6, 7, 8}));
  REQUIRE(f.read(keys({1, 2})) == all(2, status::success));
  CHECK(f.write(keys({9})) == all(1, status::success));
  // 8 used + 1 > 8: evict 8 + 1 - 5 = 4 unlocked objects, LRU first (3, 4, 5, 6).
  CHECK(f.counts->removed_as(bus::removal_reason::evicted) == 4);
  CHECK(f.l1->usage().slots_used == 5);
  for (auto id : {1, 2, 7, 8, 9}) CHECK(f.l1->state(key(static_cast<std::uint64_t>(id))) != object_state::absent);
  for (auto id : {3, 4, 5, 6}) CHECK(f.l1->state(key(static_cast<std::uint64_t>(id))) == object_state::absent);
}

TEST_CASE("evict() frees down to the target only above the watermark", "[l1][tier][eviction]") {
  fixture f(10, 0.5, 0.2);  // watermark 5 slots, target 2
  make_ready(f, keys({1, 2, 3, 4, 5}));
  CHECK(f.l1->evict() == 0);  // at the watermark, not above
  // Locked objects cannot be evicted, so an allocation that fits in free slots goes above
  // the watermark.
  REQUIRE(f.read(keys({1, 2, 3, 4, 5})) == all(5, status::success));
  REQUIRE(f.write(keys({6, 7, 8})) == all(3, status::success));
  CHECK(f.counts->removed_total() == 0);
  CHECK(f.l1->usage().slots_used == 8);
  CHECK(f.l1->evict() == 0);  // everything is locked
  REQUIRE(f.finish(keys({6, 7, 8})) == all(3, status::success));
  REQUIRE(f.unread(keys({1, 2, 3, 4, 5})) == all(5, status::success));
  CHECK(f.l1->evict() == 6);
  CHECK(f.l1->usage().slots_used == 2);
  CHECK(f.counts->removed_as(bus::removal_reason::evicted) == 6);
  CHECK(f.l1->evict() == 0);
}

TEST_CASE("a full tier with the noop policy answers out_of_memory", "[l1][tier][eviction]") {
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 3;
  tier<noop> t(o);
  std::vector<status> out(3);
  REQUIRE(t.reserve_write(keys({1, 2, 3}), 100, {}, out) == 3);
  REQUIRE(t.finish_write(keys({1, 2, 3}), out) == 3);
  std::vector<status> one(1);
  CHECK(t.reserve_write(keys({4}), 100, {}, one) == 0);
  CHECK(one[0] == status::out_of_memory);
  CHECK(t.evict() == 0);
  CHECK(t.usage().objects == 3);
  REQUIRE(t.remove(keys({2}), false, one) == 1);
  CHECK(t.reserve_write(keys({4}), 100, {}, one) == 1);
}

TEST_CASE("clear removes unlocked objects, and locked ones only when forced", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2, 3}));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  REQUIRE(f.write(keys({4})) == all(1, status::success));
  CHECK(f.l1->clear(false) == 2);
  CHECK(f.l1->usage().objects == 2);
  CHECK(f.l1->clear(true) == 2);
  CHECK(f.l1->usage().objects == 0);
  CHECK(f.l1->usage().removing == 2);
  CHECK(f.unread(keys({2})) == all(1, status::success));
  CHECK(f.abandon(keys({4})) == all(1, status::success));
  CHECK(f.l1->usage().slots_used == 0);
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 4);
}

TEST_CASE("remove_if removes the matching objects, leaves locked ones unless forced, and a forced one keeps its "
          "bytes for its reader",
          "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2, 3, 4}));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  REQUIRE(f.write(keys({5})) == all(1, status::success));  // a write in flight
  std::vector<std::span<const std::byte>> views(1);
  std::vector<status> one(1);
  REQUIRE(f.l1->read_views(keys({2}), one, views) == 1);
  std::memset(const_cast<std::byte*>(views[0].data()), 0x5a, views[0].size());
  auto odd_or_in_use = [](const chunk_key& k) { return k.hash.lo % 2 == 1 || k.hash.lo == 2; };

  const removal_summary kept = f.l1->remove_if(odd_or_in_use, false);
  CHECK(kept.removed == 2);  // 1 and 3
  CHECK(kept.removed_bytes == 2000);
  CHECK(kept.locked == 2);  // 2 (read) and 5 (being written)
  CHECK(kept.locked_bytes == 2000);
  CHECK_FALSE(f.l1->contains(key(1)));
  CHECK(f.l1->contains(key(2)));
  CHECK(f.l1->contains(key(4)));  // not matched

  const removal_summary forced = f.l1->remove_if(odd_or_in_use, true);
  CHECK(forced.removed == 2);
  CHECK(forced.locked == 0);
  CHECK_FALSE(f.l1->contains(key(2)));  // gone for lookups at once
  CHECK(f.l1->usage().removing == 2);
  // The reader still sees its bytes: the slot is not reused until it lets go.
  REQUIRE(f.l1->read_views(keys({2}), one, views) == 1);
  CHECK(views[0][0] == std::byte{0x5a});
  CHECK(f.finish(keys({5})) == all(1, status::not_found));  // the writer finds its key gone
  CHECK(f.unread(keys({2})) == all(1, status::success));
  CHECK(f.l1->usage().slots_used == 1);  // 4 alone
  CHECK(f.counts->removed_as(bus::removal_reason::deleted) == 4);
}

TEST_CASE("for_each_object reports every object held with its size and state", "[l1][tier]") {
  fixture f;
  make_ready(f, keys({1, 2}));
  REQUIRE(f.read(keys({2})) == all(1, status::success));
  REQUIRE(f.write(keys({3}), {}, 300) == all(1, status::success));
  REQUIRE(f.write(keys({4})) == all(1, status::success));
  REQUIRE(f.read(keys({4})) == all(1, status::not_readable));
  REQUIRE(f.remove(keys({1})) == all(1, status::success));
  std::map<std::uint64_t, std::pair<std::size_t, object_state>> seen;
  f.l1->for_each_object([&](const chunk_key& k, std::size_t bytes, object_state st) {
    CHECK(seen.emplace(k.hash.lo, std::pair{bytes, st}).second);
  });
  CHECK(seen.size() == 3);
  CHECK(seen[2] == std::pair{std::size_t{1000}, object_state::read_locked});
  CHECK(seen[3] == std::pair{std::size_t{300}, object_state::write_locked});
  CHECK(seen[4].second == object_state::write_locked);
}

// ----------------------------------------------------------------------------------------
// the default bus
// ----------------------------------------------------------------------------------------
TEST_CASE("a tier without a bus works and publishes nothing", "[l1][tier]") {
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 2;
  tier<> t(o);
  static_assert(std::is_same_v<decltype(t), tier<lru, bus::null_bus>>);
  std::vector<status> out(1);
  CHECK(t.reserve_write(keys({1}), 10, {}, out) == 1);
  CHECK(t.finish_write(keys({1}), out) == 1);
  CHECK(t.contains(key(1)));
}

// ----------------------------------------------------------------------------------------
// partial batches, prefixes, holds handed to several readers
// ----------------------------------------------------------------------------------------
TEST_CASE("a partial batch allocates the new keys that fit, in order, and refuses the rest", "[l1][tier][eviction]") {
  fixture f(4, 1.0, 0.5);
  make_ready(f, keys({1, 2}));
  REQUIRE(f.read(keys({1})) == all(1, status::success));  // locked: key 2 is the only victim
  write_options o;
  o.all_or_nothing = false;
  CHECK(f.write(keys({3, 4, 5, 6}), o) ==
        std::vector<status>{status::success, status::success, status::success, status::out_of_memory});
  CHECK(f.l1->state(key(2)) == object_state::absent);  // evicted for the part that fits
  CHECK(f.l1->state(key(6)) == object_state::absent);
  CHECK(f.counts->allocation_failed_keys[static_cast<std::size_t>(bus::allocation_purpose::store)] == 1);
  CHECK(f.counts->write_refused == 1);
}

namespace {
struct prefix_call {
  prefix_result r;
  std::vector<prefix_take> takes;
  std::vector<std::span<std::byte>> buffers;
};
prefix_call prefix(fixture& f, const std::vector<chunk_key>& ks, std::vector<bool> loadable,
                   std::vector<bool> waitable = {}, prefix_options o = {}) {
  prefix_call c;
  c.takes.resize(ks.size());
  c.buffers.resize(ks.size());
  if (o.object_bytes == 0) o.object_bytes = 1000;
  waitable.resize(ks.size(), false);
  loadable.resize(ks.size(), false);
  c.r = f.l1->reserve_prefix(
      ks, o, [&](std::size_t i) { return static_cast<bool>(loadable[i]); },
      [&](std::size_t i) { return static_cast<bool>(waitable[i]); }, c.takes, c.buffers);
  return c;
}
}  // namespace

TEST_CASE("reserve_prefix reads what L1 holds, writes what only the caller can load, waits where told",
          "[l1][tier][prefix]") {
  fixture f(8);
  make_ready(f, keys({2, 3}));
  REQUIRE(f.write(keys({4})) == all(1, status::success));  // being written by a writer the caller knows
  const auto c =
      prefix(f, keys({1, 2, 3, 4, 5, 6}), {true, false, false, false, true, false}, {false, false, false, true});
  CHECK(c.r.length == 5);
  CHECK(c.r.end == prefix_end::missing);  // key 6: absent, not loadable
  CHECK(c.takes == std::vector<prefix_take>{prefix_take::write, prefix_take::read, prefix_take::read, prefix_take::wait,
                                            prefix_take::write, prefix_take::none});
  CHECK(c.r.reads == 2);
  CHECK(c.r.writes == 2);
  CHECK(c.r.waits == 1);
  CHECK(c.buffers[0].size() == 1000);
  CHECK(c.buffers[1].empty());
  CHECK(f.l1->state(key(1)) == object_state::write_locked);
  CHECK(f.l1->info(key(2))->pinned_readers == 1);
  CHECK(f.l1->state(key(6)) == object_state::absent);
  CHECK(f.counts->read_reserved == 2);
  CHECK(f.counts->read_refused == 0);  // not asked to count the end
}

TEST_CASE("reserve_prefix takes the longest prefix that fits and gives back, uncounted, what lies past it",
          "[l1][tier][prefix]") {
  fixture f(4, 1.0, 0.5);
  make_ready(f, keys({2, 4}));  // two slots left
  const std::uint64_t reads_before = f.counts->read_reserved;
  // 1 write, 2 read, 3 write, 4 read, 5 write: room for two new keys, so the prefix ends at 5.
  const auto c = prefix(f, keys({1, 2, 3, 4, 5}), {true, false, true, false, true});
  CHECK(c.r.length == 4);
  CHECK(c.r.end == prefix_end::no_room);
  CHECK(c.r.short_of_room == 1);
  CHECK(c.r.writes == 2);
  CHECK(f.counts->read_reserved - reads_before == 2);
  CHECK(f.counts->allocation_failed_keys[static_cast<std::size_t>(bus::allocation_purpose::prefetch)] == 1);
  // The reads of the prefix were never evicted to make room, and nothing stays held past it.
  CHECK(f.l1->state(key(2)) == object_state::read_locked);
  CHECK(f.l1->state(key(4)) == object_state::read_locked);
  CHECK(f.l1->state(key(5)) == object_state::absent);
}

TEST_CASE("reserve_prefix cut by room releases the reads it took past the cut", "[l1][tier][prefix]") {
  fixture f(3, 1.0, 0.5);
  make_ready(f, keys({2, 4}));  // one slot left
  REQUIRE(f.read(keys({4})) == all(1, status::success));  // another reader: 4 cannot be evicted
  const std::uint64_t reads_before = f.counts->read_reserved;
  const auto c = prefix(f, keys({1, 2, 3, 4}), {true, false, true, false});
  CHECK(c.r.length == 2);  // 1 write, 2 read; 3 has no slot
  CHECK(c.r.end == prefix_end::no_room);
  CHECK(c.takes[3] == prefix_take::none);
  CHECK(f.l1->info(key(4))->expiring_readers == 1);  // the walk's hold on 4 went back, the other stays
  CHECK(f.l1->info(key(4))->pinned_readers == 0);
  CHECK(f.counts->read_reserved - reads_before == 1);
  CHECK(f.counts->read_finished == 0);
}

TEST_CASE("reserve_prefix evicts its own unlocked reads past the longest prefix whose new keys fit",
          "[l1][tier][prefix]") {
  // The long document: 48 chunks on L2, a 24-slot L1 full of its back half (24..47), unlocked.
  // Holding 24..47 leaves no room for 0..23; giving them up makes room for 0..23: the prefix
  // is the front half, every round, instead of nothing.
  fixture f(24, 0.8, 0.7);
  std::vector<chunk_key> doc;
  for (std::uint64_t i = 0; i < 48; ++i) doc.push_back(key(1000 + i));
  const std::vector<chunk_key> front(doc.begin(), doc.begin() + 24);
  const std::vector<chunk_key> back(doc.begin() + 24, doc.end());
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    make_ready(f, back);  // what the engine recomputed and stored last round
    const std::uint64_t evicted_before = f.counts->removed_as(bus::removal_reason::evicted);
    const std::uint64_t failed_before = f.counts->allocation_failures;
    prefix_options o;
    o.temporary = true;  // a prefetch somebody waits for
    const auto c = prefix(f, doc, std::vector<bool>(48, true), {}, o);
    CHECK(c.r.length == 24);
    CHECK(c.r.writes == 24);
    CHECK(c.r.reads == 0);
    CHECK(c.r.short_of_room == 0);  // no key of the prefix lacked a slot
    CHECK(c.r.end == prefix_end::no_room);
    CHECK(f.counts->allocation_failures == failed_before);
    CHECK(f.counts->removed_as(bus::removal_reason::evicted) - evicted_before == 24);
    for (std::size_t i = 0; i < 48; ++i) {
      INFO("key " << i);
      CHECK(c.takes[i] == (i < 24 ? prefix_take::write : prefix_take::none));
      CHECK(f.l1->state(doc[i]) == (i < 24 ? object_state::write_locked : object_state::absent));
    }
    // The loads land and the reader is done with them: temporary, they go.
    std::vector<status> out(24);
    const std::vector<std::uint32_t> holds(24, 1);
    REQUIRE(f.l1->finish_write_and_reserve_read(front, holds, lock_lifetime::pinned, out) == 24);
    REQUIRE(f.unread(front, 0, lock_lifetime::pinned) == all(24, status::success));
    CHECK(f.l1->usage().slots_used == 0);
  }
}

TEST_CASE("reserve_prefix keeps the reads inside the prefix it returns and never evicts another holder's",
          "[l1][tier][prefix]") {
  fixture f(4, 1.0, 0.5);
  make_ready(f, keys({2, 4, 5, 6}));  // full
  REQUIRE(f.read(keys({5})) == all(1, status::success));  // held by someone else
  // 1 write, 2 read, 3 write, 4 read, 5 read, 6 read. Giving up 4 and 6 (5 is held elsewhere)
  // makes room for 1 and 3: the prefix is 1, 2, 3.
  const auto c = prefix(f, keys({1, 2, 3, 4, 5, 6}), {true, false, true, false, false, false});
  CHECK(c.r.length == 3);
  CHECK(c.r.end == prefix_end::no_room);
  CHECK(c.r.writes == 2);
  CHECK(c.r.reads == 1);
  CHECK(f.l1->state(key(2)) == object_state::read_locked);  // inside the prefix: held, not evicted
  CHECK(f.l1->info(key(2))->pinned_readers == 1);
  CHECK(f.l1->state(key(4)) == object_state::absent);
  CHECK(f.l1->state(key(6)) == object_state::absent);
  CHECK(f.l1->info(key(5))->expiring_readers == 1);  // the other holder's object stays
  CHECK(f.l1->info(key(5))->pinned_readers == 0);
}

TEST_CASE("reserve_prefix misused with a loadable key and no object size throws and holds nothing",
          "[l1][tier][prefix]") {
  fixture f(8);
  make_ready(f, keys({1}));
  std::vector<prefix_take> takes(2);
  prefix_options o;  // object_bytes 0: no key may be loadable
  CHECK_THROWS_AS(f.l1->reserve_prefix(
                      keys({1, 2}), o, [](std::size_t i) { return i == 1; }, [](std::size_t) { return false; }, takes),
                  std::invalid_argument);
  CHECK(f.l1->state(key(1)) == object_state::ready);  // the walk's hold on key 1 went back
  CHECK(f.l1->state(key(2)) == object_state::absent);
  CHECK(f.counts->read_reserved == 0);
}

TEST_CASE("a read prefix stops at the first key it cannot read and touches nothing after it", "[l1][tier][prefix]") {
  fixture f(8);
  make_ready(f, keys({1, 3}));
  std::vector<prefix_take> takes(3);
  prefix_options o;
  o.count_refused_read = true;
  const auto r = f.l1->reserve_read_prefix(keys({1, 2, 3}), o, takes);
  CHECK(r.length == 1);
  CHECK(r.end == prefix_end::missing);
  CHECK(takes[2] == prefix_take::none);
  CHECK(f.l1->state(key(3)) == object_state::ready);
  CHECK(f.counts->read_reserved == 1);
  CHECK(f.counts->read_refused == 1);
  // An object of another size ends a prefix that asks for a size.
  o.object_bytes = 2000;
  CHECK(f.l1->reserve_read_prefix(keys({1}), o, std::span(takes).first(1)).end == prefix_end::wrong_size);
}

TEST_CASE("reserve_prefix refuses a key repeated as a new key, and busy keys it is not told to wait for",
          "[l1][tier][prefix]") {
  fixture f(8);
  auto c = prefix(f, keys({1, 1}), {true, true});
  CHECK(c.r.length == 1);
  CHECK(c.r.end == prefix_end::busy);
  c = prefix(f, keys({1}), {true});  // key 1 is write-locked now, nobody waits for it
  CHECK(c.r.length == 0);
  CHECK(c.r.end == prefix_end::busy);
}

TEST_CASE("one load can be handed to several readers, and a temporary one nobody reads is freed at once",
          "[l1][tier]") {
  fixture f(8);
  write_options o;
  o.temporary = true;
  o.lock = lock_lifetime::pinned;
  REQUIRE(f.write(keys({1, 2}), o) == all(2, status::success));
  std::vector<status> out(2);
  const std::vector<std::uint32_t> holds = {3, 0};
  CHECK(f.l1->finish_write_and_reserve_read(keys({1, 2}), holds, lock_lifetime::pinned, out) == 2);
  CHECK(f.l1->info(key(1))->pinned_readers == 3);
  CHECK(f.l1->state(key(2)) == object_state::absent);
  CHECK(f.counts->removed_as(bus::removal_reason::temporary) == 1);
  CHECK(f.unread(keys({1}), 0, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.unread(keys({1}), 1, lock_lifetime::pinned) == all(1, status::success));
  CHECK(f.l1->state(key(1)) == object_state::absent);  // freed with its last reader
}
