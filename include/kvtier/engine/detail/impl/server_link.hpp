#pragma once
// Definitions of engine::detail::server_link (declarations and documentation:
// kvtier/engine/detail/server_link.hpp).

#include <kvtier/engine/detail/server_link.hpp>
#include <kvtier/protocol/detail/send.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <variant>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {
namespace detail {

/// co_spawn completion: a coroutine of the connector that throws is a bug; fail loudly.
inline void rethrow_if(std::exception_ptr e) {
  if (e) std::rethrow_exception(e);
}

inline std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count());
}

// ---------------------------------------------------------------------------------------
// Construction, the thread, health
// ---------------------------------------------------------------------------------------

inline server_link::server_link(const connector_options& options, protocol::register_kv_request registration,
                                int region_fd, link_owner& owner)
    : options_(options),
      registration_(std::move(registration)),
      region_fd_(region_fd),
      owner_(owner),
      io_(std::make_unique<boost::asio::io_context>(1)),
      breaker_(options.breaker_threshold) {
  work_.emplace(io_->get_executor());
  ex_ = io_->get_executor();
  ping_timer_.emplace(ex_);
  retry_timer_.emplace(ex_);
}

inline void server_link::start() {
  boost::asio::co_spawn(ex_, lifecycle(), rethrow_if);
  thread_ = std::thread([this] { io_->run(); });
  ::pthread_setname_np(thread_.native_handle(), "kvtier-connect");  // 15 chars max; for top/gdb
}

inline void server_link::stop() {
  if (!io_) return;
  {
    std::lock_guard g(mu_);
    stopping_ = true;
    healthy_.store(false, std::memory_order_release);
  }
  work_.reset();
  io_->stop();
  if (thread_.joinable()) thread_.join();
  // Asio objects go before their io_context; the context then destroys the coroutine frames
  // still suspended in it (their sockets and timers with them).
  calls_.clear();
  connections_.clear();
  ping_timer_.reset();
  retry_timer_.reset();
  io_.reset();
}

inline bool server_link::wait_ready(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return ready_cv_.wait_for(lock, timeout, [&] { return state_ == health_state::healthy; });
}

inline link_stats server_link::stats_locked() const {
  link_stats s = stats_;
  s.pending_calls = calls_.size();
  s.unhealthy_ns = unhealthy_ns_ + (state_ == health_state::unhealthy ? elapsed_ns(unhealthy_since_) : 0);
  s.open_connections = 0;
  for (const auto& [epoch, c] : connections_)
    if (!c->broken) ++s.open_connections;
  return s;
}

inline void server_link::retire_connections_locked() {
  std::vector<std::uint64_t> epochs;
  for (const auto& [e, c] : connections_) epochs.push_back(e);
  for (std::uint64_t e : epochs) maybe_retire_io(e);
}

// ---------------------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------------------

inline void server_link::issue_locked(std::uint64_t id, call_kind kind, std::uint64_t epoch,
                                      protocol::message_type expect, std::vector<std::byte> bytes, int fd,
                                      clock::duration timeout, call_done done, bool lazy) {
  auto c = std::make_shared<pending_call>();
  c->id = id;
  c->kind = kind;
  c->epoch = epoch;
  c->expect = expect;
  c->timeout = timeout;
  c->bytes = std::move(bytes);
  c->fd = fd;
  c->done = std::move(done);
  calls_.insert(std::move(c));
  ++stats_.calls_issued;
  // Never completes inside this call. On the link's thread, one send_queued_io sends every
  // call queued before it runs; another thread's calls are sent by its send_issued, after
  // the mutex is released (issue_lock).
  send_queue_.push_back(id);
  if (send_posted_) return;
  if (io_->get_executor().running_in_this_thread()) {
    send_posted_ = true;
    boost::asio::post(ex_, [this] { send_queued_io(); });
  } else if (!lazy) {
    caller_sends_ = true;
  }
}

inline void server_link::send_lazy_locked() {
  if (send_queue_.empty() || send_posted_) return;
  send_posted_ = true;
  boost::asio::post(ex_, [this] { send_queued_io(); });
}

