#pragma once
// One aggregate struct per event type. Events own their data (no pointers into the
// publisher), are cheap to copy (no heap), and carry the counts and ids their subscribers
// need. Each has `static constexpr event_type type`. The exceptions are the three key events
// at the end (tier_keys_stored, tier_keys_removed, chunks_described): they carry the keys
// and tokens themselves (vectors), and a publisher builds them only when the bus wants them
// (wants_kind below), so a bus without a key subscriber pays nothing for them.
//
// Counting rules (the prefetch counters; docs/metrics.md says what each series counts):
//   l2_prefetch_lookup_completed::hit_count   the pure L2 contiguous prefix, before any L1
//                                             reservation;
//   l2_prefetch_load_submitted::key_count     keys actually handed to backends;
//   l2_prefetch_load_submitted::trimmed_count keys found in L2 but dropped by trimming;
//   l2_prefetch_load_completed::failed_count  keys submitted and not loaded.

#include <kvtier/bus/event_type.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <concepts>
#include <vector>
#include <tuple>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {

/// A short name owned by value (backend names, reasons): at most 31 bytes, longer is cut.
class short_name {
 public:
  constexpr short_name() noexcept = default;
  /// From anything that converts to std::string_view (literals, std::string, string_view).
  template <class S>
    requires std::convertible_to<const S&, std::string_view>
  constexpr short_name(const S& text) noexcept {  // NOLINT(google-explicit-constructor)
    const std::string_view s(text);
    size_ = static_cast<std::uint8_t>(std::min(s.size(), capacity));
    std::copy_n(s.data(), size_, chars_.data());
  }
  [[nodiscard]] constexpr std::string_view view() const noexcept { return {chars_.data(), size_}; }
  constexpr operator std::string_view() const noexcept { return view(); }  // NOLINT
  friend constexpr bool operator==(const short_name& a, const short_name& b) noexcept {
    return a.view() == b.view();
  }

  static constexpr std::size_t capacity = 31;

 private:
  std::array<char, capacity> chars_{};
  std::uint8_t size_ = 0;
};

/// Why L1 objects went away.
enum class removal_reason : std::uint8_t {
  evicted,    ///< taken by the eviction policy above the watermark
  deleted,    ///< deleted on request (clear, skip_l1 store policy, ...)
  temporary,  ///< a temporary (prefetched) object freed after its last reader
  abandoned,  ///< a write that failed and was dropped without becoming readable
};
inline constexpr std::size_t removal_reason_count = 4;
[[nodiscard]] constexpr std::string_view name(removal_reason r) noexcept {
  constexpr std::array<std::string_view, removal_reason_count> n = {"evicted", "deleted", "temporary", "abandoned"};
  return n[static_cast<std::size_t>(r)];
}

/// What an L1 allocation was for.
enum class allocation_purpose : std::uint8_t { store, prefetch };
inline constexpr std::size_t allocation_purpose_count = 2;
[[nodiscard]] constexpr std::string_view name(allocation_purpose p) noexcept {
  return p == allocation_purpose::store ? "store" : "prefetch";
}

enum class lock_kind : std::uint8_t { read, write };
inline constexpr std::size_t lock_kind_count = 2;
[[nodiscard]] constexpr std::string_view name(lock_kind k) noexcept { return k == lock_kind::read ? "read" : "write"; }

/// Why (part of) an L2 prefetch did not load.
enum class prefetch_failure : std::uint8_t {
  l1_out_of_memory,     ///< no L1 slots for the keys L2 had
  io_error,             ///< the backend failed the read
  corrupt_object,       ///< the object failed its checksum: dropped, never served
  timeout,              ///< the request's deadline passed before the keys landed
  backend_unavailable,  ///< the backend was down
};
inline constexpr std::size_t prefetch_failure_count = 5;
[[nodiscard]] constexpr std::string_view name(prefetch_failure f) noexcept {
  constexpr std::array<std::string_view, prefetch_failure_count> n = {"l1_out_of_memory", "io_error", "corrupt_object",
                                                                      "timeout", "backend_unavailable"};
  return n[static_cast<std::size_t>(f)];
}

