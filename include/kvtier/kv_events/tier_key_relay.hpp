#pragma once
// tier_key_relay: the bus subscriber that hands the key events (bus::tier_keys_stored,
// tier_keys_removed, chunks_described) to a tier_key_sink, on the bus's deferred path: the
// data path only queues them (never blocks; a full queue drops and the bus counts it), and
// the sink runs on the drain thread, one event at a time, in queue order.
//
// Without a sink attached the relay wants nothing, so bus::wants_kind says false and no tier
// builds a key event: a server without `kv_events` pays nothing for them.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>

#include <atomic>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

/// What receives the key events (the server's tier_announcer). Called on the bus's drain
/// thread only, never concurrently.
class tier_key_sink {
 public:
  virtual ~tier_key_sink() = default;
  virtual void on(const bus::tier_keys_stored& e) = 0;
  virtual void on(const bus::tier_keys_removed& e) = 0;
  virtual void on(const bus::chunks_described& e) = 0;
};

class tier_key_relay {
 public:
  static constexpr bus::delivery delivery_mode = bus::delivery::deferred;

  tier_key_relay() = default;
  tier_key_relay(tier_key_relay&& o) noexcept : sink_(o.sink_.load(std::memory_order_acquire)) {}
  tier_key_relay& operator=(tier_key_relay&&) = delete;

  /// Attaches the sink (null: detaches). Attach before the traffic it should see; detach
  /// only after the bus's drain thread stopped (a drain in progress may still call it).
  void attach(tier_key_sink* sink) noexcept { sink_.store(sink, std::memory_order_release); }
  [[nodiscard]] bool attached() const noexcept { return sink_.load(std::memory_order_acquire) != nullptr; }

  [[nodiscard]] bool wants(const bus::tier_keys_stored&) const noexcept { return attached(); }
  [[nodiscard]] bool wants(const bus::tier_keys_removed&) const noexcept { return attached(); }
  [[nodiscard]] bool wants(const bus::chunks_described&) const noexcept { return attached(); }

  void on(const bus::tier_keys_stored& e) { forward(e); }
  void on(const bus::tier_keys_removed& e) { forward(e); }
  void on(const bus::chunks_described& e) { forward(e); }

 private:
  template <class E>
  void forward(const E& e) {
    if (auto* s = sink_.load(std::memory_order_acquire)) s->on(e);
  }

  std::atomic<tier_key_sink*> sink_{nullptr};
};

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
