#pragma once
// model_namespaces: what the server knows about the model ids of its chunk keys, so that an
// operator can see and select objects by model and salt (list_objects_request,
// evict_request; docs/server.md, "Administration").
//
// A chunk key's model id is salted_model_id(make_model_id(model name, KV shape, layout
// kind, registration salt), request salt) (core/model_id.hpp): a hash, which cannot be read
// back. So the server learns each id as it meets it: a registration's own id (request salt
// "") when the registration is made, and a request's salted id when a lookup, retrieve or
// store uses it, each with the model name, dtype kind, layout kind and both salts. An id the
// server has not met since it started is unknown: objects on disk or in Redis from before a
// restart (until an engine registers that model and uses that salt again), or another
// server's objects in a shared Redis. An operator names those by their id.
//
// Bounded: at most max_entries ids (4096: one per model and tenant salt in use is the
// expected few dozen); past that the longest known is forgotten, and a request that uses it
// again learns it again (so a namespace in use is never unknown for long). learn() costs one
// hash lookup when the id is known (every lookup, retrieve and store calls it). On the
// server's I/O thread, like the other tables of server_context.

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

class model_namespaces {
 public:
  /// Most ids remembered.
  static constexpr std::size_t max_entries = 4096;

  /// What the server knows of one model id.
  struct entry {
    std::string model_name;
    std::string deployment_salt;   ///< the registration's cache_salt (in the base id)
    std::string cache_salt;        ///< the requests' salt ("" for the base id itself)
    std::uint64_t base_model_id = 0;  ///< the registration's model id (before the request salt)
    dtype_kind dtype = dtype_kind::fp16;
    kv_layout_kind layout = kv_layout_kind::nhd;
  };

  /// Records that `model_id` is `base_model_id` (a registration of `model_name` ...) salted
  /// with `cache_salt`. Nothing changes when the id is known already.
  void learn(std::uint64_t model_id, std::uint64_t base_model_id, std::string_view model_name,
             std::string_view deployment_salt, std::string_view cache_salt, dtype_kind dtype, kv_layout_kind layout) {
    if (map_.contains(model_id)) return;
    if (map_.size() >= max_entries) {
      map_.erase(order_.front());
      order_.pop_front();
    }
    map_.emplace(model_id, entry{std::string(model_name), std::string(deployment_salt), std::string(cache_salt),
                                 base_model_id, dtype, layout});
    order_.push_back(model_id);
  }

  /// What is known of `model_id`, or null.
  [[nodiscard]] const entry* find(std::uint64_t model_id) const noexcept {
    auto it = map_.find(model_id);
    return it == map_.end() ? nullptr : &it->second;
  }

  /// Calls f(model_id, entry) for every known id, oldest first.
  template <class F>
  void for_each(F&& f) const {
    for (const std::uint64_t id : order_) f(id, map_.at(id));
  }

  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

 private:
  std::unordered_map<std::uint64_t, entry> map_;
  std::deque<std::uint64_t> order_;  ///< learned first, forgotten first
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
