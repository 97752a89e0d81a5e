#pragma once
// server_config: every option of kvtier-server with its default, its JSON form and its
// validation. The flags of examples/server/main.cpp map one to one onto the JSON keys (a
// flag --l1-read-ttl-seconds is the key "l1_read_ttl_seconds"); a --config FILE is read
// first and flags override it. docs/server.md lists every key.
//
//   server_config c = server_config::parse(json);   // from_json + validate, throws config_error
//   nlohmann::json j = c.to_json();                  // every key, parse(to_json()) == c
//
// Every refusal is a config_error "<what> (<value>): <what to change>" (server_config_json.hpp).
// The defaults run without any flag: 1 GiB of L1 in 4 MiB slots (a 0.5B model's 256-token
// chunk is 3 MiB; an 8B model's is 32 MiB: raise l1_slot_bytes), LRU eviction, no L2.

#include <kvtier/config.hpp>
#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/kv_events_config.hpp>
#include <kvtier/server/config/server_config_json.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The L1 eviction policies the server is built with (l1/policy/).
enum class eviction_kind : std::uint8_t { lru, s3fifo, arc, noop };
/// The store policies (pipeline/policies.hpp): L1 keeps stored keys, or drops them once
/// every L2 backend has them (L1 as a write buffer).
enum class store_kind : std::uint8_t { write_through, skip_l1 };
/// How long a lookup waits for its L2 prefetch (pipeline/policies.hpp).
enum class prefetch_wait_kind : std::uint8_t { best_effort, wait_complete, timeout };

inline constexpr std::array<std::string_view, 4> eviction_names = {"lru", "s3fifo", "arc", "noop"};
inline constexpr std::array<std::string_view, 2> store_names = {"write_through", "skip_l1"};
inline constexpr std::array<std::string_view, 3> prefetch_wait_names = {"best_effort", "wait_complete", "timeout"};

[[nodiscard]] constexpr std::string_view name(eviction_kind k) noexcept {
  return eviction_names[static_cast<std::size_t>(k)];
}
[[nodiscard]] constexpr std::string_view name(store_kind k) noexcept {
  return store_names[static_cast<std::size_t>(k)];
}
[[nodiscard]] constexpr std::string_view name(prefetch_wait_kind k) noexcept {
  return prefetch_wait_names[static_cast<std::size_t>(k)];
}

/// The default socket: protocol::default_socket_path() ($XDG_RUNTIME_DIR/kvtier/kvtier.sock,
/// /run/kvtier/kvtier.sock for root, else ${TMPDIR:-/tmp}/kvtier-<uid>/kvtier.sock), the same
/// rule every client program uses. The server creates and verifies that directory at start.
[[nodiscard]] inline std::string default_socket_path() { return protocol::default_socket_path(); }

struct server_config {
  // --- socket -------------------------------------------------------------------------
  std::string socket_path = default_socket_path();  ///< "socket": the Unix socket
  /// "socket_mode" (an octal string, "0600"): the socket file's permission bits. Wider
  /// modes only let other users reach the socket; who is served is decided by the peer's
  /// uid (allowed_uids, allowed_gids).
  std::uint32_t socket_mode = 0600;

  // --- who may connect, and how much a client may hold ---------------------------------
  /// "allowed_uids" (uids or user names): users served besides the server's own (and root).
  std::vector<std::uint32_t> allowed_uids;
  /// "allowed_gids" (gids or group names): members of these groups are served too.
  std::vector<std::uint32_t> allowed_gids;
  std::uint32_t max_connections = 1024;         ///< "max_connections": open connections, all clients
  std::uint32_t max_connections_per_uid = 512;  ///< "max_connections_per_uid"
  /// "max_lookup_keys" ("auto" = 0: 4 x max_lookup_keys_per_client): chunk keys all open
  /// lookups may hold together (~40 bytes of server memory each).
  std::uint64_t max_lookup_keys = 0;
  /// "max_lookup_keys_per_client" ("auto" = 0: the larger of 2^20, one maximal lookup, and
  /// 64 keys per L1 slot): chunk keys the open lookups of one connection may hold.
  std::uint64_t max_lookup_keys_per_client = 0;

