#pragma once
// server (server/server.hpp): what the server tells about itself.
//   add_metrics()   the kvtier_server_* and kvtier_http_* series of the metrics registry, and
//                   the collectors of the cache and the bus (docs/metrics.md);
//   status_json()   the status document (status_request, GET /status; docs/server.md,
//                   "Status JSON");
//   health_json()   GET /healthz: "serving" with the boot token, or "stopping";
//   the HTTP endpoint (http_exporter.hpp) that serves /metrics, /healthz and /status on the
//   server's I/O thread when metrics_port is set;
//   startup_line()  the one line kvtier-server prints when it is up.

#include <kvtier/server/server.hpp>

#include <kvtier/protocol/limits.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/version.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The log lines of l1_prefault (l1_residency.hpp), when the prefault ended: how long, and
/// which backends read into registered memory.
inline void server::log_l1_residency(const l1_residency_report& r) {
  if (!r.error.empty())
    log_.warn(
        "L1 not prefaulted ({}, {} of {} MiB in): its other pages come on first use, each first load into a "
        "slot faults them in",
        r.error, r.prefaulted_bytes >> 20, r.bytes >> 20);
  else
    log_.info("L1 prefaulted: {} MiB in {:.0f} ms ({}{})", r.bytes >> 20, r.prefault_ms,
              r.populated ? "MADV_POPULATE_WRITE" : "a write per page",
              r.behind_requests ? ", behind the first requests" : ", before serving");
  if (r.huge_pages != "off") {
    const long long huge = l1_huge_page_bytes(cache_->l1_arena());
    log_.info("L1 huge pages: {}; {} of {} MiB of L1 are in huge pages", r.huge_pages,
              huge < 0 ? std::string("? (/proc/self/smaps unreadable)") : std::to_string(huge >> 20), r.bytes >> 20);
  }
  const cache::l1_registration_report& g = r.registration;
  if (!g.registered.empty())
    log_.info(
        "L1 registered with L2 backend(s) {} (io_uring fixed buffers) in {:.0f} ms ({} steps, the longest "
        "{:.0f} ms)",
        fmt::join(g.registered, ", "), g.register_ms, g.steps, g.longest_step_ms);
  if (!g.refused.empty())
    log_.warn("L1 refused by {}: reads into L1 pin their pages per read", fmt::join(g.refused, "; "));
}

