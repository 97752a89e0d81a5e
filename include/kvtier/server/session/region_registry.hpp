#pragma once
// region_registry: the registrations of the server's clients, one per connection that sent
// register_kv_request, with its mapped kv_region and the layouts derived from the request.
// make_registration() enforces the contract's checks (chunk size, slot size, fd size and
// seals), maps the region (prefaulted later, in the background: region_prefault.hpp; or
// now where the kernel cannot), and answers with a request_error
// (request_error.hpp) that says what to change; it reads only the requirements, so it may
// run on any thread (the server runs it on its worker pool). add() makes the result its
// connection's registration, on the server's one I/O thread like every other member (no
// locks; size() alone may be read from anywhere). The lookups of the clients are in
// lookup_table.hpp.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>
#include <kvtier/server/session/region_prefault.hpp>
#include <kvtier/server/session/request_error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

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
  std::string cache_salt;  ///< the registration's salt (in model_id)
  protocol::region_kind kind = protocol::region_kind::cpu_memfd;
  paged_kv_layout layout;                       ///< the region's layout (block_size/num_blocks 0 without one)
  chunk_layout chunk;                           ///< {shape, server chunk tokens}
  std::size_t object_bytes = 0;                 ///< chunk.object_bytes(): one shard of one chunk
  std::uint32_t blocks_per_chunk = 0;           ///< chunk_tokens / block_size (0 without a region)
  std::uint64_t prefill_tokens_per_second = 0;  ///< as the engine declared (0: not declared)
  kv_region region;                             ///< the worker's memory, mapped here (invalid without one)
  /// Whether `region`'s pages are still to be faulted in (prefault_in_background).
  bool prefault_pending = false;
  prefault_token prefault;  ///< stops that background prefault when this registration goes
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

  /// Validates `r` and maps its region (fd; its pages are left for prefault_in_background
  /// where the kernel has MADV_POPULATE_WRITE, else prefaulted now, as long as allocating
  /// them): connection `client_id`'s registration, for add(). Any thread (it
  /// reads only the requirements). The refusals follow the contract:
  /// invalid_argument (fd missing or unexpected, rank/world size, malformed shape),
  /// layout_mismatch (chunk size, chunk % block size, object larger than a slot, region
  /// size or seals), unsupported (a region kind or layout kind this build cannot copy).
  [[nodiscard]] request_result<registration> make_registration(std::uint64_t client_id,
                                                               const protocol::register_kv_request& r,
                                                               protocol::unique_fd fd) const {
    using protocol::region_kind;
    if (auto e = shape_error(r)) return *e;
    const chunk_layout chunk{r.model, req_.chunk_tokens};
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
    std::optional<request_error> refused;
    switch (r.region) {
      case region_kind::none:
        refused = describe_scheduler(r, fd, reg);
        break;
      case region_kind::cuda_ipc:
        return fail(errc::unsupported,
                    "this kvtier-server was built without CUDA and cannot open a cuda_ipc region: stage the KV in a "
                    "cpu_memfd region, or run a CUDA build of the server");
      case region_kind::cpu_memfd:
        refused = map_memfd_region(r, chunk, std::move(fd), reg);
        break;
    }
    if (refused) return *refused;
    reg.model_id = make_model_id(r.model_name, r.model, r.layout_kind, r.cache_salt);
    reg.cache_salt = r.cache_salt;
    reg.registered_at = std::chrono::steady_clock::now();
    return reg;
  }

  /// Makes `reg` (make_registration) its connection's registration, replacing a previous one.
  registration& add(registration reg) {
    const std::uint64_t id = reg.client_id;
    auto [it, inserted] = regs_.insert_or_assign(id, std::move(reg));
    (void)inserted;
    count_.store(regs_.size(), std::memory_order_relaxed);
    return it->second;
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

  /// The checks of everything but the region: rank and world size, the model's name and
  /// shape, the chunk size and the slot size, the layout kind.
  [[nodiscard]] std::optional<request_error> shape_error(const protocol::register_kv_request& r) const {
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
    return std::nullopt;
  }

  /// Region kind none (a scheduler): no memory, so nothing to map; its model id is the
  /// workers' (same name, shape, layout kind and salt), so its lookups prefetch their chunks.
  [[nodiscard]] static std::optional<request_error> describe_scheduler(const protocol::register_kv_request& r,
                                                                      const protocol::unique_fd& fd,
                                                                      registration& reg) {
    if (fd)
      return fail(errc::invalid_argument,
                  "a registration with region kind none (a scheduler) carries no fd: send region cpu_memfd "
                  "with the memfd, or none without it");
    if (r.block_size != 0 || r.num_blocks != 0 || r.region_bytes != 0 || !r.region_descriptor.empty() ||
        !r.strides.dense())
      return fail(errc::invalid_argument,
                  "a registration with region kind none describes no blocks: send block_size, num_blocks, "
                  "region_bytes 0, strides 0 and no region_descriptor");
    reg.layout = paged_kv_layout{r.model, 0, 0, r.layout_kind};
    return std::nullopt;
  }

  /// Region kind cpu_memfd: the layout checked against the chunk and the fd's size and
  /// seals, the region mapped (prefaulted now where the kernel cannot do it behind).
  [[nodiscard]] std::optional<request_error> map_memfd_region(const protocol::register_kv_request& r,
                                                              const chunk_layout& chunk, protocol::unique_fd fd,
                                                              registration& reg) const {
    if (!fd) return fail(errc::invalid_argument, "register_kv_request came without the region's memfd (SCM_RIGHTS)");
    // With explicit strides, validation_error() also checks that every row lies within
    // 1 PiB, that no two rows overlap and that layout_kind is the strides' order; its
    // messages name the shape and the strides.
    const paged_kv_layout layout = r.layout();
    if (auto e = layout.validation_error(); !e.empty()) return fail(errc::invalid_argument, "KV layout: " + e);
    if (auto e = layout.compatibility_error(chunk); !e.empty()) return fail(errc::layout_mismatch, e);
    const std::size_t bytes = kv_region::bytes_for(layout);
    if (r.region_bytes != bytes)
      return fail(errc::layout_mismatch, "region_bytes " + std::to_string(r.region_bytes) + " is not the " +
                                             std::to_string(bytes) + " bytes a region of this layout has (" +
                                             layout.describe() + ")");
    if (!r.region_descriptor.empty())
      return fail(errc::invalid_argument, "a cpu_memfd registration carries no region_descriptor");
    const bool background = kv_region::populate_supported();
    auto region = kv_region::open(fd.release(), layout, !background);
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
    reg.prefault_pending = background;
    return std::nullopt;
  }

  requirements req_;
  std::unordered_map<std::uint64_t, registration> regs_;
  std::atomic<std::size_t> count_{0};
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