  // --- L1 ------------------------------------------------------------------------------
  std::uint32_t chunk_tokens = 256;                      ///< "chunk_size": tokens per chunk
  std::uint64_t l1_size_bytes = std::uint64_t{1} << 30;  ///< "l1_size_gb" | "l1_size_mb" | "l1_size_bytes"
  std::uint64_t l1_slot_bytes = std::uint64_t{4} << 20;  ///< "l1_slot_bytes": largest chunk object
  eviction_kind eviction = eviction_kind::lru;           ///< "eviction_policy"
  double eviction_watermark = 0.8;                       ///< "eviction_watermark": share of slots
  double eviction_target = 0.7;                          ///< "eviction_target": evict down to this share
  double l1_write_ttl_s = 600;                           ///< "l1_write_ttl_seconds"
  double l1_read_ttl_s = 300;                            ///< "l1_read_ttl_seconds": lookup locks
  double lookup_ttl_s = 300;                             ///< "lookup_ttl_seconds": forget unreleased lookups
  /// "l1_prefault": once the server serves, fault every page of L1 in behind the first
  /// requests, then register L1 with the L2 backends that read into it faster so (the disk
  /// backend's io_uring fixed buffers): no page fault or page pinning on a load. Costs no
  /// start-up time (server/l1_residency.hpp) and makes all of L1 resident.
  bool l1_prefault = true;
  /// "l1_huge_pages": madvise(MADV_HUGEPAGE) on the L1 arena before its pages are faulted in,
  /// so L1 slots are 2 MiB pages where the kernel's transparent huge pages allow it ("madvise"
  /// or "always" in /sys/kernel/mm/transparent_hugepage/enabled). O_DIRECT loads from disk
  /// into physically contiguous slots take fewer block-layer segments: the 0.5B L2 hit went
  /// from 1.7-2.1x the disk's time to 1.34-1.41x (docs/performance.md, "L1 in huge pages").
  bool l1_huge_pages = true;

  // --- L2 and pipelines ----------------------------------------------------------------
  std::vector<nlohmann::json> l2_backends;                           ///< "l2_backends": backend_factory descriptions
  store_kind store_policy = store_kind::write_through;               ///< "l2_store_policy"
  prefetch_wait_kind prefetch_policy = prefetch_wait_kind::timeout;  ///< "prefetch_policy"
  std::uint32_t prefetch_timeout_base_ms = 2000;                     ///< "prefetch_timeout_base_ms" (timeout)
  std::uint32_t prefetch_timeout_per_1k_tokens_ms = 100;             ///< "prefetch_timeout_per_1k_tokens_ms" (timeout)
  std::uint32_t prefetch_timeout_cap_ms = 30000;  ///< "prefetch_timeout_cap_ms" (timeout, wait_complete)
  std::uint32_t prefetch_max_in_flight = 8;       ///< "prefetch_max_in_flight"
  /// "prefetch_load_timeout_ms": deadline of one L2 load task (pipeline::prefetch_options::
  /// load_timeout); also the load budget the server tells engines at registration, which
  /// their retrieve deadlines follow.
  std::uint32_t prefetch_load_timeout_ms = 30000;
  /// "prefetch_probe_every", "prefetch_probe_chunks": the load-or-recompute gate's probes
  /// (one declining request in probe_every loads probe_chunks of what the gate declined, so
  /// the backend's estimate keeps learning; 0: never probe). docs/pipelines.md.
  std::uint32_t prefetch_probe_every = 8;
  std::uint32_t prefetch_probe_chunks = 1;
  /// "worker_threads": threads of the worker pool, which runs what must not hold up the I/O
  /// thread: the copies between the engines' regions and L1 (retrieve, store), a registered
  /// region's mapping and prefault; 0 = from the cores (worker_thread_count()). The key was
  /// "copy_threads" (named when the pool ran the copies alone): still read, as an alias.
  std::uint32_t worker_threads = 0;

