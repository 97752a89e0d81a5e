// The façade and both pipelines over the disk backend (O_DIRECT, io_uring where allowed):
// stores go through L1 to disk and come back byte-exact; a corrupt file is a miss; a hung
// load (the fault injector around the disk) does not hang the lookup, and the slots it
// would write stay reserved until it completes.
#include <kvtier/cache/tiered_cache.hpp>

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <catch2/catch.hpp>

#include "cache/cache_checks.hpp"
#include "support/asio.hpp"
#include "support/process.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_disk_pipeline_test {

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::run_sync;

namespace {

constexpr std::size_t object_bytes = 256 * 1024;
using metrics_bus = bus::basic_event_bus<telemetry::metrics_subscriber>;

template <class Store = pipeline::write_through, class Eviction = l1::lru>
struct traits : cache::default_traits {
  using eviction_policy = Eviction;
  using bus_type = metrics_bus;
  using store_policy = Store;
  using wait_policy = pipeline::wait_complete;
};

chunk_key key(std::uint64_t i) { return chunk_key{0xd15c, 1, 0, hash128{i, i * 131}}; }

std::vector<std::byte> payload(const chunk_key& k) {
  std::vector<std::byte> b(object_bytes);
  for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<std::byte>(k.hash.lo * 29 + j * 3 + (j >> 11));
  return b;
}

std::vector<chunk_key> keys(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(key(first + i));
  return k;
}

template <class Traits = traits<>>
struct fixture {
  test::temp_dir dir{"kvtier-disk-pipeline"};
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  std::shared_ptr<l2::disk_backend> disk;
  std::shared_ptr<l2::fault_injecting_backend<l2::disk_backend>> faulty;
  std::unique_ptr<cache::tiered_cache<Traits>> cache;
  std::uint64_t last_id = 0;

  explicit fixture(std::chrono::nanoseconds wait_cap = std::chrono::seconds(60), std::size_t l1_slots = 32) {
    l2::disk_backend_options d;
    d.path = dir.path() / "l2";
    d.capacity_bytes = std::uint64_t{256} << 20;
    disk = std::make_shared<l2::disk_backend>(io.get_executor(), d);
    telemetry::collect_disk_backend(reg, *disk);
    faulty = std::make_shared<l2::fault_injecting_backend<l2::disk_backend>>(*disk);
    cache::cache_options o;
    o.l1.slot_bytes = object_bytes;
    o.l1.slot_count = l1_slots;
    o.l1.eviction_watermark = 1.0;
    o.l1.eviction_target = 0.9;
    typename cache::tiered_cache<Traits>::policies p;
    p.wait.cap = wait_cap;
    cache = std::make_unique<cache::tiered_cache<Traits>>(
        io.get_executor(), o, events, std::vector<l2::any_backend>{l2::any_backend(faulty)}, std::move(p));
    // The server registers the L1 arena once; reads into L1 slots then use fixed buffers.
    (void)disk->register_buffers(cache->l1().arena());
  }

  double metric(const char* name, const telemetry::label_pairs& l = {}) { return reg.value(name, l).value_or(-1); }

  void settle() {
    run_sync(io, [&]() -> asio::awaitable<void> { co_await cache->wait_idle(); }());
  }

  void put_l1(std::span<const chunk_key> ks) {
    std::vector<l1::status> st(ks.size());
    std::vector<std::span<std::byte>> buf(ks.size());
    cache->reserve_write(ks, object_bytes, st, buf);
    for (std::size_t i = 0; i < ks.size(); ++i) {
      REQUIRE(st[i] == l1::status::success);
      const auto p = payload(ks[i]);
      std::memcpy(buf[i].data(), p.data(), p.size());
    }
    cache->finish_write(ks, {}, st);
    settle();
  }

  std::uint64_t start(std::span<const chunk_key> ks) {
    cache::lookup_request r;
    r.keys = ks;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    last_id = cache->start_lookup(r);
    return last_id;
  }

  cache::lookup_status wait(std::uint64_t id) {
    auto [ec, st] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
      co_return co_await cache->async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    return st;
  }