inline void server_link::send_issued(std::unique_lock<std::mutex>& lock) {
  if (!std::exchange(caller_sends_, false) || send_posted_ || stopping_) return lock.unlock();
  // Written here only when every call queued is for the current connection, open, carries
  // no fd, and no write of the link's thread (or the unsent end of an earlier write here)
  // waits in the socket's queue: the frames go in order and whole.
  std::shared_ptr<server_connection> s;
  std::unique_lock<std::mutex> send;
  if (auto it = connections_.find(current_epoch_); it != connections_.end() && !it->second->broken) {
    s = it->second;
    send = std::unique_lock(s->send_mu);
  }
  std::vector<std::shared_ptr<pending_call>> batch;
  bool here = s && s->send_fd >= 0 && s->link_writes == 0 && s->unsent.empty();
  for (std::size_t i = 0; here && i < send_queue_.size(); ++i) {
    std::shared_ptr<pending_call> c = calls_.find(send_queue_[i]);
    if (!c) continue;  // released before it could be sent
    here = c->epoch == s->epoch && c->fd < 0;
    batch.push_back(std::move(c));
  }
  if (!here) {
    if (send) send.unlock();
    send_posted_ = true;
    lock.unlock();
    boost::asio::post(ex_, [this] { send_queued_io(); });
    return;
  }
  send_queue_.clear();
  std::vector<std::vector<std::byte>> frames;
  frames.reserve(batch.size());
  const clock::time_point now = clock::now();
  for (const std::shared_ptr<pending_call>& c : batch) {
    c->sent_at = now;
    // From this thread: the timer's wait goes into the io_context's timer queue (its own
    // lock; timerfd_settime when it is the earliest), which wakes nothing.
    arm_deadline_locked(*c, c->sent_at + c->timeout);
    c->sent = true;
    frames.push_back(std::move(c->bytes));
  }
  stats_.calls_sent_by_caller += frames.size();
  lock.unlock();
  // The write, under the socket's send_mu only: the server's reply (on the link's thread,
  // under the mutex) may come before it returns. A call completed meanwhile (on the link's
  // thread) was sent, which the checks above allowed for already.
  write_here(std::move(s), std::move(send), std::move(frames));
}

inline void server_link::write_here(std::shared_ptr<server_connection> s, std::unique_lock<std::mutex> send,
                                    std::vector<std::vector<std::byte>> frames) {
  const std::uint64_t epoch = s->epoch;
  std::vector<iovec> iov;
  iov.reserve(frames.size());
  for (auto& f : frames) iov.push_back(iovec{f.data(), f.size()});
  const protocol::detail::send_outcome r = protocol::detail::send_nonblocking(s->send_fd, iov);
  if (r.error != 0 && r.error != EAGAIN) {
    const error_code ec(r.error, boost::system::system_category());
    send.unlock();
    boost::asio::post(ex_, [this, epoch, ec] { on_write_error_io(epoch, ec); });
  } else if (r.error == EAGAIN) {
    // The socket is full: the rest goes first when the link's thread writes next, and it
    // writes next now.
    for (const iovec& piece : iov) {  // what was written is consumed (iov_len 0)
      const auto* p = static_cast<const std::byte*>(piece.iov_base);
      s->unsent.insert(s->unsent.end(), p, p + piece.iov_len);
    }
    send.unlock();
    boost::asio::post(ex_, [this, s] {
      std::lock_guard g(s->send_mu);
      if (!s->unsent.empty()) write_io(s, {}, -1);
    });
  }
}

inline void server_link::complete_locked(pending_call& c, call_result r) {
  if (c.deadline) c.deadline->cancel();
  if (c.done) c.done(c, r);
}