  // --- clients, logs, shutdown ---------------------------------------------------------
  telemetry::log_level log_level = telemetry::log_level::info;  ///< "log_level"
  /// "client_reap_timeout" (seconds): a connection silent this long is closed and reaped.
  /// The default is stretched by config::timeout_scale in sanitizer builds.
  double client_reap_timeout_s = 30.0 * config::timeout_scale;
  std::uint32_t max_lookups_per_client = 16384;  ///< "max_lookups_per_client"
  double shutdown_timeout_s = 5;                 ///< "shutdown_timeout": wait for L2 work at exit
  /// "metrics_port": the HTTP port of /metrics, /healthz and /status (0 = off; the JSON
  /// string "auto" = any free port, which the startup line names: metrics_any_port).
  std::uint16_t metrics_port = 0;
  bool metrics_any_port = false;              ///< "metrics_port": "auto"
  std::string metrics_address = "127.0.0.1";  ///< "metrics_address": loopback unless told otherwise
  /// "kv_events": KV events for routers (kv_events_config.hpp; off when absent or null).
  kv_events_config kv_events;

  /// The worker pool's size: worker_threads, or when 0 half the cores, between 1 and 8.
  [[nodiscard]] std::uint32_t worker_thread_count() const noexcept {
    if (worker_threads > 0) return worker_threads;
    const unsigned cores = std::thread::hardware_concurrency();
    return std::clamp<std::uint32_t>(cores / 2, 1, 8);
  }

  /// Whether the HTTP endpoint is on.
  [[nodiscard]] bool metrics_enabled() const noexcept { return metrics_port != 0 || metrics_any_port; }

  friend bool operator==(const server_config&, const server_config&) = default;

  /// The L1 slots: l1_size_bytes / l1_slot_bytes.
  [[nodiscard]] std::uint64_t l1_slot_count() const noexcept {
    return l1_slot_bytes ? l1_size_bytes / l1_slot_bytes : 0;
  }

  /// max_lookup_keys_per_client with "auto" resolved.
  [[nodiscard]] std::uint64_t lookup_keys_per_client() const noexcept {
    if (max_lookup_keys_per_client != 0) return max_lookup_keys_per_client;
    return std::max<std::uint64_t>(std::uint64_t{1} << 20, l1_slot_count() * 64);
  }
  /// max_lookup_keys with "auto" resolved.
  [[nodiscard]] std::uint64_t lookup_keys_total() const noexcept {
    return max_lookup_keys != 0 ? max_lookup_keys : 4 * lookup_keys_per_client();
  }
  /// Who the server serves besides itself and root.
  [[nodiscard]] protocol::peer_policy peer_policy() const {
    return {{allowed_uids.begin(), allowed_uids.end()}, {allowed_gids.begin(), allowed_gids.end()}};
  }

  /// Reads the keys of `j` over this configuration (keys absent keep their value). Throws
  /// config_error for an unknown key, a wrong type or an out-of-range value.
  void merge_json(const nlohmann::json& j);

  /// Checks what single keys cannot (L1 size vs slot size, watermark vs target, backends).
  /// Throws config_error.
  void validate(const backend_factory& backends = backend_factory::builtin()) const;

  /// Defaults + `j`, validated. Throws config_error.
  [[nodiscard]] static server_config parse(const nlohmann::json& j,
                                           const backend_factory& backends = backend_factory::builtin()) {
    server_config c;
    c.merge_json(j);
    c.validate(backends);
    return c;
  }

  /// Every key with its value (l1 size as l1_size_bytes).
  [[nodiscard]] nlohmann::json to_json() const;

  [[nodiscard]] std::chrono::nanoseconds client_reap_timeout() const noexcept { return seconds(client_reap_timeout_s); }
  [[nodiscard]] static std::chrono::nanoseconds seconds(double s) noexcept {
    return std::chrono::nanoseconds(static_cast<std::int64_t>(s * 1e9));
  }

 private:
  // merge_json's parts, in its order: who may connect and how much each may hold; L1, L2
  // and the prefetch; the process (threads, logs, timeouts, the HTTP endpoint).
  void merge_clients(json_object_reader& r);
  void merge_cache(json_object_reader& r);
  void merge_process(json_object_reader& r);
};

