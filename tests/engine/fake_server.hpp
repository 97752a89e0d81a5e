#pragma once
// Test support for the engine connector: a scripted cache server speaking the real protocol
// (protocol::connection over a Unix socket in a temp dir) on its own thread, with an
// in-memory chunk store. It copies between its map and the engine's KV region through its
// own kv_region::open mapping of the registered memfd, like the real server, so retrieves
// really write blocks and stores really read them (and check their generations after the
// copy). It follows tests' scripts: delay nothing, hold requests of a type (a server stuck on
// them) and answer them later (a hung server waking up), send progress for held
// retrieves (layers, and chunks it then copies first; or for any call id: a late one), hang completely (pings too), close
// every connection (EOF), shut their read sides (the connector's writes fail with EPIPE), restart (new boot token, everything forgotten), reject
// registrations, answer lookups `pending` a number of times (a server that answers before the
// prefetch is decided).
//
// Memory ordering for sanitizers: the fake server and the test share the region's bytes in
// one process, but their hand-over goes through the socket, which ThreadSanitizer does not
// see. The server copies under its mutex, and the test calls sync() (the same mutex) after
// writing blocks it will store and before reading blocks a retrieve wrote.

#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/kv_transfer.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unix_socket.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier::test {

class fake_server {
 public:
  fake_server(std::string path, std::uint32_t chunk_tokens) : path_(std::move(path)), chunk_tokens_(chunk_tokens) {
    boot_token_ = fresh_token();
  }
  fake_server(const fake_server&) = delete;
  fake_server& operator=(const fake_server&) = delete;
  ~fake_server() { stop(); }

  /// Listens and serves on a thread of its own.
  void start() {
    listen();
    thread_ = std::thread([this] { io_.run(); });
  }
  /// Listens and serves on the calling thread until stop() (a forked child's main).
  void run() {
    listen();
    io_.run();
  }
  void stop() {
    if (!thread_.joinable()) return;
    boost::asio::post(io_, [this] {
      if (acceptor_) acceptor_->close();
      close_all_io();
      io_.stop();
    });
    thread_.join();
  }

