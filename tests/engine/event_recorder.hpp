#pragma once
// Test support: a bus subscriber that records every event (immediate delivery, so nothing
// is ever dropped) and lets a test wait for a condition on what it saw, with a generous
// deadline, instead of sleeping.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

namespace kvtier::test {

/// Copies share one record (the bus takes its subscribers by value).
class event_recorder {
 public:
  static constexpr bus::delivery delivery_mode = bus::delivery::immediate;

  /// Everything recorded, read under the recorder's lock (wait / with).
  struct record {
    std::array<std::size_t, bus::event_type_count> counts{};
    std::vector<bus::connector_healthy> healthy;
    std::vector<bus::connector_unhealthy> unhealthy;
    std::vector<bus::connector_reconnected> reconnected;
    std::vector<bus::connector_lookup_completed> lookups;
    std::vector<bus::connector_retrieve_completed> retrieves;
    std::vector<bus::connector_store_completed> stores;
    std::vector<bus::connector_load_error> load_errors;
    std::vector<bus::connector_quarantine_changed> quarantine;

    [[nodiscard]] std::size_t count(bus::event_type t) const { return counts[static_cast<std::size_t>(t)]; }
    template <class E>
    [[nodiscard]] std::size_t count() const {
      return count(E::type);
    }
    [[nodiscard]] std::size_t released_blocks() const {
      std::size_t n = 0;
      for (const auto& q : quarantine) n += q.released_blocks;
      return n;
    }
  };

  template <bus::event E>
  void on(const E& e) {
    std::lock_guard g(s_->m);
    ++s_->r.counts[static_cast<std::size_t>(E::type)];
    if constexpr (std::is_same_v<E, bus::connector_healthy>) s_->r.healthy.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_unhealthy>) s_->r.unhealthy.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_reconnected>) s_->r.reconnected.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_lookup_completed>) s_->r.lookups.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_retrieve_completed>) s_->r.retrieves.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_store_completed>) s_->r.stores.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_load_error>) s_->r.load_errors.push_back(e);
    else if constexpr (std::is_same_v<E, bus::connector_quarantine_changed>) s_->r.quarantine.push_back(e);
    s_->cv.notify_all();
  }

  /// Waits until pred(record) holds; false when `deadline` passes first (the test fails).
  template <class Pred>
  bool wait(Pred pred, std::chrono::seconds deadline = std::chrono::seconds(60)) const {
    std::unique_lock l(s_->m);
    return s_->cv.wait_for(l, deadline, [&] { return pred(s_->r); });
  }

  /// A copy of the record.
  [[nodiscard]] record snapshot() const {
    std::lock_guard g(s_->m);
    return s_->r;
  }

 private:
  struct shared {
    std::mutex m;
    std::condition_variable cv;
    record r;
  };
  std::shared_ptr<shared> s_ = std::make_shared<shared>();
};

}  // namespace kvtier::test