namespace detail {
template <std::size_t N>
std::vector<std::string_view> choices(const std::array<std::string_view, N>& a) {
  return {a.begin(), a.end()};
}
template <class Enum, std::size_t N>
Enum enum_of(const std::array<std::string_view, N>& names, const std::string& s) {
  for (std::size_t i = 0; i < N; ++i)
    if (names[i] == s) return static_cast<Enum>(i);
  return Enum{};  // unreachable: the reader checked the choices
}

/// A user (or, with `group`, a group) as an id: a number, or a name this machine knows.
inline std::optional<std::uint32_t> account_id(const std::string& name, bool group) {
  if (name.empty()) return std::nullopt;
  if (name.find_first_not_of("0123456789") == std::string::npos) {
    if (name.size() > 10) return std::nullopt;
    const std::uint64_t v = std::stoull(name);
    if (v >= 0xffffffffULL) return std::nullopt;  // (uid_t)-1 means "no one"
    return static_cast<std::uint32_t>(v);
  }
  if (group) {
    if (const ::group* g = ::getgrnam(name.c_str())) return static_cast<std::uint32_t>(g->gr_gid);
  } else if (const ::passwd* p = ::getpwnam(name.c_str())) {
    return static_cast<std::uint32_t>(p->pw_uid);
  }
  return std::nullopt;
}

/// "allowed_uids" / "allowed_gids": an array of ids or names, or one string of them
/// separated by commas (the command-line form, "1001,alice").
inline std::optional<std::vector<std::uint32_t>> read_accounts(json_object_reader& r, std::string_view key,
                                                               bool group) {
  const nlohmann::json* v = r.raw(key);
  if (!v) return std::nullopt;
  const std::string what = group ? "group" : "user";
  const std::string fix = "must be a list of " + what + " ids or names, e.g. [1001, \"" +
                          (group ? std::string("kvtier") : std::string("alice")) + "\"] or \"1001,alice\"";
  std::vector<std::string> names;
  if (v->is_string()) {
    const std::string s = v->get<std::string>();
    std::size_t at = 0;
    while (at <= s.size()) {
      const std::size_t comma = std::min(s.find(',', at), s.size());
      names.push_back(s.substr(at, comma - at));
      at = comma + 1;
    }
  } else if (v->is_array()) {
    for (const auto& e : *v) {
      if (e.is_number_integer() && e.get<std::int64_t>() >= 0)
        names.push_back(std::to_string(e.get<std::int64_t>()));
      else if (e.is_string())
        names.push_back(e.get<std::string>());
      else
        throw r.error(key, e, fix);
    }
  } else {
    throw r.error(key, *v, fix);
  }
  std::vector<std::uint32_t> ids;
  for (const auto& n : names) {
    const auto id = account_id(n, group);
    if (!id) throw r.error(key, nlohmann::json(n), "no such " + what + " on this machine; " + fix);
    ids.push_back(*id);
  }
  return ids;
}

/// A budget key: a positive integer, or "auto" (0).
inline std::optional<std::uint64_t> read_budget(json_object_reader& r, std::string_view key, std::uint64_t hi,
                                                std::string_view hint) {
  if (const nlohmann::json* v = r.raw(key); v && v->is_string() && v->get<std::string>() == "auto") return 0;
  return r.integer(key, 1, hi, hint);
}
}  // namespace detail

inline void server_config::merge_json(const nlohmann::json& j) {
  json_object_reader r(j, "");
  merge_clients(r);
  merge_cache(r);
  merge_process(r);
  r.finish();
}

inline void server_config::merge_clients(json_object_reader& r) {
  if (auto v = r.string("socket")) socket_path = *v;
  if (auto v =
          r.string("socket_mode", {}, "an octal mode such as \"0600\" (only this user) or \"0660\" (its group too)")) {
    const bool octal = !v->empty() && v->size() <= 4 && v->find_first_not_of("01234567") == std::string::npos;
    const std::uint32_t m = octal ? static_cast<std::uint32_t>(std::stoul(*v, nullptr, 8)) : 0;
    if (!octal || (m & 0600) != 0600)
      throw r.error("socket_mode", nlohmann::json(*v),
                    "must be an octal mode that lets this user read and write, e.g. \"0600\" or \"0660\"");
    socket_mode = m;
  }
  if (auto v = detail::read_accounts(r, "allowed_uids", false)) allowed_uids = std::move(*v);
  if (auto v = detail::read_accounts(r, "allowed_gids", true)) allowed_gids = std::move(*v);
  if (auto v = r.integer("max_connections", 1, 1 << 20)) max_connections = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("max_connections_per_uid", 1, 1 << 20))
    max_connections_per_uid = static_cast<std::uint32_t>(*v);
  if (auto v = detail::read_budget(r, "max_lookup_keys", std::uint64_t{1} << 40, "or \"auto\"")) max_lookup_keys = *v;
  if (auto v = detail::read_budget(r, "max_lookup_keys_per_client", std::uint64_t{1} << 40, "or \"auto\""))
    max_lookup_keys_per_client = *v;
}

