#pragma once
// The messages between an engine worker (connector) and the cache server, one struct each,
// and `message`, the variant a decoder yields. docs/protocol.md is the reference.
//
// Requests carry chunk hashes (the connector hashes tokens itself with core/token_hasher),
// block ids of the engine's registered KV region, and `request_key`, the engine's request
// id. KV bytes never travel here: the region is one memfd passed once with SCM_RIGHTS
// beside register_kv_request (see connection.hpp). Every request is answered by its own
// response type or by error_response, with the request's call id (frame header).
//
// Each struct has `static constexpr message_type type`, a defaulted operator==, and
// `fields(self)`: its members in wire order with their limits (field.hpp). Requests name
// their answer as `response_type`.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/field.hpp>
#include <kvtier/protocol/limits.hpp>

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// The message type in the frame header. Values are stable: append, never renumber.
/// A response is its request's value | 0x8000; error_response (0x8000) answers any request.
/// A progress message is its request's value | 0x4000: the server sends it, with the
/// request's call id, zero or more times before the request's response (never after it).
enum class message_type : std::uint16_t {
  register_kv_request = 0x0001,
  unregister_kv_request = 0x0002,
  lookup_request = 0x0003,
  query_prefetch_request = 0x0004,
  retrieve_request = 0x0005,
  store_request = 0x0006,
  free_lookup_locks_request = 0x0007,
  end_request_request = 0x0008,
  ping_request = 0x0009,
  clear_request = 0x000a,
  get_chunk_size_request = 0x000b,
  status_request = 0x000c,
  list_objects_request = 0x000d,
  evict_request = 0x000e,
  describe_chunks_request = 0x000f,
  list_keys_request = 0x0010,

  retrieve_progress = 0x4005,

  error_response = 0x8000,
  register_kv_response = 0x8001,
  unregister_kv_response = 0x8002,
  lookup_response = 0x8003,
  query_prefetch_response = 0x8004,
  retrieve_response = 0x8005,
  store_response = 0x8006,
  free_lookup_locks_response = 0x8007,
  end_request_response = 0x8008,
  ping_response = 0x8009,
  clear_response = 0x800a,
  get_chunk_size_response = 0x800b,
  status_response = 0x800c,
  list_objects_response = 0x800d,
  evict_response = 0x800e,
  describe_chunks_response = 0x800f,
  list_keys_response = 0x8010,
};

/// Bit set in every response type.
inline constexpr std::uint16_t response_bit = 0x8000;
/// Bit set in every progress type (a server -> engine message about a request in flight).
inline constexpr std::uint16_t progress_bit = 0x4000;

[[nodiscard]] constexpr bool is_response(message_type t) noexcept {
  return (static_cast<std::uint16_t>(t) & response_bit) != 0;
}
[[nodiscard]] constexpr bool is_progress(message_type t) noexcept {
  return (static_cast<std::uint16_t>(t) & (response_bit | progress_bit)) == progress_bit;
}
/// True for what only the server sends: responses and progress messages.
[[nodiscard]] constexpr bool from_server(message_type t) noexcept { return is_response(t) || is_progress(t); }

// ---------------------------------------------------------------------------------------
// Responses (declared first: requests name theirs).
// ---------------------------------------------------------------------------------------

/// Answers any request that failed: a kvtier::errc value and a human-readable reason.
/// Its body layout (u32 code, string message) is frozen for every protocol version, so a
/// peer of another version can read why it was refused.
struct error_response {
  static constexpr message_type type = message_type::error_response;
  std::uint32_t code = 0;  ///< a kvtier::errc value (unknown values are kept as they are)
  std::string message;     ///< <= max_error_message_bytes

  /// The code in the kvtier category.
  [[nodiscard]] error_code error() const noexcept { return {static_cast<int>(code), kvtier_category()}; }

  /// An error reply; `text` is cut to max_error_message_bytes.
  [[nodiscard]] static error_response make(errc e, std::string_view text) {
    return {static_cast<std::uint32_t>(e), std::string(text.substr(0, max_error_message_bytes))};
  }

  friend bool operator==(const error_response&, const error_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("code", self.code), bounded("message", self.message, max_error_message_bytes)};
  }
};

struct register_kv_response {
  static constexpr message_type type = message_type::register_kv_response;
  std::uint64_t boot_token = 0;    ///< random per server boot; a change reveals a restart
  std::uint64_t client_id = 0;     ///< the server's id of this registration (status, metrics)
  std::uint64_t model_id = 0;      ///< the model namespace of this engine's chunk keys
  std::uint32_t chunk_tokens = 0;  ///< tokens per chunk the server uses (echo or override)
  /// The longest a retrieve may wait for the L2 loads of its lookup (the server's prefetch
  /// load timeout), in ms: a retrieve's deadline is at most this plus the engine's own
  /// retrieve timeout (docs/fault-tolerance.md, "Deadlines").
  std::uint32_t load_budget_ms = 0;

