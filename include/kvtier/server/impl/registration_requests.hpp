#pragma once
// session (server/session.hpp): register_kv_request and unregister_kv_request. A registration
// is checked and its KV region mapped by region_registry (region_registry.hpp: the contract's
// checks, the fd's size and seals), on the copy pool (a map and fstat: quick, but a syscall
// the I/O thread need not wait for). The region's pages are faulted in after the answer, in
// the background (region_prefault.hpp: ~0.25 ms per MiB, tens of seconds for a large KV
// cache, beyond the connector's deadline for a registration); where the kernel cannot do
// that safely, the registry prefaults before answering, still on the copy pool, so the I/O
// thread serves every connection meanwhile (this one's pings too: its reader answers them;
// its other requests wait for the answer, in order). A registration belongs
// to its connection until it unregisters or goes (session_closed reaps it). Unregistering
// releases the connection's lookups too.

#include <kvtier/server/region_prefault.hpp>
#include <kvtier/server/session.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <functional>
#include <type_traits>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::server {

inline boost::asio::awaitable<request_result<protocol::register_kv_response>> session::on_register(
    const protocol::register_kv_request& r, protocol::unique_fd fd) {
  const bool maps_region = static_cast<bool>(fd);
  auto make = [&] {
    if (maps_region && !kv_region::populate_supported() && ctx_.hooks.during_prefault)
      ctx_.hooks.during_prefault(id_);
    return ctx_.clients.make_registration(id_, r, std::move(fd));
  };
  // A region is mapped on the copy pool (see the header comment).
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
  registration& g = ctx_.clients.add(std::move(*made));
  if (g.prefault_pending) prefault_region(g);
  ctx_.log.info(
      "client {}: registered pid {} rank {}/{} model {} ({} layers, {} KV heads, head dim {}, {}, {}), region {}: "
      "{} blocks of {} tokens, {} MiB",
      id_, g.instance_id, g.rank, g.world_size, g.model_name, g.chunk.model.num_layers, g.chunk.model.num_kv_heads,
      g.chunk.model.head_dim, name(g.chunk.model.dtype), name(g.layout.kind()), protocol::name(g.kind),
      g.layout.num_blocks, g.layout.block_size, g.region.bytes() >> 20);
  co_return protocol::register_kv_response{ctx_.boot_token, id_, g.model_id, g.chunk.chunk_tokens};
}

/// Faults the pages of `g`'s region in on the copy pool, behind the registration's answer
/// (region_prefault.hpp); stops when the registration goes.
inline void session::prefault_region(registration& g) {
  g.prefault_pending = false;
  std::function<void()> before;
  if (ctx_.hooks.during_prefault) before = [hook = ctx_.hooks.during_prefault, id = id_] { hook(id); };
  telemetry::logger& log = ctx_.log;  // the server's: outlives its copy pool
  prefault_in_background(ctx_.copy_executor, g.region.data(), g.region.bytes(), g.prefault.watch(), std::move(before),
                         [&log, id = id_](prefault_outcome o) {
                           const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.elapsed).count();
                           if (o.complete)
                             log.info("client {}: region prefaulted ({} MiB in {} ms)", id, o.bytes >> 20, ms);
                           else if (o.error != 0)
                             log.warn("client {}: region prefault stopped after {} MiB: madvise errno {}", id,
                                      o.bytes >> 20, o.error);
                         });
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