inline void server_config::merge_cache(json_object_reader& r) {
  if (auto v = r.integer("chunk_size", 1, 65536, "a multiple of the engine's block size, e.g. 256"))
    chunk_tokens = static_cast<std::uint32_t>(*v);
  if (auto v = read_size(r, "l1_size")) l1_size_bytes = *v;
  if (auto v = r.integer("l1_slot_bytes", 4096, std::uint64_t{1} << 40,
                         "at least the engine's chunk object (a 0.5B model's 256-token chunk is 3 MiB, an 8B "
                         "model's 32 MiB)"))
    l1_slot_bytes = *v;
  if (auto v = r.string("eviction_policy", detail::choices(eviction_names)))
    eviction = detail::enum_of<eviction_kind>(eviction_names, *v);
  if (auto v = r.number("eviction_watermark", 0, 1, "the share of L1 slots at which eviction starts, e.g. 0.8"))
    eviction_watermark = *v;
  if (auto v = r.number("eviction_target", 0, 1, "the share of L1 slots eviction frees down to, e.g. 0.7"))
    eviction_target = *v;
  if (auto v = r.number("l1_write_ttl_seconds", 0.001, 1e7)) l1_write_ttl_s = *v;
  if (auto v = r.number("l1_read_ttl_seconds", 0.001, 1e7)) l1_read_ttl_s = *v;
  if (auto v = r.number("lookup_ttl_seconds", 0.001, 1e7)) lookup_ttl_s = *v;
  if (auto v = r.boolean("l1_prefault")) l1_prefault = *v;
  if (auto v = r.boolean("l1_huge_pages")) l1_huge_pages = *v;
  if (const nlohmann::json* b = r.raw("l2_backends")) {
    if (!b->is_array())
      throw r.error("l2_backends", *b, "must be an array of backend objects, e.g. [{\"type\": \"memory\"}]");
    l2_backends.assign(b->begin(), b->end());
  }
  if (auto v = r.string("l2_store_policy", detail::choices(store_names)))
    store_policy = detail::enum_of<store_kind>(store_names, *v);
  if (auto v = r.string("prefetch_policy", detail::choices(prefetch_wait_names)))
    prefetch_policy = detail::enum_of<prefetch_wait_kind>(prefetch_wait_names, *v);
  constexpr std::uint64_t max_ms = 24ULL * 3600 * 1000;
  if (auto v = r.integer("prefetch_timeout_base_ms", 0, max_ms))
    prefetch_timeout_base_ms = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_timeout_per_1k_tokens_ms", 0, max_ms))
    prefetch_timeout_per_1k_tokens_ms = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_timeout_cap_ms", 0, max_ms))
    prefetch_timeout_cap_ms = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_max_in_flight", 1, 65536)) prefetch_max_in_flight = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_load_timeout_ms", 1, max_ms))
    prefetch_load_timeout_ms = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_probe_every", 0, 1u << 20)) prefetch_probe_every = static_cast<std::uint32_t>(*v);
  if (auto v = r.integer("prefetch_probe_chunks", 0, 65536)) prefetch_probe_chunks = static_cast<std::uint32_t>(*v);
}