/// The server's own series (kvtier_server_*, kvtier_http_*) and the collectors of the cache
/// and the bus (docs/metrics.md); the events' counters come from the bus's
/// metrics_subscriber. Called once, by the constructor.
inline void server::add_metrics() {
  telemetry::collect_cache(registry_, *cache_);
  telemetry::collect_bus(registry_, bus_);
  using telemetry::metric_type;
  registry_.add_callback("kvtier_server_connections", "Open client connections", metric_type::gauge, {},
                         [this] { return static_cast<double>(connections_.load(std::memory_order_relaxed)); });
  registry_.add_callback("kvtier_server_registrations", "Registered KV regions (engine workers)", metric_type::gauge,
                         {}, [this] { return static_cast<double>(clients_.size()); });
  registry_.add_callback(
      "kvtier_server_uptime_seconds", "Seconds since the server started", metric_type::gauge, {},
      [this] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count(); });
  registry_.add_callback("kvtier_server_info", "Always 1; the labels describe the server", metric_type::gauge,
                         {{"version", std::string(version_string)},
                          {"boot_token", fmt::format("{:016x}", boot_token_)},
                          {"eviction_policy", std::string(cache_->eviction_policy())},
                          {"store_policy", std::string(name(config_.store_policy))},
                          {"prefetch_policy", std::string(name(config_.prefetch_policy))}},
                         [] { return 1.0; });
  registry_.add_callback(
      "kvtier_server_l1_resident",
      "1 once every page of L1 is faulted in and L1 is registered with the L2 backends (l1_prefault, done behind "
      "the first requests); 0 before, or when l1_prefault is off",
      metric_type::gauge, {}, [this] { return l1_residency() == l1_residency_state::resident ? 1.0 : 0.0; });
  registry_.add_callback("kvtier_server_l1_prefaulted_bytes", "Bytes of L1 the start-up prefault has faulted in",
                         metric_type::gauge, {},
                         [this] { return static_cast<double>(l1_prefaulted_bytes_.load(std::memory_order_relaxed)); });
  if (heap_usage().known) {
    registry_.add_callback("kvtier_server_heap_in_use_bytes",
                           "The C++ heap handed out (glibc mallinfo2, every arena; the L1 arena included when malloc "
                           "mapped it): what a leak grows",
                           metric_type::gauge, {}, [] { return static_cast<double>(heap_usage().in_use_bytes); });
    registry_.add_callback("kvtier_server_heap_free_bytes",
                           "Free memory the allocator keeps inside its arenas for reuse (resident until reused or "
                           "trimmed)",
                           metric_type::gauge, {}, [] { return static_cast<double>(heap_usage().free_bytes); });
    registry_.add_callback("kvtier_server_heap_trims_total",
                           "Times the reaper gave the arenas' free pages back (malloc_trim: more than 4 MiB free, no "
                           "request in flight, at most every 10 s)",
                           metric_type::counter, {}, [this] { return static_cast<double>(heap_trimmer_.trims()); });
    registry_.add_callback("kvtier_server_heap_trim_seconds_total",
                           "Time the heap trims took (the I/O thread, at moments no request was in flight)",
                           metric_type::counter, {}, [this] { return heap_trimmer_.trim_seconds(); });
  }
  registry_.add_callback("kvtier_server_clients_reaped_total",
                         "Connections closed by the server: idle past client_reap_timeout, or a broken stream",
                         metric_type::counter, {},
                         [this] { return static_cast<double>(reaped_.load(std::memory_order_relaxed)); });
  for (std::size_t r = 0; r < client_budget::refusal_count; ++r)
    registry_.add_callback(
        "kvtier_server_connections_refused_total",
        "Connections refused at accept: a peer uid not allowed, or a connection cap (max_connections, "
        "max_connections_per_uid)",
        metric_type::counter, {{"reason", std::string(client_budget::refusal_names[r])}},
        [this, r] { return static_cast<double>(budget_.refused(static_cast<client_budget::refusal>(r))); });
  registry_.add_callback("kvtier_server_lookups_refused_total",
                         "Lookups refused because a lookup key budget (max_lookup_keys, "
                         "max_lookup_keys_per_client) was spent",
                         metric_type::counter, {}, [this] { return static_cast<double>(budget_.lookups_refused()); });
  static constexpr std::array<std::string_view, 4> http_reasons = {"cap", "header_timeout", "idle_timeout",
                                                                   "bad_request"};
  for (std::size_t r = 0; r < http_reasons.size(); ++r)
    registry_.add_callback(
        "kvtier_http_connections_dropped_total",
        "HTTP endpoint connections closed by the server: to make room at the cap (idle first), "
        "a request header not complete in time, idle past the timeout, a malformed request",
        metric_type::counter, {{"reason", std::string(http_reasons[r])}}, [this, r] {
          if (!http_) return 0.0;
          const auto st = http_->stats();
          const std::uint64_t v[] = {st.dropped_at_cap, st.header_timeouts, st.idle_timeouts, st.bad_requests};
          return static_cast<double>(v[r]);
        });
}

/// "http://127.0.0.1:9464" (the endpoint's base URL), or empty when it is off.
inline std::string server::metrics_url() const {
  if (metrics_port_ == 0) return {};
  const bool v6 = config_.metrics_address.find(':') != std::string::npos;
  return v6 ? fmt::format("http://[{}]:{}", config_.metrics_address, metrics_port_)
            : fmt::format("http://{}:{}", config_.metrics_address, metrics_port_);
}