  // --- script -------------------------------------------------------------------------
  /// Requests of type `t` are held: neither processed nor answered, until release_held().
  void hold(protocol::message_type t, bool on = true) {
    std::lock_guard g(m_);
    if (on)
      held_types_.insert(t);
    else
      held_types_.erase(t);
  }
  /// Every request is held, pings included: a stopped (SIGSTOP) or deadlocked server.
  void hang(bool on = true) {
    std::lock_guard g(m_);
    hang_ = on;
  }
  /// The server's thread stops (reads, answers and accepts nothing) until thaw(): a server
  /// whose sockets fill up. Returns once it stopped.
  void freeze() {
    freeze_after([] {});
  }
  /// Shuts the read side of every client connection (shutdown(SHUT_RD): the connector's
  /// next write fails with EPIPE, while its reads see no EOF), then freezes as freeze() does,
  /// before this server's own reads can see their EOF and close: a write error the
  /// connector meets before any read does. Returns once frozen; thaw() goes on (the
  /// sessions then see EOF and close).
  void shut_reads_and_freeze() {
    freeze_after([this] {
      for (auto& s : sessions_) (void)::shutdown(s->conn->socket().native_handle(), SHUT_RD);
    });
  }
  void thaw() {
    {
      std::lock_guard g(m_);
      frozen_ = false;
    }
    cv_.notify_all();
  }
  /// Processes and answers every held request of connections still open (late replies; a
  /// retrieve then writes its blocks). Waits until done.
  void release_held() {
    on_io([this] {
      std::vector<held_request> held;
      {
        std::lock_guard g(m_);
        held.swap(held_);
      }
      for (auto& h : held)
        if (h.s->open) process(h.s, std::move(h.f));
    });
  }
  /// Sends retrieve_progress{layers, chunks} for every held retrieve that asked for
  /// progress, without answering it, after copying its first `chunks` chunks into the
  /// engine's blocks (what the count promises); returns how many were sent. Waits until
  /// queued.
  std::size_t send_progress_to_held(std::uint32_t layers, std::uint32_t chunks = 0) {
    std::size_t sent = 0;
    on_io([&] {
      std::lock_guard g(m_);
      for (auto& h : held_) {
        if (!h.s->open || h.f.header.type != protocol::message_type::retrieve_request) continue;
        auto m = protocol::decode_message(h.f);
        if (!m || !std::get<protocol::retrieve_request>(*m).progress) continue;
        if (chunks > 0) {
          protocol::retrieve_request first = std::get<protocol::retrieve_request>(*m);
          const std::uint32_t bpc = chunk_tokens_ / h.s->region->layout().block_size;
          first.chunk_hashes.resize(std::min<std::size_t>(chunks, first.chunk_hashes.size()));
          first.block_ids.resize(first.chunk_hashes.size() * bpc);
          copy_retrieve(*h.s, first);
        }
        reply(h.s, h.f.header.call_id, protocol::retrieve_progress{layers, chunks});
        ++sent;
      }
    });
    return sent;
  }
  /// Sends retrieve_progress{layers, chunks} under `call_id` on every open connection (a
  /// progress for a call the connector does not know, or gave up on). Waits until queued.
  void send_progress(std::uint64_t call_id, std::uint32_t layers, std::uint32_t chunks = 0) {
    on_io([&] {
      for (auto& s : sessions_)
        if (s->open) reply(s, call_id, protocol::retrieve_progress{layers, chunks});
    });
  }
  /// The load budget the registrations are answered with (register_kv_response::
  /// load_budget_ms; 30 s, the real server's default, unless set).
  void set_load_budget_ms(std::uint32_t ms) {
    std::lock_guard g(m_);
    load_budget_ms_ = ms;
  }
  /// Closes every client connection (the connector sees EOF). Held requests are dropped.
  void close_connections() {
    on_io([this] { close_all_io(); });
  }
  /// A new server process: connections closed, new boot token, store and lookups forgotten.
  void restart() {
    on_io([this] {
      close_all_io();
      std::lock_guard g(m_);
      boot_token_ = fresh_token();
      chunks_.clear();
      lookups_.clear();
    });
  }
  /// Forgets every registration without closing the connections (a server bug).
  void forget_registrations() {
    on_io([this] {
      for (auto& s : sessions_) s->registered = false;
    });
  }
  /// Registrations are refused with `e` (nullopt: accepted again).
  void reject_registrations(std::optional<errc> e) {
    std::lock_guard g(m_);
    reject_ = e;
  }
  /// A lookup's answer, then its queries' answer `pending` this many times before `done` (a
  /// server that answers before the prefetch is decided). 0 (default): the lookup's own
  /// answer is `done`.
  void set_pending_answers(std::uint64_t n) {
    std::lock_guard g(m_);
    pending_answers_ = n;
  }
  /// describe_chunks_request is answered described=`on` (default false: a server that
  /// publishes no KV events), or refused with `refuse` when set.
  void set_described(bool on, std::optional<errc> refuse = std::nullopt) {
    std::lock_guard g(m_);
    described_ = on;
    refuse_descriptions_ = refuse;
  }
  /// A happens-before edge with the server's copies (see the header comment).
  void sync() const { std::lock_guard g(m_); }

  // --- observations -------------------------------------------------------------------
  [[nodiscard]] std::size_t received(protocol::message_type t) const {
    std::lock_guard g(m_);
    auto it = received_.find(t);
    return it == received_.end() ? 0 : it->second;
  }
  /// Request frames received, pings aside (they come every ping_interval).
  [[nodiscard]] std::size_t received_work() const {
    std::lock_guard g(m_);
    std::size_t n = 0;
    for (const auto& [t, count] : received_)
      if (t != protocol::message_type::ping_request) n += count;
    return n;
  }
  /// Waits until `n` requests of type `t` have arrived; false after `deadline`.
  bool wait_received(protocol::message_type t, std::size_t n,
                     std::chrono::seconds deadline = std::chrono::seconds(60)) const {
    std::unique_lock l(m_);
    return cv_.wait_for(l, deadline, [&] {
      auto it = received_.find(t);
      return it != received_.end() && it->second >= n;
    });
  }
  /// Every lookup_request received, in order.
  [[nodiscard]] std::vector<protocol::lookup_request> lookups() const {
    std::lock_guard g(m_);
    return lookup_requests_;
  }
  /// Every describe_chunks_request received, in order.
  [[nodiscard]] std::vector<protocol::describe_chunks_request> descriptions() const {
    std::lock_guard g(m_);
    return descriptions_;
  }
  /// Every retrieve_request processed (answered), in order.
  [[nodiscard]] std::vector<protocol::retrieve_request> retrieves() const {
    std::lock_guard g(m_);
    return retrieves_;
  }
  [[nodiscard]] std::vector<protocol::store_request> stores() const {
    std::lock_guard g(m_);
    return stores_;
  }
  [[nodiscard]] bool has_chunk(const chunk_key& k) const {
    std::lock_guard g(m_);
    return chunks_.contains(k);
  }
  [[nodiscard]] std::size_t chunk_count() const {
    std::lock_guard g(m_);
    return chunks_.size();
  }
  [[nodiscard]] std::size_t held() const {
    std::lock_guard g(m_);
    return held_.size();
  }
  [[nodiscard]] std::uint64_t boot_token() const {
    std::lock_guard g(m_);
    return boot_token_;
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// Every registration received, in order.
  [[nodiscard]] std::vector<protocol::register_kv_request> registrations() const {
    std::lock_guard g(m_);
    return registrations_;
  }

 private:
  struct session {
    std::shared_ptr<protocol::connection> conn;
    bool open = true;
    bool registered = false;
    std::optional<kv_region> region;
    std::uint16_t rank = 0;
    std::uint16_t world_size = 1;
    std::uint64_t model_id = 0;
  };
  struct held_request {
    std::shared_ptr<session> s;
    protocol::frame f;
  };
  struct lookup_state {
    std::uint32_t hit_chunks = 0;
    std::uint64_t pending_left = 0;
  };

  static std::uint64_t fresh_token() {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) | rd();
  }

