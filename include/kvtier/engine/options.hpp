#pragma once
// connector_options: everything an engine's connector needs to know, with the defaults
// docs/fault-tolerance.md explains. A worker's KV layout (model shape, block size, number of
// blocks, layout kind) is not repeated here: it is the layout of the kv_region the connector
// is given, so the two can never disagree. A scheduler's connector has no region and names
// the model's per-rank shape and layout kind in `model` and `layout_kind` instead.

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/protocol/limits.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

/// Every deadline and period of the connector. The values are the unscaled ones: the
/// connector multiplies each by connector_options::timeout_scale (config::timeout_scale by
/// default: 1 in optimised builds, 4 under ASan, 10 under TSan), so a slow sanitizer build is
/// not taken for a hung server.
struct connector_timeouts {
  using duration = std::chrono::milliseconds;

  /// Period of the liveness ping while healthy. An idle connector pings too: the server reaps
  /// clients that stay silent (contract: 30 s), and a hang is only seen through a request.
  duration ping_interval{200};
  /// A ping unanswered this long means the server is hung: the connector turns unhealthy.
  /// Detection takes at most ping_interval + ping_timeout after the server stops answering.
  duration ping_timeout{1000};
  /// Deadline of the small calls: get_chunk_size, register, free_lookup_locks, end_request.
  /// (A lookup waits until lookup_timeout: the server answers it when the prefetch is
  /// decided.)
  duration request_timeout{2000};
  /// How long a lookup may stay pending (prefetch still deciding) before it answers 0 and its
  /// locks are freed: the deadline of its one call (and of a query after a `pending` answer).
  /// Its timeout does not count towards the breaker (a slow prefetch is no hung server).
  duration lookup_timeout{5000};
  /// How long a retrieve may go without news: its deadline is the last progress message
  /// (the server sends one each time more chunks or layers landed; the retrieve's start
  /// before the first) plus retrieve_timeout, and never later than its start plus the
  /// server's load budget (register_kv_response::load_budget_ms: how long the server waits
  /// for an L2 load, 30 s by default) plus retrieve_timeout. Past it the chunks progress
  /// said were ready count as retrieved; the other blocks are load errors (recomputed) and
  /// quarantined (docs/fault-tolerance.md, "Deadlines").
  duration retrieve_timeout{5000};
  /// Deadline of a store: past it the store counts as finished (the engine may reuse the
  /// blocks; generation fencing keeps a late copy from being stored).
  duration store_timeout{10000};
  /// Reconnection backoff: the first retry after reconnect_initial, doubling up to
  /// reconnect_max.
  duration reconnect_initial{50};
  duration reconnect_max{2000};
  /// Quarantined blocks are released when it is proven that no copy can follow: the
  /// server's late answer, its close of the connection (EOF: it closes one only after every
  /// copy it started for it ended), or its process gone (pidfd). A server that runs at all
  /// gives one of these within about its client reap timeout (30 s): it answers, or it
  /// reaps the connection the connector abandoned. Only a server alive but not running
  /// (stopped, frozen, deadlocked) keeps blocks longer, and it is also the only one that may
  /// still write them (when it resumes mid-copy). Past this limit the blocks are released
  /// anyway: 10 minutes is 20 times the default reap timeout and far beyond any copy of a
  /// running server (< 1 s, docs/server.md), so only a server frozen longer than that in the
  /// middle of a copy could write a released block; the cost it bounds is capacity (the
  /// blocks of the retrieves in flight when the server stopped: new ones are not sent while
  /// it is unhealthy). 0: no limit, blocks wait for a proof however long (safety over
  /// capacity: choose it where a server may be frozen for long, e.g. under a debugger).
  /// docs/fault-tolerance.md has the trade.
  duration quarantine_limit{std::chrono::minutes(10)};
};

