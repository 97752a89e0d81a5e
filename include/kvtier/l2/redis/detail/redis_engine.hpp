#pragma once
// redis_engine: the state behind l2::redis_backend, on one strand: the node pools (a few
// redis_links per Redis node, reconnected with backoff), cluster slot routing, the batches
// that carry the backend's operations, the background refresh of usage and of the slot map,
// local pins, counters and throttled logs. See l2/redis_backend.hpp for the semantics.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/redis/detail/redis_link.hpp>
#include <kvtier/l2/redis/detail/redis_slot.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/redis_options.hpp>
#include <kvtier/l2/redis/redis_stats.hpp>
#include <kvtier/l2/types.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::l2::detail {

class redis_engine;

/// One Redis node and its connections.
struct redis_node {
  struct conn {
    std::shared_ptr<redis_link> link;  ///< nullptr while waiting to reconnect
    std::unique_ptr<boost::asio::steady_timer> retry;
    std::chrono::milliseconds backoff{0};  ///< wait before the next attempt
    bool failed = false;                   ///< the last attempt or connection failed
  };
  redis_endpoint ep;
  std::string name;  ///< "host:port"
  std::vector<conn> conns;
  std::size_t rr = 0;  ///< round-robin cursor over conns
  std::string last_error;

  [[nodiscard]] std::size_t up() const noexcept {
    std::size_t n = 0;
    for (const auto& c : conns) n += c.link && c.link->up() ? 1 : 0;
    return n;
  }
};

/// A set of commands sent together (pipelined over the nodes' connections) and awaited
/// together until a deadline. Follows MOVED/ASK per command. Lives in the operation's
/// coroutine frame; its destructor detaches whatever is still outstanding.
class redis_batch final : public redis_reply_sink {
 public:
  enum class command : std::uint8_t { exists, get, set, del, raw };
  struct item {
    command cmd = command::raw;
    std::string key;  ///< the Redis key (routing and command argument)
    std::uint16_t slot = 0;
    redis_node* fixed = nullptr;                          ///< node-addressed command (INFO, DBSIZE, CLUSTER SLOTS)
    std::vector<std::string> args;                        ///< raw: the whole command
    std::array<std::byte, object_header_bytes> header{};  ///< set: the object header
    std::span<const std::byte> payload;                   ///< set: the caller's bytes
    std::span<std::byte> dst;                             ///< get: the caller's buffer
    chunk_key expect;                                     ///< get: the key the object must carry

    std::shared_ptr<redis_link> link;  ///< where the command is outstanding
    redis_request* req = nullptr;
    std::uint32_t redirects = 0;
    bool done = false;       ///< result holds the answer
    bool timed_out = false;  ///< given up at the deadline (or cancelled)
    redis_reply_event result;
  };

  redis_batch(redis_engine& e, deadline d);
  ~redis_batch() { abandon_all(); }
  redis_batch(const redis_batch&) = delete;
  redis_batch& operator=(const redis_batch&) = delete;

  item& add(command c, std::string key = {});
  [[nodiscard]] std::vector<item>& items() noexcept { return items_; }

  /// Sends everything and waits; errc::timeout at the deadline, operation_aborted when the
  /// caller cancelled (outstanding commands are then detached: timed_out).
  boost::asio::awaitable<error_code> run();

 private:
  void issue(std::size_t i, redis_node* n, bool asking);
  void on_reply(std::size_t tag, redis_reply_event&& e) override;
  void finish(std::size_t i, redis_reply_event&& e);
  void abandon_all();

  redis_engine& engine_;
  deadline deadline_;
  std::vector<item> items_;
  std::size_t remaining_ = 0;
  boost::asio::steady_timer wake_;
};

class redis_engine final : public std::enable_shared_from_this<redis_engine>, private redis_link_owner {
 public:
  using strand_type = boost::asio::strand<boost::asio::any_io_executor>;
  using lookup_tuple = std::tuple<error_code, bitmap>;
  using batch_tuple = std::tuple<error_code, batch_result>;

  using counters = redis_counters;

  redis_engine(boost::asio::any_io_executor ex, redis_backend_options o, std::string password, telemetry::logger* log)
      : strand_(boost::asio::make_strand(std::move(ex))),
        options_(std::move(o)),
        password_(std::move(password)),
        log_(log),
        refresh_timer_(strand_),
        slots_(redis_cluster_slots, nullptr),
        counters_(std::make_shared<counters>()) {
    for (auto& t : throttles_)
      t = std::make_unique<telemetry::log_throttle>(
          std::chrono::duration_cast<clock::duration>(options_.log_interval_ms));
    health_ = {false, "not connected yet"};
  }

