#pragma once
// Reads l2::redis_backend_options from the backend's JSON object in the server configuration
// (here, not in l2/, so that l2/ needs no JSON library),
// e.g. {"type": "redis", "nodes": ["10.0.0.5:6379"], "cluster": false, "ttl_seconds": 86400,
//       "password_file": "/run/secrets/redis"}.
// Keys are the field names of redis_backend_options (durations: integers, milliseconds);
// "type" may be present and must then be "redis". An unknown key, a value of the wrong type
// or out of range throws std::invalid_argument naming the key; so does "password" (the
// password comes from password_file or password_env, never from the configuration).

#include <kvtier/config.hpp>
#include <kvtier/l2/redis/redis_options.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

namespace detail {

/// The error of key `key`: "redis backend: "<key>" <what>" (the key quoted as an excerpt: an
/// unknown key may be of any length).
[[nodiscard]] inline std::invalid_argument redis_key_error(const std::string& key, const std::string& what) {
  const std::string k = key.size() <= 80 ? key : key.substr(0, 60) + "... (" + std::to_string(key.size()) + " bytes)";
  return std::invalid_argument("redis backend: \"" + k + "\" " + what);
}

[[nodiscard]] inline std::string redis_string(const std::string& key, const nlohmann::json& v) {
  if (!v.is_string()) throw redis_key_error(key, "must be a string");
  return v.get<std::string>();
}

[[nodiscard]] inline std::uint32_t redis_uint(const std::string& key, const nlohmann::json& v) {
  if (!v.is_number_integer() || v.get<std::int64_t>() < 0 ||
      v.get<std::int64_t>() > std::numeric_limits<std::uint32_t>::max())
    throw redis_key_error(key, "must be a non-negative integer");
  return static_cast<std::uint32_t>(v.get<std::int64_t>());
}

}  // namespace detail

[[nodiscard]] inline l2::redis_backend_options redis_options_from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("redis backend: the configuration must be a JSON object");
  l2::redis_backend_options o;
  const auto fail = detail::redis_key_error;
  const auto get_string = detail::redis_string;
  const auto get_uint = detail::redis_uint;
  auto get_ms = [](const std::string& key, const nlohmann::json& v) {
    return std::chrono::milliseconds(detail::redis_uint(key, v));
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "type") {
      if (get_string(key, v) != "redis") throw fail(key, "must be \"redis\"");
    } else if (key == "name") {
      o.name = get_string(key, v);
    } else if (key == "nodes") {
      if (!v.is_array()) throw fail(key, "must be an array of \"host:port\" strings");
      o.nodes.clear();
      for (const auto& n : v) o.nodes.push_back(get_string(key, n));
    } else if (key == "cluster") {
      if (!v.is_boolean()) throw fail(key, "must be true or false");
      o.cluster = v.get<bool>();
    } else if (key == "key_prefix") {
      o.key_prefix = get_string(key, v);
    } else if (key == "connections_per_node") {
      o.connections_per_node = get_uint(key, v);
    } else if (key == "max_inflight_bytes_per_connection") {
      if (!v.is_number_integer() || v.get<std::int64_t>() <= 0) throw fail(key, "must be a positive integer");
      o.max_inflight_bytes_per_connection = static_cast<std::uint64_t>(v.get<std::int64_t>());
    } else if (key == "ttl_seconds") {
      o.ttl_seconds = get_uint(key, v);
    } else if (key == "username") {
      o.username = get_string(key, v);
    } else if (key == "password_file") {
      o.password_file = get_string(key, v);
    } else if (key == "password_env") {
      o.password_env = get_string(key, v);
    } else if (key == "database") {
      o.database = get_uint(key, v);
    } else if (key == "connect_timeout_ms") {
      o.connect_timeout_ms = get_ms(key, v);
    } else if (key == "reconnect_backoff_min_ms") {
      o.reconnect_backoff_min_ms = get_ms(key, v);
    } else if (key == "reconnect_backoff_max_ms") {
      o.reconnect_backoff_max_ms = get_ms(key, v);
    } else if (key == "info_interval_ms") {
      o.info_interval_ms = get_ms(key, v);
    } else if (key == "log_interval_ms") {
      o.log_interval_ms = get_ms(key, v);
    } else if (key == "max_redirects") {
      o.max_redirects = get_uint(key, v);
    } else if (key == "password") {
      throw fail(key,
                 "is not accepted: put the password in a file (password_file) or an environment "
                 "variable (password_env)");
    } else {
      throw fail(key, "is not a redis backend option");
    }
  }
  o.validate();
  return o;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