  friend bool operator==(const register_kv_response&, const register_kv_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("boot_token", self.boot_token), field("client_id", self.client_id),
                      field("model_id", self.model_id), field("chunk_tokens", self.chunk_tokens),
                      field("load_budget_ms", self.load_budget_ms)};
  }
};

/// An empty acknowledgement; one distinct type per request so a reply names what it answers.
template <message_type Type>
struct empty_response {
  static constexpr message_type type = Type;
  friend bool operator==(const empty_response&, const empty_response&) = default;
  static constexpr auto fields(auto&) noexcept { return std::tuple{}; }
};
using unregister_kv_response = empty_response<message_type::unregister_kv_response>;
using free_lookup_locks_response = empty_response<message_type::free_lookup_locks_response>;
using end_request_response = empty_response<message_type::end_request_response>;
using clear_response = empty_response<message_type::clear_response>;

/// Where the prefetch of a request stands.
enum class prefetch_state : std::uint8_t {
  pending = 0,  ///< still running: ask again
  done = 1,     ///< finished: hit counts are final (reported once, like LMCache's pop-once)
  unknown = 2,  ///< no lookup under that key (never submitted, already reported, or reaped)
};
[[nodiscard]] constexpr std::string_view name(prefetch_state s) noexcept {
  switch (s) {
    case prefetch_state::pending:
      return "pending";
    case prefetch_state::done:
      return "done";
    case prefetch_state::unknown:
      return "unknown";
  }
  return "invalid";
}

/// Where a lookup's prefetch stands, with its hit counts once decided; one distinct type per
/// request that asks (lookup_response, query_prefetch_response).
template <message_type Type>
struct basic_prefetch_response {
  static constexpr message_type type = Type;
  prefetch_state state = prefetch_state::unknown;
  std::uint32_t hit_chunks = 0;     ///< contiguous prefix now held for retrieve (L1, or loading from L2)
  std::uint32_t l1_hit_chunks = 0;  ///< of those, how many were already in L1 at lookup

  friend bool operator==(const basic_prefetch_response&, const basic_prefetch_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{enumerated("state", self.state, prefetch_state::unknown), field("hit_chunks", self.hit_chunks),
                      field("l1_hit_chunks", self.l1_hit_chunks)};
  }
};
/// The lookup was accepted: `done` with its counts when its prefetch was decided at once (an
/// L1 hit, no L2 backend) or, when the request asked for it (answer_when_decided), once it is
/// decided; `pending` when it was not decided and the request did not ask to wait (ask with
/// query_prefetch); `unknown` when a held answer's lookup went first (released, ended,
/// replaced, unregistered) or the cache no longer knows it.
using lookup_response = basic_prefetch_response<message_type::lookup_response>;
using query_prefetch_response = basic_prefetch_response<message_type::query_prefetch_response>;

struct retrieve_response {
  static constexpr message_type type = message_type::retrieve_response;
  std::uint32_t retrieved_chunks = 0;  ///< contiguous prefix that landed in the engine's blocks

  friend bool operator==(const retrieve_response&, const retrieve_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("retrieved_chunks", self.retrieved_chunks)};
  }
};

/// Progress of a retrieve that asked for it (retrieve_request::progress), sent with the
/// retrieve's call id before its retrieve_response, never after it, each time one of its
/// counts grew. `layers_ready` leading layers of every chunk the response will count as
/// retrieved are in the engine's blocks and final: the engine may compute those layers
/// (always below the model's layer count: the response itself means every layer). The
/// response may still count fewer chunks than were requested: the blocks of the chunks it
/// does not count are load errors, whatever layers_ready said (docs/protocol.md,
/// "Layer-wise retrieves"). `chunks_ready` leading chunks are in the engine's blocks, every
/// layer, and final: the response counts at least these, and an engine that gives up on
/// the retrieve (its deadline, the server gone) may count them as retrieved. Both are
/// non-decreasing over one retrieve.
struct retrieve_progress {
  static constexpr message_type type = message_type::retrieve_progress;
  std::uint32_t layers_ready = 0;
  std::uint32_t chunks_ready = 0;

  friend bool operator==(const retrieve_progress&, const retrieve_progress&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("layers_ready", self.layers_ready), field("chunks_ready", self.chunks_ready)};
  }
};