  void listen() {
    auto a = protocol::listen_unix(boost::asio::any_io_executor(io_.get_executor()), path_);
    if (!a) throw std::runtime_error("fake_server: cannot listen on " + path_ + ": " + a.error().message());
    acceptor_.emplace(std::move(*a));
    boost::asio::co_spawn(io_, accept_loop(), boost::asio::detached);
  }

  template <class F>
  void on_io(F f) {
    std::promise<void> done;
    boost::asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait();
  }

  /// Runs `first` on the server's thread, then stops that thread until thaw(); returns once
  /// it stopped.
  template <class F>
  void freeze_after(F first) {
    auto stopped = std::make_shared<std::promise<void>>();
    std::future<void> done = stopped->get_future();
    {
      std::lock_guard g(m_);
      frozen_ = true;
    }
    boost::asio::post(io_, [this, stopped, first = std::move(first)] {
      first();
      std::unique_lock l(m_);
      stopped->set_value();
      cv_.wait(l, [&] { return !frozen_; });
    });
    done.wait();
  }

  void close_all_io() {
    for (auto& s : sessions_) {
      s->open = false;
      s->conn->close();
    }
    sessions_.clear();
    std::lock_guard g(m_);
    held_.clear();
  }

  boost::asio::awaitable<void> accept_loop() {
    namespace asio = boost::asio;
    for (;;) {
      auto [ec, socket] = co_await acceptor_->async_accept(asio::as_tuple(asio::use_awaitable));
      if (ec) co_return;
      auto s = std::make_shared<session>();
      s->conn = std::make_shared<protocol::connection>(std::move(socket));
      sessions_.push_back(s);
      asio::co_spawn(io_, serve(s), asio::detached);
    }
  }

  boost::asio::awaitable<void> serve(std::shared_ptr<session> s) {
    namespace asio = boost::asio;
    for (;;) {
      auto [ec, f] = co_await s->conn->async_read_frame(asio::as_tuple(asio::use_awaitable));
      if (ec) {
        s->open = false;
        co_return;
      }
      {
        std::lock_guard g(m_);
        ++received_[f.header.type];
        cv_.notify_all();
        if (hang_ || held_types_.contains(f.header.type)) {
          held_.push_back(held_request{s, std::move(f)});
          continue;
        }
      }
      process(s, std::move(f));
    }
  }

  void reply(const std::shared_ptr<session>& s, std::uint64_t call_id, const protocol::message& m) {
    s->conn->async_send(call_id, m, [](error_code) {});
  }

  static protocol::error_response error(errc e, std::string_view why) { return protocol::error_response::make(e, why); }

  /// Where lookup `l` stands: `pending` while it has pending answers left, then `done`.
  template <class Response>
  static Response answer(lookup_state& l) {
    if (l.pending_left > 0) {
      --l.pending_left;
      return Response{protocol::prefetch_state::pending, 0, 0};
    }
    return Response{protocol::prefetch_state::done, l.hit_chunks, l.hit_chunks};
  }

