#pragma once
// Test support for the key events (bus::tier_keys_stored, tier_keys_removed): a deferred
// subscriber that applies them, in queue order, to one set of keys per tier (stored: insert,
// removed: erase), as the server's tier_announcer does. After bus.drain(), a tier's set must
// be exactly what the tier lists: that is the contract the tests check.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/event_bus.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>

namespace kvtier::test {

/// What the collector saw: the keys each tier holds by its events, and counts that a test
/// checks (a removal of a key never stored, or a key stored twice, breaks the contract).
struct key_ledger {
  std::map<std::uint8_t, std::set<chunk_key>> held;
  std::uint64_t stored_events = 0;
  std::uint64_t removed_events = 0;
  std::uint64_t stored_keys = 0;
  std::array<std::uint64_t, bus::key_removal_count> removed_keys{};  ///< by reason
  std::uint64_t unknown_removals = 0;                                ///< removed keys the tier had not announced
  std::uint64_t repeated_stores = 0;                                 ///< stored keys the tier held already
  std::uint64_t empty_events = 0;                                    ///< events without keys (never published)

  [[nodiscard]] const std::set<chunk_key>& of(std::uint8_t tier) { return held[tier]; }
  [[nodiscard]] std::uint64_t removed_as(bus::key_removal r) const { return removed_keys[static_cast<std::size_t>(r)]; }
  [[nodiscard]] std::uint64_t removed_total() const {
    std::uint64_t n = 0;
    for (auto r : removed_keys) n += r;
    return n;
  }
};

/// The deferred subscriber. `enabled` false: it wants no key event (bus::wants_kind answers
/// false), as the server's relay without a sink.
struct key_collector {
  static constexpr bus::delivery delivery_mode = bus::delivery::deferred;

  std::shared_ptr<key_ledger> ledger = std::make_shared<key_ledger>();
  std::shared_ptr<std::atomic<bool>> enabled = std::make_shared<std::atomic<bool>>(true);

  [[nodiscard]] bool wants(const bus::tier_keys_stored&) const noexcept { return enabled->load(); }
  [[nodiscard]] bool wants(const bus::tier_keys_removed&) const noexcept { return enabled->load(); }

  void on(const bus::tier_keys_stored& e) {
    auto& held = ledger->held[e.tier];
    ++ledger->stored_events;
    if (e.keys.empty()) ++ledger->empty_events;
    for (const auto& k : e.keys) {
      ++ledger->stored_keys;
      if (!held.insert(k).second) ++ledger->repeated_stores;
    }
  }
  void on(const bus::tier_keys_removed& e) {
    auto& held = ledger->held[e.tier];
    ++ledger->removed_events;
    if (e.keys.empty()) ++ledger->empty_events;
    for (const auto& k : e.keys) {
      ++ledger->removed_keys[static_cast<std::size_t>(e.reason)];
      if (held.erase(k) == 0) ++ledger->unknown_removals;
    }
  }
};

/// A bus with only the collector; a queue large enough for every test's events.
using key_bus = bus::basic_event_bus<key_collector>;
inline bus::bus_options large_queue() { return bus::bus_options{std::size_t{1} << 20}; }

}  // namespace kvtier::test