struct store_response {
  static constexpr message_type type = message_type::store_response;
  std::uint32_t stored = 0;           ///< chunks copied into L1 (and offered to L2)
  std::uint32_t already_present = 0;  ///< chunks the cache had (nothing copied)
  std::uint32_t failed = 0;           ///< out of memory, fenced (generation changed), ...

  friend bool operator==(const store_response&, const store_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("stored", self.stored), field("already_present", self.already_present),
                      field("failed", self.failed)};
  }
};

struct ping_response {
  static constexpr message_type type = message_type::ping_response;
  std::uint64_t boot_token = 0;      ///< as in register_kv_response: a change means restart
  std::uint64_t server_time_ns = 0;  ///< the server's steady clock (diagnostics only)

  friend bool operator==(const ping_response&, const ping_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("boot_token", self.boot_token), field("server_time_ns", self.server_time_ns)};
  }
};

struct get_chunk_size_response {
  static constexpr message_type type = message_type::get_chunk_size_response;
  std::uint32_t chunk_tokens = 0;

  friend bool operator==(const get_chunk_size_response&, const get_chunk_size_response&) = default;
  static constexpr auto fields(auto& self) noexcept { return std::tuple{field("chunk_tokens", self.chunk_tokens)}; }
};

struct status_response {
  static constexpr message_type type = message_type::status_response;
  std::string json;  ///< registrations, locks held per client, L1 usage; <= max_status_json_bytes

  friend bool operator==(const status_response&, const status_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("json", self.json, max_status_json_bytes)};
  }
};

/// The objects the server holds, per model namespace and tier, as JSON (docs/server.md,
/// "Administration").
struct list_objects_response {
  static constexpr message_type type = message_type::list_objects_response;
  std::string json;  ///< <= max_status_json_bytes

  friend bool operator==(const list_objects_response&, const list_objects_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("json", self.json, max_status_json_bytes)};
  }
};

/// What an evict_request removed, in total and (json) per tier.
struct evict_response {
  static constexpr message_type type = message_type::evict_response;
  std::uint64_t removed_objects = 0;  ///< objects removed, every tier together
  std::uint64_t removed_bytes = 0;    ///< their bytes, as each tier counts them
  std::uint64_t in_use_objects = 0;   ///< matched but kept: locked in L1 (not forced), pinned or being stored in L2
  std::uint64_t failed_objects = 0;   ///< matched but not removed: a backend error
  /// {"tiers": [{"tier", "removed_objects", "removed_bytes", "in_use_objects",
  /// "failed_objects", "error"}...]}; <= max_status_json_bytes
  std::string json;

  friend bool operator==(const evict_response&, const evict_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("removed_objects", self.removed_objects), field("removed_bytes", self.removed_bytes),
                      field("in_use_objects", self.in_use_objects), field("failed_objects", self.failed_objects),
                      bounded("json", self.json, max_status_json_bytes)};
  }
};

/// Whether the server turned a describe_chunks_request into KV events.
struct describe_chunks_response {
  static constexpr message_type type = message_type::describe_chunks_response;
  /// false: this server publishes no KV events (nothing was kept); the connection should
  /// send no more descriptions (a later server on a new connection may publish).
  bool described = false;

  friend bool operator==(const describe_chunks_response&, const describe_chunks_response&) = default;
  static constexpr auto fields(auto& self) noexcept { return std::tuple{field("described", self.described)}; }
};

/// The chunk keys one tier holds (list_keys_request).
struct list_keys_response {
  static constexpr message_type type = message_type::list_keys_response;
  /// {"tier": name, "keys": ["<model id>/<world size>/<rank>/<hash>", ...] (chunk_key::
  /// to_string, sorted), "total": objects the tier holds, "truncated": whether keys has fewer};
  /// <= max_status_json_bytes
  std::string json;

  friend bool operator==(const list_keys_response&, const list_keys_response&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("json", self.json, max_status_json_bytes)};
  }
};

// ---------------------------------------------------------------------------------------
// Requests.
// ---------------------------------------------------------------------------------------

/// What a registration brings of the engine's KV memory. Values are stable.
enum class region_kind : std::uint8_t {
  none = 0,       ///< no KV memory: a scheduler (lookup, query, free, end only)
  cpu_memfd = 1,  ///< a sealed memfd (kv_region) passed beside the frame
  cuda_ipc = 2,   ///< GPU memory: region_descriptor holds the CUDA IPC descriptor bytes
};
[[nodiscard]] constexpr std::string_view name(region_kind k) noexcept {
  switch (k) {
    case region_kind::none:
      return "none";
    case region_kind::cpu_memfd:
      return "cpu_memfd";
    case region_kind::cuda_ipc:
      return "cuda_ipc";
  }
  return "unknown";
}