  // Runs on the server's thread.
  void process(const std::shared_ptr<session>& s, protocol::frame f) {
    namespace p = protocol;
    const std::uint64_t call_id = f.header.call_id;
    auto decoded = p::decode_message(f);
    if (!decoded) return reply(s, call_id, error(errc::protocol_error, decoded.error().reason));
    std::lock_guard g(m_);
    p::message out = std::visit(
        [&](auto& msg) -> p::message {
          using T = std::decay_t<decltype(msg)>;
          if constexpr (std::is_same_v<T, p::get_chunk_size_request>) {
            return p::get_chunk_size_response{chunk_tokens_};
          } else if constexpr (std::is_same_v<T, p::ping_request>) {
            return p::ping_response{boot_token_, 1};
          } else if constexpr (std::is_same_v<T, p::register_kv_request>) {
            return do_register(*s, msg, std::move(f.fd));
          } else if constexpr (std::is_same_v<T, p::lookup_request>) {
            if (!s->registered) return error(errc::not_registered, "register first");
            lookup_requests_.push_back(msg);
            lookup_state l;
            l.pending_left = pending_answers_;
            for (const hash128& h : msg.chunk_hashes) {
              bool all = true;
              for (std::uint16_t r = 0; r < msg.world_size; ++r)
                all = all &&
                      chunks_.contains(chunk_key{salted_model_id(msg.model_id, msg.cache_salt), msg.world_size, r, h});
              if (!all) break;
              ++l.hit_chunks;
            }
            return answer<p::lookup_response>(lookups_[msg.request_key] = l);
          } else if constexpr (std::is_same_v<T, p::query_prefetch_request>) {
            auto it = lookups_.find(msg.request_key);
            if (it == lookups_.end()) return p::query_prefetch_response{p::prefetch_state::unknown, 0, 0};
            return answer<p::query_prefetch_response>(it->second);
          } else if constexpr (std::is_same_v<T, p::retrieve_request>) {
            retrieves_.push_back(msg);
            return do_retrieve(*s, msg);
          } else if constexpr (std::is_same_v<T, p::store_request>) {
            stores_.push_back(msg);
            return do_store(*s, msg);
          } else if constexpr (std::is_same_v<T, p::free_lookup_locks_request>) {
            return p::free_lookup_locks_response{};
          } else if constexpr (std::is_same_v<T, p::end_request_request>) {
            lookups_.erase(msg.request_key);
            return p::end_request_response{};
          } else if constexpr (std::is_same_v<T, p::describe_chunks_request>) {
            if (!s->registered) return error(errc::not_registered, "register first");
            descriptions_.push_back(msg);
            if (refuse_descriptions_) return error(*refuse_descriptions_, "refused by the test script");
            return p::describe_chunks_response{described_};
          } else if constexpr (std::is_same_v<T, p::unregister_kv_request>) {
            s->registered = false;
            s->region.reset();
            return p::unregister_kv_response{};
          } else {
            return error(errc::unsupported, "the fake server does not answer this");
          }
        },
        *decoded);
    reply(s, call_id, out);
  }

  protocol::message do_register(session& s, const protocol::register_kv_request& r, protocol::unique_fd fd) {
    if (reject_) return error(*reject_, "rejected by the test script");
    if (r.chunk_tokens != chunk_tokens_)
      return error(errc::layout_mismatch, "chunk_tokens must be " + std::to_string(chunk_tokens_));
    if (r.region == protocol::region_kind::none) {
      if (fd) return error(errc::invalid_argument, "a scheduler registration carries no fd");
      s.region.reset();
    } else {
      if (!fd) return error(errc::invalid_argument, "no region fd");
      auto region = kv_region::open(fd.release(), r.layout());
      if (!region)
        return error(region.error() == errc::layout_mismatch ? errc::layout_mismatch : errc::invalid_argument,
                     "cannot map the region: " + region.error().message());
      s.region = std::move(*region);
    }
    s.registered = true;
    s.rank = r.rank;
    s.world_size = r.world_size;
    s.model_id = make_model_id(r.model_name, r.model, r.layout_kind, r.cache_salt);
    registrations_.push_back(r);
    return protocol::register_kv_response{boot_token_, ++client_ids_, s.model_id, chunk_tokens_, load_budget_ms_};
  }

  [[nodiscard]] std::optional<protocol::error_response> check_blocks(const session& s, std::uint16_t rank,
                                                                     std::size_t chunks,
                                                                     const std::vector<std::uint32_t>& ids) const {
    if (!s.registered) return error(errc::not_registered, "register first");
    if (!s.region) return error(errc::no_kv_region, "registered without a region");
    if (rank != s.rank) return error(errc::invalid_argument, "rank differs from the registration's");
    const std::uint32_t bpc = chunk_tokens_ / s.region->layout().block_size;
    if (ids.size() != chunks * bpc) return error(errc::invalid_argument, "block count");
    for (std::uint32_t b : ids)
      if (b >= s.region->layout().num_blocks) return error(errc::invalid_argument, "block id out of range");
    return std::nullopt;
  }

