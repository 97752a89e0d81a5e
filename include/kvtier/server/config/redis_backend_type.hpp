#pragma once
// Registers the "redis" L2 backend type (l2/redis/redis_backend.hpp) with a backend_factory:
//
//   {"type": "redis", "nodes": ["10.0.0.5:6379"], "cluster": false, "ttl_seconds": 86400}
//
// The keys are the fields of l2::redis_backend_options (server/config/redis_options_json.hpp). Needs
// kvtier::redis (hiredis). The backend's kvtier_l2_redis_* series (telemetry/collectors.hpp)
// go to the server's registry. Several servers may share one Redis: every server sees what
// the others stored.

#include <kvtier/config.hpp>
#include <kvtier/l2/redis/redis_backend.hpp>
#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/redis_options_json.hpp>
#include <kvtier/telemetry/collectors.hpp>

#include <memory>
#include <stdexcept>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline void add_redis_backend_type(backend_factory& f) {
  f.add_type("redis",
             "Redis or Redis Cluster shared by a fleet; keys: name, nodes ([\"host:port\"]), cluster, key_prefix, "
             "connections_per_node, ttl_seconds, username, password_file|password_env, database, ... "
             "(docs/deployment.md)",
             [](json_object_reader& r) {
               const std::string where = r.prefix();
               l2::redis_backend_options o;
               try {
                 o = redis_options_from_json(r.rest());
               } catch (const std::invalid_argument& e) {
                 throw config_error(where.substr(0, where.size() - 1), "redis", e.what());
               }
               backend_spec s;
               std::string nodes;
               for (const auto& n : o.nodes) nodes += (nodes.empty() ? "" : ",") + n;
               s.description = std::string(o.cluster ? "redis cluster, " : "redis, ") + nodes;
               s.create = [o](const backend_context& ctx, const std::string& name) {
                 l2::redis_backend_options named = o;
                 named.name = name;
                 auto b = std::make_shared<l2::redis_backend>(ctx.executor, std::move(named), ctx.log);
                 if (ctx.metrics) telemetry::collect_redis_backend(*ctx.metrics, *b);
                 return l2::any_backend(std::move(b));
               };
               return s;
             });
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
