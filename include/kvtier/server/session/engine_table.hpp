#pragma once
// engine_table: which connections are one engine. vLLM splits an engine instance into a
// scheduler process and one worker process per rank, each with its own connection; they
// register with the same engine id (register_kv_request::engine_id: vLLM's
// kv_transfer_config.engine_id), and the server knows the connections of one peer uid
// (SO_PEERCRED) and one engine id as one engine. The engine is the scope of its lookups
// (lookup_table.hpp): what its scheduler looked up, its workers retrieve.
//
// Every live registration of an engine must agree on the model id (name, per-rank shape,
// layout kind and registration salt: the namespace of its chunk keys; a request's own salt
// is added per request) and on the world size, or the lookups of one would name keys the
// others never copy: a registration that disagrees is refused, saying with what. A
// connection registered without an engine id is an engine of its own (scope = its
// connection id). Engine scopes have the top bit set, connection ids never do, so the two
// never collide. On the server's one I/O thread.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/server/session/request_error.hpp>

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

class engine_table {
 public:
  /// The top bit of every engine scope: connection ids (the listener counts from 1) never
  /// have it.
  static constexpr std::uint64_t engine_scope_bit = std::uint64_t{1} << 63;

  /// What a registration declares about its engine.
  struct declaration {
    ::uid_t uid = 0;           ///< the connection's peer uid (SO_PEERCRED)
    std::string engine_id;     ///< empty: the connection is an engine of its own
    std::uint64_t model_id = 0;
    std::uint16_t world_size = 1;
    std::string model_name;    ///< for the refusal's message
  };

  /// Makes connection `client_id` a member of the engine `d` declares (leaving the engine
  /// it belonged to before, if any) and returns the scope of its lookups; or refuses it,
  /// when the engine's other live registrations disagree on the model id or world size (the
  /// connection then keeps what it had).
  request_result<std::uint64_t> join(std::uint64_t client_id, const declaration& d) {
    if (d.engine_id.empty()) {
      leave(client_id);
      return client_id;
    }
    const key_type key{d.uid, d.engine_id};
    if (auto it = engines_.find(key); it != engines_.end()) {
      const engine& e = it->second;
      const bool alone = e.members.size() == 1 && e.members.contains(client_id);
      if (!alone && (e.model_id != d.model_id || e.world_size != d.world_size))
        return request_error{
            errc::invalid_argument,
            "engine_id '" + d.engine_id + "' is registered by " + std::to_string(e.members.size()) +
                " other connection(s) with model '" + e.model_name + "' (model id " + std::to_string(e.model_id) +
                ", world size " + std::to_string(e.world_size) + "); this registration says model '" + d.model_name +
                "' (model id " + std::to_string(d.model_id) + ", world size " + std::to_string(d.world_size) +
                "): every process of one engine registers the same model name, shape, layout, cache salt and "
                "world size; give a different engine its own engine_id"};
    }
    // Registering again with the same engine keeps its scope (and its lookups).
    if (auto m = member_of_.find(client_id); m == member_of_.end() || m->second != key) leave(client_id);
    auto [it, inserted] = engines_.try_emplace(key);
    engine& e = it->second;
    if (inserted) e.scope = engine_scope_bit | next_engine_++;
    e.model_id = d.model_id;
    e.world_size = d.world_size;
    e.model_name = d.model_name;
    e.members.insert(client_id);
    member_of_[client_id] = key;
    return e.scope;
  }

  /// Connection `client_id` unregistered or went: it leaves its engine (an engine without
  /// members is forgotten).
  void leave(std::uint64_t client_id) {
    auto m = member_of_.find(client_id);
    if (m == member_of_.end()) return;
    if (auto it = engines_.find(m->second); it != engines_.end()) {
      it->second.members.erase(client_id);
      if (it->second.members.empty()) engines_.erase(it);
    }
    member_of_.erase(m);
  }

  /// The scope of connection `client_id`'s lookups: its engine's, or its own id.
  [[nodiscard]] std::uint64_t scope_of(std::uint64_t client_id) const {
    auto m = member_of_.find(client_id);
    if (m == member_of_.end()) return client_id;
    auto it = engines_.find(m->second);
    return it == engines_.end() ? client_id : it->second.scope;
  }

  /// The engine id connection `client_id` registered with (empty: none).
  [[nodiscard]] std::string_view engine_id_of(std::uint64_t client_id) const {
    auto m = member_of_.find(client_id);
    return m == member_of_.end() ? std::string_view() : std::string_view(m->second.second);
  }

  /// Connections of the engine `client_id` belongs to (1 for a connection of its own).
  [[nodiscard]] std::size_t members_with(std::uint64_t client_id) const {
    auto m = member_of_.find(client_id);
    if (m == member_of_.end()) return 1;
    auto it = engines_.find(m->second);
    return it == engines_.end() ? 1 : it->second.members.size();
  }

  /// Engines with an engine id and at least one live registration.
  [[nodiscard]] std::size_t size() const noexcept { return engines_.size(); }

 private:
  using key_type = std::pair<::uid_t, std::string>;
  struct engine {
    std::uint64_t scope = 0;
    std::uint64_t model_id = 0;
    std::uint16_t world_size = 1;
    std::string model_name;
    std::set<std::uint64_t> members;
  };

  std::map<key_type, engine> engines_;
  std::unordered_map<std::uint64_t, key_type> member_of_;
  std::uint64_t next_engine_ = 1;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