  protocol::message do_retrieve(session& s, const protocol::retrieve_request& r) {
    if (auto e = check_blocks(s, r.rank, r.chunk_hashes.size(), r.block_ids)) return *e;
    return protocol::retrieve_response{copy_retrieve(s, r)};
  }

  /// Copies the leading chunks of `r` the store has into its blocks; returns how many.
  std::uint32_t copy_retrieve(session& s, const protocol::retrieve_request& r) {
    const chunk_layout chunk{s.region->layout().model, chunk_tokens_};
    const std::uint32_t bpc = chunk_tokens_ / s.region->layout().block_size;
    std::uint32_t done = 0;
    for (std::size_t i = 0; i < r.chunk_hashes.size(); ++i) {
      auto it =
          chunks_.find(chunk_key{salted_model_id(s.model_id, r.cache_salt), s.world_size, s.rank, r.chunk_hashes[i]});
      if (it == chunks_.end()) break;
      const std::uint64_t before = std::uint64_t{i} * chunk_tokens_;
      const std::uint32_t skip =
          r.skip_tokens <= before
              ? 0
              : static_cast<std::uint32_t>(std::min<std::uint64_t>(r.skip_tokens - before, chunk_tokens_));
      const std::span<const std::uint32_t> ids(r.block_ids.data() + i * bpc, bpc);
      if (scatter_chunk(s.region->view(), ids, chunk, it->second.data(), skip)) break;
      ++done;
    }
    return done;
  }

  protocol::message do_store(session& s, const protocol::store_request& r) {
    if (auto e = check_blocks(s, r.rank, r.chunk_hashes.size(), r.block_ids)) return *e;
    const chunk_layout chunk{s.region->layout().model, chunk_tokens_};
    const std::uint32_t bpc = chunk_tokens_ / s.region->layout().block_size;
    protocol::store_response out;
    for (std::size_t i = 0; i < r.chunk_hashes.size(); ++i) {
      const chunk_key key{salted_model_id(s.model_id, r.cache_salt), s.world_size, s.rank, r.chunk_hashes[i]};
      if (chunks_.contains(key)) {
        ++out.already_present;
        continue;
      }
      std::vector<std::byte> object(chunk.object_bytes());
      const std::span<const std::uint32_t> ids(r.block_ids.data() + i * bpc, bpc);
      if (gather_chunk(s.region->view(), ids, chunk, object.data())) {
        ++out.failed;
        continue;
      }
      // The seqlock check after the copy: a block reused meanwhile fences the chunk.
      bool fenced = false;
      for (std::size_t j = 0; j < bpc; ++j)
        fenced = fenced || s.region->generation(ids[j]) != r.block_generations[i * bpc + j];
      if (fenced) {
        ++out.failed;
        continue;
      }
      chunks_.emplace(key, std::move(object));
      ++out.stored;
    }
    return out;
  }

  std::string path_;
  std::uint32_t chunk_tokens_;
  boost::asio::io_context io_{1};
  std::optional<boost::asio::basic_socket_acceptor<boost::asio::local::stream_protocol, boost::asio::any_io_executor>>
      acceptor_;
  std::thread thread_;
  std::vector<std::shared_ptr<session>> sessions_;  // the server's thread only

  mutable std::mutex m_;
  mutable std::condition_variable cv_;
  std::uint64_t boot_token_ = 0;
  std::uint64_t client_ids_ = 0;
  bool hang_ = false;
  bool frozen_ = false;
  std::set<protocol::message_type> held_types_;
  std::vector<held_request> held_;
  std::optional<errc> reject_;
  std::uint64_t pending_answers_ = 0;
  std::uint32_t load_budget_ms_ = 30000;
  std::map<protocol::message_type, std::size_t> received_;
  std::vector<protocol::lookup_request> lookup_requests_;
  std::vector<protocol::describe_chunks_request> descriptions_;
  bool described_ = false;
  std::optional<errc> refuse_descriptions_;
  std::vector<protocol::store_request> stores_;
  std::vector<protocol::retrieve_request> retrieves_;
  std::map<chunk_key, std::vector<std::byte>> chunks_;
  std::map<std::string, lookup_state> lookups_;
  std::vector<protocol::register_kv_request> registrations_;
};

}  // namespace kvtier::test