/// Registers an engine process with the server: a worker with its paged KV region, or a
/// scheduler without one (region_kind::none). A cpu_memfd registration carries exactly one fd
/// (the region's memfd, SCM_RIGHTS): the frame's `fd` on the server side.
struct register_kv_request {
  static constexpr message_type type = message_type::register_kv_request;
  using response_type = register_kv_response;
  std::uint64_t instance_id = 0;                     ///< the engine process's pid (ping and reaping use it)
  std::uint16_t rank = 0;                            ///< tensor-parallel rank of this worker (0 for a scheduler)
  std::uint16_t world_size = 1;                      ///< tensor-parallel world size
  std::string model_name;                            ///< <= max_model_name_bytes
  model_shape model;                                 ///< layers, KV heads, head dim, dtype kind, MHA/MLA
  std::uint32_t block_size = 0;                      ///< tokens per paged-KV block (0 for region none)
  std::uint32_t num_blocks = 0;                      ///< blocks in the region (0 for region none)
  std::uint32_t chunk_tokens = 0;                    ///< tokens per chunk the engine hashes with
  std::uint64_t region_bytes = 0;                    ///< size of the memfd region (0 for region none)
  kv_layout_kind layout_kind = kv_layout_kind::nhd;  ///< NHD / HND (MHA) or MLA
  region_kind region = region_kind::cpu_memfd;
  /// cuda_ipc: the descriptor bytes of cuda/ipc_region.cuh (<= max_region_descriptor_bytes);
  /// empty otherwise.
  std::string region_descriptor;
  /// Folded into the connection's model id: engines with different salts never share
  /// chunks (a deployment-wide tenant salt; a request may add its own, see lookup_request).
  std::string cache_salt;
  /// The engine's prefill rate for this model (tokens per second, 0: not declared). The
  /// server offers from L2 only what loads faster than the engine would recompute it.
  std::uint64_t prefill_tokens_per_second = 0;
  /// Where the region's rows are (bytes; core/kv_layout.hpp): all zero for the dense layout
  /// of layout_kind, else the engine's own tensor strides, which must agree with layout_kind
  /// (the order of the chunk objects, part of the model id). Zero for region none.
  kv_strides strides{};
  /// The engine instance this connection belongs to (<= max_engine_id_bytes), shared by its
  /// scheduler and every worker rank (vLLM's kv_transfer_config.engine_id): the server knows
  /// the connections of one peer uid and engine id as one engine, whose lookups any of them
  /// may use (a worker's retrieve copies what the scheduler looked up). Empty: the
  /// connection is an engine of its own.
  std::string engine_id;

  /// The paged KV layout the region holds.
  [[nodiscard]] paged_kv_layout layout() const noexcept {
    return {model, block_size, num_blocks, layout_kind, strides};
  }

  friend bool operator==(const register_kv_request&, const register_kv_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("instance_id", self.instance_id),
                      field("rank", self.rank),
                      field("world_size", self.world_size),
                      bounded("model_name", self.model_name, max_model_name_bytes),
                      field("model", self.model),
                      field("block_size", self.block_size),
                      field("num_blocks", self.num_blocks),
                      field("chunk_tokens", self.chunk_tokens),
                      field("region_bytes", self.region_bytes),
                      enumerated("layout_kind", self.layout_kind, last_kv_layout_kind),
                      enumerated("region", self.region, region_kind::cuda_ipc),
                      bounded("region_descriptor", self.region_descriptor, max_region_descriptor_bytes),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes),
                      field("prefill_tokens_per_second", self.prefill_tokens_per_second),
                      field("strides.layer", self.strides.layer),
                      field("strides.plane", self.strides.plane),
                      field("strides.block", self.strides.block),
                      field("strides.token", self.strides.token),
                      field("strides.head", self.strides.head),
                      bounded("engine_id", self.engine_id, max_engine_id_bytes)};
  }
};

/// Drops this connection's registration (and its locks); the region fd is closed.
struct unregister_kv_request {
  static constexpr message_type type = message_type::unregister_kv_request;
  using response_type = unregister_kv_response;
  friend bool operator==(const unregister_kv_request&, const unregister_kv_request&) = default;
  static constexpr auto fields(auto&) noexcept { return std::tuple{}; }
};