  redis_engine(const redis_engine&) = delete;
  redis_engine& operator=(const redis_engine&) = delete;

  ~redis_engine() {
    // Reached after shutdown(), or when the io_context is destroyed with our handlers in it:
    // the links may outlive us in their coroutine frames, so they must forget us.
    for (auto& [name, n] : nodes_)
      for (auto& c : n->conns)
        if (c.link) c.link->forget_owner();
  }

  [[nodiscard]] const strand_type& strand() const noexcept { return strand_; }
  [[nodiscard]] const redis_backend_options& options() const noexcept { return options_; }
  [[nodiscard]] std::shared_ptr<counters> counter_cells() const noexcept { return counters_; }

  /// Connects to the seeds and starts the background refresh. On the strand.
  void start() {
    for (const auto& s : options_.nodes)
      if (auto ep = redis_parse_endpoint(s)) seeds_.push_back(node_for(*ep));
    update_health();
    boost::asio::co_spawn(strand_, refresh_loop(shared_from_this()), boost::asio::detached);
  }

  /// Closes every connection (outstanding commands fail), stops the background work. On the
  /// strand. Operations started afterwards answer errc::shutting_down.
  void shutdown() {
    if (shut_down_) return;
    shut_down_ = true;
    refresh_timer_.cancel();
    for (auto& [name, n] : nodes_)
      for (auto& c : n->conns) {
        c.retry->cancel();
        if (auto l = std::move(c.link)) l->detach_owner();
      }
    update_health();
  }

