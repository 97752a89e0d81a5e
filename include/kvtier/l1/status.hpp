#pragma once
// The vocabulary of the L1 tier's batch operations: the per-key answer (`status`), the write
// modes of reserve_write (LMCache's "new", "update", "all"), how long a lock lives
// (`lock_lifetime`), how reserve_prefix took a key and why its prefix ended (`prefix_take`,
// `prefix_end`) and the state of one object as the tier reports it (`object_state`).

#include <kvtier/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

/// The answer of a batch operation for one key. Values are stable (they may travel in
/// protocol replies): append, never renumber. LMCache's names in parentheses.
enum class status : std::uint8_t {
  success,        ///< done (SUCCESS)
  not_found,      ///< the key is absent, or was removed while locked (KEY_NOT_EXIST)
  not_readable,   ///< the object exists but is being written (KEY_NOT_READABLE)
  not_writable,   ///< the key exists (mode new), or is locked or temporary (KEY_NOT_WRITABLE)
  wrong_state,    ///< the object is not in the state the operation needs, e.g. finish_write
                  ///< of a key that is not write-locked, finish_read without a read lock
                  ///< (KEY_IN_WRONG_STATE)
  locked,         ///< remove without force of a read- or write-locked key (KEY_IS_LOCKED)
  out_of_memory,  ///< the new keys of the batch did not all fit, even after eviction
                  ///< (OUT_OF_MEMORY); nothing of them was allocated
  skipped,        ///< not tried: an operation on a prefix stopped at an earlier key
};
inline constexpr std::size_t status_count = 8;

/// "success", "not_found", ..., for logs and protocol dumps.
[[nodiscard]] constexpr std::string_view name(status s) noexcept {
  constexpr std::array<std::string_view, status_count> n = {"success",     "not_found", "not_readable",  "not_writable",
                                                            "wrong_state", "locked",    "out_of_memory", "skipped"};
  const auto i = static_cast<std::size_t>(s);
  return i < status_count ? n[i] : std::string_view{"unknown"};
}

/// Which keys of a reserve_write batch may be written (LMCache's write modes; docs/l1.md).
enum class write_mode : std::uint8_t {
  new_only,  ///< LMCache "new": absent keys only; an existing key answers not_writable
  update,    ///< existing, writable keys only (ready, unlocked, not temporary); an absent
             ///< key answers not_found
  all,       ///< absent keys are created, existing writable keys are rewritten
};
inline constexpr std::size_t write_mode_count = 3;

[[nodiscard]] constexpr std::string_view name(write_mode m) noexcept {
  constexpr std::array<std::string_view, write_mode_count> n = {"new", "update", "all"};
  const auto i = static_cast<std::size_t>(m);
  return i < write_mode_count ? n[i] : std::string_view{"unknown"};
}

/// Whether a lock is released by its TTL when its holder goes silent.
///
/// Locks taken for remote clients expire (write 600 s, read 300 s by default) so a crashed
/// client cannot pin memory forever. Locks the server takes for its own in-flight work (the
/// kernel reading into a slot, writing a slot out, a memcpy) are pinned: freeing such a slot
/// would let the late read or write land in memory that now holds another object.
enum class lock_lifetime : std::uint8_t {
  expiring,  ///< released by the TTL of tier_options (write_lock_ttl / read_lock_ttl)
  pinned,    ///< held until released explicitly; never expires
};

[[nodiscard]] constexpr std::string_view name(lock_lifetime l) noexcept {
  return l == lock_lifetime::expiring ? "expiring" : "pinned";
}

/// How l1::tier::reserve_prefix took one key.
enum class prefix_take : std::uint8_t {
  none,   ///< not taken: the prefix ended at or before this key
  read,   ///< readable: 1 + extra_count read holds taken
  write,  ///< absent and loadable: a new object, write-locked, to be written by the caller
  wait,   ///< being written by a writer the caller said it waits for: left as it is
};
inline constexpr std::size_t prefix_take_count = 4;

[[nodiscard]] constexpr std::string_view name(prefix_take t) noexcept {
  constexpr std::array<std::string_view, prefix_take_count> n = {"none", "read", "write", "wait"};
  const auto i = static_cast<std::size_t>(t);
  return i < prefix_take_count ? n[i] : std::string_view{"unknown"};
}

/// Why the prefix of l1::tier::reserve_prefix ended.
enum class prefix_end : std::uint8_t {
  complete,    ///< every key was taken
  missing,     ///< absent and not loadable, or removed while locked
  busy,        ///< being written by a writer the caller does not wait for (or repeated in the batch)
  wrong_size,  ///< readable, but not of the size asked for
  no_room,     ///< it needed a slot and none was left, even after eviction
};
inline constexpr std::size_t prefix_end_count = 5;

[[nodiscard]] constexpr std::string_view name(prefix_end e) noexcept {
  constexpr std::array<std::string_view, prefix_end_count> n = {"complete", "missing", "busy", "wrong_size", "no_room"};
  const auto i = static_cast<std::size_t>(e);
  return i < prefix_end_count ? n[i] : std::string_view{"unknown"};
}

/// The state of one key, as l1::tier::state reports it.
enum class object_state : std::uint8_t {
  absent,        ///< not in the tier
  write_locked,  ///< reserved for writing; not readable
  ready,         ///< readable, unlocked: evictable
  read_locked,   ///< readable, held by at least one reader: not evictable
  removing,      ///< removed (forced) while locked: lookups miss, the memory is freed when
                 ///< the last lock is released or expires; the key cannot be rewritten
                 ///< until then
};
inline constexpr std::size_t object_state_count = 5;

[[nodiscard]] constexpr std::string_view name(object_state s) noexcept {
  constexpr std::array<std::string_view, object_state_count> n = {"absent", "write_locked", "ready", "read_locked",
                                                                  "removing"};
  const auto i = static_cast<std::size_t>(s);
  return i < object_state_count ? n[i] : std::string_view{"unknown"};
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