/// Starts the lookup + prefetch of a request's chunks (the scheduler side).
struct lookup_request {
  static constexpr message_type type = message_type::lookup_request;
  using response_type = lookup_response;
  std::string request_key;            ///< <= max_request_key_bytes
  std::uint64_t model_id = 0;         ///< from register_kv_response
  std::uint16_t world_size = 1;       ///< prefetch every rank's shard
  std::vector<hash128> chunk_hashes;  ///< rolling prefix hashes of the full chunks, <= max_chunk_hashes
  std::string cache_salt;             ///< the request's salt (vLLM cache_salt), <= max_cache_salt_bytes
  /// Answer when the prefetch is decided (one round trip, nothing polls) instead of at once;
  /// the server answers earlier, `unknown`, when the lookup is released, ended or replaced.
  bool answer_when_decided = false;

  friend bool operator==(const lookup_request&, const lookup_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes),
                      field("model_id", self.model_id),
                      field("world_size", self.world_size),
                      bounded("chunk_hashes", self.chunk_hashes, max_chunk_hashes),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes),
                      field("answer_when_decided", self.answer_when_decided)};
  }
};

struct query_prefetch_request {
  static constexpr message_type type = message_type::query_prefetch_request;
  using response_type = query_prefetch_response;
  std::string request_key;  ///< <= max_request_key_bytes

  friend bool operator==(const query_prefetch_request&, const query_prefetch_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes)};
  }
};

/// Copies prefetched chunks from L1 into the engine's blocks (the worker side).
struct retrieve_request {
  static constexpr message_type type = message_type::retrieve_request;
  using response_type = retrieve_response;
  std::string request_key;  ///< <= max_request_key_bytes
  std::uint16_t rank = 0;
  std::uint32_t first_chunk = 0;         ///< index of chunk_hashes[0] in the request's prompt
  std::vector<hash128> chunk_hashes;     ///< <= max_chunk_hashes
  std::vector<std::uint32_t> block_ids;  ///< destination blocks, chunk by chunk, <= max_block_ids
  std::uint32_t skip_tokens = 0;         ///< leading tokens the engine already has (not overwritten)
  std::string cache_salt;                ///< the request's salt, as in its lookup_request
  /// Send retrieve_progress each time more leading chunks (or, when every chunk is readable
  /// at once, an L1 hit copied layer by layer, more leading layers) are in the engine's
  /// blocks; the response alone otherwise.
  bool progress = false;

  friend bool operator==(const retrieve_request&, const retrieve_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes),
                      field("rank", self.rank),
                      field("first_chunk", self.first_chunk),
                      bounded("chunk_hashes", self.chunk_hashes, max_chunk_hashes),
                      bounded("block_ids", self.block_ids, max_block_ids),
                      field("skip_tokens", self.skip_tokens),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes),
                      field("progress", self.progress)};
  }
};

/// Copies the engine's blocks into L1 under the given chunk hashes (the worker side).
struct store_request {
  static constexpr message_type type = message_type::store_request;
  using response_type = store_response;
  std::string request_key;  ///< <= max_request_key_bytes
  std::uint16_t rank = 0;
  std::uint32_t first_chunk = 0;         ///< index of chunk_hashes[0] in the request's prompt
  std::vector<hash128> chunk_hashes;     ///< <= max_chunk_hashes
  std::vector<std::uint32_t> block_ids;  ///< source blocks, chunk by chunk, <= max_block_ids
  /// One per block id: the fencing seqlock value the engine read for that block; the server
  /// re-reads it after copying and drops the chunk if the block was reused meanwhile.
  std::vector<std::uint64_t> block_generations;
  std::string cache_salt;  ///< the request's salt (vLLM cache_salt), <= max_cache_salt_bytes

  /// Null when the lengths agree (one generation per block id), else why not.
  [[nodiscard]] const char* wire_error() const noexcept {
    return block_generations.size() == block_ids.size() ? nullptr
                                                        : "block_generations must hold one value per block id";
  }

  friend bool operator==(const store_request&, const store_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes),
                      field("rank", self.rank),
                      field("first_chunk", self.first_chunk),
                      bounded("chunk_hashes", self.chunk_hashes, max_chunk_hashes),
                      bounded("block_ids", self.block_ids, max_block_ids),
                      bounded("block_generations", self.block_generations, max_block_ids),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes)};
  }
};

/// Releases the lookup's read locks of chunks that will never be retrieved.
struct free_lookup_locks_request {
  static constexpr message_type type = message_type::free_lookup_locks_request;
  using response_type = free_lookup_locks_response;
  std::string request_key;  ///< <= max_request_key_bytes

  friend bool operator==(const free_lookup_locks_request&, const free_lookup_locks_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes)};
  }
};

/// The engine finished the request: the server drops its session state.
struct end_request_request {
  static constexpr message_type type = message_type::end_request_request;
  using response_type = end_request_response;
  std::string request_key;  ///< <= max_request_key_bytes