/// Why a prefetch did not offer keys some tier could serve.
enum class decline_reason : std::uint8_t {
  slower_than_recompute,  ///< loading them from L2 takes longer than the engine computes them
};
inline constexpr std::size_t decline_reason_count = 1;
[[nodiscard]] constexpr std::string_view name(decline_reason r) noexcept {
  constexpr std::array<std::string_view, decline_reason_count> n = {"slower_than_recompute"};
  return n[static_cast<std::size_t>(r)];
}

/// How a connector call ended (lookups, retrieves, stores), and why blocks became load errors.
enum class connector_outcome : std::uint8_t {
  ok,         ///< the server answered (a lookup may still find nothing, a store refuse chunks)
  partial,    ///< a retrieve answered with fewer chunks than asked: the rest are load errors
  failed,     ///< the server answered with an error (or a lookup it did not know)
  timeout,    ///< the call's deadline passed (a retrieve's blocks are quarantined)
  unhealthy,  ///< skipped or released because the server is unhealthy
};
inline constexpr std::size_t connector_outcome_count = 5;
[[nodiscard]] constexpr std::string_view name(connector_outcome o) noexcept {
  constexpr std::array<std::string_view, connector_outcome_count> n = {"ok", "partial", "failed", "timeout",
                                                                       "unhealthy"};
  return n[static_cast<std::size_t>(o)];
}

/// The request types of the cache server (server/session/request_kinds.hpp maps the wire messages
/// onto these).
enum class request_kind : std::uint8_t {
  register_kv,
  unregister_kv,
  lookup,
  query_prefetch,
  retrieve,
  store,
  free_lookup_locks,
  end_request,
  ping,
  clear,
  get_chunk_size,
  status,
  list_objects,
  evict,
  describe_chunks,
  list_keys,
  other,
};
inline constexpr std::size_t request_kind_count = 17;
[[nodiscard]] constexpr std::string_view name(request_kind k) noexcept {
  constexpr std::array<std::string_view, request_kind_count> n = {
      "register_kv", "unregister_kv",  "lookup", "query_prefetch", "retrieve", "store", "free_lookup_locks",
      "end_request", "ping",           "clear",  "get_chunk_size", "status",   "list_objects", "evict",
      "describe_chunks", "list_keys", "other"};
  return n[static_cast<std::size_t>(k)];
}

// ----------------------------------------------------------------------------------------
// L1 tier
// ----------------------------------------------------------------------------------------
struct l1_read_reserved {
  static constexpr event_type type = event_type::l1_read_reserved;
  std::uint32_t key_count = 0;     ///< keys now read-locked
  std::uint32_t failed_count = 0;  ///< keys that were absent or not readable
  std::uint32_t holds = 0;         ///< read holds taken: key_count x readers per key
};
struct l1_read_finished {
  static constexpr event_type type = event_type::l1_read_finished;
  std::uint32_t key_count = 0;  ///< read locks released
  std::uint32_t holds = 0;      ///< read holds released: key_count x readers per key
};
struct l1_write_reserved {
  static constexpr event_type type = event_type::l1_write_reserved;
  std::uint32_t key_count = 0;     ///< keys now write-locked
  std::uint32_t failed_count = 0;  ///< keys refused (exists, locked, out of memory)
  allocation_purpose purpose = allocation_purpose::store;
};
struct l1_write_finished {
  static constexpr event_type type = event_type::l1_write_finished;
  std::uint32_t key_count = 0;  ///< keys made readable (offered to the store pipeline)
};
struct l1_write_finished_and_read_reserved {
  static constexpr event_type type = event_type::l1_write_finished_and_read_reserved;
  std::uint32_t key_count = 0;  ///< prefetched keys made readable and read-locked (not re-stored)
  std::uint32_t holds = 0;      ///< read holds taken (a key several waiters read: one per waiter; none: 0)
};
struct l1_keys_evicted {
  static constexpr event_type type = event_type::l1_keys_evicted;
  std::uint32_t key_count = 0;
  std::uint64_t bytes = 0;
  removal_reason reason = removal_reason::evicted;
};
struct l1_allocation_failed {
  static constexpr event_type type = event_type::l1_allocation_failed;
  std::uint32_t key_count = 0;  ///< keys of the batch that could not be allocated
  allocation_purpose purpose = allocation_purpose::store;
};
struct l1_lock_expired {
  static constexpr event_type type = event_type::l1_lock_expired;
  std::uint32_t key_count = 0;  ///< locks released by their TTL (a client that went away)
  lock_kind lock = lock_kind::read;
  std::uint32_t holds = 0;  ///< read: the holds those locks had (every expiring reader of the key); write: 0
};