/// How one retrieve loads (connector::retrieve, retrieve_hashes). Every retrieve asks the
/// server for progress (protocol::retrieve_request::progress), so layers_ready() and
/// wait_layers() see the layers of an L1 hit land one by one (the engine can compute layer l
/// while the server copies layer l + 1: vLLM's wait_for_layer_load), and the retrieve's
/// deadline follows the chunks as they land. When the server cannot copy layer by layer
/// (chunks still loading from L2), the layers are ready all at once when the retrieve ends.
struct retrieve_options {
  /// The engine waits for this load within its step (vLLM's synchronous load:
  /// get_num_new_matched_tokens answered `(n, False)`): the request is never reported in
  /// finished_recving, which vLLM expects only of asynchronous loads (finished_tracker.hpp).
  /// Its failed blocks still come from take_load_error_blocks(); the engine must take them
  /// after wait_retrieves() and before it accepts the step's output.
  bool synchronous = false;
};

/// What a description of chunks (connector::describe_chunks) says beside their hashes and
/// tokens: what vLLM's BlockStored event carries for routers (docs/integration.md, "Routers").
struct chunk_description_extras {
  /// The engine's tokens per block; 0: connector_options::block_size.
  std::uint32_t block_size = 0;
  /// The chunk before hashes[0] in the same prompt; none: hashes[0] is the prompt's first chunk.
  std::optional<hash128> parent;
  /// The LoRA adapter (vLLM's lora_request.lora_name), <= 256 bytes; empty: none.
  std::string lora_name;
  /// vLLM's lora_request.lora_int_id; -1: none.
  std::int64_t lora_id = -1;
  /// vLLM's extra_keys of each block of the chunks (one msgpack value each, <= 4096 bytes),
  /// block by block; empty: none.
  std::vector<std::string> block_extra_keys;
};

/// The connector's configuration. Construct, fill in, pass to engine::connector.
struct connector_options {
  /// The server's Unix socket (protocol::default_socket_path() is the servers' default).
  std::string socket_path;
  /// The uid the server's process must run as; unset: this process's effective uid. Root is
  /// accepted too. Checked with SO_PEERCRED right after connecting, before anything (the KV
  /// region's memfd above all) is sent: a process of another user listening on the path is
  /// refused (last_error() says so, unhealthy reason "peer_refused"). Set it when the server
  /// runs under a service account.
  std::optional<std::uint32_t> server_uid;
  /// This worker's tensor-parallel rank and the world size.
  std::uint16_t rank = 0;
  std::uint16_t world_size = 1;
  /// Whether this connector issues lookups (the "scheduler" role); unset: rank == 0.
  std::optional<bool> scheduler;
  /// The model's name; with the model shape, the layout kind and cache_salt it makes the
  /// model id (make_model_id), so engines of different dtypes or layouts never share chunks.
  std::string model_name;
  /// A connector without a kv_region (a scheduler): the shape one rank's workers register
  /// (num_kv_heads of one rank) and their layout kind, so its lookups name the workers'
  /// chunks. Ignored (must stay default) for a connector with a region: the region's layout
  /// is the one that counts.
  model_shape model{};
  kv_layout_kind layout_kind = kv_layout_kind::nhd;
  /// Folded into the model id of every chunk this connector names: engines with different
  /// salts never share chunks (a deployment-wide tenant salt). A request may add its own
  /// (the cache_salt argument of lookup/retrieve/store, vLLM's per-request cache_salt).
  std::string cache_salt;
  /// The engine's prefill rate for this model in tokens per second (0: not declared); the
  /// server offers from L2 only what loads faster than the engine recomputes it.
  std::uint64_t prefill_tokens_per_second = 0;
  /// Tokens per chunk; must equal the server's and be a multiple of the region's block size.
  std::uint32_t chunk_tokens = 256;
  /// The chunk hash (must match every other engine that shares the cache).
  hash_algorithm hash = hash_algorithm::xxh3_128;
  /// This worker's id towards the server (ping, status); 0: the process id.
  std::uint64_t instance_id = 0;
  /// The engine instance this connector belongs to (<= 128 bytes), the same in its
  /// scheduler's and every worker's connector (vLLM: kv_transfer_config.engine_id). The
  /// server knows the connections of one uid and engine id as one engine: a worker's
  /// retrieve copies through the scheduler's lookup (each chunk as its L2 load lands) and
  /// gives back that rank's holds when it ends. Empty: this connector's connection is an
  /// engine of its own (lookups and retrieves must then be made on one connector).
  std::string engine_id;