  friend bool operator==(const end_request_request&, const end_request_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("request_key", self.request_key, max_request_key_bytes)};
  }
};

struct ping_request {
  static constexpr message_type type = message_type::ping_request;
  using response_type = ping_response;
  std::uint64_t instance_id = 0;  ///< keeps this worker's registration from being reaped

  friend bool operator==(const ping_request&, const ping_request&) = default;
  static constexpr auto fields(auto& self) noexcept { return std::tuple{field("instance_id", self.instance_id)}; }
};

struct clear_request {
  static constexpr message_type type = message_type::clear_request;
  using response_type = clear_response;
  bool force = false;  ///< also drop locked objects (their locks are broken)

  friend bool operator==(const clear_request&, const clear_request&) = default;
  static constexpr auto fields(auto& self) noexcept { return std::tuple{field("force", self.force)}; }
};

struct get_chunk_size_request {
  static constexpr message_type type = message_type::get_chunk_size_request;
  using response_type = get_chunk_size_response;
  friend bool operator==(const get_chunk_size_request&, const get_chunk_size_request&) = default;
  static constexpr auto fields(auto&) noexcept { return std::tuple{}; }
};

/// Asks for the server's state as JSON (tests and operators read it).
struct status_request {
  static constexpr message_type type = message_type::status_request;
  using response_type = status_response;
  friend bool operator==(const status_request&, const status_request&) = default;
  static constexpr auto fields(auto&) noexcept { return std::tuple{}; }
};

// --- Administration (docs/server.md, "Administration"): the server's owner and root only;
// an unregistered connection may send them.

/// Lists the objects of every tier (L1 and each L2 backend) per model namespace: the
/// salted model id of their chunk keys, with the model name and salts the server learned
/// for it from registrations and requests ("unknown" for ids it has not seen since it
/// started), and per tier the objects and bytes.
struct list_objects_request {
  static constexpr message_type type = message_type::list_objects_request;
  using response_type = list_objects_response;
  friend bool operator==(const list_objects_request&, const list_objects_request&) = default;
  static constexpr auto fields(auto&) noexcept { return std::tuple{}; }
};

/// Removes the objects a selection names from the tiers named. The selection is `all`, or
/// one or more of by_model (the model name), by_salt (the request salt, "" for unsalted
/// requests) and by_model_id (one namespace, as list_objects shows it; the only way to name
/// an unknown one), all of which must match. Objects in use are kept and counted: read- or
/// write-locked in L1 (unless `force`), pinned by a prefetch or still being stored in L2.
struct evict_request {
  static constexpr message_type type = message_type::evict_request;
  using response_type = evict_response;
  bool all = false;  ///< every object (then no by_* may be set)
  bool by_model = false;
  std::string model_name;  ///< <= max_model_name_bytes
  bool by_salt = false;
  std::string cache_salt;  ///< <= max_cache_salt_bytes
  bool by_model_id = false;
  std::uint64_t model_id = 0;
  /// Comma-separated tier names: "l1" and L2 backend names (as list_objects shows them);
  /// empty: every tier. <= max_tier_list_bytes
  std::string tiers;
  /// L1: also remove objects in use; they leave at once for lookups and their memory is
  /// freed when the copy or load holding them ends (never pulled from under it).
  bool force = false;

  friend bool operator==(const evict_request&, const evict_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("all", self.all),
                      field("by_model", self.by_model),
                      bounded("model_name", self.model_name, max_model_name_bytes),
                      field("by_salt", self.by_salt),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes),
                      field("by_model_id", self.by_model_id),
                      field("model_id", self.model_id),
                      bounded("tiers", self.tiers, max_tier_list_bytes),
                      field("force", self.force)};
  }
};

/// Lists the chunk keys of one tier ("l1" or an L2 backend's name): what a router's index of
/// the KV events is checked against, and what one rebuilds from after a replay gap. At most
/// max_keys keys (and what fits in max_status_json_bytes: ~60,000). Administration: the
/// server's owner and root only. L1 lists every object it holds, writes in flight included
/// (a router hears of those once they are readable).
struct list_keys_request {
  static constexpr message_type type = message_type::list_keys_request;
  using response_type = list_keys_response;
  std::string tier;            ///< <= max_tier_list_bytes
  std::uint32_t max_keys = 0;  ///< 0: as many as fit

  friend bool operator==(const list_keys_request&, const list_keys_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{bounded("tier", self.tier, max_tier_list_bytes), field("max_keys", self.max_keys)};
  }
};

// --- KV events for routers (docs/integration.md, "Routers"; docs/kv-events.md).

