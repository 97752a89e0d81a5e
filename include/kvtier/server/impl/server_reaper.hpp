#pragma once
// server (server/server.hpp): the reaper, and what happens when a session ends.
//   reap_loop()       a timer, four times per client_reap_timeout (at most once a second):
//                     expires L1 locks and lookups past their TTL, forgets the lookups the
//                     cache forgot, and closes the connections silent for
//                     client_reap_timeout (session::close: a connection with a copy in
//                     flight closes once it ended, session/session.hpp), and, at a tick
//                     with no request in flight, gives the heap's free pages back when it
//                     holds many (heap_trim.hpp);
//   session_closed()  a session's loop ended (EOF, a broken stream, reaped, shutdown): its
//                     lookups are released, its registration dropped (its region unmapped),
//                     the connection caps given back, one log line.

#include <kvtier/server/server.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline boost::asio::awaitable<void> server::reap_loop() {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  const auto timeout = config_.client_reap_timeout();
  // Four checks per timeout, at most one a second: a silent client goes 1.0-1.25x the
  // timeout after its last frame.
  const auto interval =
      std::clamp<std::chrono::nanoseconds>(timeout / 4, std::chrono::milliseconds(5), std::chrono::seconds(1));
  for (;;) {
    reap_timer_.expires_after(interval);
    auto [ec] = co_await reap_timer_.async_wait(as_tuple(use_awaitable));
    if (ec || stopping_) co_return;
    cache_->expire();
    lookups_.erase_if([this](const lookup_table::entry& e) { return !cache_->known(e.cache_id); });
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::shared_ptr<session>> idle;
    for (const auto& [id, s] : sessions_)
      if (now - s->last_activity() > timeout) idle.push_back(s);
    for (auto& s : idle) {
      reaped_.fetch_add(1, std::memory_order_relaxed);
      s->close(fmt::format("reaped: silent for more than {} s (client_reap_timeout)", config_.client_reap_timeout_s));
    }
    const bool nothing_in_flight = std::ranges::all_of(
        sessions_, [](const auto& e) { return e.second->requests_in_flight() == 0 && e.second->copies_in_flight() == 0; });
    heap_trimmer_.maybe_trim(now, nothing_in_flight);
  }
}

inline void server::session_closed(std::uint64_t id) noexcept {
  budget_.closed(id);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  const std::shared_ptr<session> s = it->second;
  sessions_.erase(it);
  std::size_t released = 0;
  for (const auto& e : lookups_.take_owned_by(id)) {
    cache_->release_all(e.cache_id);
    ++released;
  }
  engines_.leave(id);
  const bool had_registration = clients_.remove(id);
  connections_.store(sessions_.size(), std::memory_order_relaxed);
  if (s->close_reason().starts_with("protocol error")) reaped_.fetch_add(1, std::memory_order_relaxed);
  const bool notable = had_registration || released > 0 || !s->close_reason().starts_with("disconnected");
  log_.log(notable && !stopping_ ? telemetry::log_level::info : telemetry::log_level::debug, "client {}: {}{}{}", id,
           s->close_reason(), had_registration ? "; registration dropped" : "",
           released ? fmt::format("; {} lookups released", released) : std::string());
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