inline void server_config::merge_process(json_object_reader& r) {
  // "copy_threads": worker_threads' old name, still read (not both).
  const nlohmann::json* old_name = r.raw("copy_threads");
  if (old_name != nullptr && r.raw("worker_threads") != nullptr)
    throw r.error("copy_threads", *old_name, "is the old name of worker_threads: give worker_threads only");
  if (auto v = r.integer(old_name != nullptr ? "copy_threads" : "worker_threads", 0, 256))
    worker_threads = static_cast<std::uint32_t>(*v);
  if (auto v = r.string("log_level", {"trace", "debug", "info", "warn", "error", "off"}))
    log_level = *telemetry::parse_log_level(*v);
  if (auto v = r.number("client_reap_timeout", 0.001, 1e7, "in seconds, e.g. 30")) client_reap_timeout_s = *v;
  if (auto v = r.integer("max_lookups_per_client", 1, std::uint64_t{1} << 24))
    max_lookups_per_client = static_cast<std::uint32_t>(*v);
  if (auto v = r.number("shutdown_timeout", 0, 3600, "in seconds, e.g. 5")) shutdown_timeout_s = *v;
  if (const nlohmann::json* v = r.raw("metrics_port"); v && v->is_string() && v->get<std::string>() == "auto") {
    metrics_port = 0;
    metrics_any_port = true;
  } else if (auto p =
                 r.integer("metrics_port", 0, 65535, "or \"auto\" (any free port); 0 turns the HTTP endpoint off")) {
    metrics_port = static_cast<std::uint16_t>(*p);
    metrics_any_port = false;
  }
  if (auto v = r.string("metrics_address", {}, "an IP address, e.g. 127.0.0.1 (loopback) or 0.0.0.0 (every interface)"))
    metrics_address = *v;
  if (const nlohmann::json* v = r.raw("kv_events")) {
    if (v->is_null()) kv_events = kv_events_config{};
    else kv_events.merge_json(*v);
  }
}

inline void server_config::validate(const backend_factory& backends) const {
  if (socket_path.empty())
    throw config_error("socket", "\"\"", "give the path of the Unix socket, e.g. /tmp/kvtier.sock");
  if (socket_path.size() >= sizeof(sockaddr_un{}.sun_path) || socket_path.find('\0') != std::string::npos)
    throw config_error("socket", socket_path,
                       "a Unix socket path must be shorter than " + std::to_string(sizeof(sockaddr_un{}.sun_path)) +
                           " bytes: choose a shorter path");
  if (chunk_tokens == 0 || chunk_tokens > 65536)
    throw config_error("chunk_size", std::to_string(chunk_tokens), "must be in 1..65536, e.g. 256");
  if (l1_slot_bytes < 4096) throw config_error("l1_slot_bytes", std::to_string(l1_slot_bytes), "must be at least 4096");
  if (const std::uint64_t ram = machine_memory_bytes(); ram != 0 && l1_size_bytes > ram)
    throw config_error(
        "l1 size", std::to_string(l1_size_bytes >> 20) + " MiB",
        "is more than this machine's memory (" + std::to_string(ram >> 20) + " MiB): lower --l1-size-gb/--l1-size-mb");
  if (l1_size_bytes < l1_slot_bytes)
    throw config_error("l1 size", std::to_string(l1_size_bytes) + " bytes",
                       "L1 must hold at least one slot of l1_slot_bytes (" + std::to_string(l1_slot_bytes) +
                           "): raise --l1-size-mb/--l1-size-gb or lower --l1-slot-bytes");
  if (!(eviction_watermark > 0 && eviction_watermark <= 1))
    throw config_error("eviction_watermark", json_object_reader::format(eviction_watermark),
                       "must be in (0, 1], e.g. 0.8");
  if (!(eviction_target >= 0 && eviction_target < eviction_watermark))
    throw config_error(
        "eviction_target", json_object_reader::format(eviction_target),
        "must be >= 0 and below eviction_watermark (" + json_object_reader::format(eviction_watermark) + "), e.g. 0.7");
  for (auto [what, v] :
       {std::pair{"l1_write_ttl_seconds", l1_write_ttl_s}, std::pair{"l1_read_ttl_seconds", l1_read_ttl_s},
        std::pair{"lookup_ttl_seconds", lookup_ttl_s}, std::pair{"client_reap_timeout", client_reap_timeout_s}})
    if (!(v > 0)) throw config_error(what, json_object_reader::format(v), "must be above 0 seconds");
  if (!(shutdown_timeout_s >= 0))
    throw config_error("shutdown_timeout", json_object_reader::format(shutdown_timeout_s), "must be >= 0 seconds");
  if (prefetch_max_in_flight == 0)
    throw config_error("prefetch_max_in_flight", "0", "must be at least 1 (LMCache's default is 8)");
  if (prefetch_load_timeout_ms == 0)
    throw config_error("prefetch_load_timeout_ms", "0", "must be at least 1 ms (default 30000)");
  if (max_lookups_per_client == 0) throw config_error("max_lookups_per_client", "0", "must be at least 1");
  if (lookup_keys_per_client() > lookup_keys_total()) {
    if (max_lookup_keys != 0)
      throw config_error("max_lookup_keys", std::to_string(max_lookup_keys),
                         "must be at least max_lookup_keys_per_client (" + std::to_string(lookup_keys_per_client()) +
                             (max_lookup_keys_per_client == 0 ? ", its automatic value" : "") + ")");
    throw config_error("max_lookup_keys_per_client", std::to_string(max_lookup_keys_per_client),
                       "must not exceed max_lookup_keys (" + std::to_string(lookup_keys_total()) + ")");
  }
  if (max_connections_per_uid > max_connections)
    throw config_error("max_connections_per_uid", std::to_string(max_connections_per_uid),
                       "must not exceed max_connections (" + std::to_string(max_connections) + ")");
  if (metrics_enabled()) {
    unsigned char addr[sizeof(in6_addr)];
    if (::inet_pton(AF_INET, metrics_address.c_str(), addr) != 1 &&
        ::inet_pton(AF_INET6, metrics_address.c_str(), addr) != 1)
      throw config_error("metrics_address", "\"" + metrics_address + "\"",
                         "must be an IPv4 or IPv6 address, e.g. 127.0.0.1 (loopback) or 0.0.0.0 (every interface)");
  }
  kv_events.validate();
  (void)backends.parse_all(l2_backends);
}