inline void server_link::send_queued_io() {
  struct frame_write {
    std::shared_ptr<server_connection> s;
    std::vector<std::byte> bytes;
    int fd = -1;
  };
  std::vector<frame_write> writes;
  {
    std::lock_guard g(mu_);
    send_posted_ = false;
    if (stopping_) return;
    std::vector<std::uint64_t> ids = std::exchange(send_queue_, {});
    writes.reserve(ids.size());
    for (std::uint64_t id : ids) {
      std::shared_ptr<pending_call> c = calls_.find(id);
      if (!c) continue;  // released before it could be sent
      auto sit = connections_.find(c->epoch);
      if (sit == connections_.end() || sit->second->broken) {
        calls_.take(id);
        complete_locked(*c, call_result{call_status::closed, {}, "connection gone"});
        continue;
      }
      c->sent_at = clock::now();
      arm_deadline_locked(*c, c->sent_at + c->timeout);
      c->sent = true;
      writes.push_back(frame_write{sit->second, std::move(c->bytes), c->fd});
    }
    // Counted before the mutex is released: an engine thread's send_issued after this point
    // must not write ahead of these.
    for (frame_write& w : writes) {
      std::lock_guard sg(w.s->send_mu);
      ++w.s->link_writes;
    }
  }
  // The writes without the mutex: a sendmsg wakes the server, which may take this core from
  // this thread. The connections are closed on this thread only, so none closes under them;
  // a call that completes meanwhile (only on this thread, after these) was sent, which its
  // handling above allowed for already.
  for (frame_write& w : writes) {
    std::lock_guard g(w.s->send_mu);
    write_io(w.s, std::move(w.bytes), w.fd, /*counted=*/true);
  }
}

inline void server_link::write_io(const std::shared_ptr<server_connection>& s, std::vector<std::byte> bytes, int fd,
                                  bool counted) {
  auto written = [this, s](error_code ec) {
    {
      std::lock_guard g(s->send_mu);
      --s->link_writes;
    }
    if (ec && ec != boost::asio::error::operation_aborted) on_write_error_io(s->epoch, ec);
  };
  if (!s->unsent.empty()) {
    ++s->link_writes;
    s->conn->async_write_frame(std::exchange(s->unsent, {}), -1, written);
  }
  if (!bytes.empty()) {
    if (!counted) ++s->link_writes;
    s->conn->async_write_frame(std::move(bytes), fd, written);
  }
}

inline void server_link::on_write_error_io(std::uint64_t epoch, error_code ec) {
  std::lock_guard g(mu_);
  if (stopping_) return;
  if (auto s = connections_.find(epoch); s != connections_.end()) {
    const bool closed = closed_by_peer(ec);
    last_error_ = closed ? "the server closed the connection" : "socket error: " + ec.message();
    on_broken_io(*s->second, closed ? "eof" : "socket_error", closed);
  }
}

inline void server_link::arm_deadline_locked(pending_call& c, clock::time_point at) {
  if (!c.deadline) c.deadline.emplace(ex_);
  // Re-arming cancels the wait in flight (its handler sees operation_aborted and does
  // nothing); the new wait is the call's deadline.
  c.deadline->expires_at(at);
  c.deadline->async_wait([this, id = c.id](error_code ec) {
    if (!ec) on_deadline_io(id);
  });
}

inline void server_link::on_deadline_io(std::uint64_t id) {
  std::lock_guard g(mu_);
  if (stopping_) return;
  std::shared_ptr<pending_call> c = calls_.take(id);
  if (!c) return;
  complete_locked(*c, call_result{call_status::timeout, {}, "deadline passed"});
  // Work (not pings, not the handshake) timing out again and again: the server answers
  // pings but does nothing else. A lookup (or its query) waits server-side for the
  // prefetch's decision: its deadline is the lookup's, and a prefetch slower than that is no
  // sign of a hung server.
  const bool work = c->kind == call_kind::retrieve || c->kind == call_kind::store || c->kind == call_kind::notify;
  if (work && c->epoch == current_epoch_ && state_ == health_state::healthy && breaker_.on_timeout()) {
    last_error_ = std::to_string(breaker_.threshold()) + " calls in a row timed out";
    mark_unhealthy_io("timeouts");
  }
}

