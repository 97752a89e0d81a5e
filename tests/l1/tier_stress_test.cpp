#include <kvtier/l1/tier.hpp>

#include <kvtier/config.hpp>
#include <kvtier/l1/policy/arc.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l1/policy/s3fifo.hpp>

#include "l1/support.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using namespace kvtier;
using namespace kvtier::l1;
using kvtier::l1::test::key;

namespace {

constexpr std::size_t object_bytes = 512;

std::byte pattern(std::uint64_t id) { return static_cast<std::byte>(id * 37 + 11); }

// A clock several threads read while one moves it.
struct atomic_clock {
  std::shared_ptr<std::atomic<std::int64_t>> ns = std::make_shared<std::atomic<std::int64_t>>(0);
  clock_type::time_point operator()() const {
    return clock_type::time_point{} + std::chrono::hours(1) + std::chrono::nanoseconds(ns->load());
  }
};

struct thread_stats {
  std::uint64_t created = 0;   // new-mode reservations that succeeded
  std::uint64_t reserved = 0;  // all reservations that succeeded
  std::uint64_t ended = 0;     // finish/abandon calls answering success or not_found
  std::uint64_t read_holds = 0;
  std::uint64_t bad = 0;      // answers the state machine does not allow
  std::uint64_t corrupt = 0;  // a read-locked object whose bytes changed
  int first_bad_line = 0;     // where the first bad answer was seen
  void fail(int line) {
    if (bad++ == 0) first_bad_line = line;
  }
};

// One client thread: random batches on overlapping keys. When locks expire (with_expiry),
// memory is touched only under pinned locks (an expiring lock may expire while held: that is
// its contract), and a write under an expiring lock is left to expire, like a client that
// crashed (ending it late could end another client's reservation of the same key, the ABA
// that docs/l1.md describes), so every readable object holds its key's pattern.
template <class Tier>
void client(Tier& t, unsigned seed, int ops, std::size_t key_space, const atomic_clock* clock, thread_stats& st) {
  const bool with_expiry = clock != nullptr;
  std::mt19937_64 rng(seed);
  std::vector<status> out;
  std::vector<std::span<std::byte>> bufs;
  std::vector<std::span<const std::byte>> views(1);
  std::vector<chunk_key> ks;
  auto good_end = [&](status s) {
    if (s == status::success || s == status::not_found)
      ++st.ended;
    else
      st.fail(__LINE__);
  };
  auto verify = [&](const chunk_key& k) {
    std::vector<status> o(1);
    const std::span<const chunk_key> one(&k, 1);
    if (t.read_views(one, o, views) != 1 || views[0].size() != object_bytes) {
      st.fail(__LINE__);
      return;
    }
    for (auto b : views[0])
      if (b != pattern(k.hash.lo)) {
        ++st.corrupt;
        return;
      }
  };
  for (int i = 0; i < ops; ++i) {
    // Every client moves time on: 20 s every 25 operations, so a lock left behind expires
    // after about 750 operations of its thread (write TTL 600 s).
    if (with_expiry && i % 25 == 0) clock->ns->fetch_add(std::chrono::nanoseconds(std::chrono::seconds(20)).count());
    const auto op = rng() % 10;
    const bool pinned = rng() % 2 == 0;
    const auto life = pinned ? lock_lifetime::pinned : lock_lifetime::expiring;
    ks.clear();
    const std::size_t n = op < 3 ? 1 + rng() % 3 : 1;
    for (std::size_t j = 0; j < n; ++j) ks.push_back(key(rng() % key_space));
    out.assign(ks.size(), status::success);
    if (op < 3) {  // write, then finish, finish-and-read or abandon
      write_options o;
      o.mode = rng() % 5 == 0 ? write_mode::update : write_mode::new_only;
      o.lock = life;
      o.temporary = rng() % 4 == 0;
      bufs.assign(ks.size(), {});
      st.reserved += t.reserve_write(ks, object_bytes, o, out, bufs);
      for (std::size_t j = 0; j < ks.size(); ++j) {
        if (out[j] != status::success) {
          if (out[j] != status::not_writable && out[j] != status::out_of_memory && out[j] != status::not_found)
            st.fail(__LINE__);
          continue;
        }
        if (o.mode == write_mode::new_only) ++st.created;
        if (!pinned && with_expiry) continue;  // crashed: the TTL cleans up
        std::memset(bufs[j].data(), static_cast<int>(pattern(ks[j].hash.lo)), object_bytes);
        const std::span<const chunk_key> one(&ks[j], 1);
        std::vector<status> r(1);
        const auto end = rng() % 6;
        if (end < 3) {
          t.finish_write(one, r);
          good_end(r[0]);
        } else if (end < 5) {
          t.finish_write_and_reserve_read(one, 0, lock_lifetime::pinned, r);
          good_end(r[0]);
          if (r[0] == status::success) {
            verify(ks[j]);
            t.finish_read(one, 0, lock_lifetime::pinned, r);
            if (r[0] != status::success) st.fail(__LINE__);
          }
        } else {
          t.abandon_write(one, r);
          good_end(r[0]);
        }
      }
    } else if (op < 6) {  // read, check the bytes, release
      const std::uint32_t extra = static_cast<std::uint32_t>(rng() % 2);
      if (t.reserve_read(ks, extra, life, out) == 1) {
        ++st.read_holds;
        if (pinned || !with_expiry) verify(ks[0]);
        t.finish_read(ks, extra, life, out);
        // An expired holder hears wrong_state, or not_found when its object was freed with
        // the expiry (a temporary or removed object).
        const bool expired_answer = out[0] == status::wrong_state || out[0] == status::not_found;
        if (out[0] != status::success && !(expired_answer && !pinned && with_expiry)) st.fail(__LINE__);
      } else if (out[0] != status::not_found && out[0] != status::not_readable) {
        st.fail(__LINE__);
      }
    } else if (op == 6) {
      t.remove(ks, rng() % 2 == 0, out);
      if (out[0] != status::success && out[0] != status::not_found && out[0] != status::locked) st.fail(__LINE__);
    } else if (op == 7) {
      (void)t.touch(ks);
    } else if (op == 8) {
      (void)(rng() % 2 ? t.evict() : t.expire_locks());
    } else {
      const auto u = t.usage();
      if (u.slots_used != u.objects + u.removing || u.slots_used > t.slot_count() || u.evictable > u.objects ||
          u.read_locked > u.slots_used || u.write_locked > u.slots_used)
        st.fail(__LINE__);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("concurrent clients keep the tier consistent while it evicts constantly", "[l1][tier][concurrency]",
                   lru, s3fifo, arc, noop) {
  const bool with_expiry = GENERATE(false, true);
  CAPTURE(with_expiry);
  atomic_clock clock;
  test::l1_recorder recorder;
  auto counts = recorder.c;
  test::recording_bus bus{recorder};
  tier_options o;
  o.slot_bytes = 4096;
  o.slot_count = 16;
  o.eviction_watermark = 0.75;
  o.eviction_target = 0.5;
  o.clock = clock;
  tier<TestType, test::recording_bus> t(o, bus);

  constexpr int threads = 4;
  const int ops = config::tsan_build ? 3000 : 20'000;
  std::vector<thread_stats> stats(threads);
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&, i] {
      client(t, 1000u + static_cast<unsigned>(i), ops, 48, with_expiry ? &clock : nullptr,
             stats[static_cast<std::size_t>(i)]);
    });
  for (auto& th : pool) th.join();

  thread_stats sum;
  for (const auto& s : stats) {
    sum.created += s.created;
    sum.reserved += s.reserved;
    sum.ended += s.ended;
    sum.read_holds += s.read_holds;
    sum.bad += s.bad;
    if (s.bad > 0) sum.first_bad_line = s.first_bad_line;
    sum.corrupt += s.corrupt;
  }
  INFO("created " << sum.created << ", reserved " << sum.reserved << ", ended " << sum.ended << ", read holds "
                  << sum.read_holds << ", expired " << counts->expired_as(bus::lock_kind::write) << " write / "
                  << counts->expired_as(bus::lock_kind::read) << " read, oom keys "
                  << counts->allocation_failed_keys[0] + counts->allocation_failed_keys[1]);
  INFO("first bad answer checked at line " << sum.first_bad_line);
  CHECK(sum.bad == 0);
  CHECK(sum.corrupt == 0);
  CHECK(sum.created > 0);
  // With expiry the tier can spend the whole run full of crashed writers' locks (noop never
  // evicts), so reads may all miss; the check that expiry did its job is below.
  if (!with_expiry) CHECK(sum.read_holds > 0);

  auto u = t.usage();
  CHECK(u.slots_used == u.objects + u.removing);
  // Every lock was released (or, with expiry, lets go now): clearing leaves nothing behind.
  clock.ns->fetch_add(std::chrono::nanoseconds(std::chrono::hours(1)).count());
  t.expire_locks();
  t.clear(false);
  u = t.usage();
  CHECK(u.objects == 0);
  CHECK(u.removing == 0);
  CHECK(u.slots_used == 0);
  CHECK(u.evictable == 0);
  CHECK(u.read_locked == 0);
  CHECK(u.write_locked == 0);
  // Each object created went away exactly once, whatever the reason.
  CHECK(counts->removed_total() == sum.created);
  CHECK(counts->write_reserved == sum.reserved);
  if (with_expiry) {
    CHECK(counts->expired_as(bus::lock_kind::write) > 0);  // the crashed writers' locks went
  } else {
    CHECK(sum.ended == sum.reserved);  // every reservation ended exactly once
    CHECK(counts->read_reserved + counts->finished_and_read_reserved == counts->read_finished);
    CHECK(counts->expired_as(bus::lock_kind::read) + counts->expired_as(bus::lock_kind::write) == 0);
  }
}
