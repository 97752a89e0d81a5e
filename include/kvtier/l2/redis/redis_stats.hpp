#pragma once
// What l2::redis_backend counts: errors by kind, reconnections, cluster redirects. The
// backend keeps them as relaxed atomics (redis_counters, shared: shared_stats() stays
// readable after the backend is gone) and answers a snapshot of plain numbers with stats();
// docs/metrics.md lists the kvtier_l2_redis_* series made of them. Standard library only.

#include <kvtier/config.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

/// The `kind` label of kvtier_l2_redis_errors_total. Connection kinds count connections;
/// the others count keys (one batch of 100 keys that times out counts 100 timeouts).
enum class redis_error_kind : std::uint8_t {
  connect,         ///< a connection attempt failed (refused, unreachable, timed out)
  disconnect,      ///< an established connection broke (Redis died, restarted, reset)
  auth,            ///< AUTH or SELECT was refused on connecting
  protocol,        ///< a reply could not be parsed (the connection is dropped)
  timeout,         ///< a key's operation did not complete by its deadline
  unavailable,     ///< a key could not be sent (no connection) or lost its connection
  server,          ///< Redis answered a key with an unexpected error
  oom,             ///< Redis refused a SET with OOM (maxmemory reached, noeviction policy)
  redirect_limit,  ///< a key was redirected (MOVED/ASK) more than max_redirects times
  corrupt,         ///< a stored value failed its header, key or checksum check (then deleted)
};
inline constexpr std::size_t redis_error_kind_count = 10;

[[nodiscard]] constexpr std::string_view name(redis_error_kind k) noexcept {
  constexpr std::array<std::string_view, redis_error_kind_count> n = {
      "connect",     "disconnect", "auth", "protocol",       "timeout",
      "unavailable", "server",     "oom",  "redirect_limit", "corrupt"};
  return n[static_cast<std::size_t>(k)];
}

struct redis_backend_stats {
  std::array<std::uint64_t, redis_error_kind_count> errors{};
  std::uint64_t reconnects = 0;  ///< connections re-established after a failure
  std::uint64_t moved = 0;       ///< MOVED redirects followed
  std::uint64_t ask = 0;         ///< ASK redirects followed
  std::uint32_t connections_up = 0;

  [[nodiscard]] std::uint64_t error(redis_error_kind k) const noexcept { return errors[static_cast<std::size_t>(k)]; }
};

/// The live counters behind redis_backend_stats: written by the backend's strand, read by
/// anyone at any time.
struct redis_counters {
  static constexpr std::size_t error_kind_count = redis_error_kind_count;
  /// The `kind` label of error kind k.
  [[nodiscard]] static constexpr std::string_view error_kind_name(std::size_t k) noexcept {
    return k < error_kind_count ? name(static_cast<redis_error_kind>(k)) : std::string_view{"unknown"};
  }

  std::array<std::atomic<std::uint64_t>, redis_error_kind_count> errors{};
  std::atomic<std::uint64_t> reconnects{0};
  std::atomic<std::uint64_t> moved{0};
  std::atomic<std::uint64_t> ask{0};
  std::atomic<std::uint32_t> connections_up{0};

  [[nodiscard]] redis_backend_stats snapshot() const noexcept {
    redis_backend_stats s;
    for (std::size_t i = 0; i < redis_error_kind_count; ++i) s.errors[i] = errors[i].load(std::memory_order_relaxed);
    s.reconnects = reconnects.load(std::memory_order_relaxed);
    s.moved = moved.load(std::memory_order_relaxed);
    s.ask = ask.load(std::memory_order_relaxed);
    s.connections_up = connections_up.load(std::memory_order_relaxed);
    return s;
  }
};

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