template <class Msg>
boost::asio::awaitable<call_result> server_link::async_call(call_kind kind, std::uint64_t epoch, const Msg& m, int fd,
                                                            clock::duration timeout) {
  auto w = std::make_shared<call_waiter>(ex_);
  const std::uint64_t id = next_call_id();
  std::vector<std::byte> bytes = encode(id, m);
  {
    std::lock_guard g(mu_);
    if (stopping_) co_return call_result{call_status::closed, {}, "stopping"};
    issue_locked(id, kind, epoch, Msg::response_type::type, std::move(bytes), fd, timeout,
                 [w](pending_call&, call_result& r) {
                   w->result = std::move(r);
                   w->timer.expires_at(clock::time_point::min());  // wakes the waiter, now or later
                 });
  }
  if (!w->result) co_await w->timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  if (!w->result) co_return call_result{call_status::closed, {}, "stopping"};
  co_return std::move(*w->result);
}

// ---------------------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------------------

inline boost::asio::awaitable<void> server_link::reader(std::shared_ptr<server_connection> s) {
  for (;;) {
    auto [ec, f] = co_await s->conn->async_read_frame(boost::asio::as_tuple(boost::asio::use_awaitable));
    // Decoded before taking the mutex: the engine's threads do not wait for it.
    std::optional<protocol::decode_result<protocol::message>> decoded;
    if (!ec) decoded.emplace(protocol::decode_message(f));
    std::lock_guard g(mu_);
    if (stopping_) co_return;
    if (ec) {
      if (ec != boost::asio::error::operation_aborted) {
        if (closed_by_peer(ec)) {
          last_error_ = s->refusal.empty() ? "the server closed the connection"
                                           : "the server refused the connection: " + s->refusal;
          on_broken_io(*s, "eof", true);
        } else if (ec.category() == kvtier_category()) {
          if (const auto* why = s->conn->last_read_error()) last_error_ = "bad stream from the server: " + why->reason;
          on_broken_io(*s, "protocol_error", false);
        } else {
          last_error_ = "socket error: " + ec.message();
          on_broken_io(*s, "socket_error", false);
        }
      }
      co_return;
    }
    send_lazy_locked();  // the thread runs anyway: what lazy issues queued goes now
    if (!on_frame_io(*s, f.header.call_id, std::move(*decoded))) co_return;
  }
}

inline bool server_link::on_frame_io(server_connection& s, std::uint64_t id,
                                     protocol::decode_result<protocol::message> decoded) {
  if (!decoded) {
    last_error_ = "bad reply from the server: " + decoded.error().reason;
    on_broken_io(s, "protocol_error", false);
    return false;
  }
  // Call ids start at 1: an error with id 0 answers no call but the connection itself (the
  // server refuses it and closes it: say why in last_error()).
  if (id == 0 && protocol::type_of(*decoded) == protocol::message_type::error_response) {
    s.refusal = std::get<protocol::error_response>(*decoded).message;
    last_error_ = "the server refused the connection: " + s.refusal;
    return true;
  }
  if (protocol::is_progress(protocol::type_of(*decoded))) {
    on_progress_io(s, id, *decoded);
    return true;
  }
  if (std::shared_ptr<pending_call> c = calls_.take(id, s.epoch)) return on_reply_io(s, *c, std::move(*decoded));
  ++stats_.late_replies;
  owner_.on_late_reply_locked(id);  // e.g. the answer of a call whose blocks are quarantined
  maybe_retire_io(s.epoch);
  return true;
}

// Progress completes nothing. A call not in flight on this connection (given up on: its
// blocks are load errors already) or not a retrieve: ignored.
inline void server_link::on_progress_io(server_connection& s, std::uint64_t id, const protocol::message& m) {
  const std::shared_ptr<pending_call> c = calls_.find(id);
  const auto* p = std::get_if<protocol::retrieve_progress>(&m);
  if (c && c->epoch == s.epoch && c->kind == call_kind::retrieve && p != nullptr) {
    ++stats_.progress_messages;
    // The server is moving this retrieve on: its deadline is the news plus its timeout,
    // within the server's own load budget (docs/fault-tolerance.md, "Deadlines").
    if (c->sent) arm_deadline_locked(*c, std::min(clock::now() + c->timeout, c->sent_at + load_budget_ + c->timeout));
    owner_.on_retrieve_progress_locked(id, p->layers_ready, p->chunks_ready);
  } else {
    ++stats_.ignored_progress;
  }
}