// ----------------------------------------------------------------------------------------
// cache facade
// ----------------------------------------------------------------------------------------
struct cache_lookup {
  static constexpr event_type type = event_type::cache_lookup;
  std::uint64_t request_id = 0;
  std::uint32_t requested_tokens = 0;  ///< tokens asked about (full chunks only)
  std::uint32_t requested_chunks = 0;  ///< chunks asked about (a chunk = world_size shards)
  /// Of the hit chunks (the leading whole chunks the lookup holds or is still loading), those
  /// whose shards were all read from L1, wherever they stand in the hit prefix: a chunk L1
  /// held after one that came from L2 counts here (tiered_cache's complete()).
  std::uint32_t l1_hit_chunks = 0;
  /// The other hit chunks: at least one shard came (or is coming) from L2 for this lookup,
  /// by its own load or one it joined; a chunk split between the tiers counts here.
  std::uint32_t l2_hit_chunks = 0;
  std::uint32_t chunk_tokens = 0;  ///< tokens per chunk, to turn chunks into tokens
};
struct cache_read_prefetched {
  static constexpr event_type type = event_type::cache_read_prefetched;
  std::uint32_t succeeded_keys = 0;
  std::uint32_t failed_keys = 0;
};
struct cache_write_reserved {
  static constexpr event_type type = event_type::cache_write_reserved;
  std::uint32_t succeeded_keys = 0;
  std::uint32_t failed_keys = 0;
};
struct cache_write_finished {
  static constexpr event_type type = event_type::cache_write_finished;
  std::uint32_t succeeded_keys = 0;
  std::uint32_t failed_keys = 0;
};

// ----------------------------------------------------------------------------------------
// L2 store (one event per backend task)
// ----------------------------------------------------------------------------------------
struct l2_store_submitted {
  static constexpr event_type type = event_type::l2_store_submitted;
  std::uint8_t backend_index = 0;
  short_name backend{};
  std::uint32_t key_count = 0;
  std::uint64_t bytes = 0;
};
struct l2_store_completed {
  static constexpr event_type type = event_type::l2_store_completed;
  std::uint8_t backend_index = 0;
  short_name backend{};
  std::uint32_t succeeded_count = 0;
  std::uint32_t failed_count = 0;
  std::uint64_t bytes = 0;        ///< bytes of the succeeded keys
  std::uint64_t duration_ns = 0;  ///< submission to completion
};

