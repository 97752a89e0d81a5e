#pragma once
// lookup_table: the lookups the server holds for engines, keyed by (engine scope,
// request_key). The scope is the engine the issuing connection belongs to (engine_table.hpp:
// the connections of one peer uid that registered with one engine id, a vLLM scheduler and
// its workers), or that connection alone when it registered without an engine id. Any
// connection of the scope may query, free, end and retrieve through a lookup; two engines
// whose request ids collide (vLLM's offline mode: "0", "1", ... in every process) never
// touch each other's lookups. A lookup also belongs to the connection that issued it: its
// keys count against that connection's key budgets (client_budget.hpp), and it is released
// when that connection goes. It remembers its chunk hashes and which ranks retrieved, so a
// rank's retrieve can give back every hold of that rank (session: impl/copy_requests.hpp).
// On the server's one I/O thread.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The lookups the server holds for engines, by (engine scope, request_key).
class lookup_table {
 public:
  struct entry {
    std::uint64_t cache_id = 0;  ///< the tiered_cache lookup
    std::uint64_t owner = 0;     ///< the connection that issued it (budgets, reaping)
    std::uint32_t chunks = 0;
    std::uint16_t world_size = 1;
    std::uint64_t model_id = 0;         ///< the request's (salted) model id of its keys
    std::vector<hash128> hashes;        ///< its chunks: rank r's keys are {model_id, world_size, r, h}
    std::vector<bool> ranks_retrieved;  ///< per rank: a retrieve of that rank gave its holds back
  };
  using key_type = std::pair<std::uint64_t, std::string>;  ///< (engine scope, request_key)

  /// Puts `e` under (scope, request_key); returns the entry it replaced, if any (a lookup of
  /// that request by any connection of the scope; another scope's is another key).
  std::optional<entry> put(std::uint64_t scope, const std::string& request_key, entry e) {
    std::optional<entry> old;
    const key_type key{scope, request_key};
    auto [it, inserted] = entries_.try_emplace(key);
    if (!inserted) {
      old = std::move(it->second);
      forget_owner(*old, key);
    }
    const std::uint64_t owner = e.owner;
    keys_ += keys_of(e);
    owned_keys_[owner] += keys_of(e);
    owned_[owner].insert(key);
    it->second = std::move(e);
    return old;
  }

  /// The lookup of `request_key` in `scope`, or null.
  [[nodiscard]] const entry* find(std::uint64_t scope, const std::string& request_key) const {
    auto it = entries_.find(key_type{scope, request_key});
    return it == entries_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] entry* find(std::uint64_t scope, const std::string& request_key) {
    auto it = entries_.find(key_type{scope, request_key});
    return it == entries_.end() ? nullptr : &it->second;
  }

  /// Removes and returns the lookup of `request_key` in `scope`.
  std::optional<entry> take(std::uint64_t scope, const std::string& request_key) {
    auto it = entries_.find(key_type{scope, request_key});
    if (it == entries_.end()) return std::nullopt;
    entry e = std::move(it->second);
    erase(it);
    return e;
  }

  /// Removes and returns every entry connection `owner` issued (O(owned x log n), whatever
  /// the other connections hold).
  std::vector<entry> take_owned_by(std::uint64_t owner) {
    std::vector<entry> out;
    auto o = owned_.find(owner);
    if (o == owned_.end()) return out;
    const std::set<key_type> keys = o->second;
    for (const key_type& k : keys)
      if (auto it = entries_.find(k); it != entries_.end()) {
        out.push_back(std::move(it->second));
        erase(it);
      }
    return out;
  }

  /// Removes the entries for which pred(entry) is true (lookups the cache forgot).
  template <class Pred>
  std::size_t erase_if(Pred pred) {
    std::size_t n = 0;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (pred(it->second)) {
        it = erase(it);
        ++n;
      } else {
        ++it;
      }
    }
    return n;
  }

  /// Every entry (for shutdown).
  std::vector<entry> take_all() {
    std::vector<entry> out;
    for (auto& [k, e] : entries_) out.push_back(std::move(e));
    entries_.clear();
    owned_.clear();
    owned_keys_.clear();
    keys_ = 0;
    return out;
  }

  /// Lookups connection `owner` issued.
  [[nodiscard]] std::size_t owned(std::uint64_t owner) const {
    auto it = owned_.find(owner);
    return it == owned_.end() ? 0 : it->second.size();
  }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Chunk keys (chunks x world size) the lookups `owner` issued hold; of all lookups
  /// (budgets, server/session/client_budget.hpp).
  [[nodiscard]] std::uint64_t owned_keys(std::uint64_t owner) const {
    auto it = owned_keys_.find(owner);
    return it == owned_keys_.end() ? 0 : it->second;
  }
  [[nodiscard]] std::uint64_t keys() const noexcept { return keys_; }
  [[nodiscard]] static std::uint64_t keys_of(const entry& e) noexcept { return std::uint64_t{e.chunks} * e.world_size; }

 private:
  using map_type = std::map<key_type, entry>;
  map_type::iterator erase(map_type::iterator it) {
    forget_owner(it->second, it->first);
    return entries_.erase(it);
  }
  void forget_owner(const entry& e, const key_type& key) {
    keys_ -= keys_of(e);
    if (auto k = owned_keys_.find(e.owner); k != owned_keys_.end() && (k->second -= keys_of(e)) == 0)
      owned_keys_.erase(k);
    if (auto o = owned_.find(e.owner); o != owned_.end()) {
      o->second.erase(key);
      if (o->second.empty()) owned_.erase(o);
    }
  }

  map_type entries_;
  std::unordered_map<std::uint64_t, std::set<key_type>> owned_;  ///< owner -> the keys of its lookups
  std::unordered_map<std::uint64_t, std::uint64_t> owned_keys_;
  std::uint64_t keys_ = 0;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