inline bool server_link::on_reply_io(server_connection& s, pending_call& c, protocol::message m) {
  const protocol::message_type t = protocol::type_of(m);
  call_result r;
  if (t == protocol::message_type::error_response) {
    r.status = call_status::error_reply;
    r.error = std::get<protocol::error_response>(m).message;
  } else if (t == c.expect) {
    r.status = call_status::reply;
    r.reply = std::move(m);
  } else {
    last_error_ =
        "the server answered " + std::string(protocol::name(c.expect)) + " with " + std::string(protocol::name(t));
    complete_locked(c, call_result{call_status::error_reply, {}, last_error_});
    on_broken_io(s, "protocol_error", false);
    return false;
  }
  if (s.epoch == current_epoch_) breaker_.on_reply();
  const bool forgotten =
      r.status == call_status::error_reply && std::get<protocol::error_response>(m).error() == errc::not_registered;
  complete_locked(c, std::move(r));
  // The server lost this connection's registration without closing it: register again.
  if (forgotten && s.epoch == current_epoch_ && state_ == health_state::healthy) {
    last_error_ = "the server no longer knows this connection's registration";
    mark_unhealthy_io("not_registered");
  }
  return true;
}

inline void server_link::on_broken_io(server_connection& s, std::string_view reason, bool server_closed) {
  if (s.broken) return;
  s.broken = true;
  s.closed_by_server = server_closed;
  s.close_socket();
  // The server's close proves its copies for this connection over (docs/protocol.md): the
  // owner releases what it fenced for calls given up on it earlier, and the calls failed
  // below need no fencing (closed_by_server_locked).
  if (server_closed) owner_.on_copies_over_locked(s.epoch);
  if (s.epoch == current_epoch_) {
    if (state_ == health_state::healthy)
      mark_unhealthy_io(reason);
    else
      fail_calls_io(s.epoch, call_status::closed);  // the handshake: establish() takes it from here
  } else {
    maybe_retire_io(s.epoch);
  }
}

inline void server_link::fail_calls_io(std::optional<std::uint64_t> epoch, call_status status) {
  for (auto& c : calls_.take_all(epoch)) complete_locked(*c, call_result{status, {}, "released"});
}

inline void server_link::mark_unhealthy_io(std::string_view reason) {
  if (state_ == health_state::unhealthy) return;
  state_ = health_state::unhealthy;
  healthy_.store(false, std::memory_order_release);
  unhealthy_since_ = clock::now();
  // Everything waiting on the server is released: the engine must not wait for it.
  owner_.on_unhealthy_locked(reason, calls_.count({call_kind::retrieve, call_kind::store}));
  fail_calls_io(std::nullopt, call_status::unhealthy);
  owner_.after_unhealthy_locked();
  const std::uint64_t old = std::exchange(current_epoch_, 0);
  if (old != 0) maybe_retire_io(old);
  if (ping_timer_) ping_timer_->cancel();
  ready_cv_.notify_all();
}

inline void server_link::maybe_retire_io(std::uint64_t epoch) {
  if (epoch == current_epoch_) return;
  auto it = connections_.find(epoch);
  if (it == connections_.end()) return;
  // Kept while the server may still write blocks it was handed on this connection: its late
  // replies arrive here, and its pidfd tells when it is gone.
  if (owner_.awaits_late_replies_locked(epoch) && !it->second->process_gone) return;
  it->second->close();
  connections_.erase(it);
}

inline void server_link::watch_process_io(const std::shared_ptr<server_connection>& s) {
  s->pidfd->async_wait(boost::asio::posix::descriptor_base::wait_read, [this, s](error_code ec) {
    if (ec) return;
    std::lock_guard g(mu_);
    if (stopping_) return;
    s->process_gone = true;
    owner_.on_copies_over_locked(s->epoch);
    maybe_retire_io(s->epoch);
  });
}

// ---------------------------------------------------------------------------------------
// Lifecycle
// ---------------------------------------------------------------------------------------

