#pragma once
// session (server/session.hpp): register_kv_request and unregister_kv_request. A registration
// is checked and its KV region mapped by region_registry (region_registry.hpp: the contract's
// checks, the fd's size and seals, the prefault of the region's pages); it belongs to this
// connection until it unregisters or goes (session_closed reaps it). Unregistering releases
// the connection's lookups too.

#include <kvtier/server/session.hpp>

#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::server {

inline request_result<protocol::register_kv_response> session::on(const protocol::register_kv_request& r,
                                                                  protocol::unique_fd fd) {
  auto reg = ctx_.clients.register_client(id_, r, std::move(fd));
  if (!reg) {
    ctx_.log.warn("client {}: registration refused: {}", id_, reg.error().message);
    return reg.error();
  }
  const registration& g = **reg;
  ctx_.log.info(
      "client {}: registered pid {} rank {}/{} model {} ({} layers, {} KV heads, head dim {}, {}, {}), region {}: "
      "{} blocks of {} tokens, {} MiB",
      id_, g.instance_id, g.rank, g.world_size, g.model_name, g.chunk.model.num_layers, g.chunk.model.num_kv_heads,
      g.chunk.model.head_dim, name(g.chunk.model.dtype), name(g.layout.kind()), protocol::name(g.kind),
      g.layout.num_blocks, g.layout.block_size, g.region.bytes() >> 20);
  return protocol::register_kv_response{ctx_.boot_token, id_, g.model_id, g.chunk.chunk_tokens};
}

inline request_result<protocol::unregister_kv_response> session::on(const protocol::unregister_kv_request&) {
  auto reg = registered("unregister_kv_request");
  if (!reg) return reg.error();
  release_owned_lookups();
  ctx_.clients.remove(id_);
  ctx_.log.info("client {}: unregistered", id_);
  return protocol::unregister_kv_response{};
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
