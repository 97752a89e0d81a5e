#pragma once
// session (server/session.hpp): register_kv_request and unregister_kv_request. A registration
// is checked and its KV region mapped by region_registry (region_registry.hpp: the contract's
// checks, the fd's size and seals). Mapping a region prefaults its pages (kv_region::open),
// which takes as long as allocating them (~0.25 ms per MiB: seconds for a large region), so
// a registration that brings a region is made on the copy pool, and answered when it is
// done: the I/O thread serves every connection meanwhile (this one's pings too: its reader
// answers them; its other requests wait for the answer, in order). A registration belongs
// to its connection until it unregisters or goes (session_closed reaps it). Unregistering
// releases the connection's lookups too.

#include <kvtier/server/session.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <type_traits>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::server {

inline boost::asio::awaitable<request_result<protocol::register_kv_response>> session::on_register(
    const protocol::register_kv_request& r, protocol::unique_fd fd) {
  const bool maps_region = static_cast<bool>(fd);
  auto make = [&] {
    if (maps_region && ctx_.hooks.during_prefault) ctx_.hooks.during_prefault(id_);
    return ctx_.clients.make_registration(id_, r, std::move(fd));
  };
  // A region is mapped and prefaulted on the copy pool (see the header comment).
  request_result<registration> made = request_error{};
  if (maps_region)
    made = co_await on_copy_pool(make);
  else
    made = make();
  if (!made) {
    ctx_.log.warn("client {}: registration refused: {}", id_, made.error().message);
    co_return made.error();
  }
  // Closed meanwhile (reaped, shutting down): unanswered, and not kept.
  if (closing_) co_return closing_error("register_kv_request");
  const registration& g = ctx_.clients.add(std::move(*made));
  ctx_.log.info(
      "client {}: registered pid {} rank {}/{} model {} ({} layers, {} KV heads, head dim {}, {}, {}), region {}: "
      "{} blocks of {} tokens, {} MiB",
      id_, g.instance_id, g.rank, g.world_size, g.model_name, g.chunk.model.num_layers, g.chunk.model.num_kv_heads,
      g.chunk.model.head_dim, name(g.chunk.model.dtype), name(g.layout.kind()), protocol::name(g.kind),
      g.layout.num_blocks, g.layout.block_size, g.region.bytes() >> 20);
  co_return protocol::register_kv_response{ctx_.boot_token, id_, g.model_id, g.chunk.chunk_tokens};
}

/// Runs f() on the copy pool and resumes on the I/O thread with its result (an exception f
/// throws is rethrown here). f runs while this coroutine waits: it may refer to its locals.
template <class F>
boost::asio::awaitable<std::invoke_result_t<F&>> session::on_copy_pool(F f) {
  using result = std::invoke_result_t<F&>;
  co_return co_await boost::asio::co_spawn(
      ctx_.copy_executor, [&f]() -> boost::asio::awaitable<result> { co_return f(); }, boost::asio::use_awaitable);
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