inline std::string server_link::fail_handshake_locked(std::uint64_t epoch, std::string_view reason,
                                                      std::string message) {
  // A server that refused the connection said why (error_response with call id 0, then it
  // closed): that reason, not the handshake call it cut short ("released"), is the error.
  if (auto it = connections_.find(epoch); it != connections_.end() && !it->second->refusal.empty())
    last_error_ = "the server refused the connection: " + it->second->refusal;
  else
    last_error_ = std::move(message);
  fail_calls_io(epoch, call_status::closed);  // (completions may change connections_: found again below)
  if (current_epoch_ == epoch) current_epoch_ = 0;
  if (auto it = connections_.find(epoch); it != connections_.end()) {
    it->second->broken = true;
    it->second->close_socket();
  }
  maybe_retire_io(epoch);
  mark_unhealthy_io(reason);  // only an edge when it was starting (a failed retry changes nothing)
  return std::string(reason);
}

inline std::string server_link::check_peer_locked(protocol::connection::socket_type& socket) {
  // Who listens there: the server's user (or root), else nothing is sent (the memfd least of
  // all). A local user who listened on the path first gets refused here.
  const ::uid_t expected = options_.server_uid.value_or(::geteuid());
  const auto who = protocol::peer_credentials(socket.native_handle());
  if (who && (who->uid == expected || who->uid == 0)) return {};
  if (!who)
    return "cannot read the credentials of the server at " + options_.socket_path + " (" + who.error().message() +
           "): not connecting";
  owner_.on_peer_refused_locked(who->uid, static_cast<std::uint32_t>(who->pid), expected);
  return "refusing the server at " + options_.socket_path + ": its process runs as " + who->describe() +
         ", not as uid " + std::to_string(expected) +
         " (another user may be listening on this path); if the server runs under a service account, set "
         "connector_options::server_uid to its uid";
}

inline boost::asio::awaitable<std::string> server_link::establish() {
  namespace asio = boost::asio;
  auto [ec, socket] =
      co_await protocol::async_connect_unix(ex_, options_.socket_path, asio::as_tuple(asio::use_awaitable));
  std::shared_ptr<server_connection> s;
  {
    std::lock_guard g(mu_);
    if (stopping_) co_return "stopping";
    if (ec) {
      last_error_ = "cannot connect to " + options_.socket_path + ": " + ec.message();
      mark_unhealthy_io("connect_failed");
      co_return "connect_failed";
    }
    if (std::string refused = check_peer_locked(socket); !refused.empty()) {
      error_code ignored;
      socket.close(ignored);
      last_error_ = std::move(refused);
      mark_unhealthy_io("peer_refused");
      co_return "peer_refused";
    }
    s = server_connection::open(ex_, std::move(socket));
    s->epoch = ++next_epoch_;
    connections_[s->epoch] = s;
    current_epoch_ = s->epoch;
    breaker_.reset();
    if (s->pidfd) watch_process_io(s);
  }
  asio::co_spawn(ex_, reader(s), rethrow_if);
  co_return co_await handshake(std::move(s));
}

