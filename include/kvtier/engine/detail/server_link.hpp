#pragma once
// server_link: the connector's transport to its server. It owns the connector's thread (one
// io_context) and does everything that is about reaching the server, not about what the
// calls mean: the connection's lifecycle, the calls in flight, the connections, health. The
// connector (the owner) is told about the edges through link_owner. docs/fault-tolerance.md,
// "Inside: the connector and its link", holds each part and the threading rule.

#include <kvtier/config.hpp>
#include <kvtier/engine/detail/call_table.hpp>
#include <kvtier/engine/detail/server_connection.hpp>
#include <kvtier/engine/health.hpp>
#include <kvtier/engine/options.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/messages.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {
namespace detail {

/// What the owner (the connector) does at the link's edges. Every function runs on the
/// link's thread with the link's mutex held, never after server_link::stop() returned.
class link_owner {
 public:
  /// Registered: the first time, or again after an unhealthy period (`reconnect`), with
  /// another boot token than before (`restarted`) and how long it was unhealthy.
  virtual void on_healthy_locked(bool reconnect, bool restarted, std::uint64_t unhealthy_ns) = 0;
  /// The unhealthy edge, before the calls in flight are released (`released_transfers` of
  /// them are retrieves and stores).
  virtual void on_unhealthy_locked(std::string_view reason, std::size_t released_transfers) = 0;
  /// The unhealthy edge, after every call in flight was released.
  virtual void after_unhealthy_locked() = 0;
  /// A connection refused: the server's process runs as `uid`, not `expected`.
  virtual void on_peer_refused_locked(std::uint32_t uid, std::uint32_t pid, std::uint32_t expected) = 0;
  /// Proof that no copy can follow on connection `epoch`: the server closed it, or its
  /// process is gone.
  virtual void on_copies_over_locked(std::uint64_t epoch) = 0;
  /// The answer to call `id`, which had completed already (deadline, unhealthy edge).
  virtual void on_late_reply_locked(std::uint64_t id) = 0;
  /// Progress of retrieve `id`, which is in flight (protocol::retrieve_progress):
  /// `layers_ready` leading layers of its chunks, and every layer of its `chunks_ready`
  /// leading chunks, are in the engine's blocks.
  virtual void on_retrieve_progress_locked(std::uint64_t id, std::uint32_t layers_ready,
                                           std::uint32_t chunks_ready) = 0;
  /// Whether connection `epoch` must stay open for late replies.
  [[nodiscard]] virtual bool awaits_late_replies_locked(std::uint64_t epoch) const = 0;

 protected:
  ~link_owner() = default;
};

/// Counters of the link (a snapshot, with the mutex held).
struct link_stats {
  std::uint64_t registrations = 0;   ///< successful registrations (first connect + reconnects)
  std::uint64_t late_replies = 0;    ///< replies to calls given up on
  std::uint64_t progress_messages = 0;  ///< progress messages for calls in flight
  std::uint64_t ignored_progress = 0;   ///< progress messages for calls not in flight (ignored)
  std::uint64_t calls_issued = 0;    ///< requests handed to a connection
  std::uint64_t calls_sent_by_caller = 0;  ///< of them, written by the issuing engine thread itself
  std::size_t pending_calls = 0;     ///< calls waiting for their reply now
  std::size_t open_connections = 0;  ///< the current one plus those kept for late replies
  /// Time spent unhealthy (no registered server) since the start, the current outage included.
  std::uint64_t unhealthy_ns = 0;
};

class server_link {
 public:
  using clock = std::chrono::steady_clock;

  /// `registration`: the register_kv_request every connection sends (with `region_fd`
  /// beside it, -1: none). Starts nothing: start() does.
  server_link(const connector_options& options, protocol::register_kv_request registration, int region_fd,
              link_owner& owner);
  server_link(const server_link&) = delete;
  server_link& operator=(const server_link&) = delete;
  ~server_link() { stop(); }

  /// Starts the thread, which connects in the background.
  void start();
  /// Stops the thread and tears the connections down; no link_owner function runs after.
  void stop();

  /// The one lock of the link and its owner.
  [[nodiscard]] std::mutex& mutex() const noexcept { return mu_; }
  /// The link's thread's executor (the owner's own timers and posts).
  [[nodiscard]] const boost::asio::any_io_executor& executor() const noexcept { return ex_; }

  [[nodiscard]] bool healthy() const noexcept { return healthy_.load(std::memory_order_acquire); }
  /// Blocks until registered (true) or `timeout` passes.
  bool wait_ready(std::chrono::milliseconds timeout);