  cache::lookup_status lookup(std::span<const chunk_key> ks) {
    const auto st = wait(start(ks));
    settle();
    return st;
  }

  // Copies a locked object out and compares it with what was written.
  bool serves_right_bytes(const chunk_key& k) { return test::serves_bytes(*cache, k, payload(k)); }
};

}  // namespace

TEST_CASE("stores go through L1 to disk and a lookup loads them back byte-exact", "[cache][disk]") {
  fixture<traits<pipeline::skip_l1, l1::noop>> f;  // L1 drops each key once the disk has it
  const auto k = keys(0, 6);
  f.put_l1(k);
  CHECK(f.metric("kvtier_l2_store_succeeded_keys_total", {{"backend", "disk"}}) == 6);
  CHECK(f.disk->usage().objects == 6);
  for (const auto& x : k) {
    CHECK(f.cache->l1().state(x) == l1::object_state::absent);
    CHECK(std::filesystem::exists(f.disk->object_file(x)));
  }
  const auto st = f.lookup(k);
  CHECK(st.chunks == 6);
  CHECK(st.l1_chunks == 0);
  CHECK(f.metric("kvtier_l2_prefetch_loaded_keys_total") == 6);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
  CHECK(f.metric("kvtier_l2_disk_read_bytes_total", {{"backend", "disk"}}) == 6.0 * object_bytes);
  f.cache->release_all(f.last_id);
  for (const auto& x : k) CHECK(f.disk->pins(x) == 0);  // the prefetch unpinned what it loaded
}

TEST_CASE("an object corrupted on disk is a miss, dropped from the disk, never served", "[cache][disk]") {
  fixture<traits<pipeline::skip_l1, l1::noop>> f;
  const auto k = keys(10, 3);
  f.put_l1(k);
  REQUIRE(f.disk->corrupt_stored(k[1]));
  const auto st = f.lookup(k);
  CHECK(st.chunks == 1);
  CHECK(f.serves_right_bytes(k[0]));
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::absent);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "corrupt_object"}}) == 1);
  CHECK(f.metric("kvtier_l2_disk_corrupt_objects_total", {{"backend", "disk"}}) == 1);
  CHECK(f.disk->usage().objects == 2);
}

TEST_CASE("a hung disk load does not hang the lookup, and its slots stay reserved until it completes",
          "[cache][disk]") {
  fixture<traits<pipeline::skip_l1, l1::noop>> f(std::chrono::milliseconds(50));
  const auto k = keys(20, 2);
  f.put_l1(k);
  f.faulty->inject({.op = l2::fault_op::load, .kind = l2::fault_kind::hang, .times = 1});
  const auto st = f.wait(f.start(k));
  CHECK(st.chunks == 0);  // answered at the wait budget
  REQUIRE(f.faulty->hung() == 1);
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::write_locked);
  CHECK(f.cache->l1().state(k[1]) == l1::object_state::write_locked);
  f.faulty->release_hung();
  f.settle();  // the late disk load ran into the still-reserved slots, which were then dropped
  CHECK(f.cache->l1().state(k[0]) == l1::object_state::absent);
  CHECK(f.cache->l1().usage().slots_used == 0);
  CHECK(f.disk->io_in_flight() == 0);
  CHECK(f.metric("kvtier_l2_prefetch_failure_keys_total", {{"reason", "timeout"}}) == 2);
  // The disk still has both, whole: a later lookup loads them.
  const auto again = f.lookup(k);
  CHECK(again.chunks == 2);
  for (const auto& x : k) CHECK(f.serves_right_bytes(x));
}

// --- issue 13: a small L1 in front of the disk ---------------------------------------------------

