#pragma once
// What a session shares with the server that owns it (server/server.hpp) and needs from it:
//
//   server_context   the server's state every session uses: configuration, the cache, the
//                    registrations (region_registry.hpp), engines (engine_table.hpp) and
//                    lookups (lookup_table.hpp),
//                    the bus, the log, the boot token, the hooks, the lookup key budgets and
//                    the model namespaces met so far (model_namespaces.hpp);
//   session_host     what a session asks of its server: the status document, and "my loop
//                    ended" (the server then reaps the connection's registration and lookups);
//   server_hooks     hooks into request handling, for tests and embedders.
//
// The server owns everything here and outlives its sessions; a session touches it on the
// server's one I/O thread only (the hooks say where they run).

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/kv_events/tier_key_relay.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/session/any_cache.hpp>
#include <kvtier/server/session/client_budget.hpp>
#include <kvtier/server/session/engine_table.hpp>
#include <kvtier/server/session/lookup_table.hpp>
#include <kvtier/server/session/model_namespaces.hpp>
#include <kvtier/server/session/region_registry.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// Hooks into request handling, run on the server's I/O thread (during_copy and
/// during_prefault: on a copy thread; during_l1_prefault: on the L1 prefault's thread). For
/// tests and embedders.
struct server_hooks {
  /// Called by a store after the chunks were copied out of the engine's region into L1 and
  /// before their block generations are re-read: a test bumps a generation here to play an
  /// engine that reused a block while the server copied it (fencing).
  std::function<void(std::uint64_t client_id, std::span<const std::uint32_t> block_ids)> after_store_copy;
  /// Called on a worker-pool thread before each chunk a retrieve or store copies: a test
  /// blocks a copy here to close its connection meanwhile.
  std::function<void(std::uint64_t client_id)> during_copy;
  /// Called on a worker-pool thread before a registered region's pages are faulted in
  /// (region_prefault.hpp: after the registration was answered; before it, on a kernel
  /// without MADV_POPULATE_WRITE): a test blocks it here to see the server serve meanwhile.
  std::function<void(std::uint64_t client_id)> during_prefault;
  /// Called on the L1 prefault's thread before its first slice (it runs once the server
  /// serves: server/l1_residency.hpp): a test blocks it here to see the server serve while L1 is not
  /// resident yet.
  std::function<void()> during_l1_prefault;
};

/// What the sessions share: the server's state (owned by server::server).
struct server_context {
  const server_config& config;
  any_cache& cache;
  region_registry& clients;
  lookup_table& lookups;
  engine_table& engines;  ///< which connections are one engine (the scopes of the lookups)
  server_event_bus& bus;
  telemetry::logger& log;
  std::uint64_t boot_token = 0;
  const server_hooks& hooks;
  client_budget* budget = nullptr;  ///< lookup key budgets (client_budget.hpp); null: none
  /// The worker pool (worker_threads): what may take long and must not hold up the I/O thread
  /// runs there (the copies run there through the cache; a registration's prefault).
  boost::asio::any_io_executor worker_executor;
  /// The longest a retrieve may wait for its lookup's L2 loads: the prefetch load timeout
  /// (register_kv_response::load_budget_ms).
  std::chrono::milliseconds load_budget{0};
  /// The model ids met in registrations and requests, with their names and salts (the
  /// operator's list and evict requests name objects by them).
  model_namespaces namespaces{};
};

/// What a session needs from the server that owns it.
class session_host {
 public:
  /// The status document (status_request).
  [[nodiscard]] virtual std::string status_json() = 0;
  /// The session's loop ended: reap its registration and lookups, forget it.
  virtual void session_closed(std::uint64_t client_id) noexcept = 0;

 protected:
  ~session_host() = default;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
