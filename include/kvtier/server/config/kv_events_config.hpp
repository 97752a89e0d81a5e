#pragma once
// The server's "kv_events" configuration (docs/kv-events.md, "The server's configuration"):
// whether the server publishes KV events for routers, where, in which form, for which tiers.
// Off when the key is absent. The endpoints follow the metrics endpoint's trust rule: loopback
// (tcp://127.0.0.1, tcp://[::1], tcp://localhost) or a local ipc:// path unless
// "allow_remote" says otherwise, since whoever reaches them reads every cached prompt's token ids.

#include <kvtier/config.hpp>
#include <kvtier/server/config/server_config_json.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

struct kv_events_config {
  bool enabled = false;                           ///< the "kv_events" object is present
  std::string endpoint = "tcp://127.0.0.1:5557";  ///< "endpoint": the PUB socket (vLLM's default port)
  std::string replay_endpoint;                    ///< "replay_endpoint": the ROUTER socket; empty: no replay
  std::string topic;                              ///< "topic": every message's first frame (vLLM's default: empty)
  std::string form = "map";                       ///< "form": map, array or array_batch (docs/kv-events.md)
  /// "tiers": the tiers announced, by name ("l1" and the backends' names); empty: every tier
  /// but Redis ones (whose own evictions the server cannot see).
  std::vector<std::string> tiers;
  /// "medium_names": a tier's medium name instead of the default (l1 CPU, disk DISK, redis
  /// REMOTE, memory MEMORY), e.g. {"disk": "STORAGE"} for a router that knows vLLM's names only.
  std::map<std::string, std::string> medium_names;
  std::uint64_t buffer_steps = 10'000;               ///< "buffer_steps": batches kept for replay
  std::uint64_t buffer_bytes = std::uint64_t{64} << 20;       ///< "buffer_bytes": and their bytes at most
  std::uint64_t description_bytes = std::uint64_t{64} << 20;  ///< "description_bytes": chunk descriptions kept
  std::int64_t data_parallel_rank = 0;               ///< "data_parallel_rank": written into every batch
  /// "send_hwm": messages ZMQ queues per subscriber before it drops that subscriber's (a
  /// subscriber that does not read loses batches, and sees the seq jump; the server is not told).
  std::uint64_t send_hwm = 100'000;
  bool allow_remote = false;                         ///< "allow_remote": endpoints off loopback

  friend bool operator==(const kv_events_config&, const kv_events_config&) = default;

  /// Reads the "kv_events" object.
  void merge_json(const nlohmann::json& j) {
    json_object_reader r(j, "kv_events.");
    enabled = true;
    if (auto v = r.string("endpoint", {}, "a ZMQ endpoint, e.g. tcp://127.0.0.1:5557 or ipc:///run/kvtier/events"))
      endpoint = *v;
    if (auto v = r.string("replay_endpoint", {}, "a ZMQ endpoint, e.g. tcp://127.0.0.1:5558; \"\": no replay"))
      replay_endpoint = *v;
    if (auto v = r.string("topic")) topic = *v;
    if (auto v = r.string("form", {"map", "array", "array_batch"})) form = *v;
    if (const nlohmann::json* v = r.raw("tiers")) {
      if (!v->is_array()) throw r.error("tiers", *v, "must be an array of tier names, e.g. [\"l1\", \"disk\"]");
      tiers.clear();
      for (const auto& t : *v) {
        if (!t.is_string()) throw r.error("tiers", *v, "must be an array of tier names, e.g. [\"l1\", \"disk\"]");
        tiers.push_back(t.get<std::string>());
      }
    }
    if (const nlohmann::json* v = r.raw("medium_names")) {
      if (!v->is_object()) throw r.error("medium_names", *v, "must be an object, e.g. {\"disk\": \"STORAGE\"}");
      for (auto it = v->begin(); it != v->end(); ++it) {
        if (!it.value().is_string() || it.value().get<std::string>().empty())
          throw r.error("medium_names", *v, "must map tier names to non-empty strings, e.g. {\"disk\": \"STORAGE\"}");
        medium_names[it.key()] = it.value().get<std::string>();
      }
    }
    if (auto v = r.integer("buffer_steps", 0, 10'000'000)) buffer_steps = *v;
    if (auto v = r.integer("buffer_bytes", 0, std::uint64_t{1} << 40)) buffer_bytes = *v;
    if (auto v = r.integer("description_bytes", 0, std::uint64_t{1} << 40)) description_bytes = *v;
    if (auto v = r.integer("data_parallel_rank", 0, 1u << 20)) data_parallel_rank = static_cast<std::int64_t>(*v);
    if (auto v = r.integer("send_hwm", 1, 1u << 30)) send_hwm = *v;
    if (auto v = r.boolean("allow_remote")) allow_remote = *v;
    r.finish();
  }

  [[nodiscard]] nlohmann::json to_json() const {
    nlohmann::json j;
    j["endpoint"] = endpoint;
    j["replay_endpoint"] = replay_endpoint;
    j["topic"] = topic;
    j["form"] = form;
    j["tiers"] = tiers;
    j["medium_names"] = medium_names;
    j["buffer_steps"] = buffer_steps;
    j["buffer_bytes"] = buffer_bytes;
    j["description_bytes"] = description_bytes;
    j["data_parallel_rank"] = data_parallel_rank;
    j["send_hwm"] = send_hwm;
    j["allow_remote"] = allow_remote;
    return j;
  }

  /// Whether a ZMQ endpoint stays on this machine: ipc://, inproc://, or tcp:// on a loopback
  /// address.
  [[nodiscard]] static bool is_local(std::string_view e) noexcept {
    if (e.starts_with("ipc://") || e.starts_with("inproc://")) return true;
    if (!e.starts_with("tcp://")) return false;
    e.remove_prefix(6);
    return e.starts_with("127.") || e.starts_with("localhost:") || e.starts_with("[::1]:");
  }

  /// Checks the endpoints (throws config_error).
  void validate() const {
    if (!enabled) return;
    if (endpoint.empty()) throw config_error("kv_events.endpoint", "\"\"", "give a ZMQ endpoint, e.g. tcp://127.0.0.1:5557");
    for (auto [key, e] : {std::pair<const char*, const std::string&>{"kv_events.endpoint", endpoint},
                          std::pair<const char*, const std::string&>{"kv_events.replay_endpoint", replay_endpoint}}) {
      if (e.empty() || allow_remote || is_local(e)) continue;
      throw config_error(key, "\"" + e + "\"",
                         "is reachable from other machines, and the events carry every cached prompt's token ids: "
                         "bind a loopback address (tcp://127.0.0.1:PORT) or an ipc:// path, or set "
                         "kv_events.allow_remote to true where the network is trusted");
    }
    if (!replay_endpoint.empty() && replay_endpoint == endpoint)
      throw config_error("kv_events.replay_endpoint", "\"" + replay_endpoint + "\"",
                         "must differ from kv_events.endpoint");
  }
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