/// The token ids of chunks the engine looked up, so that a server publishing vLLM KV events
/// can announce them (BlockStored needs every block's tokens; the server keys chunks by their
/// prefix hashes and never sees tokens). The scheduler's connection sends it fire and forget
/// beside its lookups; a worker's may too. The server checks it against the connection's
/// registration (model id and world size as in lookup_request; token_ids holds exactly
/// chunk_hashes.size() x the registration's chunk_tokens; block_size divides chunk_tokens;
/// block_extra_keys is empty or one value per block; lora_id >= -1) and answers
/// described=false, keeping nothing, when it publishes no KV events: the connection then stops
/// sending them. The chunks' model id is the registration's salted with cache_salt, exactly
/// as a lookup's.
struct describe_chunks_request {
  static constexpr message_type type = message_type::describe_chunks_request;
  using response_type = describe_chunks_response;
  std::uint64_t model_id = 0;    ///< from register_kv_response, as in lookup_request
  std::uint16_t world_size = 1;  ///< the registration's
  std::string cache_salt;        ///< the request's salt (vLLM cache_salt), <= max_cache_salt_bytes
  std::uint32_t block_size = 0;  ///< the engine's tokens per block (divides chunk_tokens)
  /// chunk_hashes[0] follows chunk parent_hash of the same prompt (the description does not
  /// start at the prompt's first chunk); false: chunk_hashes[0] is the prompt's first chunk.
  bool has_parent = false;
  hash128 parent_hash{};
  std::vector<hash128> chunk_hashes;     ///< consecutive chunks of one prompt, in order, <= max_chunk_hashes
  std::vector<std::uint32_t> token_ids;  ///< every token of those chunks, <= max_described_tokens
  std::string lora_name;                 ///< the LoRA adapter (vLLM lora_name); empty: none
  std::int64_t lora_id = -1;             ///< vLLM's lora_int_id; -1: none
  /// vLLM's extra_keys of each block of these chunks, one msgpack value per block (written
  /// into BlockStored as given; the server only checks that each is one msgpack value), or
  /// empty: none. <= max_block_extra_keys values of <= max_block_extra_key_bytes each.
  std::vector<std::string> block_extra_keys;

  friend bool operator==(const describe_chunks_request&, const describe_chunks_request&) = default;
  static constexpr auto fields(auto& self) noexcept {
    return std::tuple{field("model_id", self.model_id),
                      field("world_size", self.world_size),
                      bounded("cache_salt", self.cache_salt, max_cache_salt_bytes),
                      field("block_size", self.block_size),
                      field("has_parent", self.has_parent),
                      field("parent_hash", self.parent_hash),
                      bounded("chunk_hashes", self.chunk_hashes, max_chunk_hashes),
                      bounded("token_ids", self.token_ids, max_described_tokens),
                      bounded("lora_name", self.lora_name, max_lora_name_bytes),
                      field("lora_id", self.lora_id),
                      bounded_strings("block_extra_keys", self.block_extra_keys, max_block_extra_keys,
                                      max_block_extra_key_bytes)};
  }
};

// ---------------------------------------------------------------------------------------
// The variant and its vocabulary.
// ---------------------------------------------------------------------------------------

/// Any decoded message.
using message = std::variant<register_kv_request, unregister_kv_request, lookup_request, query_prefetch_request,
                             retrieve_request, store_request, free_lookup_locks_request, end_request_request,
                             ping_request, clear_request, get_chunk_size_request, status_request, error_response,
                             register_kv_response, unregister_kv_response, lookup_response, query_prefetch_response,
                             retrieve_response, store_response, free_lookup_locks_response, end_request_response,
                             ping_response, clear_response, get_chunk_size_response, status_response,
                             retrieve_progress, list_objects_request, evict_request, list_objects_response,
                             evict_response, describe_chunks_request, describe_chunks_response,
                             list_keys_request, list_keys_response>;

/// A type that travels in a frame: an alternative of `message`.
template <class T>
concept wire_message = requires(T& m, const T& c) {
  { T::type } -> std::convertible_to<message_type>;
  T::fields(m);
  T::fields(c);
};

/// A request: a wire message with a `response_type`.
template <class T>
concept wire_request = wire_message<T> && wire_message<typename T::response_type> &&
    (T::response_type::type == static_cast<message_type>(static_cast<std::uint16_t>(T::type) | response_bit));

[[nodiscard]] inline message_type type_of(const message& m) noexcept {
  return std::visit([](const auto& x) { return std::decay_t<decltype(x)>::type; }, m);
}

namespace detail {
template <std::size_t... I>
constexpr bool known_type(std::uint16_t t, std::index_sequence<I...>) noexcept {
  return ((static_cast<std::uint16_t>(std::variant_alternative_t<I, message>::type) == t) || ...);
}
}  // namespace detail