// ----------------------------------------------------------------------------------------
// L2 prefetch (per request; l2_backend_load_completed per backend task)
// ----------------------------------------------------------------------------------------
struct l2_prefetch_lookup_submitted {
  static constexpr event_type type = event_type::l2_prefetch_lookup_submitted;
  std::uint64_t request_id = 0;
  std::uint32_t key_count = 0;
  std::uint32_t backend_count = 0;
};
struct l2_prefetch_lookup_completed {
  static constexpr event_type type = event_type::l2_prefetch_lookup_completed;
  std::uint64_t request_id = 0;
  std::uint32_t key_count = 0;
  std::uint32_t hit_count = 0;  ///< pure L2 contiguous prefix, before L1 reservation
};
struct l2_prefetch_load_submitted {
  static constexpr event_type type = event_type::l2_prefetch_load_submitted;
  std::uint64_t request_id = 0;
  std::uint32_t key_count = 0;      ///< keys actually submitted to backends
  std::uint32_t backend_count = 0;  ///< load tasks (backends with at least one key)
  std::uint32_t trimmed_count = 0;  ///< found in L2, dropped by trimming (hole or L1 reservation)
  std::uint64_t bytes = 0;
};
struct l2_prefetch_load_completed {
  static constexpr event_type type = event_type::l2_prefetch_load_completed;
  std::uint64_t request_id = 0;
  std::uint32_t loaded_count = 0;  ///< submitted and landed
  std::uint32_t failed_count = 0;  ///< submitted and not landed
  std::uint64_t bytes = 0;         ///< bytes loaded
  std::uint64_t duration_ns = 0;   ///< lookup submission to completion
};
struct l2_prefetch_failed {
  static constexpr event_type type = event_type::l2_prefetch_failed;
  std::uint64_t request_id = 0;
  prefetch_failure reason = prefetch_failure::io_error;
  std::uint32_t key_count = 0;
};
struct l2_backend_load_completed {
  static constexpr event_type type = event_type::l2_backend_load_completed;
  std::uint8_t backend_index = 0;
  short_name backend{};
  std::uint32_t key_count = 0;     ///< keys submitted to this backend
  std::uint32_t loaded_count = 0;  ///< keys that landed
  std::uint64_t bytes = 0;         ///< bytes that landed
  std::uint64_t duration_ns = 0;
};

// ----------------------------------------------------------------------------------------
// cache server
// ----------------------------------------------------------------------------------------
struct server_request_started {
  static constexpr event_type type = event_type::server_request_started;
  request_kind kind = request_kind::other;
  std::uint64_t client_id = 0;
};
struct server_request_finished {
  static constexpr event_type type = event_type::server_request_finished;
  request_kind kind = request_kind::other;
  std::uint64_t client_id = 0;
  bool ok = true;
  std::uint64_t duration_ns = 0;
};

// ----------------------------------------------------------------------------------------
// engine connector
// ----------------------------------------------------------------------------------------
struct connector_healthy {
  static constexpr event_type type = event_type::connector_healthy;
  std::uint32_t rank = 0;
  std::uint64_t unhealthy_ns = 0;  ///< how long it was unhealthy (0 at first connect)
};
struct connector_unhealthy {
  static constexpr event_type type = event_type::connector_unhealthy;
  std::uint32_t rank = 0;
  short_name reason{};  ///< "eof", "ping_timeout", "connect_failed", ...
  std::uint32_t released_requests = 0;  ///< pending requests released on the edge
};
struct connector_reconnected {
  static constexpr event_type type = event_type::connector_reconnected;
  std::uint32_t rank = 0;
  bool server_restarted = false;  ///< the boot token changed: the region was registered again
};
/// A lookup got its answer (lookup_result stops being pending).
struct connector_lookup_completed {
  static constexpr event_type type = event_type::connector_lookup_completed;
  std::uint32_t rank = 0;
  connector_outcome outcome = connector_outcome::ok;
  std::uint32_t requested_chunks = 0;  ///< full chunks of the request's tokens
  std::uint32_t hit_chunks = 0;        ///< chunks every rank has (0 unless ok)
  std::uint32_t chunk_tokens = 0;      ///< to turn chunks into tokens
  std::uint64_t duration_ns = 0;       ///< lookup() to the answer
};
/// A retrieve completed (it is then reported finished receiving).
struct connector_retrieve_completed {
  static constexpr event_type type = event_type::connector_retrieve_completed;
  std::uint32_t rank = 0;
  connector_outcome outcome = connector_outcome::ok;
  std::uint32_t requested_chunks = 0;
  std::uint32_t retrieved_chunks = 0;   ///< the prefix whose KV is in the engine's blocks
  std::uint32_t load_error_blocks = 0;  ///< blocks the engine must recompute
  std::uint64_t duration_ns = 0;        ///< retrieve() to completion
};
/// A store completed, or was skipped (outcome unhealthy).
struct connector_store_completed {
  static constexpr event_type type = event_type::connector_store_completed;
  std::uint32_t rank = 0;
  connector_outcome outcome = connector_outcome::ok;
  std::uint32_t requested_chunks = 0;
  std::uint32_t stored_chunks = 0;           ///< copied into the cache
  std::uint32_t already_present_chunks = 0;  ///< the cache had them
  std::uint32_t failed_chunks = 0;           ///< refused: no room, or fenced (block reused meanwhile)
  std::uint64_t duration_ns = 0;             ///< store() to completion
};
/// Blocks became load errors (take_load_error_blocks hands them to the engine).
struct connector_load_error {
  static constexpr event_type type = event_type::connector_load_error;
  std::uint32_t rank = 0;
  connector_outcome reason = connector_outcome::failed;  ///< partial, failed, timeout or unhealthy
  std::uint32_t block_count = 0;
};
/// Blocks entered or left quarantine.
struct connector_quarantine_changed {
  static constexpr event_type type = event_type::connector_quarantine_changed;
  std::uint32_t rank = 0;
  std::uint32_t held_blocks = 0;      ///< blocks that entered quarantine
  std::uint32_t released_blocks = 0;  ///< blocks that left it (late reply, server process gone)
  std::uint32_t quarantined_blocks = 0;  ///< this connector's quarantined blocks afterwards
};