  // --- with mutex() held ---------------------------------------------------------------
  [[nodiscard]] health_state state_locked() const noexcept { return state_; }
  [[nodiscard]] bool stopping_locked() const noexcept { return stopping_; }
  [[nodiscard]] const std::string& last_error_locked() const noexcept { return last_error_; }
  [[nodiscard]] std::uint64_t boot_token_locked() const noexcept { return boot_token_.value_or(0); }
  /// The model id of the last registration.
  [[nodiscard]] std::uint64_t model_id_locked() const noexcept { return model_id_; }
  /// The server's load budget (register_kv_response::load_budget_ms) of the last
  /// registration: the longest a retrieve's deadline moves with its progress.
  [[nodiscard]] clock::duration load_budget_locked() const noexcept { return load_budget_; }
  /// Whether the server closed connection `epoch` (its copies for it are over).
  [[nodiscard]] bool closed_by_server_locked(std::uint64_t epoch) const {
    auto it = connections_.find(epoch);
    return it != connections_.end() && it->second->closed_by_server;
  }
  [[nodiscard]] link_stats stats_locked() const;

  /// A call id, allocated before the lock so that the frame can be encoded outside it.
  [[nodiscard]] std::uint64_t next_call_id() noexcept { return next_call_id_.fetch_add(1, std::memory_order_relaxed); }
  /// The frame of `m` under `call_id`; std::invalid_argument when it cannot be encoded.
  template <class Msg>
  [[nodiscard]] static std::vector<std::byte> encode(std::uint64_t call_id, const Msg& m) {
    auto r = protocol::encode_frame(call_id, m);
    if (!r)
      throw std::invalid_argument("kvtier::engine::connector: cannot encode " + std::string(protocol::name(Msg::type)) +
                                  ": " + r.error().message());
    return std::move(*r);
  }
  /// Issues call `id` (its frame `bytes`) on the current connection, expecting `expect`
  /// within `timeout` of its sending. `done` runs once when it completes, with the mutex
  /// held, on the link's thread, never inside this call. A thread other than the link's
  /// issues through issue_lock, whose send_issued writes the calls on the caller's thread
  /// after releasing the mutex (waking the link's thread instead would cost the caller more
  /// than the call: on a busy machine the woken thread takes the caller's core).
  /// `lazy` (a notification nothing waits for, such as end_request): nothing is sent for it
  /// alone; it goes with the next call that is sent, or when the link's thread runs anyway
  /// (a reply read, the next ping: within ping_interval).
  void issue_locked(std::uint64_t id, call_kind kind, protocol::message_type expect, std::vector<std::byte> bytes,
                    clock::duration timeout, call_done done, bool lazy = false) {
    issue_locked(id, kind, current_epoch_, expect, std::move(bytes), -1, timeout, std::move(done), lazy);
  }
  /// Closes the older connections the owner no longer awaits late replies on.
  void retire_connections_locked();

  /// Releases `lock` (on the mutex) and sends the calls a thread other than the link's
  /// issued under it (issue_lock's end). They are written on the calling thread (one
  /// sendmsg, MSG_DONTWAIT) when they are all for the current connection and nothing of the
  /// link's thread waits in its write queue; their deadlines are armed first, under the
  /// mutex. Otherwise, or for what the socket does not take, the link's thread is woken to
  /// write them. Only while the link runs (before stop()).
  void send_issued(std::unique_lock<std::mutex>& lock);

 private:
  struct call_waiter {
    explicit call_waiter(const boost::asio::any_io_executor& ex) : timer(ex, clock::time_point::max()) {}
    boost::asio::steady_timer timer;
    std::optional<call_result> result;
  };

  [[nodiscard]] clock::duration scaled(std::chrono::milliseconds d) const noexcept { return options_.scaled(d); }

