#pragma once
// session (server/session/session.hpp): the checks the request handlers share, each answering a
// request_error that names the request and says what to change:
//   registered()              the connection registered (register_kv_request) before;
//   registered_with_region()  ... and brought a KV region (retrieve and store need one; a
//                             scheduler's connection, region kind none, has none);
//   copy_target()             a retrieve's or store's: registered with a region, its rank
//                             the registration's, blocks_per_chunk block ids per chunk hash,
//                             each in the region;
// and request_model_id(), the model id of a request's keys, learned in the server's model
// namespaces on the way (model_namespaces.hpp: an operator's list names it).
// The checks of a registration itself are region_registry's (region_registry.hpp); those of
// one kind of request only stay in its handler (a lookup's model id, world size and key
// budgets: impl/lookup_requests.hpp).

#include <kvtier/server/session/session.hpp>

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The connection's registration, or not_registered naming the request.
inline request_result<registration*> session::registered(std::string_view what) {
  if (registration* r = ctx_.clients.find(id_)) return r;
  return request_error{errc::not_registered,
                       std::string(what) + " needs a registration: send register_kv_request first"};
}

/// The connection's registration when it brought a KV region; not_registered or
/// no_kv_region (a scheduler's connection) naming the request otherwise.
inline request_result<registration*> session::registered_with_region(std::string_view what) {
  auto reg = registered(what);
  if (!reg) return reg.error();
  if (!(*reg)->has_region())
    return request_error{errc::no_kv_region,
                         std::string(what) +
                             " needs a KV region: this connection registered without one (region kind none, a "
                             "scheduler), which may only look up, query, free lookup locks and end requests"};
  return *reg;
}

/// The checks shared by retrieve and store: registered_with_region, the rank is the
/// registration's, there are blocks_per_chunk block ids per chunk hash, and every block id is
/// in the region. The registration the copies go through, or the first check's error.
inline request_result<registration*> session::copy_target(std::string_view what, std::uint16_t rank,
                                                         std::size_t chunks,
                                                         std::span<const std::uint32_t> block_ids) {
  auto found = registered_with_region(what);
  if (!found) return found;
  const registration& reg = **found;
  if (rank != reg.rank)
    return request_error{errc::invalid_argument, std::string(what) + ".rank " + std::to_string(rank) +
                                                     " differs from the registration's rank " +
                                                     std::to_string(reg.rank)};
  if (block_ids.size() != chunks * reg.blocks_per_chunk)
    return request_error{
        errc::invalid_argument,
        std::string(what) + ": " + std::to_string(block_ids.size()) + " block ids for " + std::to_string(chunks) +
            " chunks; each chunk takes " + std::to_string(reg.blocks_per_chunk) + " blocks (chunk_tokens " +
            std::to_string(reg.chunk.chunk_tokens) + " / block_size " + std::to_string(reg.layout.block_size) + ")"};
  for (const std::uint32_t b : block_ids)
    if (b >= reg.layout.num_blocks)
      return request_error{errc::invalid_argument, std::string(what) + ": block id " + std::to_string(b) +
                                                       " is out of range (the region has " +
                                                       std::to_string(reg.layout.num_blocks) + " blocks)"};
  return found;
}

/// The model id of a request's chunk keys (registration::model_id_for its salt), recorded in
/// the server's model namespaces with the model name and both salts.
inline std::uint64_t session::request_model_id(const registration& reg, const std::string& salt) {
  const std::uint64_t mid = reg.model_id_for(salt);
  ctx_.namespaces.learn(mid, reg.model_id, reg.model_name, reg.cache_salt, salt, reg.chunk.model.dtype,
                        reg.layout.kind());
  return mid;
}

inline std::uint64_t session::request_id_of(const std::string& request_key) noexcept {
  return static_cast<std::uint64_t>(std::hash<std::string>{}(request_key));
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