TEST_CASE("a prompt longer than L1 is stored whole and later served from disk as far as L1 can take it",
          "[cache][disk][small_l1]") {
  fixture<> f(std::chrono::seconds(60), 24);  // write-through, LRU, 24 slots
  const auto k = keys(100, 48);
  std::vector<l1::status> st(k.size());
  std::vector<std::span<std::byte>> buf(k.size());
  CHECK(f.cache->reserve_write(k, object_bytes, st, buf) == 48);  // 24 L1 slots, 24 staged for L2
  for (std::size_t i = 0; i < k.size(); ++i) {
    REQUIRE(st[i] == l1::status::success);
    REQUIRE(buf[i].size() == object_bytes);
    const auto p = payload(k[i]);
    std::memcpy(buf[i].data(), p.data(), p.size());
  }
  CHECK(f.cache->finish_write(k, {}, st) == 48);
  f.settle();
  CHECK(f.disk->usage().objects == 48);
  CHECK(f.metric("kvtier_l2_store_succeeded_keys_total", {{"backend", "disk"}}) == 48);
  CHECK(f.cache->status().store_inflight_bytes == 0);
  // L1 now holds what fit; a lookup takes it and continues from the disk as far as L1 allows.
  const auto first = f.lookup(k);
  CHECK(first.chunks == 24);
  f.cache->release_all(f.last_id);
  f.cache->clear(false);
  const auto st2 = f.lookup(k);
  CHECK(st2.chunks == 24);  // the longest prefix L1 can take, from the disk
  CHECK(st2.l1_chunks == 0);
  for (std::size_t i = 0; i < 24; ++i) CHECK(f.serves_right_bytes(k[i]));
  f.cache->release_all(f.last_id);
  // With room, the whole prompt comes back from disk byte-exact, in two lookups of 24.
  f.cache->clear(false);
  const auto tail = f.lookup(std::span(k).subspan(24));
  CHECK(tail.chunks == 24);
  for (std::size_t i = 24; i < 48; ++i) CHECK(f.serves_right_bytes(k[i]));
  f.cache->release_all(f.last_id);
}

TEST_CASE("two 15-chunk documents looked up together in a 24-slot L1 both hit", "[cache][disk][small_l1]") {
  fixture<traits<pipeline::skip_l1>> f(std::chrono::seconds(60), 24);
  const auto a = keys(200, 15);
  const auto b = keys(300, 15);
  f.put_l1(a);  // skip_l1: on disk only afterwards
  f.put_l1(b);
  REQUIRE(f.disk->usage().objects == 30);
  REQUIRE(f.cache->l1().usage().objects == 0);
  const auto ia = f.start(a);
  const auto ib = f.start(b);
  const auto sa = f.wait(ia);
  const auto sb = f.wait(ib);
  f.settle();
  CHECK(sa.chunks + sb.chunks == 24);  // every slot serves one of them
  CHECK(sa.chunks > 0);
  CHECK(sb.chunks > 0);
  for (std::size_t i = 0; i < sa.chunks; ++i) CHECK(f.serves_right_bytes(a[i]));
  for (std::size_t i = 0; i < sb.chunks; ++i) CHECK(f.serves_right_bytes(b[i]));
  f.cache->release_all(ia);
  f.cache->release_all(ib);
  CHECK(f.cache->l1().usage().slots_used == 0);
}

TEST_CASE("two lookups prefetching the same document at once share the load and both hit", "[cache][disk][small_l1]") {
  fixture<traits<pipeline::skip_l1>> f(std::chrono::seconds(60), 24);
  const auto d = keys(400, 15);
  f.put_l1(d);
  REQUIRE(f.cache->l1().usage().objects == 0);
  const auto i1 = f.start(d);
  const auto i2 = f.start(d);
  const auto s1 = f.wait(i1);
  const auto s2 = f.wait(i2);
  f.settle();
  CHECK(s1.chunks == 15);
  CHECK(s2.chunks == 15);
  CHECK(f.metric("kvtier_l2_prefetch_load_keys_total") == 15);  // loaded once, for both
  CHECK(f.cache->l1().usage().slots_used == 15);
  for (const auto& x : d) CHECK(f.serves_right_bytes(x));
  f.cache->release_all(i1);
  for (const auto& x : d) CHECK(f.cache->l1().state(x) == l1::object_state::read_locked);  // still the other's
  f.cache->release_all(i2);
  CHECK(f.cache->l1().usage().slots_used == 0);  // temporary: freed with the last reader
}

