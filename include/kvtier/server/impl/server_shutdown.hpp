#pragma once
// server (server/server.hpp): the shutdown sequence (stop(), or SIGTERM/SIGINT with
// server_options::handle_signals), on the I/O thread, in this order:
//   1. stop accepting (listener::close), the signal handler, the reaper and the L1 prefault
//      (it stops before its next slice; nothing is registered);
//   2. close every connection (session::close: each ends once its copies ended, and reaps
//      its registration and lookups, impl/server_reaper.hpp) and stop the prefetches
//      (nothing reads what they load any more, so a copy that waits for a load ends at
//      once); wait up to 2 s for the connections to end;
//   3. release the lookups that remain;
//   4. wait for the cache's L2 work in flight (stores of written chunks; prefetch loads
//      already submitted end by their deadlines) up to shutdown_timeout;
//   5. stop the cache (queued stores dropped; operations in flight waited for, every
//      coroutine of the cache ended);
//   6. stop the HTTP endpoint (/healthz answered 503 "stopping" until now), remove the
//      socket file (unless another server replaced it meanwhile: listener::remove_socket),
//      and stop the io_context: run() returns.

#include <kvtier/server/server.hpp>
#include <kvtier/telemetry/log_escaped.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline void server::begin_shutdown() {
  if (stopping_) return;
  stopping_ = true;
  listener_.close();   // at once: no connection is admitted once the shutdown began
  stop_l1_prefault();  // before its next slice; nothing is registered
  boost::asio::co_spawn(io_, shutdown(), telemetry::log_escaped{&log_, "shutdown"});
}

inline boost::asio::awaitable<void> server::shutdown() {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  error_code ignored;
  if (signals_) signals_->cancel(ignored);
  reap_timer_.cancel();
  std::vector<std::shared_ptr<session>> open;
  for (const auto& [id, s] : sessions_) open.push_back(s);
  for (auto& s : open) s->close("server shutting down");
  open.clear();
  // Nothing reads what a prefetch loads any more: a copy that waits for a load ends now
  // (its connection is closing: it answers nothing), not when the load lands.
  cache_->stop_prefetches();
  // Each closed session ends on its next turn of the loop (its pending read or write
  // completes with operation_aborted) and reaps itself.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!sessions_.empty() && std::chrono::steady_clock::now() < deadline)
    co_await boost::asio::post(io_, use_awaitable);
  for (const auto& e : lookups_.take_all()) cache_->release_all(e.cache_id);

  // In-flight L2 work (stores of written chunks, prefetch loads), up to shutdown_timeout.
  struct idle_state {
    explicit idle_state(boost::asio::io_context& io) : timer(io) {}
    boost::asio::steady_timer timer;
    bool idle = false;
  };
  auto st = std::make_shared<idle_state>(io_);
  st->timer.expires_after(server_config::seconds(config_.shutdown_timeout_s));
  boost::asio::co_spawn(io_, cache_->wait_idle(), [st](std::exception_ptr) {
    st->idle = true;
    st->timer.cancel();
  });
  if (!st->idle) co_await st->timer.async_wait(as_tuple(use_awaitable));
  if (!st->idle)
    log_.warn("shutdown: L2 work still in flight after {} s (shutdown_timeout); exiting without it",
              config_.shutdown_timeout_s);
  co_await cache_->stop();  // drops what is queued; then every coroutine of the cache has ended
  stop_http();              // last: /healthz answered 503 "stopping" until now
  listener_.remove_socket();
  log_.info("stopped (boot token {:016x})", boot_token_);
  io_.stop();
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