/// True for the values that name a message of this protocol version.
[[nodiscard]] constexpr bool is_known(std::uint16_t type) noexcept {
  return detail::known_type(type, std::make_index_sequence<std::variant_size_v<message>>{});
}

/// The message's struct name ("lookup_request"); "unknown" for other values.
[[nodiscard]] constexpr std::string_view name(message_type t) noexcept {
  switch (t) {
    case message_type::register_kv_request:
      return "register_kv_request";
    case message_type::unregister_kv_request:
      return "unregister_kv_request";
    case message_type::lookup_request:
      return "lookup_request";
    case message_type::query_prefetch_request:
      return "query_prefetch_request";
    case message_type::retrieve_request:
      return "retrieve_request";
    case message_type::store_request:
      return "store_request";
    case message_type::free_lookup_locks_request:
      return "free_lookup_locks_request";
    case message_type::end_request_request:
      return "end_request_request";
    case message_type::ping_request:
      return "ping_request";
    case message_type::clear_request:
      return "clear_request";
    case message_type::get_chunk_size_request:
      return "get_chunk_size_request";
    case message_type::status_request:
      return "status_request";
    case message_type::list_objects_request:
      return "list_objects_request";
    case message_type::evict_request:
      return "evict_request";
    case message_type::describe_chunks_request:
      return "describe_chunks_request";
    case message_type::list_keys_request:
      return "list_keys_request";
    case message_type::retrieve_progress:
      return "retrieve_progress";
    case message_type::error_response:
      return "error_response";
    case message_type::register_kv_response:
      return "register_kv_response";
    case message_type::unregister_kv_response:
      return "unregister_kv_response";
    case message_type::lookup_response:
      return "lookup_response";
    case message_type::query_prefetch_response:
      return "query_prefetch_response";
    case message_type::retrieve_response:
      return "retrieve_response";
    case message_type::store_response:
      return "store_response";
    case message_type::free_lookup_locks_response:
      return "free_lookup_locks_response";
    case message_type::end_request_response:
      return "end_request_response";
    case message_type::ping_response:
      return "ping_response";
    case message_type::clear_response:
      return "clear_response";
    case message_type::get_chunk_size_response:
      return "get_chunk_size_response";
    case message_type::status_response:
      return "status_response";
    case message_type::list_objects_response:
      return "list_objects_response";
    case message_type::evict_response:
      return "evict_response";
    case message_type::describe_chunks_response:
      return "describe_chunks_response";
    case message_type::list_keys_response:
      return "list_keys_response";
  }
  return "unknown";
}

/// True for the one request that may carry an fd (the KV region's memfd of a cpu_memfd
/// registration).
[[nodiscard]] constexpr bool carries_fd(message_type t) noexcept { return t == message_type::register_kv_request; }

/// True for the administration requests: the server answers them to its owner and root only.
[[nodiscard]] constexpr bool is_admin(message_type t) noexcept {
  return t == message_type::list_objects_request || t == message_type::evict_request ||
         t == message_type::list_keys_request;
}

namespace detail {
template <std::size_t... I>
constexpr bool all_wire_messages(std::index_sequence<I...>) noexcept {
  return (wire_message<std::variant_alternative_t<I, message>> && ...);
}
template <std::size_t... I>
constexpr bool types_unique(std::index_sequence<I...>) noexcept {
  constexpr std::uint16_t t[] = {static_cast<std::uint16_t>(std::variant_alternative_t<I, message>::type)...};
  for (std::size_t a = 0; a < sizeof...(I); ++a)
    for (std::size_t b = a + 1; b < sizeof...(I); ++b)
      if (t[a] == t[b]) return false;
  return true;
}
}  // namespace detail
static_assert(detail::all_wire_messages(std::make_index_sequence<std::variant_size_v<message>>{}));
static_assert(detail::types_unique(std::make_index_sequence<std::variant_size_v<message>>{}),
              "two message structs share a message_type");
static_assert(wire_request<register_kv_request> && wire_request<unregister_kv_request> &&
              wire_request<lookup_request> && wire_request<query_prefetch_request> && wire_request<retrieve_request> &&
              wire_request<store_request> && wire_request<free_lookup_locks_request> &&
              wire_request<end_request_request> && wire_request<ping_request> && wire_request<clear_request> &&
              wire_request<get_chunk_size_request> && wire_request<status_request> &&
              wire_request<list_objects_request> && wire_request<evict_request> &&
              wire_request<describe_chunks_request> && wire_request<list_keys_request>);

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