  // With mu_ held, on the link's thread (but issue_locked).
  void issue_locked(std::uint64_t id, call_kind kind, std::uint64_t epoch, protocol::message_type expect,
                    std::vector<std::byte> bytes, int fd, clock::duration timeout, call_done done, bool lazy = false);
  /// On the link's thread: sends what lazy issues left queued (a send_queued_io posted).
  void send_lazy_locked();
  void complete_locked(pending_call& c, call_result r);
  /// Sends the calls queued by issue_locked, in their order: the checks and the deadlines
  /// under the mutex, the writes (sendmsg, which wakes the server) after releasing it.
  void send_queued_io();
  /// Hands `bytes` (and `fd`; none when empty) to `s`'s write queue, after what an engine
  /// thread's write left unsent; with s.send_mu held, on the link's thread. `counted`: the
  /// frame is in s.link_writes already.
  void write_io(const std::shared_ptr<server_connection>& s, std::vector<std::byte> bytes, int fd,
                bool counted = false);
  /// send_issued's write of `frames` on `s`, on the caller's thread, with `send` holding
  /// s->send_mu: what the socket does not take goes to s->unsent, for the link's thread.
  void write_here(std::shared_ptr<server_connection> s, std::unique_lock<std::mutex> send,
                  std::vector<std::vector<std::byte>> frames);
  /// A write on connection `epoch` failed.
  void on_write_error_io(std::uint64_t epoch, error_code ec);
  /// (Re)arms call `c`'s deadline timer to expire at `at`.
  void arm_deadline_locked(pending_call& c, clock::time_point at);
  void on_deadline_io(std::uint64_t id);
  /// A frame read on `s`, decoded (outside the mutex) into `decoded`.
  bool on_frame_io(server_connection& s, std::uint64_t id, protocol::decode_result<protocol::message> decoded);
  /// A progress message for call `id` (moves its deadline on).
  void on_progress_io(server_connection& s, std::uint64_t id, const protocol::message& m);
  /// The reply to call `c`, taken from the calls in flight; false when it breaks the connection.
  bool on_reply_io(server_connection& s, pending_call& c, protocol::message m);
  /// `server_closed`: the break is the server's close (EOF, EPIPE, ECONNRESET).
  void on_broken_io(server_connection& s, std::string_view reason, bool server_closed);
  void mark_unhealthy_io(std::string_view reason);
  void fail_calls_io(std::optional<std::uint64_t> epoch, call_status status);
  void maybe_retire_io(std::uint64_t epoch);
  void watch_process_io(const std::shared_ptr<server_connection>& s);
  std::string fail_handshake_locked(std::uint64_t epoch, std::string_view reason, std::string message);
  /// Why a socket refuses to be used: empty when its peer runs as the expected uid.
  std::string check_peer_locked(protocol::connection::socket_type& socket);

  // Coroutines on the link's thread.
  template <class Msg>
  boost::asio::awaitable<call_result> async_call(call_kind kind, std::uint64_t epoch, const Msg& m, int fd,
                                                 clock::duration timeout);
  boost::asio::awaitable<void> lifecycle();
  /// One connection attempt up to the registration; the failure's reason, empty on success.
  boost::asio::awaitable<std::string> establish();
  boost::asio::awaitable<std::string> handshake(std::shared_ptr<server_connection> s);
  boost::asio::awaitable<void> ping_loop(std::uint64_t epoch);
  boost::asio::awaitable<void> reader(std::shared_ptr<server_connection> s);

  const connector_options& options_;  ///< the owner's, which outlives the link
  protocol::register_kv_request registration_;
  int region_fd_;
  link_owner& owner_;

  // I/O objects: the io_context first, so that stop() can tear the others down before it.
  std::unique_ptr<boost::asio::io_context> io_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  boost::asio::any_io_executor ex_;
  std::optional<boost::asio::steady_timer> ping_timer_;   ///< the ping loop's pause
  std::optional<boost::asio::steady_timer> retry_timer_;  ///< the reconnection pause
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable ready_cv_;
  std::atomic<bool> healthy_{false};
  std::atomic<std::uint64_t> next_call_id_{1};  ///< call ids start at 1 (0: "no call" in errors)
  // --- guarded by mu_ ---
  bool stopping_ = false;
  health_state state_ = health_state::starting;
  clock::time_point unhealthy_since_{};
  std::uint64_t unhealthy_ns_ = 0;  ///< the outages that ended (stats_locked adds the current one)
  std::string last_error_;
  std::optional<std::uint64_t> boot_token_;  ///< of the last registration
  std::uint64_t model_id_ = 0;
  clock::duration load_budget_{};
  std::uint64_t next_epoch_ = 0;
  std::uint64_t current_epoch_ = 0;  ///< the connection being set up or registered; 0: none
  breaker breaker_;
  call_table calls_;
  std::map<std::uint64_t, std::shared_ptr<server_connection>> connections_;
  link_stats stats_{};
  std::vector<std::uint64_t> send_queue_;  ///< calls issued and not yet written or handed to send_queued_io
  bool send_posted_ = false;               ///< a send_queued_io is posted
  bool caller_sends_ = false;              ///< a send_issued owes the queue a sending
};

/// The link's mutex for a function of an engine's thread that issues calls: on leaving the
/// scope it releases the mutex and sends what was issued (server_link::send_issued).
class issue_lock {
 public:
  explicit issue_lock(server_link& link) : link_(link), lock_(link.mutex()) {}
  issue_lock(const issue_lock&) = delete;
  issue_lock& operator=(const issue_lock&) = delete;
  ~issue_lock() { link_.send_issued(lock_); }

 private:
  server_link& link_;
  std::unique_lock<std::mutex> lock_;
};

}  // namespace detail
}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/engine/detail/impl/server_link.hpp>