/// The connector refused the process listening on the server's socket: it runs as another
/// uid than the expected one (connector_options::server_uid). Nothing was sent to it.
struct connector_peer_refused {
  static constexpr event_type type = event_type::connector_peer_refused;
  std::uint32_t rank = 0;
  std::uint32_t peer_uid = 0;  ///< the uid the listening process runs as
  std::uint32_t peer_pid = 0;
  std::uint32_t expected_uid = 0;  ///< the uid the connector accepts (and root)
};

/// A lookup's prefetch offered a shorter prefix than L1 and L2 could serve (load or recompute,
/// pipeline/load_or_recompute.hpp): the declined chunks' tokens are the engine's to compute.
/// A probe (one declining request in prefetch_options::probe_every) still loads the first
/// declined chunks, so the backend's estimate keeps learning: they are offered, not declined.
struct l2_prefetch_declined {
  static constexpr event_type type = event_type::l2_prefetch_declined;
  std::uint64_t request_id = 0;
  decline_reason reason = decline_reason::slower_than_recompute;
  std::uint32_t key_count = 0;        ///< keys not offered
  std::uint64_t tokens = 0;           ///< their chunks' tokens
  std::uint32_t probe_key_count = 0;  ///< keys the gate judged slower but loads as a probe
  std::uint64_t probe_tokens = 0;     ///< their chunks' tokens
};

/// The cache took an L2 backend (published once per backend by tiered_cache's constructor,
/// in index order), so subscribers know each backend's name before its first operation (the
/// metrics subscriber creates its per-backend series at zero).
struct cache_backend_attached {
  static constexpr event_type type = event_type::cache_backend_attached;
  std::uint8_t backend_index = 0;
  short_name backend{};
};

/// The tier a key event is about: 0 is L1, 1 + b is L2 backend b (cache_backend_attached's
/// backend_index + 1).
inline constexpr std::uint8_t l1_tier = 0;
[[nodiscard]] constexpr std::uint8_t l2_tier(std::size_t backend_index) noexcept {
  return static_cast<std::uint8_t>(1 + backend_index);
}

/// Keys that entered a tier: in L1, objects made readable (written by a store, or landed by
/// a prefetch from L2); in an L2 backend, objects whose store succeeded, and those a
/// backend's start-up found. Published by the tier itself when its index changes, in the
/// same order as its removals of the same keys (so a subscriber that applies stored and
/// removed in queue order holds what the tier holds: what visit_l1 / async_list list).
struct tier_keys_stored {
  static constexpr event_type type = event_type::tier_keys_stored;
  std::uint8_t tier = l1_tier;
  std::vector<chunk_key> keys;
};

