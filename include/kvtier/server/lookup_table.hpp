#pragma once
// lookup_table: the lookups the server holds for engines, keyed by (connection, request_key).
// A lookup belongs to the connection that issued it (for all ranks' keys): only that
// connection queries, frees, ends or releases it, and it is released when that connection
// goes. Two engines whose request ids collide (vLLM's offline mode: "0", "1", ... in every
// process) never touch each other's lookups. It also counts the chunk keys each connection's
// lookups hold (the key budgets of client_budget.hpp). On the server's one I/O thread.

#include <kvtier/config.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// The lookups the server holds for engines, by (connection, request_key).
class lookup_table {
 public:
  struct entry {
    std::uint64_t cache_id = 0;  ///< the tiered_cache lookup
    std::uint64_t owner = 0;     ///< the connection that issued it (the first half of its key)
    std::uint32_t chunks = 0;
    std::uint16_t world_size = 1;
  };
  using key_type = std::pair<std::uint64_t, std::string>;  ///< (owner connection, request_key)

  /// Puts `e` under (e.owner, request_key); returns the entry it replaced, if any (the same
  /// connection's earlier lookup of that request: another connection's is another key).
  std::optional<entry> put(const std::string& request_key, entry e) {
    std::optional<entry> old;
    auto [it, inserted] = entries_.try_emplace(key_type{e.owner, request_key}, e);
    if (inserted) {
      ++owned_[e.owner];
    } else {
      old = it->second;
      forget_keys(*old);
      it->second = e;
    }
    keys_ += keys_of(e);
    owned_keys_[e.owner] += keys_of(e);
    return old;
  }

  /// Connection `owner`'s lookup of `request_key`, or null.
  [[nodiscard]] const entry* find(std::uint64_t owner, const std::string& request_key) const {
    auto it = entries_.find(key_type{owner, request_key});
    return it == entries_.end() ? nullptr : &it->second;
  }

  /// Removes and returns connection `owner`'s lookup of `request_key`.
  std::optional<entry> take(std::uint64_t owner, const std::string& request_key) {
    auto it = entries_.find(key_type{owner, request_key});
    if (it == entries_.end()) return std::nullopt;
    entry e = it->second;
    erase(it);
    return e;
  }

  /// Removes and returns every entry `owner` issued (its keys are one range of the map:
  /// O(owned x log n), whatever the other connections hold).
  std::vector<entry> take_owned_by(std::uint64_t owner) {
    std::vector<entry> out;
    if (owned(owner) == 0) return out;
    auto it = entries_.lower_bound(key_type{owner, std::string()});
    while (it != entries_.end() && it->first.first == owner) {
      out.push_back(it->second);
      it = erase(it);
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
    for (const auto& [k, e] : entries_) out.push_back(e);
    entries_.clear();
    owned_.clear();
    owned_keys_.clear();
    keys_ = 0;
    return out;
  }

  [[nodiscard]] std::size_t owned(std::uint64_t owner) const {
    auto it = owned_.find(owner);
    return it == owned_.end() ? 0 : it->second;
  }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Chunk keys (chunks x world size) the lookups of `owner` hold; of all lookups (budgets,
  /// server/client_budget.hpp).
  [[nodiscard]] std::uint64_t owned_keys(std::uint64_t owner) const {
    auto it = owned_keys_.find(owner);
    return it == owned_keys_.end() ? 0 : it->second;
  }
  [[nodiscard]] std::uint64_t keys() const noexcept { return keys_; }
  [[nodiscard]] static std::uint64_t keys_of(const entry& e) noexcept { return std::uint64_t{e.chunks} * e.world_size; }

 private:
  using map_type = std::map<key_type, entry>;
  map_type::iterator erase(map_type::iterator it) {
    auto o = owned_.find(it->second.owner);
    if (o != owned_.end() && --o->second == 0) owned_.erase(o);
    forget_keys(it->second);
    return entries_.erase(it);
  }
  void forget_keys(const entry& e) {
    keys_ -= keys_of(e);
    if (auto k = owned_keys_.find(e.owner); k != owned_keys_.end() && (k->second -= keys_of(e)) == 0)
      owned_keys_.erase(k);
  }

  map_type entries_;
  std::unordered_map<std::uint64_t, std::size_t> owned_;
  std::unordered_map<std::uint64_t, std::uint64_t> owned_keys_;
  std::uint64_t keys_ = 0;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
