#pragma once
// session (server/session/session.hpp): register_kv_request and unregister_kv_request. A registration
// is checked and its KV region mapped by region_registry (region_registry.hpp: the contract's
// checks, the fd's size and seals), on the worker pool (a map and fstat: quick, but a syscall
// the I/O thread need not wait for). The region's pages are faulted in after the answer, in
// the background (region_prefault.hpp: ~0.25 ms per MiB, tens of seconds for a large KV
// cache, beyond the connector's deadline for a registration); where the kernel cannot do
// that safely, the registry prefaults before answering, still on the worker pool, so the I/O
// thread serves every connection meanwhile (this one's pings too: its reader answers them;
// its other requests wait for the answer, in order). A registration belongs
// to its connection until it unregisters or goes (session_closed reaps it). Unregistering
// releases the connection's lookups too.
//
// A registration with an engine id joins that engine (engine_table.hpp: the connections of
// this peer uid and engine id, a vLLM scheduler and its workers), on the I/O thread after the
// region was mapped: its lookups are the engine's from then on. The engine's other live
// registrations must agree on the model id and world size, or it is refused (its region
// unmapped, the connection keeping what it had).

#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier/server/session/region_prefault.hpp>
#include <kvtier/server/session/session.hpp>

#include <fmt/format.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline boost::asio::awaitable<request_result<protocol::register_kv_response>> session::on(
    const protocol::register_kv_request& r, call& c) {
  protocol::unique_fd fd = std::move(c.fd);
  const bool maps_region = static_cast<bool>(fd);
  auto make = [&] {
    if (maps_region && !kv_region::populate_supported() && ctx_.hooks.during_prefault)
      ctx_.hooks.during_prefault(id_);
    return ctx_.clients.make_registration(id_, r, std::move(fd));
  };
  // A region is mapped on the worker pool (see the header comment).
  request_result<registration> made = request_error{};
  if (maps_region)
    made = co_await on_worker_pool(make);
  else
    made = make();
  if (!made) {
    ctx_.log.warn("client {}: registration refused: {}", id_, made.error().message);
    co_return made.error();
  }
  // Closed meanwhile (reaped, shutting down): unanswered, and not kept.
  if (closing_) co_return closing_error("register_kv_request");
  // Its engine: the peer's uid (SO_PEERCRED, as the listener admitted it) and engine id.
  engine_table::declaration d;
  d.engine_id = r.engine_id;
  d.model_id = made->model_id;
  d.world_size = made->world_size;
  d.model_name = made->model_name;
  if (!d.engine_id.empty()) {
    auto peer = protocol::peer_credentials(conn_.socket().native_handle());
    if (!peer)
      co_return request_error{errc::permission_denied, "register_kv_request: cannot read this connection's peer "
                                                       "credentials (" +
                                                           peer.error().message() + ") to join engine_id '" +
                                                           d.engine_id + "'"};
    d.uid = peer->uid;
  }
  auto scope = ctx_.engines.join(id_, d);
  if (!scope) {
    ctx_.log.warn("client {}: registration refused: {}", id_, scope.error().message);
    co_return scope.error();
  }
  // Lookups it issued under another scope would be out of its reach now: released.
  if (*scope != scope_) release_owned_lookups();
  scope_ = *scope;
  registration& g = ctx_.clients.add(std::move(*made));
  ctx_.namespaces.learn(g.model_id, g.model_id, g.model_name, g.cache_salt, "", g.chunk.model.dtype,
                        g.layout.kind());  // what an operator's list calls its keys
  if (g.prefault_pending) prefault_region(g);
  ctx_.log.info(
      "client {}: registered pid {} rank {}/{} model {} ({} layers, {} KV heads, head dim {}, {}, {}), region {}: "
      "{} blocks of {} tokens, {} MiB{}",
      id_, g.instance_id, g.rank, g.world_size, g.model_name, g.chunk.model.num_layers, g.chunk.model.num_kv_heads,
      g.chunk.model.head_dim, name(g.chunk.model.dtype), name(g.layout.kind()), protocol::name(g.kind),
      g.layout.num_blocks, g.layout.block_size, g.region.bytes() >> 20,
      d.engine_id.empty() ? std::string()
                          : fmt::format(", engine '{}' ({} connections)", d.engine_id, ctx_.engines.members_with(id_)));
  const auto budget_ms = std::clamp<std::int64_t>(ctx_.load_budget.count(), 0, std::numeric_limits<std::uint32_t>::max());
  co_return protocol::register_kv_response{ctx_.boot_token, id_, g.model_id, g.chunk.chunk_tokens,
                                           static_cast<std::uint32_t>(budget_ms)};
}

/// Faults the pages of `g`'s region in on the worker pool, behind the registration's answer
/// (region_prefault.hpp); stops when the registration goes.
inline void session::prefault_region(registration& g) {
  g.prefault_pending = false;
  std::function<void()> before;
  if (ctx_.hooks.during_prefault) before = [hook = ctx_.hooks.during_prefault, id = id_] { hook(id); };
  telemetry::logger& log = ctx_.log;  // the server's: outlives its worker pool
  prefault_in_background(ctx_.worker_executor, g.region.data(), g.region.bytes(), g.prefault.watch(), std::move(before),
                         [&log, id = id_](prefault_outcome o) {
                           const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.elapsed).count();
                           if (o.complete)
                             log.info("client {}: region prefaulted ({} MiB in {} ms)", id, o.bytes >> 20, ms);
                           else if (o.error != 0)
                             log.warn("client {}: region prefault stopped after {} MiB: madvise errno {}", id,
                                      o.bytes >> 20, o.error);
                         });
}

/// Runs f() on the worker pool and resumes on the I/O thread with its result (an exception f
/// throws is rethrown here). f runs while this coroutine waits: it may refer to its locals.
template <class F>
boost::asio::awaitable<std::invoke_result_t<F&>> session::on_worker_pool(F f) {
  using result = std::invoke_result_t<F&>;
  co_return co_await boost::asio::co_spawn(
      ctx_.worker_executor, [&f]() -> boost::asio::awaitable<result> { co_return f(); }, boost::asio::use_awaitable);
}

inline request_result<protocol::unregister_kv_response> session::on(const protocol::unregister_kv_request&, call&) {
  auto reg = registered("unregister_kv_request");
  if (!reg) return reg.error();
  release_owned_lookups();
  ctx_.engines.leave(id_);
  scope_ = id_;
  ctx_.clients.remove(id_);
  ctx_.log.info("client {}: unregistered", id_);
  return protocol::unregister_kv_response{};
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
