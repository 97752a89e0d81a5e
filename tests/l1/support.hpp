#pragma once
// Helpers of the L1 tests: keys, a manual clock, and a bus that counts the L1 events.

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/status.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvtier::l1::test {

inline chunk_key key(std::uint64_t i) { return chunk_key{7, 1, 0, {i, 0x5eed}}; }

inline std::vector<chunk_key> keys(std::initializer_list<std::uint64_t> ids) {
  std::vector<chunk_key> v;
  for (auto i : ids) v.push_back(key(i));
  return v;
}

/// A clock the test moves by hand (shared by copies, so a tier_options can hold one).
struct manual_clock {
  std::shared_ptr<std::chrono::steady_clock::time_point> now = std::make_shared<std::chrono::steady_clock::time_point>(
      std::chrono::steady_clock::time_point{} + std::chrono::hours(1));
  std::chrono::steady_clock::time_point operator()() const { return *now; }
  void advance(std::chrono::steady_clock::duration d) const { *now += d; }
};

/// Counts of every L1 event (relaxed atomics: publishers run on many threads).
struct l1_counts {
  std::atomic<std::uint64_t> write_reserved{0}, write_refused{0}, write_reserved_events{0};
  std::atomic<std::uint64_t> write_finished{0}, finished_and_read_reserved{0};
  std::atomic<std::uint64_t> read_reserved{0}, read_refused{0}, read_finished{0};
  std::atomic<std::uint64_t> read_holds_taken{0}, read_holds_released{0}, read_holds_expired{0};
  std::array<std::atomic<std::uint64_t>, bus::removal_reason_count> removed{};
  std::array<std::atomic<std::uint64_t>, bus::removal_reason_count> removed_bytes{};
  std::array<std::atomic<std::uint64_t>, bus::allocation_purpose_count> allocation_failed_keys{};
  std::atomic<std::uint64_t> allocation_failures{0};
  std::array<std::atomic<std::uint64_t>, bus::lock_kind_count> expired{};

  [[nodiscard]] std::uint64_t removed_as(bus::removal_reason r) const {
    return removed[static_cast<std::size_t>(r)].load();
  }
  [[nodiscard]] std::uint64_t removed_total() const {
    std::uint64_t n = 0;
    for (const auto& r : removed) n += r.load();
    return n;
  }
  [[nodiscard]] std::uint64_t expired_as(bus::lock_kind k) const { return expired[static_cast<std::size_t>(k)].load(); }
};

struct l1_recorder {
  std::shared_ptr<l1_counts> c = std::make_shared<l1_counts>();
  static constexpr auto relaxed = std::memory_order_relaxed;
  void on(const bus::l1_write_reserved& e) {
    c->write_reserved.fetch_add(e.key_count, relaxed);
    c->write_refused.fetch_add(e.failed_count, relaxed);
    c->write_reserved_events.fetch_add(1, relaxed);
  }
  void on(const bus::l1_write_finished& e) { c->write_finished.fetch_add(e.key_count, relaxed); }
  void on(const bus::l1_write_finished_and_read_reserved& e) {
    c->finished_and_read_reserved.fetch_add(e.key_count, relaxed);
    c->read_holds_taken.fetch_add(e.holds, relaxed);
  }
  void on(const bus::l1_read_reserved& e) {
    c->read_reserved.fetch_add(e.key_count, relaxed);
    c->read_refused.fetch_add(e.failed_count, relaxed);
    c->read_holds_taken.fetch_add(e.holds, relaxed);
  }
  void on(const bus::l1_read_finished& e) {
    c->read_finished.fetch_add(e.key_count, relaxed);
    c->read_holds_released.fetch_add(e.holds, relaxed);
  }
  void on(const bus::l1_keys_evicted& e) {
    c->removed[static_cast<std::size_t>(e.reason)].fetch_add(e.key_count, relaxed);
    c->removed_bytes[static_cast<std::size_t>(e.reason)].fetch_add(e.bytes, relaxed);
  }
  void on(const bus::l1_allocation_failed& e) {
    c->allocation_failures.fetch_add(1, relaxed);
    c->allocation_failed_keys[static_cast<std::size_t>(e.purpose)].fetch_add(e.key_count, relaxed);
  }
  void on(const bus::l1_lock_expired& e) {
    c->expired[static_cast<std::size_t>(e.lock)].fetch_add(e.key_count, relaxed);
    c->read_holds_expired.fetch_add(e.holds, relaxed);
  }
};

using recording_bus = bus::basic_event_bus<l1_recorder>;

}  // namespace kvtier::l1::test
