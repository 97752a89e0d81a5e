#pragma once
// redis_backend_options: the configuration of l2::redis_backend. Each field maps 1:1 onto a
// key of the backend's JSON object in the server configuration (same name; durations are
// integers in milliseconds, as the _ms suffix says); server/config/redis_options_json.hpp reads that object.
// Standard library only.
//
// There is deliberately no password field: a password on a command line or in a config file
// that is shared and logged leaks. It comes from a file (password_file, e.g. a mounted
// secret, mode 0600) or from an environment variable (password_env names the variable).

#include <kvtier/config.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

struct redis_backend_options {
  /// The backend's name in metrics, logs and status ("backend" label).
  std::string name = "redis";
  /// "host:port" of the Redis server (standalone: exactly one), or the seed nodes of a
  /// cluster (any reachable master or replica; the slot map is read from the cluster).
  std::vector<std::string> nodes = {"127.0.0.1:6379"};
  /// Redis Cluster: route each key to the master of its slot (CRC16), follow MOVED and ASK.
  bool cluster = false;
  /// First field of every key: "<key_prefix>:<model id>:<world size>:<rank>:<chunk hash>".
  /// Different deployments sharing one Redis use different prefixes. Avoid '{' and '}' (a
  /// hash tag would put every key in one cluster slot).
  std::string key_prefix = "kvtier";
  /// TCP connections per Redis node; requests of a batch are spread over them round-robin
  /// and pipelined on each.
  std::uint32_t connections_per_node = 4;
  /// Replies one connection may have outstanding, in expected bytes (one GET always goes):
  /// deeper pipelining of large values only piles them up in Redis's output buffers (with
  /// 3 MiB objects, the default keeps one GET per connection in flight; measured in
  /// docs/performance.md). Small requests pipeline without limit.
  std::uint64_t max_inflight_bytes_per_connection = std::uint64_t{4} << 20;
  /// Expiry of each stored object in seconds (SET ... EX); 0: no expiry (Redis's maxmemory
  /// policy alone evicts).
  std::uint32_t ttl_seconds = 0;
  /// ACL user for AUTH (Redis 6+); empty: the default user ("AUTH <password>").
  std::string username;
  /// File whose content (trailing newline removed) is the password; read once at start.
  std::string password_file;
  /// Name of the environment variable that holds the password; read once at start.
  std::string password_env;
  /// SELECT this database after connecting (standalone only; a cluster has database 0).
  std::uint32_t database = 0;
  /// A connection attempt (resolve + TCP connect) that takes longer is abandoned.
  std::chrono::milliseconds connect_timeout_ms{1000};
  /// Reconnection backoff: the first retry after min, doubling per failed attempt up to max.
  std::chrono::milliseconds reconnect_backoff_min_ms{50};
  std::chrono::milliseconds reconnect_backoff_max_ms{2000};
  /// How often usage (INFO memory, DBSIZE) and, in a cluster, the slot map are refreshed.
  std::chrono::milliseconds info_interval_ms{1000};
  /// A recurring error (Redis down, timeouts) is logged at most once per interval per kind.
  std::chrono::milliseconds log_interval_ms{10000};
  /// MOVED/ASK redirects followed per command before it fails (io_error).
  std::uint32_t max_redirects = 5;

  /// Throws std::invalid_argument naming the field when a value is out of range.
  void validate() const {
    auto bad = [](const std::string& what) { return std::invalid_argument("redis_backend_options: " + what); };
    if (name.empty()) throw bad("name must not be empty");
    if (nodes.empty()) throw bad("nodes must list at least one \"host:port\"");
    if (!cluster && nodes.size() != 1)
      throw bad("nodes: a standalone Redis takes exactly one \"host:port\" (set cluster for several)");
    for (const auto& n : nodes) {
      const auto colon = n.rfind(':');
      bool ok = colon != std::string::npos && colon > 0 && colon + 1 < n.size() && n.size() - colon - 1 <= 5;
      std::uint32_t port = 0;
      for (std::size_t i = colon + 1; ok && i < n.size(); ++i) {
        if (n[i] < '0' || n[i] > '9')
          ok = false;
        else
          port = port * 10 + static_cast<std::uint32_t>(n[i] - '0');
      }
      if (!ok || port == 0 || port > 65535) throw bad("nodes: '" + n + "' is not \"host:port\"");
    }
    if (key_prefix.empty()) throw bad("key_prefix must not be empty");
    if (key_prefix.find_first_of(" \r\n") != std::string::npos)
      throw bad("key_prefix must not contain spaces or line breaks");
    if (connections_per_node == 0 || connections_per_node > 256) throw bad("connections_per_node must be in [1, 256]");
    if (max_inflight_bytes_per_connection == 0) throw bad("max_inflight_bytes_per_connection must be > 0");
    if (!password_file.empty() && !password_env.empty()) throw bad("set password_file or password_env, not both");
    if (cluster && database != 0) throw bad("database must be 0 with cluster (Redis Cluster has one database)");
    if (connect_timeout_ms.count() <= 0) throw bad("connect_timeout_ms must be > 0");
    if (reconnect_backoff_min_ms.count() <= 0 || reconnect_backoff_max_ms < reconnect_backoff_min_ms)
      throw bad("reconnect_backoff_min_ms must be > 0 and <= reconnect_backoff_max_ms");
    if (info_interval_ms.count() <= 0) throw bad("info_interval_ms must be > 0");
    if (log_interval_ms.count() < 0) throw bad("log_interval_ms must be >= 0");
    if (max_redirects == 0 || max_redirects > 64) throw bad("max_redirects must be in [1, 64]");
  }
};

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
