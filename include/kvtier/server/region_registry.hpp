#pragma once
// The server's bookkeeping of its clients, all touched on the server's one I/O thread (no
// locks; region_registry::size() alone may be read from anywhere):
//
//   region_registry   registrations: one per connection that sent register_kv_request,
//                     with its mapped kv_region and the layouts derived from the request.
//                     register_client() enforces the contract's checks (chunk size, slot
//                     size, fd size and seals) and answers with a request_error that says
//                     what to change.
//   lookup_table      the lookups in flight, keyed by (connection, request_key): a lookup
//                     belongs to the connection that issued it (for all ranks' keys), only
//                     that connection queries, frees, ends or releases it, and it is
//                     released when that connection goes. Two engines whose request ids
//                     collide (vLLM's offline mode: "0", "1", ... in every process) never
//                     touch each other's lookups.
//
// request_error is how a handler refuses a request: an errc and a message, sent back as
// error_response.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>

#include <boost/assert/source_location.hpp>
#include <boost/system/result.hpp>
#include <boost/system/system_error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// A refused request: the code and the reason sent back in error_response.
struct request_error {
  errc code = errc::invalid_argument;
  std::string message;

  [[nodiscard]] protocol::error_response response() const { return protocol::error_response::make(code, message); }
};

[[noreturn]] inline void throw_exception_from_error(const request_error& e, const boost::source_location&) {
  throw boost::system::system_error(make_error_code(e.code), e.message);
}

/// A value or the request_error that refuses the request.
template <class T>
using request_result = boost::system::result<T, request_error>;

/// One registered engine process (one connection): a worker with its KV region, or a
/// scheduler without one (region_kind::none: lookups only).
struct registration {
  std::uint64_t client_id = 0;    ///< the connection's id (stable across re-registrations)
  std::uint64_t instance_id = 0;  ///< the process's pid, as it says
  std::uint16_t rank = 0;
  std::uint16_t world_size = 1;
  std::string model_name;
  /// make_model_id(model_name, shape, layout kind, registration salt); a request's keys use
  /// salted_model_id(model_id, request salt).
  std::uint64_t model_id = 0;
  protocol::region_kind kind = protocol::region_kind::cpu_memfd;
  paged_kv_layout layout;                       ///< the region's layout (block_size/num_blocks 0 without one)
  chunk_layout chunk;                           ///< {shape, server chunk tokens}
  std::size_t object_bytes = 0;                 ///< chunk.object_bytes(): one shard of one chunk
  std::uint32_t blocks_per_chunk = 0;           ///< chunk_tokens / block_size (0 without a region)
  std::uint64_t prefill_tokens_per_second = 0;  ///< as the engine declared (0: not declared)
  kv_region region;                             ///< the worker's memory, mapped here (invalid without one)
  std::chrono::steady_clock::time_point registered_at{};

  /// Whether the connection registered KV memory (retrieve and store need it).
  [[nodiscard]] bool has_region() const noexcept { return kind != protocol::region_kind::none; }

  /// The model id of a request's chunks (salted_model_id of the request's cache salt).
  [[nodiscard]] std::uint64_t model_id_for(std::string_view request_salt) const noexcept {
    return salted_model_id(model_id, request_salt);
  }

  /// The chunk key of this worker's shard of chunk `hash` under the request model id `mid`
  /// (model_id_for(salt)).
  [[nodiscard]] chunk_key key(std::uint64_t mid, const hash128& hash) const noexcept {
    return chunk_key{mid, world_size, rank, hash};
  }
};

class region_registry {
 public:
  /// What every registration must match.
  struct requirements {
    std::uint32_t chunk_tokens = 256;  ///< the server's chunk size
    std::size_t slot_bytes = 0;        ///< the L1 slot size: the largest object
  };

  /// Largest tensor-parallel world size accepted (a lookup holds world_size keys per chunk).
  static constexpr std::uint16_t max_world_size = 1024;
  /// Whether regions of layout kind HND can be copied (core/kv_transfer.hpp).
  static constexpr bool supports_hnd = true;

  explicit region_registry(requirements req) : req_(req) {}

  /// Validates `r`, maps its region (fd), and makes it connection `client_id`'s registration,
  /// replacing a previous one only on success. The refusals follow the contract:
  /// invalid_argument (fd missing or unexpected, rank/world size, malformed shape),
  /// layout_mismatch (chunk size, chunk % block size, object larger than a slot, region
  /// size or seals), unsupported (a region kind or layout kind this build cannot copy).
  request_result<const registration*> register_client(std::uint64_t client_id, const protocol::register_kv_request& r,
                                                      protocol::unique_fd fd) {
    using protocol::region_kind;
    if (r.world_size > max_world_size)
      return fail(errc::invalid_argument,
                  "world_size " + std::to_string(r.world_size) + " is above " + std::to_string(max_world_size));
    if (r.world_size == 0 || r.rank >= r.world_size)
      return fail(errc::invalid_argument,
                  "rank " + std::to_string(r.rank) + " is not below world_size " + std::to_string(r.world_size));
    if (r.model_name.empty()) return fail(errc::invalid_argument, "model_name is empty: send the model's name");
    if (auto e = r.model.validation_error(); !e.empty()) return fail(errc::invalid_argument, "model shape: " + e);
    if (r.chunk_tokens != req_.chunk_tokens)
      return fail(errc::layout_mismatch, "chunk_tokens " + std::to_string(r.chunk_tokens) +
                                             " differs from the server's chunk size " +
                                             std::to_string(req_.chunk_tokens) +
                                             ": hash with the server's chunk size (get_chunk_size) or restart the "
                                             "server with --chunk-size " +
                                             std::to_string(r.chunk_tokens));
    const chunk_layout chunk{r.model, req_.chunk_tokens};
    if (chunk.object_bytes() > req_.slot_bytes)
      return fail(errc::layout_mismatch,
                  "a chunk of this model is " + std::to_string(chunk.object_bytes()) +
                      " bytes, above the server's L1 slot size of " + std::to_string(req_.slot_bytes) +
                      " bytes: restart the server with --l1-slot-bytes " + std::to_string(chunk.object_bytes()) +
                      " or more (JSON key l1_slot_bytes)");
    if (r.layout_kind == kv_layout_kind::mla && r.model.attention != attention_kind::mla)
      return fail(errc::invalid_argument, "layout kind MLA needs an MLA model shape (attention mla)");
    if (r.layout_kind == kv_layout_kind::hnd && r.model.attention == attention_kind::mha && !supports_hnd)
      return fail(errc::unsupported, "layout kind HND is not supported by this server: register NHD blocks");