/// The /healthz document: {"status": "serving" | "stopping", "boot_token", "uptime_s", ...}.
inline std::string server::health_json() const {
  nlohmann::json j;
  j["status"] = stopping_ ? "stopping" : "serving";
  j["boot_token"] = boot_token_;
  j["boot_token_hex"] = fmt::format("{:016x}", boot_token_);
  j["version"] = version_string;
  j["pid"] = ::getpid();
  j["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count();
  return j.dump();
}

/// The one line the program prints when it is up.
inline std::string server::startup_line() const {
  std::string backends;
  for (const auto& b : backend_lines_) backends += (backends.empty() ? "" : ", ") + b;
  return fmt::format(
      "kvtier-server {} listening on {} (boot token {:016x}, pid {}): L1 {} MiB in {} slots of {} KiB, eviction {}, "
      "chunk {} tokens, L2 backends: {}, store {}, prefetch {}, {} worker threads, metrics {}",
      version_string, config_.socket_path, boot_token_, ::getpid(), (cache_->slot_count() * cache_->slot_bytes()) >> 20,
      cache_->slot_count(), cache_->slot_bytes() >> 10, cache_->eviction_policy(), config_.chunk_tokens,
      backends.empty() ? std::string("none") : backends, name(config_.store_policy), name(config_.prefetch_policy),
      config_.worker_thread_count(), metrics_port_ ? metrics_url() + "/metrics" : std::string("off"));
}

namespace detail {

/// One connection in the status document's "clients".
[[nodiscard]] inline nlohmann::json client_status(std::uint64_t id, const session& s, const registration* reg,
                                                  const lookup_table& lookups, const engine_table& engines,
                                                  std::chrono::steady_clock::time_point now) {
  using nlohmann::json;
  json c;
  c["client_id"] = id;
  c["registered"] = reg != nullptr;
  if (reg) {
    c["instance_id"] = reg->instance_id;
    c["rank"] = reg->rank;
    c["world_size"] = reg->world_size;
    c["model"] = reg->model_name;
    c["model_id"] = reg->model_id;
    c["region_kind"] = std::string(protocol::name(reg->kind));
    c["dtype"] = std::string(name(reg->chunk.model.dtype));
    c["layout_kind"] = std::string(name(reg->layout.kind()));
    c["prefill_tokens_per_second"] = reg->prefill_tokens_per_second;
    c["num_blocks"] = reg->layout.num_blocks;
    c["block_size"] = reg->layout.block_size;
    c["region_bytes"] = reg->region.bytes();
  } else {
    c["instance_id"] = nullptr;
    c["rank"] = nullptr;
    c["world_size"] = nullptr;
    c["model"] = nullptr;
    c["model_id"] = nullptr;
  }
  c["idle_s"] = std::chrono::duration<double>(now - s.last_activity()).count();
  c["requests"] = s.requests();
  c["lookups"] = lookups.owned(id);
  c["engine_id"] = std::string(engines.engine_id_of(id));
  c["engine_connections"] = engines.members_with(id);
  return c;
}

/// The status document's "backends": each L2 backend's usage and health, with its type.
[[nodiscard]] inline nlohmann::json backends_status(const cache::cache_status& cs,
                                                    const std::vector<std::string>& types) {
  nlohmann::json backends = nlohmann::json::array();
  for (std::size_t b = 0; b < cs.backends.size(); ++b) {
    const auto& x = cs.backends[b];
    backends.push_back({{"name", x.name},
                        {"type", b < types.size() ? types[b] : std::string()},
                        {"bytes_used", x.usage.bytes_used},
                        {"bytes_capacity", x.usage.bytes_capacity},
                        {"objects", x.usage.objects},
                        {"healthy", x.health.healthy},
                        {"reason", x.health.reason}});
  }
  return backends;
}

/// The status document's "held": what the server hands out and gets back, each read where
/// it is held (not from event counters); all 0 on an idle server (docs/server.md, "Status
/// JSON").
[[nodiscard]] inline nlohmann::json held_status(
    const cache::cache_status& cs, const lookup_table& lookups,
    const std::unordered_map<std::uint64_t, std::shared_ptr<session>>& sessions) {
  std::size_t requests = 0;
  std::size_t copies = 0;
  for (const auto& entry : sessions) {
    requests += entry.second->requests_in_flight();
    copies += entry.second->copies_in_flight();
  }
  nlohmann::json h;
  h["l1_read_locked"] = cs.l1.read_locked;          // l1::tier::usage()
  h["l1_write_locked"] = cs.l1.write_locked;        // l1::tier::usage()
  h["lookup_keys"] = lookups.keys();                // lookup_table: what client_budget counts
  h["requests_in_flight"] = requests;               // session::requests_in_flight()
  h["copies_in_flight"] = copies;                   // session::copies_in_flight() (copy_scope)
  h["store_staged_bytes"] = cs.store_staged_bytes;  // store_controller::staged_bytes()
  return h;
}

/// The status document's "memory": the C++ heap (heap_trim.hpp), to tell a leak (in use
/// grows) from memory the allocator keeps for reuse; null where malloc is not glibc's.
[[nodiscard]] inline nlohmann::json memory_status(const heap_trimmer& trimmer) {
  const heap_usage_info h = heap_usage();
  if (!h.known) return nullptr;
  return {{"heap_in_use_bytes", h.in_use_bytes},
          {"heap_free_bytes", h.free_bytes},
          {"heap_arena_bytes", h.arena_bytes},
          {"heap_mmapped_bytes", h.mmapped_bytes},
          {"heap_trims", trimmer.trims()},
          {"heap_trim_seconds", trimmer.trim_seconds()}};
}

}  // namespace detail

/// The status document (status_request): I/O thread only.
inline std::string server::status_json() {
  using nlohmann::json;
  const auto now = std::chrono::steady_clock::now();
  json j;
  j["boot_token"] = boot_token_;
  j["version"] = version_string;
  j["protocol_version"] = protocol::protocol_version;
  j["pid"] = ::getpid();
  j["uptime_s"] = std::chrono::duration<double>(now - started_at_).count();
  j["socket"] = config_.socket_path;
  j["metrics_url"] = metrics_url();
  j["connections"] = sessions_.size();
  j["chunk_tokens"] = config_.chunk_tokens;
  j["eviction_policy"] = std::string(cache_->eviction_policy());
  j["store_policy"] = std::string(name(config_.store_policy));
  j["prefetch_policy"] = std::string(name(config_.prefetch_policy));
  std::vector<std::uint64_t> ids;
  for (const auto& [id, s] : sessions_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  json clients = json::array();
  for (std::uint64_t id : ids)
    clients.push_back(detail::client_status(id, *sessions_.at(id), clients_.find(id), lookups_, engines_, now));
  j["clients"] = std::move(clients);
  j["lookups"] = lookups_.size();
  j["engines"] = engines_.size();
  const cache::cache_status cs = cache_->status();
  j["l1"] = {{"bytes_used", cs.l1.bytes_used},
             {"bytes_capacity", cs.l1.bytes_capacity},
             {"objects", cs.l1.objects},
             {"slots_used", cs.l1.slots_used},
             {"slot_bytes", cache_->slot_bytes()},
             {"slot_count", cache_->slot_count()},
             {"evictable", cs.l1.evictable},
             {"removing", cs.l1.removing},
             {"object_bytes", cs.l1.object_bytes},
             {"cache_lookups", cs.lookups},
             {"residency", std::string(name(l1_residency()))},
             {"huge_pages", l1_report_.huge_pages},
             {"prefaulted_bytes", l1_prefaulted_bytes_.load(std::memory_order_relaxed)}};
  j["backends"] = detail::backends_status(cs, backend_types_);
  j["prefetch"] = {{"active", cs.prefetches_active}, {"inflight_bytes", cs.prefetch_inflight_bytes}};
  j["store"] = {{"inflight_tasks", cs.store_inflight_tasks},
                {"inflight_bytes", cs.store_inflight_bytes},
                {"pending_keys", cs.store_pending_keys}};
  j["held"] = detail::held_status(cs, lookups_, sessions_);
  j["memory"] = detail::memory_status(heap_trimmer_);
  j["kv_events"] = kv_events_status();
  std::string text = j.dump();
  if (text.size() > protocol::max_status_json_bytes) {
    // Thousands of connections: keep the totals, drop the per-client list.
    j["clients"] = json::array();
    j["clients_truncated"] = ids.size();
    text = j.dump();
  }
  return text;
}

inline void server::start_http() {
  http_exporter_options o;
  o.address = config_.metrics_address;
  o.port = config_.metrics_any_port ? 0 : config_.metrics_port;
  http_.emplace(boost::asio::any_io_executor(io_.get_executor()), std::move(o));
  http_->route("/metrics", [this] { return http_response::metrics(registry_); });
  http_->route("/healthz", [this] { return http_response::json(stopping_ ? 503 : 200, health_json()); });
  http_->route("/status", [this] { return http_response::json(200, status_json()); });
  auto port = http_->start();
  if (!port) {
    const error_code ec = port.error();
    http_.reset();
    throw std::runtime_error(fmt::format(
        "cannot serve metrics on {}:{} ({}): {}", config_.metrics_address, config_.metrics_port, ec.message(),
        ec == boost::asio::error::address_in_use
            ? "another program uses that port: choose another --metrics-port, \"auto\", or 0 to turn it off"
            : "check --metrics-address (an address of this machine) and --metrics-port (ports below 1024 need "
              "privileges)"));
  }
  metrics_port_ = *port;
}

inline void server::stop_http() {
  if (http_) http_->stop();
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
