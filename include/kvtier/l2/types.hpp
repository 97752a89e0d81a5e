#pragma once
// Vocabulary of the L2 tier: per-key outcomes, batch results, usage and health, and what a
// listing returns.

#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

using clock = std::chrono::steady_clock;

/// When an operation must complete by. Backends complete late operations with
/// errc::timeout (and whatever had landed), never later than the deadline plus the time it
/// takes to make the caller's buffers safe (see l2_backend in concepts.hpp).
using deadline = clock::time_point;

/// What happened to one key of a batch.
enum class key_outcome : std::uint8_t {
  ok,           ///< loaded / stored / removed
  not_found,    ///< the backend does not have the key (a miss, not an error)
  exists,       ///< store: the key was already stored (skipped, not rewritten)
  io_error,     ///< the device or network failed this key
  corrupt,      ///< the stored copy failed its header or checksum check: dropped, never served
  no_space,     ///< store: the backend is full and nothing could be evicted
  rejected,     ///< the key or its size is not acceptable (e.g. destination size mismatch)
  timeout,      ///< the deadline passed before this key completed
  unavailable,  ///< the backend is down
};
inline constexpr std::size_t key_outcome_count = 9;

[[nodiscard]] constexpr std::string_view name(key_outcome o) noexcept {
  constexpr std::array<std::string_view, key_outcome_count> n = {
      "ok", "not_found", "exists", "io_error", "corrupt", "no_space", "rejected", "timeout", "unavailable"};
  return n[static_cast<std::size_t>(o)];
}

/// Per-key outcomes of a load, store or remove, in the order of the keys passed.
struct batch_result {
  std::vector<key_outcome> outcomes;

  batch_result() = default;
  explicit batch_result(std::size_t n, key_outcome initial = key_outcome::timeout) : outcomes(n, initial) {}

  [[nodiscard]] std::size_t size() const noexcept { return outcomes.size(); }
  [[nodiscard]] bool ok(std::size_t i) const noexcept { return outcomes[i] == key_outcome::ok; }
  [[nodiscard]] std::size_t count(key_outcome o) const noexcept {
    std::size_t n = 0;
    for (auto x : outcomes) n += x == o ? 1 : 0;
    return n;
  }
  /// Bit i set when key i is ok.
  [[nodiscard]] bitmap ok_bits() const {
    bitmap b(outcomes.size());
    for (std::size_t i = 0; i < outcomes.size(); ++i)
      if (outcomes[i] == key_outcome::ok) b.set(i);
    return b;
  }
};

/// Told, on the backend's executor, how much of key `index` of a load batch has landed and
/// passed its integrity check: bytes [0, verified_bytes) of its destination are final (they
/// hold the stored object's bytes, checked, and nothing writes them any more), so the caller
/// may read them before the key, or the whole batch, completes (the pipelined L2 hit; a
/// layer-wise retrieve reads the first layers of a chunk before its last ones land).
/// verified_bytes == the destination's size: the key landed, its outcome will be ok and
/// nothing writes any of its destination. A key whose later bytes then fail (a corrupt
/// segment, an I/O error, the deadline) still completes with that failure: the bytes told
/// stay the stored object's bytes, but the key is not ok. A backend that supports it
/// (observable_load_backend, concepts.hpp) calls it with growing verified_bytes, at most once
/// with the whole size, before the operation completes; a backend that verifies whole objects
/// only tells the whole size. Keys it is not called for are settled by the completion as
/// usual. It must not block: post the work elsewhere.
using load_observer = std::function<void(std::size_t index, std::size_t verified_bytes)>;

/// Bytes on the backend, as the backend measures them (the disk backend counts bytes actually
/// allocated on the file system, not logical sizes).
struct usage_info {
  std::uint64_t bytes_used = 0;
  std::uint64_t bytes_capacity = 0;  ///< 0 when the backend has no fixed capacity
  std::uint64_t objects = 0;
};

struct health_info {
  bool healthy = true;
  std::string reason;  ///< why not, when not healthy
};

/// One stored object as a listing (listing_backend, concepts.hpp) reports it: its key and
/// its bytes as the backend counts them in usage() (the disk backend: bytes allocated on the
/// file system; Redis: the stored value, header included; memory: the payload).
struct listed_object {
  chunk_key key;
  std::uint64_t bytes = 0;

  friend bool operator==(const listed_object&, const listed_object&) = default;
};

/// Which objects a listing returns: those whose key it accepts (empty: every object). Runs on
/// the backend's executor, possibly under the backend's lock: it must not call into the
/// backend, and should be cheap (it sees every stored object).
using key_filter = std::function<bool(const chunk_key&)>;

/// How a backend's index changed (key_listener).
enum class key_change : std::uint8_t {
  stored,   ///< the keys became visible: a store of them succeeded (lookups find them, listings list them)
  removed,  ///< the keys stopped being visible (the reason says why)
};

/// Told by a backend (key_announcing_backend, concepts.hpp), synchronously, on the thread that
/// changes its index and at the moment it does, so that the calls of one backend come in the
/// order of its index: applying them in order (stored: insert, removed: erase) to the keys
/// async_list listed when the listener was set holds what async_list lists. `reason` is
/// meaningful for removed only: bus::key_removal::evicted (its capacity), corrupt (an object
/// that failed its checks on load, deleted), deleted (async_remove, and an object a load found
/// gone). What a backend finds at start-up (the disk backend's scan) is not told: whoever
/// sets the listener lists the backend first. It may run under the backend's lock: it must
/// be cheap (queue an event), must not block and must not call into the backend.
using key_listener = std::function<void(key_change, bus::key_removal reason, std::span<const chunk_key> keys)>;

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