    registration reg;
    reg.client_id = client_id;
    reg.instance_id = r.instance_id;
    reg.rank = r.rank;
    reg.world_size = r.world_size;
    reg.model_name = r.model_name;
    reg.kind = r.region;
    reg.chunk = chunk;
    reg.object_bytes = chunk.object_bytes();
    reg.prefill_tokens_per_second = r.prefill_tokens_per_second;
    switch (r.region) {
      case region_kind::none: {
        // A scheduler: no memory, so nothing to map; its model id is the workers' (same name,
        // shape, layout kind and salt), so its lookups prefetch their chunks.
        if (fd)
          return fail(errc::invalid_argument,
                      "a registration with region kind none (a scheduler) carries no fd: send region cpu_memfd "
                      "with the memfd, or none without it");
        if (r.block_size != 0 || r.num_blocks != 0 || r.region_bytes != 0 || !r.region_descriptor.empty())
          return fail(errc::invalid_argument,
                      "a registration with region kind none describes no blocks: send block_size, num_blocks, "
                      "region_bytes 0 and no region_descriptor");
        reg.layout = paged_kv_layout{r.model, 0, 0, r.layout_kind};
        break;
      }
      case region_kind::cuda_ipc:
        return fail(errc::unsupported,
                    "this kvtier-server was built without CUDA and cannot open a cuda_ipc region: stage the KV in a "
                    "cpu_memfd region, or run a CUDA build of the server");
      case region_kind::cpu_memfd: {
        if (!fd)
          return fail(errc::invalid_argument, "register_kv_request came without the region's memfd (SCM_RIGHTS)");
        const paged_kv_layout layout = r.layout();
        if (auto e = layout.validation_error(); !e.empty()) return fail(errc::invalid_argument, "KV layout: " + e);
        if (auto e = layout.compatibility_error(chunk); !e.empty()) return fail(errc::layout_mismatch, e);
        const std::size_t bytes = kv_region::bytes_for(layout);
        if (r.region_bytes != bytes)
          return fail(errc::layout_mismatch, "region_bytes " + std::to_string(r.region_bytes) + " is not the " +
                                                 std::to_string(bytes) + " bytes a region of this layout has");
        if (!r.region_descriptor.empty())
          return fail(errc::invalid_argument, "a cpu_memfd registration carries no region_descriptor");
        auto region = kv_region::open(fd.release(), layout);
        if (!region) {
          if (region.error() == errc::layout_mismatch)
            return fail(errc::layout_mismatch, "the fd is not a memfd of " + std::to_string(bytes) +
                                                   " bytes sealed against resizing (F_SEAL_SHRINK|F_SEAL_GROW|"
                                                   "F_SEAL_SEAL): create the region with kv_region::create");
          return fail(errc::invalid_argument, "cannot map the region: " + region.error().message());
        }
        reg.layout = layout;
        reg.blocks_per_chunk = req_.chunk_tokens / r.block_size;
        reg.region = std::move(*region);
        break;
      }
    }
    reg.model_id = make_model_id(r.model_name, r.model, r.layout_kind, r.cache_salt);
    reg.registered_at = std::chrono::steady_clock::now();
    auto [it, inserted] = regs_.insert_or_assign(client_id, std::move(reg));
    (void)inserted;
    count_.store(regs_.size(), std::memory_order_relaxed);
    return &it->second;
  }

  /// The registration of a connection, or null.
  [[nodiscard]] registration* find(std::uint64_t client_id) noexcept {
    auto it = regs_.find(client_id);
    return it == regs_.end() ? nullptr : &it->second;
  }

  /// Drops a registration (unmaps its region). Returns whether there was one.
  bool remove(std::uint64_t client_id) {
    const bool had = regs_.erase(client_id) != 0;
    count_.store(regs_.size(), std::memory_order_relaxed);
    return had;
  }

  /// Registrations; may be read from any thread (the metrics gauge).
  [[nodiscard]] std::size_t size() const noexcept { return count_.load(std::memory_order_relaxed); }
  [[nodiscard]] const requirements& required() const noexcept { return req_; }

 private:
  static request_error fail(errc e, std::string m) { return request_error{e, std::move(m)}; }

  requirements req_;
  std::unordered_map<std::uint64_t, registration> regs_;
  std::atomic<std::size_t> count_{0};
};

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