TEST_CASE("L1's registration pieces start and end on huge-page boundaries inside the arena", "[cache][disk]") {
  // io_uring coalesces a registered buffer into 2 MiB segments only when every page of it is
  // in a huge page: a piece holding the arena's unaligned head or tail (4 KiB pages) would
  // make every 1 MiB read into it a request of 256 pages, which virtio-blk (254 segments)
  // splits in two. So the head and the tail are pieces of their own.
  constexpr std::size_t huge = cache::l1_register_align_bytes;
  // Never touched (only addresses are computed): no page of it becomes resident.
  const std::size_t memory_bytes = 3 * cache::l1_register_piece_bytes / 2 + 4 * huge;
  const auto memory = std::make_unique_for_overwrite<std::byte[]>(memory_bytes);
  const auto at = reinterpret_cast<std::uintptr_t>(memory.get());
  const std::size_t skew = (huge - at % huge) % huge + 4096;  // the arena starts 4 KiB past a boundary
  const std::span<std::byte> arena(memory.get() + skew, memory_bytes - skew - 8192);
  const auto base = reinterpret_cast<std::uintptr_t>(arena.data());
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  for (std::size_t from = 0; from < arena.size();) {
    const std::size_t to = cache::l1_register_piece_end(arena, from);
    REQUIRE(to > from);
    pieces.emplace_back(from, to);
    from = to;
  }
  REQUIRE(pieces.size() >= 3);
  CHECK(pieces.front().first == 0);
  CHECK(pieces.back().second == arena.size());
  for (std::size_t k = 0; k + 1 < pieces.size(); ++k) {
    INFO("piece " << k);
    CHECK((base + pieces[k].second) % huge == 0);  // every cut inside the arena on a boundary
    CHECK(pieces[k].second - pieces[k].first <= cache::l1_register_piece_bytes);
  }
  CHECK(pieces.front().second == huge - 4096);  // the head: up to the first boundary
  CHECK((base + arena.size()) % huge != 0);
  CHECK(pieces.back().second - pieces.back().first < huge);  // the tail: from the last boundary
  // An aligned arena has no head piece; a tiny one is one piece.
  const std::span<std::byte> aligned(memory.get() + skew - 4096, 3 * huge);
  CHECK(cache::l1_register_piece_end(aligned, 0) == 3 * huge);
  CHECK(cache::l1_register_piece_end(arena.subspan(0, 8192), 0) == 8192);
}

TEST_CASE("register_l1 hands L1 to a disk backend as io_uring fixed buffers, and says who took it",
          "[cache][disk]") {
  // What a program embedding the cache does once L1 is resident (the server does the same,
  // a piece per turn of its I/O thread).
  test::temp_dir dir{"kvtier-register-l1"};
  asio::io_context io;
  telemetry::registry reg;
  metrics_bus events{telemetry::metrics_subscriber{reg}};
  l2::disk_backend_options d;
  d.path = dir.path() / "l2";
  d.capacity_bytes = std::uint64_t{64} << 20;
  auto disk = std::make_shared<l2::disk_backend>(io.get_executor(), d);
  telemetry::collect_io(reg, disk->file_io_kind() == kvtier::io::file_io_kind::uring, disk->shared_io_stats());
  cache::cache_options o;
  o.l1.slot_bytes = object_bytes;
  o.l1.slot_count = 8;
  cache::tiered_cache<traits<>> c(io.get_executor(), o, events,
                                  std::vector<l2::any_backend>{l2::any_backend(disk)});
  const cache::l1_registration_report r = c.register_l1();
  CHECK(r.steps == 1);  // 2 MiB of L1, on a 2 MiB boundary (slot_allocator): one piece
  CHECK(r.registered.size() + r.refused.size() <= 1);
  if (r.registered.empty()) {
    // The pread fallback has nothing to register; RLIMIT_MEMLOCK may refuse it.
    WARN("the disk backend took no fixed buffers here: " << (r.refused.empty() ? "no io_uring" : r.refused[0]));
    return;
  }
  CHECK(r.registered[0] == "disk");
  CHECK(reg.value("kvtier_io_fixed_buffer_bytes", {}).value_or(0) == static_cast<double>(8 * object_bytes));
}

}  // namespace file_disk_pipeline_test