  /// "<prefix>:<model id, 16 hex>:<world size>:<rank>:<chunk hash, 32 hex>".
  [[nodiscard]] std::string key_of(const chunk_key& k) const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string m(16, '0');
    for (int i = 0; i < 16; ++i) m[static_cast<std::size_t>(15 - i)] = digits[(k.model_id >> (4 * i)) & 0xf];
    std::string s;
    s.reserve(options_.key_prefix.size() + 64);
    s += options_.key_prefix;
    s += ':';
    s += m;
    s += ':';
    s += std::to_string(k.world_size);
    s += ':';
    s += std::to_string(k.rank);
    s += ':';
    s += k.hash.to_hex();
    return s;
  }

  // --- synchronous, any thread -----------------------------------------------------------
  void unpin(std::span<const chunk_key> keys) {
    std::lock_guard g(pins_mutex_);
    for (const auto& k : keys)
      if (auto it = pins_.find(k); it != pins_.end() && --it->second == 0) pins_.erase(it);
  }
  [[nodiscard]] std::uint32_t pins(const chunk_key& k) const {
    std::lock_guard g(pins_mutex_);
    auto it = pins_.find(k);
    return it == pins_.end() ? 0 : it->second;
  }
  [[nodiscard]] usage_info usage() const {
    std::lock_guard g(state_mutex_);
    return usage_;
  }
  [[nodiscard]] health_info health() const {
    std::lock_guard g(state_mutex_);
    return health_;
  }
  [[nodiscard]] redis_backend_stats stats() const { return counters_->snapshot(); }

  // --- operations (coroutines on the strand) ---------------------------------------------
  static boost::asio::awaitable<lookup_tuple> lookup(std::shared_ptr<redis_engine> self,
                                                     std::span<const chunk_key> keys, deadline d) {
    auto& e = *self;
    const std::size_t n = keys.size();
    if (e.shut_down_) co_return lookup_tuple{make_error_code(errc::shutting_down), bitmap(n)};
    redis_batch b(e, d);
    for (const auto& k : keys) b.add(redis_batch::command::exists, e.key_of(k));
    const error_code ec = co_await b.run();
    bitmap found(n);
    outcome_tally tally;
    for (std::size_t i = 0; i < n; ++i) {
      const auto& it = b.items()[i];
      if (it.done && it.result.st == redis_reply_event::status::reply && it.result.reply->type == REDIS_REPLY_INTEGER) {
        if (it.result.reply->integer > 0) found.set(i);
        ++tally.answered;
        continue;
      }
      e.tally_failure(it, tally);
    }
    e.report_tally(tally, "lookup");
    if (ec)
      co_return lookup_tuple{ec == boost::asio::error::operation_aborted ? ec : make_error_code(errc::timeout),
                             bitmap(n)};
    if (n > 0 && tally.answered == 0)
      co_return lookup_tuple{make_error_code(tally.unavailable == n ? errc::backend_unavailable : errc::io_error),
                             bitmap(n)};
    {
      std::lock_guard g(e.pins_mutex_);
      for (std::size_t i = 0; i < n; ++i)
        if (found.test(i)) ++e.pins_[keys[i]];
    }
    co_return lookup_tuple{error_code{}, std::move(found)};
  }

  static boost::asio::awaitable<batch_tuple> load(std::shared_ptr<redis_engine> self, std::span<const chunk_key> keys,
                                                  std::span<const std::span<std::byte>> dst, deadline d) {
    auto& e = *self;
    const std::size_t n = keys.size();
    batch_result r(n, key_outcome::timeout);
    if (keys.size() != dst.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
    if (e.shut_down_) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{make_error_code(errc::shutting_down), r};
    }
    redis_batch b(e, d);
    for (std::size_t i = 0; i < n; ++i) {
      auto& it = b.add(redis_batch::command::get, e.key_of(keys[i]));
      it.dst = dst[i];
      it.expect = keys[i];
    }
    const error_code ec = co_await b.run();
    outcome_tally tally;
    std::vector<std::string> corrupt;
    for (std::size_t i = 0; i < n; ++i) {
      auto& it = b.items()[i];
      using st = redis_reply_event::status;
      if (it.done && it.result.st == st::object_ok)
        r.outcomes[i] = key_outcome::ok;
      else if (it.done && it.result.st == st::object_nil)
        r.outcomes[i] = key_outcome::not_found;
      else if (it.done && it.result.st == st::object_size)
        r.outcomes[i] = key_outcome::rejected;
      else if (it.done && it.result.st == st::object_corrupt) {
        r.outcomes[i] = key_outcome::corrupt;
        corrupt.push_back(it.key);
        ++tally.corrupt;
      } else {
        r.outcomes[i] = e.tally_failure(it, tally);
        continue;
      }
      ++tally.answered;
    }
    e.report_tally(tally, "load");
    if (!corrupt.empty() && !ec) {
      // A corrupt value is never served and is dropped, so that the next lookup misses it
      // (the caller may look it up again as soon as we answer: delete before answering).
      redis_batch del(e, d);
      for (auto& k : corrupt) del.add(redis_batch::command::del, std::move(k));
      co_await del.run();
    }
    if (ec) co_return batch_tuple{ec == boost::asio::error::operation_aborted ? ec : make_error_code(errc::timeout), r};
    if (n > 0 && tally.unavailable == n) co_return batch_tuple{make_error_code(errc::backend_unavailable), r};
    co_return batch_tuple{error_code{}, r};
  }

  static boost::asio::awaitable<batch_tuple> store(std::shared_ptr<redis_engine> self, std::span<const chunk_key> keys,
                                                   std::span<const std::span<const std::byte>> src, deadline d) {
    auto& e = *self;
    const std::size_t n = keys.size();
    batch_result r(n, key_outcome::timeout);
    if (keys.size() != src.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
    if (e.shut_down_) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{make_error_code(errc::shutting_down), r};
    }
    if (clock::now() >= d) co_return batch_tuple{make_error_code(errc::timeout), r};
    redis_batch b(e, d);
    for (std::size_t i = 0; i < n; ++i) {
      auto& it = b.add(redis_batch::command::set, e.key_of(keys[i]));
      object_header h;
      h.key = keys[i];
      h.payload_bytes = src[i].size();
      h.payload_checksum = payload_checksum(src[i]);
      encode_header(h, it.header);
      it.payload = src[i];
    }
    const error_code ec = co_await b.run();
    outcome_tally tally;
    std::uint64_t stored = 0, stored_bytes = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const auto& it = b.items()[i];
      if (it.done && it.result.st == redis_reply_event::status::reply) {
        const int t = it.result.reply->type;
        if (t == REDIS_REPLY_STATUS) {
          r.outcomes[i] = key_outcome::ok;
          ++stored;
          stored_bytes += object_header_bytes + src[i].size();
        } else if (t == REDIS_REPLY_NIL) {
          r.outcomes[i] = key_outcome::exists;  // SET NX found the key
        } else {
          r.outcomes[i] = key_outcome::io_error;
          ++tally.server;
          continue;
        }
        ++tally.answered;
        continue;
      }
      r.outcomes[i] = e.tally_failure(it, tally);
    }
    e.report_tally(tally, "store");
    if (stored > 0) e.note_mutation(static_cast<std::int64_t>(stored), static_cast<std::int64_t>(stored_bytes));
    if (ec) co_return batch_tuple{ec == boost::asio::error::operation_aborted ? ec : make_error_code(errc::timeout), r};
    if (n > 0 && tally.unavailable == n) co_return batch_tuple{make_error_code(errc::backend_unavailable), r};
    co_return batch_tuple{error_code{}, r};
  }

  static boost::asio::awaitable<batch_tuple> remove(std::shared_ptr<redis_engine> self, std::span<const chunk_key> keys,
                                                    deadline d) {
    auto& e = *self;
    const std::size_t n = keys.size();
    batch_result r(n, key_outcome::timeout);
    if (e.shut_down_) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{make_error_code(errc::shutting_down), r};
    }
    // Pinned here (a prefetch of this process is about to load it): not removed.
    std::vector<std::size_t> sent;
    {
      std::lock_guard g(e.pins_mutex_);
      for (std::size_t i = 0; i < n; ++i) {
        if (e.pins_.contains(keys[i]))
          r.outcomes[i] = key_outcome::rejected;
        else
          sent.push_back(i);
      }
    }
    redis_batch b(e, d);
    for (auto i : sent) b.add(redis_batch::command::del, e.key_of(keys[i]));
    const error_code ec = co_await b.run();
    outcome_tally tally;
    std::uint64_t removed = 0;
    for (std::size_t j = 0; j < sent.size(); ++j) {
      const auto& it = b.items()[j];
      const std::size_t i = sent[j];
      if (it.done && it.result.st == redis_reply_event::status::reply && it.result.reply->type == REDIS_REPLY_INTEGER) {
        r.outcomes[i] = it.result.reply->integer > 0 ? key_outcome::ok : key_outcome::not_found;
        removed += it.result.reply->integer > 0 ? 1 : 0;
        ++tally.answered;
        continue;
      }
      r.outcomes[i] = e.tally_failure(it, tally);
    }
    e.report_tally(tally, "remove");
    if (removed > 0) e.note_mutation(-static_cast<std::int64_t>(removed), 0);
    if (ec) co_return batch_tuple{ec == boost::asio::error::operation_aborted ? ec : make_error_code(errc::timeout), r};
    if (!sent.empty() && tally.unavailable == sent.size())
      co_return batch_tuple{make_error_code(errc::backend_unavailable), r};
    co_return batch_tuple{error_code{}, r};
  }

 private:
  friend class redis_batch;

  // --- routing ---------------------------------------------------------------------------
  redis_node* node_for(const redis_endpoint& ep) {
    const std::string name = ep.to_string();
    if (auto it = nodes_.find(name); it != nodes_.end()) return it->second.get();
    auto n = std::make_unique<redis_node>();
    n->ep = ep;
    n->name = name;
    n->conns.resize(options_.connections_per_node);
    redis_node* p = n.get();
    nodes_.emplace(name, std::move(n));
    for (std::size_t i = 0; i < p->conns.size(); ++i) {
      p->conns[i].retry = std::make_unique<boost::asio::steady_timer>(strand_);
      p->conns[i].backoff = options_.reconnect_backoff_min_ms;
      if (!shut_down_) connect(*p, i);
    }
    return p;
  }

  void connect(redis_node& n, std::size_t i) {
    redis_link_options lo;
    lo.endpoint = n.ep;
    lo.connect_timeout = options_.connect_timeout_ms;
    lo.username = options_.username;
    lo.password = password_;
    lo.database = options_.database;
    lo.max_inflight_bytes = options_.max_inflight_bytes_per_connection;
    n.conns[i].link = std::make_shared<redis_link>(strand_, std::move(lo), static_cast<redis_link_owner*>(this));
    n.conns[i].link->start();
  }

  /// The node of a slot (cluster), the server (standalone), or any connected node when the
  /// slot map does not know the slot yet (it will answer MOVED).
  redis_node* route(std::uint16_t slot) {
    if (!options_.cluster) return seeds_.empty() ? nullptr : seeds_.front();
    if (redis_node* n = slots_[slot]) return n;
    for (redis_node* n : seeds_)
      if (n->up() > 0) return n;
    for (auto& [name, n] : nodes_)
      if (n->up() > 0) return n.get();
    return seeds_.empty() ? nullptr : seeds_.front();
  }

  /// A connection of the node: one that is up (round-robin), else one still connecting
  /// (the command waits there), else none (the node is down and waits to reconnect).
  std::shared_ptr<redis_link> pick_link(redis_node& n) {
    // The least loaded connection that is up (expected reply bytes; ties: round-robin).
    const std::size_t k = n.conns.size();
    std::shared_ptr<redis_link> best;
    std::size_t at = 0;
    for (std::size_t j = 0; j < k; ++j) {
      auto& c = n.conns[(n.rr + j) % k];
      if (c.link && c.link->up() && (!best || c.link->load() < best->load())) {
        best = c.link;
        at = j;
      }
    }
    if (best) {
      n.rr = (n.rr + at + 1) % k;
      return best;
    }
    for (auto& c : n.conns)
      if (c.link && c.link->current() != redis_link::state::closed) return c.link;
    return nullptr;
  }

  void on_redirect(const redis_redirect& r, redis_node* to) {
    (r.ask ? counters_->ask : counters_->moved).fetch_add(1, std::memory_order_relaxed);
    if (!r.ask) {
      slots_[r.slot] = to;  // this slot at once; the rest of the map with the refresh
      request_slot_refresh();
    }
  }

  // --- redis_link_owner ------------------------------------------------------------------
  std::pair<redis_node*, redis_node::conn*> find(const redis_link& l) {
    for (auto& [name, n] : nodes_)
      for (auto& c : n->conns)
        if (c.link.get() == &l) return {n.get(), &c};
    return {nullptr, nullptr};
  }

  void on_link_up(redis_link& l) override {
    auto [n, c] = find(l);
    if (c == nullptr) return;
    if (c->failed) counters_->reconnects.fetch_add(1, std::memory_order_relaxed);
    c->failed = false;
    c->backoff = options_.reconnect_backoff_min_ms;
    if (log_ != nullptr && log_->enabled(telemetry::log_level::debug))
      log_->debug("redis backend '{}': connected to {}", options_.name, n->name);
    if (options_.cluster && !map_known_) request_slot_refresh();  // the first node up: read the map now
    update_health();
  }

  void on_link_down(redis_link& l, error_code, std::string_view why, bool was_up, bool handshake) override {
    auto [n, c] = find(l);
    if (c == nullptr) return;
    c->link.reset();  // (the link itself is kept alive by whoever closed it)
    n->last_error = std::string(why);
    const auto kind = handshake                           ? redis_error_kind::auth
                      : why.starts_with("protocol error") ? redis_error_kind::protocol
                      : was_up                            ? redis_error_kind::disconnect
                                                          : redis_error_kind::connect;
    report(kind, 1, n->name + ": " + std::string(why));
    c->failed = true;
    if (!shut_down_) {
      const std::size_t i = static_cast<std::size_t>(c - n->conns.data());
      c->retry->expires_after(c->backoff);
      // n = n: clang before 16 cannot capture a structured binding by name.
      c->retry->async_wait([w = weak_from_this(), n = n, i](boost::system::error_code ec) {
        auto self = w.lock();
        if (ec || !self || self->shut_down_ || n->conns[i].link) return;
        self->connect(*n, i);
      });
      c->backoff = std::min(options_.reconnect_backoff_max_ms, c->backoff * 2);
    }
    update_health();
  }

  // --- health, usage, counters -----------------------------------------------------------
  void update_health() {
    health_info h;
    std::uint32_t up = 0;
    for (auto& [name, n] : nodes_) up += static_cast<std::uint32_t>(n->up());
    if (shut_down_) {
      h = {false, "shut down"};
    } else if (!options_.cluster) {
      redis_node* s = seeds_.empty() ? nullptr : seeds_.front();
      if (s == nullptr || s->up() == 0)
        h = {false, "no connection to " + (s ? s->name : options_.nodes.front()) +
                        (s && !s->last_error.empty() ? " (" + s->last_error + ")" : std::string())};
    } else if (!map_known_) {
      h = {false, "cluster slot map not loaded yet"};
    } else {
      std::string down;
      for (redis_node* m : masters_)
        if (m->up() == 0)
          down += (down.empty() ? "" : ", ") + m->name + (m->last_error.empty() ? "" : " (" + m->last_error + ")");
      if (!down.empty()) h = {false, "no connection to master " + down};
    }
    counters_->connections_up.store(up, std::memory_order_relaxed);
    std::lock_guard g(state_mutex_);
    health_ = std::move(h);
  }

  void note_mutation(std::int64_t objects, std::int64_t bytes) {
    ++mutations_;
    std::lock_guard g(state_mutex_);
    usage_.objects =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, static_cast<std::int64_t>(usage_.objects) + objects));
    usage_.bytes_used =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, static_cast<std::int64_t>(usage_.bytes_used) + bytes));
  }

  void report(redis_error_kind k, std::uint64_t n, std::string_view detail) {
    if (n == 0) return;
    counters_->errors[static_cast<std::size_t>(k)].fetch_add(n, std::memory_order_relaxed);
    if (log_ == nullptr || !log_->enabled(telemetry::log_level::warn)) return;
    if (auto hidden = throttles_[static_cast<std::size_t>(k)]->allow()) {
      if (*hidden > 0)
        log_->warn("redis backend '{}': {} x{}: {} ({} more since the last report)", options_.name, name(k), n, detail,
                   *hidden);
      else
        log_->warn("redis backend '{}': {} x{}: {}", options_.name, name(k), n, detail);
    }
  }

  struct outcome_tally {
    std::size_t answered = 0, unavailable = 0, timeout = 0, server = 0, oom = 0, redirect_limit = 0, corrupt = 0;
    std::string last_error;
  };

  /// The outcome of a command that got no usable answer, counted in the tally.
  key_outcome tally_failure(const redis_batch::item& it, outcome_tally& t) {
    if (!it.done || it.timed_out) {
      ++t.timeout;
      return key_outcome::timeout;
    }
    const auto& e = it.result;
    if (e.st == redis_reply_event::status::failed) {
      ++t.unavailable;
      t.last_error = e.text;
      return key_outcome::unavailable;
    }
    if (e.st == redis_reply_event::status::error) {
      t.last_error = e.text;
      const std::string_view s = e.text;
      if (s.starts_with("OOM")) {
        ++t.oom;
        return key_outcome::no_space;
      }
      if (s.starts_with("MOVED") || s.starts_with("ASK")) {
        ++t.redirect_limit;
        return key_outcome::io_error;
      }
      // Not this key's fault: the node cannot serve now (cluster down, loading, a replica, a
      // script running) or this client may not (no AUTH: Redis 7 refuses even to read a
      // large argument from an unauthenticated client, "unauthenticated bulk length").
      for (std::string_view down :
           {"CLUSTERDOWN", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOAUTH", "WRONGPASS", "READONLY", "BUSY", "NOPERM"})
        if (s.starts_with(down)) {
          ++t.unavailable;
          return key_outcome::unavailable;
        }
      if (s.find("unauthenticated") != std::string_view::npos) {
        ++t.unavailable;
        return key_outcome::unavailable;
      }
    }
    ++t.server;
    return key_outcome::io_error;
  }

  void report_tally(const outcome_tally& t, std::string_view op) {
    const std::string why = std::string(op) + (t.last_error.empty() ? "" : ": " + t.last_error);
    report(redis_error_kind::timeout, t.timeout, std::string(op) + ": deadline passed");
    report(redis_error_kind::unavailable, t.unavailable, why);
    report(redis_error_kind::server, t.server, why);
    report(redis_error_kind::oom, t.oom, why);
    report(redis_error_kind::redirect_limit, t.redirect_limit, why);
    report(redis_error_kind::corrupt, t.corrupt, std::string(op) + ": stored value failed its check; deleted");
  }

  // --- background refresh ----------------------------------------------------------------
  static boost::asio::awaitable<void> refresh_loop(std::shared_ptr<redis_engine> self) {
    while (!self->shut_down_) {
      co_await self->refresh_once();
      if (self->shut_down_) break;
      self->refresh_timer_.expires_after(self->options_.info_interval_ms);
      co_await self->refresh_timer_.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
  }

  deadline refresh_deadline() const {
    return clock::now() + std::max<clock::duration>(options_.info_interval_ms, std::chrono::seconds(1));
  }

  boost::asio::awaitable<void> refresh_once() {
    if (options_.cluster) co_await refresh_slots();
    std::vector<redis_node*> masters = options_.cluster ? masters_ : seeds_;
    if (masters.empty()) co_return;
    const std::uint64_t m0 = mutations_;
    redis_batch b(*this, refresh_deadline());
    for (redis_node* m : masters) {
      auto& info = b.add(redis_batch::command::raw);
      info.fixed = m;
      info.args = {"INFO", "memory"};
      auto& size = b.add(redis_batch::command::raw);
      size.fixed = m;
      size.args = {"DBSIZE"};
    }
    if (co_await b.run()) co_return;
    usage_info u;
    bool unbounded = false;
    for (std::size_t j = 0; j < masters.size(); ++j) {
      const auto& info = b.items()[2 * j];
      const auto& size = b.items()[2 * j + 1];
      if (!info.done || info.result.st != redis_reply_event::status::reply ||
          info.result.reply->type != REDIS_REPLY_STRING || !size.done ||
          size.result.st != redis_reply_event::status::reply || size.result.reply->type != REDIS_REPLY_INTEGER)
        co_return;  // keep the last figures
      const auto text = redis_reply_text(*info.result.reply);
      u.bytes_used += redis_info_field(text, "used_memory").value_or(0);
      const auto cap = redis_info_field(text, "maxmemory").value_or(0);
      unbounded = unbounded || cap == 0;
      u.bytes_capacity += cap;
      u.objects += static_cast<std::uint64_t>(std::max<long long>(0, size.result.reply->integer));
    }
    if (unbounded) u.bytes_capacity = 0;
    // A store or remove that completed while the figures were being read may or may not be
    // in them: keep the local estimate then, unless that keeps happening (under a steady
    // write load the figures are taken anyway, one refresh in three).
    if (mutations_ != m0 && ++skipped_refreshes_ < 3) co_return;
    skipped_refreshes_ = 0;
    std::lock_guard g(state_mutex_);
    usage_ = u;
  }

  boost::asio::awaitable<void> refresh_slots() {
    redis_node* ask = nullptr;
    for (redis_node* m : masters_)
      if (m->up() > 0) {
        ask = m;
        break;
      }
    if (ask == nullptr)
      for (redis_node* s : seeds_)
        if (s->up() > 0) {
          ask = s;
          break;
        }
    if (ask == nullptr)
      for (auto& [name, n] : nodes_)
        if (n->up() > 0) {
          ask = n.get();
          break;
        }
    if (ask == nullptr) co_return;
    redis_batch b(*this, refresh_deadline());
    auto& it = b.add(redis_batch::command::raw);
    it.fixed = ask;
    it.args = {"CLUSTER", "SLOTS"};
    if (co_await b.run()) co_return;
    const auto& res = b.items().front().result;
    if (res.st != redis_reply_event::status::reply) {
      report(redis_error_kind::server, 1, "CLUSTER SLOTS on " + ask->name + ": " + res.text);
      co_return;
    }
    const auto ranges = redis_parse_cluster_slots(*res.reply, ask->ep.host);
    if (!ranges) {
      report(redis_error_kind::protocol, 1, "CLUSTER SLOTS on " + ask->name + ": unexpected reply");
      co_return;
    }
    std::vector<redis_node*> table(redis_cluster_slots, nullptr);
    std::vector<redis_node*> masters;
    for (const auto& r : *ranges) {
      redis_node* m = node_for(r.master);
      if (std::find(masters.begin(), masters.end(), m) == masters.end()) masters.push_back(m);
      for (std::uint32_t s = r.first; s <= r.last; ++s) table[s] = m;
    }
    slots_ = std::move(table);
    masters_ = std::move(masters);
    map_known_ = true;
    update_health();
  }

  void request_slot_refresh() {
    if (!options_.cluster || slot_refresh_running_ || shut_down_) return;
    slot_refresh_running_ = true;
    boost::asio::co_spawn(
        strand_,
        [self = shared_from_this()]() -> boost::asio::awaitable<void> {
          co_await self->refresh_slots();
          self->slot_refresh_running_ = false;
        },
        boost::asio::detached);
  }

  strand_type strand_;
  redis_backend_options options_;
  std::string password_;
  telemetry::logger* log_;
  std::array<std::unique_ptr<telemetry::log_throttle>, redis_error_kind_count> throttles_;
  boost::asio::steady_timer refresh_timer_;
  bool shut_down_ = false;

  std::map<std::string, std::unique_ptr<redis_node>> nodes_;
  std::vector<redis_node*> seeds_;
  std::vector<redis_node*> slots_;    ///< cluster: slot -> master (nullptr: unknown)
  std::vector<redis_node*> masters_;  ///< cluster: the masters of the last slot map
  bool map_known_ = false;
  bool slot_refresh_running_ = false;

  std::uint64_t mutations_ = 0;  ///< completed stores/removes that changed something
  int skipped_refreshes_ = 0;

  mutable std::mutex pins_mutex_;
  std::unordered_map<chunk_key, std::uint32_t, chunk_key_hash> pins_;
  mutable std::mutex state_mutex_;
  usage_info usage_;
  health_info health_;
  std::shared_ptr<counters> counters_;
};

// --- redis_batch -----------------------------------------------------------------------
inline redis_batch::redis_batch(redis_engine& e, deadline d) : engine_(e), deadline_(d), wake_(e.strand()) {}

inline redis_batch::item& redis_batch::add(command c, std::string key) {
  auto& it = items_.emplace_back();
  it.cmd = c;
  if (!key.empty()) it.slot = redis_key_slot(key);
  it.key = std::move(key);
  return it;
}

inline boost::asio::awaitable<error_code> redis_batch::run() {
  namespace asio = boost::asio;
  remaining_ = items_.size();
  if (remaining_ == 0) co_return error_code{};
  if (clock::now() >= deadline_) {
    for (auto& it : items_) it.timed_out = true;
    co_return make_error_code(errc::timeout);
  }
  for (std::size_t i = 0; i < items_.size(); ++i)
    issue(i, items_[i].fixed != nullptr ? items_[i].fixed : engine_.route(items_[i].slot), false);
  wake_.expires_at(deadline_);
  while (remaining_ > 0) {
    auto [ec] = co_await wake_.async_wait(asio::as_tuple(asio::use_awaitable));
    if (remaining_ == 0) break;
    if (!ec) {  // the deadline
      abandon_all();
      co_return make_error_code(errc::timeout);
    }
    const auto cs = co_await asio::this_coro::cancellation_state;
    if (cs.cancelled() != asio::cancellation_type::none) {
      abandon_all();
      co_return asio::error::operation_aborted;
    }
  }
  co_return error_code{};
}

inline void redis_batch::issue(std::size_t i, redis_node* n, bool asking) {
  item& it = items_[i];
  std::shared_ptr<redis_link> link = n != nullptr ? engine_.pick_link(*n) : nullptr;
  if (!link) {
    redis_reply_event e;
    e.st = redis_reply_event::status::failed;
    e.text = n == nullptr ? std::string("no Redis node")
                          : "not connected to " + n->name + (n->last_error.empty() ? "" : " (" + n->last_error + ")");
    finish(i, std::move(e));
    return;
  }
  auto r = std::make_unique<redis_request>();
  if (asking) {
    redis_format_append(r->head, {"ASKING"});
    r->asking = true;
  }
  switch (it.cmd) {
    case command::exists:
      redis_format_append(r->head, {"EXISTS", it.key});
      break;
    case command::del:
      redis_format_append(r->head, {"DEL", it.key});
      break;
    case command::get:
      redis_format_append(r->head, {"GET", it.key});
      r->kind = redis_reply_kind::object;
      r->reply_bytes = object_header_bytes + it.dst.size();
      r->dst = it.dst;
      r->expect = it.expect;
      break;
    case command::set: {
      auto f = redis_set_frame(it.key, object_header_bytes + it.payload.size(), engine_.options().ttl_seconds);
      r->head += f.head;
      r->object_header = it.header;
      r->has_object_header = true;
      r->payload = it.payload;
      r->tail = std::move(f.tail);
      break;
    }
    case command::raw: {
      std::vector<const char*> argv;
      std::vector<std::size_t> lens;
      for (const auto& a : it.args) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      char* cmd = nullptr;
      const int len = redisFormatCommandArgv(&cmd, static_cast<int>(argv.size()), argv.data(), lens.data());
      if (len < 0 || cmd == nullptr) throw std::bad_alloc();
      r->head.append(cmd, static_cast<std::size_t>(len));
      redisFreeCommand(cmd);
      break;
    }
  }
  r->sink = this;
  r->tag = i;
  it.link = link;
  it.req = link->submit(std::move(r));
}

inline void redis_batch::on_reply(std::size_t tag, redis_reply_event&& e) {
  item& it = items_[tag];
  const std::shared_ptr<redis_link> from = std::move(it.link);
  it.req = nullptr;
  if (e.st == redis_reply_event::status::error && it.fixed == nullptr) {
    if (auto rd = redis_parse_redirect(e.text); rd && it.redirects < engine_.options().max_redirects) {
      ++it.redirects;
      if (rd->to.host.empty() && from) rd->to.host = from->endpoint().host;
      redis_node* to = engine_.node_for(rd->to);
      engine_.on_redirect(*rd, to);
      issue(tag, to, rd->ask);
      return;
    }
  }
  finish(tag, std::move(e));
}

inline void redis_batch::finish(std::size_t i, redis_reply_event&& e) {
  item& it = items_[i];
  if (it.done) return;
  it.done = true;
  it.result = std::move(e);
  if (--remaining_ == 0) wake_.cancel();
}

inline void redis_batch::abandon_all() {
  // Detach every outstanding request first, so that a connection closed by one abandon()
  // does not report our other requests back to us.
  std::vector<std::pair<std::shared_ptr<redis_link>, redis_request*>> out;
  for (auto& it : items_) {
    if (it.done) continue;
    it.done = true;
    it.timed_out = true;
    if (it.req != nullptr) {
      it.req->sink = nullptr;
      out.emplace_back(std::move(it.link), it.req);
      it.req = nullptr;
    }
  }
  remaining_ = 0;
  for (auto& [link, req] : out) link->abandon(req);
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::l2::detail