inline boost::asio::awaitable<std::string> server_link::handshake(std::shared_ptr<server_connection> s) {
  const std::uint64_t epoch = s->epoch;
  const auto request_timeout = scaled(options_.timeouts.request_timeout);
  const auto why = [](const call_result& r) {
    return r.status == call_status::timeout       ? "handshake_timeout"
           : r.status == call_status::error_reply ? "handshake_error"
                                                  : "eof";
  };
  const protocol::get_chunk_size_request chunk_size_query;
  call_result r = co_await async_call(call_kind::control, epoch, chunk_size_query, -1, request_timeout);
  if (r.status != call_status::reply) {
    std::lock_guard g(mu_);
    co_return fail_handshake_locked(epoch, why(r),
                                    "get_chunk_size failed: " + (r.error.empty() ? std::string(why(r)) : r.error));
  }
  const std::uint32_t server_chunk = std::get<protocol::get_chunk_size_response>(r.reply).chunk_tokens;
  if (server_chunk != options_.chunk_tokens) {
    std::lock_guard g(mu_);
    co_return fail_handshake_locked(epoch, "chunk_size_mismatch",
                                    "the server uses chunk_tokens=" + std::to_string(server_chunk) +
                                        ", this connector " + std::to_string(options_.chunk_tokens) +
                                        ": configure both with the same chunk size");
  }
  r = co_await async_call(call_kind::control, epoch, registration_, region_fd_, request_timeout);
  std::lock_guard g(mu_);
  if (stopping_) co_return "stopping";
  if (r.status == call_status::error_reply)
    co_return fail_handshake_locked(epoch, "register_failed", "the server refused the registration: " + r.error);
  if (r.status != call_status::reply)
    co_return fail_handshake_locked(epoch, why(r), "register failed: " + std::string(why(r)));
  if (s->broken || current_epoch_ != epoch)
    co_return fail_handshake_locked(epoch, "eof", "connection lost while registering");
  const auto& resp = std::get<protocol::register_kv_response>(r.reply);
  const bool reconnect = boot_token_.has_value();
  const bool restarted = reconnect && *boot_token_ != resp.boot_token;
  boot_token_ = resp.boot_token;
  model_id_ = resp.model_id;
  load_budget_ = std::chrono::milliseconds(resp.load_budget_ms);
  const bool was_unhealthy = state_ == health_state::unhealthy;
  state_ = health_state::healthy;
  healthy_.store(true, std::memory_order_release);
  ++stats_.registrations;
  const std::uint64_t outage = was_unhealthy ? elapsed_ns(unhealthy_since_) : 0;
  unhealthy_ns_ += outage;
  owner_.on_healthy_locked(reconnect, restarted, outage);
  ready_cv_.notify_all();
  co_return std::string{};
}

inline boost::asio::awaitable<void> server_link::ping_loop(std::uint64_t epoch) {
  namespace asio = boost::asio;
  for (;;) {
    {
      std::lock_guard g(mu_);
      if (stopping_ || epoch != current_epoch_ || state_ != health_state::healthy) co_return;
    }
    const protocol::ping_request ping{registration_.instance_id};
    call_result r = co_await async_call(call_kind::ping, epoch, ping, -1, scaled(options_.timeouts.ping_timeout));
    {
      std::lock_guard g(mu_);
      if (stopping_ || epoch != current_epoch_ || state_ != health_state::healthy) co_return;
      if (r.status == call_status::timeout) {
        last_error_ =
            "the server left a ping unanswered for " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::milliseconds>(scaled(options_.timeouts.ping_timeout)).count()) +
            " ms";
        mark_unhealthy_io("ping_timeout");
        co_return;
      }
      if (r.status == call_status::error_reply) {
        last_error_ = "the server answered a ping with an error: " + r.error;
        mark_unhealthy_io("ping_error");
        co_return;
      }
      if (r.status != call_status::reply) co_return;
      const auto& pr = std::get<protocol::ping_response>(r.reply);
      if (boot_token_ && pr.boot_token != *boot_token_) {
        last_error_ = "the server's boot token changed under a live connection";
        mark_unhealthy_io("server_restarted");
        co_return;
      }
    }
    ping_timer_->expires_after(scaled(options_.timeouts.ping_interval));
    co_await ping_timer_->async_wait(asio::as_tuple(asio::use_awaitable));
  }
}

inline boost::asio::awaitable<void> server_link::lifecycle() {
  namespace asio = boost::asio;
  backoff retry(scaled(options_.timeouts.reconnect_initial), scaled(options_.timeouts.reconnect_max));
  for (;;) {
    {
      std::lock_guard g(mu_);
      if (stopping_) co_return;
    }
    const std::string failure = co_await establish();
    std::uint64_t epoch = 0;
    {
      std::lock_guard g(mu_);
      if (stopping_) co_return;
      epoch = current_epoch_;
    }
    if (failure.empty()) {
      retry.reset();
      co_await ping_loop(epoch);
      std::lock_guard g(mu_);
      if (stopping_) co_return;
    }
    retry_timer_->expires_after(retry.next());
    co_await retry_timer_->async_wait(asio::as_tuple(asio::use_awaitable));
  }
}

}  // namespace detail
}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
