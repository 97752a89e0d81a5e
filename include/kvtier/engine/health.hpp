#pragma once
// The connector's view of its server's health, as small pure pieces the connector combines
// (docs/fault-tolerance.md has the whole state machine):
//
//   health_state   starting -> healthy <-> unhealthy (starting -> unhealthy when the first
//                  connection fails: the connector runs degraded until a server appears)
//   backoff        delays between reconnection attempts: initial, doubling, capped
//   breaker        trips after N consecutive call timeouts with no reply in between: a server
//                  that answers pings but no work is unhealthy too
//
// Why the server turned unhealthy is a short reason string (bus::connector_unhealthy::reason):
// "eof", "socket_error", "ping_timeout", "timeouts" (breaker), "protocol_error",
// "connect_failed", "handshake_timeout", "chunk_size_mismatch", "register_failed",
// "server_restarted" (boot token changed under a live connection), "ping_error",
// "not_registered" (the server answered that it no longer knows the registration).

#include <kvtier/config.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

enum class health_state : std::uint8_t {
  starting,   ///< no connection yet, no failure yet (the engine may wait_ready)
  healthy,    ///< registered, answering: requests go to the server
  unhealthy,  ///< degraded: lookups answer 0, stores are skipped, retrieves are load errors
};

[[nodiscard]] constexpr std::string_view name(health_state s) noexcept {
  switch (s) {
    case health_state::starting: return "starting";
    case health_state::healthy: return "healthy";
    case health_state::unhealthy: return "unhealthy";
  }
  return "invalid";
}

/// Reconnection delays: initial, 2 x initial, 4 x initial, ... capped at max; reset() after
/// a success. No jitter: each worker has its own local socket, so synchronized retries of
/// several workers cost the server nothing worth spreading.
class backoff {
 public:
  using duration = std::chrono::nanoseconds;

  backoff(duration initial, duration max) : initial_(initial), max_(max), next_(initial) {
    if (initial.count() <= 0 || max < initial)
      throw std::invalid_argument("kvtier::engine::backoff: need 0 < initial <= max");
  }

  /// The delay before the next attempt; each call doubles the following one up to max.
  duration next() noexcept {
    const duration d = next_;
    next_ = next_ >= max_ / 2 ? max_ : next_ * 2;
    return d;
  }

  void reset() noexcept { next_ = initial_; }

 private:
  duration initial_;
  duration max_;
  duration next_;
};

/// Counts consecutive timeouts; any reply resets the count.
class breaker {
 public:
  explicit breaker(std::uint32_t threshold) : threshold_(std::max<std::uint32_t>(threshold, 1)) {}

  /// A call timed out; true when this trips the breaker (count reached the threshold).
  bool on_timeout() noexcept { return ++consecutive_ == threshold_; }
  /// A reply arrived: the server is doing work.
  void on_reply() noexcept { consecutive_ = 0; }
  /// A new connection starts with a clean count.
  void reset() noexcept { consecutive_ = 0; }

  [[nodiscard]] std::uint32_t consecutive_timeouts() const noexcept { return consecutive_; }
  [[nodiscard]] std::uint32_t threshold() const noexcept { return threshold_; }

 private:
  std::uint32_t threshold_;
  std::uint32_t consecutive_ = 0;
};

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