/// Why keys left a tier (tier_keys_removed).
enum class key_removal : std::uint8_t {
  evicted,  ///< the tier's capacity policy (L1 eviction, a disk backend's capacity eviction)
  deleted,  ///< on request: an operator's evict, a clear, a store policy (skip_l1), a rewrite
  corrupt,  ///< an object that failed its checks on load and was deleted
  expired,  ///< a temporary object (a prefetch landed in L1) freed after its last reader
};
inline constexpr std::size_t key_removal_count = 4;
[[nodiscard]] constexpr std::string_view name(key_removal r) noexcept {
  constexpr std::array<std::string_view, key_removal_count> n = {"evicted", "deleted", "corrupt", "expired"};
  return n[static_cast<std::size_t>(r)];
}

/// Keys that left a tier (every key a tier_keys_stored of the same tier announced before, and
/// only those: a write abandoned before it became readable is not a removal).
struct tier_keys_removed {
  static constexpr event_type type = event_type::tier_keys_removed;
  std::uint8_t tier = l1_tier;
  key_removal reason = key_removal::evicted;
  std::vector<chunk_key> keys;
};

/// What chunks hold, as an engine's scheduler described them (protocol describe_chunks):
/// the token ids of consecutive chunks of one prompt, so a KV event can name each block's
/// tokens. Chunk i's key is {model_id, world_size, rank, chunk_hashes[i]} for every rank.
struct chunks_described {
  static constexpr event_type type = event_type::chunks_described;
  std::uint64_t model_id = 0;    ///< the chunks' model id (the request's salt folded in)
  std::uint16_t world_size = 1;  ///< the engine's tensor-parallel size (the keys' world_size)
  std::uint32_t chunk_tokens = 0;
  std::uint32_t block_size = 0;  ///< the engine's tokens per block (divides chunk_tokens)
  bool has_parent = false;       ///< chunk_hashes[0] follows a chunk (parent_hash) of the same prompt
  hash128 parent_hash{};
  std::vector<hash128> chunk_hashes;   ///< consecutive chunks of one prompt, in order
  std::vector<std::uint32_t> token_ids;  ///< chunk_hashes.size() * chunk_tokens
  std::string lora_name;                ///< empty: none
  std::int64_t lora_id = -1;            ///< -1: none
  /// vLLM's extra_keys of the blocks, one msgpack value per block of these chunks, written
  /// into BlockStored as given (not read by kvtier); empty: none.
  std::vector<std::string> block_extra_keys;
};

/// Every event type, in event_type order (the deferred queue stores a variant of these).
using all_events =
    std::tuple<l1_read_reserved, l1_read_finished, l1_write_reserved, l1_write_finished,
               l1_write_finished_and_read_reserved, l1_keys_evicted, l1_allocation_failed, l1_lock_expired,
               cache_lookup, cache_read_prefetched, cache_write_reserved, cache_write_finished, l2_store_submitted,
               l2_store_completed, l2_prefetch_lookup_submitted, l2_prefetch_lookup_completed,
               l2_prefetch_load_submitted, l2_prefetch_load_completed, l2_prefetch_failed, l2_backend_load_completed,
               server_request_started, server_request_finished, connector_healthy, connector_unhealthy,
               connector_reconnected, connector_lookup_completed, connector_retrieve_completed,
               connector_store_completed, connector_load_error, connector_quarantine_changed, connector_peer_refused,
               l2_prefetch_declined, cache_backend_attached, tier_keys_stored, tier_keys_removed,
               chunks_described>;

static_assert(std::tuple_size_v<all_events> == event_type_count, "one struct per event_type");

/// An event type: an aggregate with a static `type`.
template <class E>
concept event = requires {
  { E::type } -> std::convertible_to<event_type>;
};

}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {
namespace detail {
template <std::size_t... I>
consteval bool events_in_type_order(std::index_sequence<I...>) {
  return ((std::tuple_element_t<I, all_events>::type == static_cast<event_type>(I)) && ...);
}
static_assert(events_in_type_order(std::make_index_sequence<event_type_count>{}),
              "all_events lists the event structs in event_type order");
}  // namespace detail
}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
