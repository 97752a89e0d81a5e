#pragma once
// Shared by the pipeline tests: an L1 tier of 64 slots of 4 KiB, two memory backends ("a",
// and "b" behind the fault injector) as the controllers see them (any_backend), a bus that
// records the pipelines' events (immediate delivery), one io_context the test drives, and
// keys whose objects carry a pattern of their own.
#include <kvtier/bus/event_bus.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>
#include <kvtier/pipeline/work_tracker.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"

#include <boost/asio/io_context.hpp>

#include <memory>
#include <optional>
#include <vector>

namespace kvtier::test {

inline constexpr std::size_t object_bytes = 4096;

/// The pipelines' events, in order.
struct pipeline_events {
  std::vector<bus::l2_store_submitted> submitted;
  std::vector<bus::l2_store_completed> completed;
  std::vector<bus::l2_prefetch_load_submitted> load_submitted;
  std::vector<bus::l2_prefetch_load_completed> load_completed;
};
struct pipeline_recorder {
  static constexpr bus::delivery delivery_mode = bus::delivery::immediate;
  std::shared_ptr<pipeline_events> e = std::make_shared<pipeline_events>();
  void on(const bus::l2_store_submitted& x) { e->submitted.push_back(x); }
  void on(const bus::l2_store_completed& x) { e->completed.push_back(x); }
  void on(const bus::l2_prefetch_load_submitted& x) { e->load_submitted.push_back(x); }
  void on(const bus::l2_prefetch_load_completed& x) { e->load_completed.push_back(x); }
};
using test_bus = bus::basic_event_bus<pipeline_recorder>;
using test_tier = l1::tier<l1::lru, test_bus>;

inline chunk_key key_of(std::uint64_t i) { return chunk_key{9, 1, 0, {i, 0xc0ffee}}; }
inline std::vector<chunk_key> keys_of(std::uint64_t first, std::size_t n) {
  std::vector<chunk_key> v;
  for (std::size_t i = 0; i < n; ++i) v.push_back(key_of(first + i));
  return v;
}
inline std::byte pattern(const chunk_key& k, std::size_t i) { return static_cast<std::byte>((k.hash.lo * 31 + i) & 0xff); }
inline void fill(const chunk_key& k, std::span<std::byte> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = pattern(k, i);
}
inline bool has_pattern(const chunk_key& k, std::span<const std::byte> bytes) {
  for (std::size_t i = 0; i < bytes.size(); ++i)
    if (bytes[i] != pattern(k, i)) return false;
  return true;
}

/// The parts every controller needs; the test adds the controller.
struct pipeline_fixture {
  boost::asio::io_context io;
  test_bus bus{pipeline_recorder{}};
  std::unique_ptr<test_tier> l1;
  std::shared_ptr<l2::memory_backend> a, b;
  std::shared_ptr<l2::fault_injecting_backend<l2::memory_backend>> faulty_b;
  std::vector<l2::any_backend> backends;
  pipeline::work_tracker tracker;

  pipeline_fixture() {
    l1::tier_options t;
    t.slot_bytes = object_bytes;
    t.slot_count = 64;
    t.eviction_watermark = 1.0;
    t.eviction_target = 0.9;
    l1 = std::make_unique<test_tier>(t, bus);
    l2::memory_backend_options m;
    m.name = "a";
    a = std::make_shared<l2::memory_backend>(io.get_executor(), m);
    m.name = "b";
    b = std::make_shared<l2::memory_backend>(io.get_executor(), m);
    faulty_b = std::make_shared<l2::fault_injecting_backend<l2::memory_backend>>(*b);
    backends.emplace_back(a);
    backends.emplace_back(faulty_b);
  }

  [[nodiscard]] pipeline_events& events() { return *bus.subscriber<pipeline_recorder>().e; }

  /// Writes `keys` into L1 with their pattern and makes them ready.
  void write_l1(const std::vector<chunk_key>& keys) {
    std::vector<l1::status> st(keys.size());
    std::vector<std::span<std::byte>> buf(keys.size());
    REQUIRE(l1->reserve_write(keys, object_bytes, l1::write_options{}, st, buf) == keys.size());
    for (std::size_t k = 0; k < keys.size(); ++k) fill(keys[k], buf[k]);
    REQUIRE(l1->finish_write(keys, st) == keys.size());
  }

  /// Stores `keys` with their pattern straight into backend `backend` (0: a, 1: b).
  void put(std::size_t backend, const std::vector<chunk_key>& keys) {
    std::vector<std::vector<std::byte>> bytes(keys.size(), std::vector<std::byte>(object_bytes));
    std::vector<std::span<const std::byte>> src;
    for (std::size_t k = 0; k < keys.size(); ++k) {
      fill(keys[k], bytes[k]);
      src.emplace_back(bytes[k]);
    }
    std::optional<l2::batch_result> r;
    backends[backend].async_store(keys, src, l2::clock::now() + std::chrono::seconds(30),
                                  [&](error_code, l2::batch_result res) { r = std::move(res); });
    REQUIRE(run_until(io, [&] { return r.has_value(); }));
    REQUIRE(r->count(l2::key_outcome::ok) == keys.size());
  }

  /// How many of `keys` backend `backend` returns with exactly their pattern.
  std::size_t held_by(std::size_t backend, const std::vector<chunk_key>& keys) {
    std::vector<std::vector<std::byte>> out(keys.size(), std::vector<std::byte>(object_bytes));
    std::vector<std::span<std::byte>> dst(out.begin(), out.end());
    std::optional<l2::batch_result> r;
    backends[backend].async_load(keys, dst, l2::clock::now() + std::chrono::seconds(30),
                                 [&](error_code, l2::batch_result res) { r = std::move(res); });
    REQUIRE(run_until(io, [&] { return r.has_value(); }));
    std::size_t good = 0;
    for (std::size_t k = 0; k < keys.size(); ++k)
      if (k < r->size() && r->outcomes[k] == l2::key_outcome::ok && has_pattern(keys[k], out[k])) ++good;
    return good;
  }

  /// How many of `keys` L1 holds readable with exactly their pattern (a read lock taken and
  /// given back around the check).
  std::size_t l1_has(const std::vector<chunk_key>& keys) {
    std::size_t good = 0;
    for (const auto& k : keys) {
      std::vector<l1::status> st(1);
      if (l1->reserve_read(std::span(&k, 1), 0, l1::lock_lifetime::pinned, st) != 1) continue;
      std::vector<std::span<const std::byte>> v(1);
      l1->read_views(std::span(&k, 1), st, v);
      if (st[0] == l1::status::success && v[0].size() == object_bytes && has_pattern(k, v[0])) ++good;
      l1->finish_read(std::span(&k, 1), 0, l1::lock_lifetime::pinned, st);
    }
    return good;
  }
};

}  // namespace kvtier::test