  connector_timeouts timeouts;
  /// Multiplies every timeout and period of `timeouts`.
  int timeout_scale = config::timeout_scale;
  /// Consecutive call timeouts (pings aside) that trip the breaker: the server is declared
  /// unhealthy even though pings still pass (it answers pings but not work).
  std::uint32_t breaker_threshold = 3;
  /// Request ids remembered after their final finished report, to swallow the engine's
  /// re-reports (finished_tracker). 65536 ids ~ 2 MiB.
  std::size_t finished_window = 65536;
  /// Lookup answers kept for lookup_result after they arrive; the oldest go first past this
  /// (end_request removes an answer at once).
  std::size_t max_lookups = 65536;
  /// Describe the chunks this connector looks up (their token ids: describe_chunks, sent by
  /// lookup() itself) to the server, for the KV events it may publish for routers. Each
  /// connection stops describing when the server answers that it publishes none.
  bool describe_chunks = true;
  /// The engine's tokens per block, sent in descriptions; 0: the region's block size, or
  /// chunk_tokens for a connector without a region. Must divide chunk_tokens (and be the
  /// region's block size for a connector with one).
  std::uint32_t block_size = 0;
  /// Chunks (hash and request salt) described on a connection that are not described again
  /// on it: the most recent this many (65536 ~ 3 MiB); a reconnection forgets them.
  std::size_t described_chunks_window = 65536;

  [[nodiscard]] bool is_scheduler() const noexcept { return scheduler.value_or(rank == 0); }

  /// `d` times timeout_scale.
  [[nodiscard]] std::chrono::milliseconds scaled(std::chrono::milliseconds d) const noexcept {
    return d * timeout_scale;
  }

  /// Empty when valid, else what is wrong and how to fix it.
  [[nodiscard]] std::string validation_error() const {
    if (socket_path.empty()) return "socket_path is empty: set it to the server's Unix socket";
    if (world_size == 0) return "world_size must be >= 1";
    if (rank >= world_size) return "rank must be below world_size";
    if (model_name.size() > protocol::max_model_name_bytes) return "model_name is longer than 256 bytes";
    if (cache_salt.size() > protocol::max_cache_salt_bytes) return "cache_salt is longer than 256 bytes";
    if (engine_id.size() > protocol::max_engine_id_bytes) return "engine_id is longer than 128 bytes";
    if (chunk_tokens == 0 || chunk_tokens > 65536) return "chunk_tokens must be in 1..65536";
    if (timeout_scale < 1) return "timeout_scale must be >= 1";
    const auto& t = timeouts;
    for (auto d : {t.ping_interval, t.ping_timeout, t.request_timeout, t.lookup_timeout, t.retrieve_timeout,
                   t.store_timeout, t.reconnect_initial, t.reconnect_max})
      if (d.count() <= 0) return "every timeout, period and backoff must be > 0 (quarantine_limit may be 0)";
    if (t.quarantine_limit.count() < 0) return "quarantine_limit must be >= 0";
    if (t.reconnect_initial > t.reconnect_max) return "reconnect_initial must not exceed reconnect_max";
    if (breaker_threshold == 0) return "breaker_threshold must be >= 1";
    if (finished_window == 0) return "finished_window must be >= 1";
    if (max_lookups == 0) return "max_lookups must be >= 1";
    if (block_size != 0 && chunk_tokens % block_size != 0) return "block_size must divide chunk_tokens (or be 0)";
    if (described_chunks_window == 0) return "described_chunks_window must be >= 1";
    return {};
  }
};

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