inline nlohmann::json server_config::to_json() const {
  nlohmann::json j;
  j["socket"] = socket_path;
  {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(socket_mode));
    j["socket_mode"] = mode;
  }
  j["allowed_uids"] = allowed_uids;
  j["allowed_gids"] = allowed_gids;
  j["max_connections"] = max_connections;
  j["max_connections_per_uid"] = max_connections_per_uid;
  if (max_lookup_keys == 0)
    j["max_lookup_keys"] = "auto";
  else
    j["max_lookup_keys"] = max_lookup_keys;
  if (max_lookup_keys_per_client == 0)
    j["max_lookup_keys_per_client"] = "auto";
  else
    j["max_lookup_keys_per_client"] = max_lookup_keys_per_client;
  j["chunk_size"] = chunk_tokens;
  j["l1_size_bytes"] = l1_size_bytes;
  j["l1_slot_bytes"] = l1_slot_bytes;
  j["eviction_policy"] = std::string(name(eviction));
  j["eviction_watermark"] = eviction_watermark;
  j["eviction_target"] = eviction_target;
  j["l1_write_ttl_seconds"] = l1_write_ttl_s;
  j["l1_read_ttl_seconds"] = l1_read_ttl_s;
  j["lookup_ttl_seconds"] = lookup_ttl_s;
  j["l1_prefault"] = l1_prefault;
  j["l1_huge_pages"] = l1_huge_pages;
  j["l2_backends"] = nlohmann::json::array();
  for (const auto& b : l2_backends) j["l2_backends"].push_back(b);
  j["l2_store_policy"] = std::string(name(store_policy));
  j["prefetch_policy"] = std::string(name(prefetch_policy));
  j["prefetch_timeout_base_ms"] = prefetch_timeout_base_ms;
  j["prefetch_timeout_per_1k_tokens_ms"] = prefetch_timeout_per_1k_tokens_ms;
  j["prefetch_timeout_cap_ms"] = prefetch_timeout_cap_ms;
  j["prefetch_max_in_flight"] = prefetch_max_in_flight;
  j["prefetch_load_timeout_ms"] = prefetch_load_timeout_ms;
  j["prefetch_probe_every"] = prefetch_probe_every;
  j["prefetch_probe_chunks"] = prefetch_probe_chunks;
  j["worker_threads"] = worker_threads;
  j["log_level"] = std::string(telemetry::to_string(log_level));
  j["client_reap_timeout"] = client_reap_timeout_s;
  j["max_lookups_per_client"] = max_lookups_per_client;
  j["shutdown_timeout"] = shutdown_timeout_s;
  if (metrics_any_port)
    j["metrics_port"] = "auto";
  else
    j["metrics_port"] = metrics_port;
  j["metrics_address"] = metrics_address;
  if (kv_events.enabled) j["kv_events"] = kv_events.to_json();
  return j;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
