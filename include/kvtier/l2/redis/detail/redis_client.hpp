#pragma once
// redis_client: the connection to Redis behind l2::redis_backend, on one strand: the node
// pools (a few redis_links per Redis node, reconnected with backoff), cluster slot routing,
// the background refresh of usage and of the slot map, health, local pins, counters and
// throttled logs. The operations of the backend run over it as redis_batches
// (redis_operations.hpp). See l2/redis/redis_backend.hpp for the semantics.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/redis/detail/redis_batch.hpp>
#include <kvtier/l2/redis/detail/redis_link.hpp>
#include <kvtier/l2/redis/detail/redis_slot.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>
#include <kvtier/l2/redis/redis_options.hpp>
#include <kvtier/l2/redis/redis_stats.hpp>
#include <kvtier/l2/types.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
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
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

class redis_client final : public std::enable_shared_from_this<redis_client>, private redis_link_owner {
 public:
  using strand_type = boost::asio::strand<boost::asio::any_io_executor>;
  using counters = redis_counters;

  redis_client(boost::asio::any_io_executor ex, redis_backend_options o, std::string password, telemetry::logger* log)
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

  redis_client(const redis_client&) = delete;
  redis_client& operator=(const redis_client&) = delete;

  ~redis_client() {
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

  /// The chunk key of a Redis key key_of() wrote under this prefix; nullopt for any other
  /// string (another prefix, a key that is not an object's).
  [[nodiscard]] std::optional<chunk_key> parse_key(std::string_view s) const {
    const std::string& prefix = options_.key_prefix;
    const std::string_view whole = s;
    if (s.size() <= prefix.size() || !s.starts_with(prefix) || s[prefix.size()] != ':') return std::nullopt;
    s.remove_prefix(prefix.size() + 1);
    auto field = [&s]() -> std::string_view {
      const auto colon = s.find(':');
      const std::string_view f = s.substr(0, colon);
      s.remove_prefix(colon == std::string_view::npos ? s.size() : colon + 1);
      return f;
    };
    auto number = [](std::string_view f, int base, std::uint64_t max) -> std::optional<std::uint64_t> {
      if (f.empty() || f.size() > (base == 16 ? 16u : 5u)) return std::nullopt;
      std::uint64_t v = 0;
      for (char c : f) {
        int d = -1;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (base == 16 && c >= 'a' && c <= 'f') d = c - 'a' + 10;
        if (d < 0) return std::nullopt;
        v = v * static_cast<std::uint64_t>(base) + static_cast<std::uint64_t>(d);
      }
      if (v > max) return std::nullopt;
      return v;
    };
    const auto model = field();
    const auto ws = field();
    const auto rank = field();
    const auto hash = s;
    if (model.size() != 16) return std::nullopt;
    const auto m = number(model, 16, ~std::uint64_t{0});
    const auto w = number(ws, 10, 0xffff);
    const auto r = number(rank, 10, 0xffff);
    const auto h = hash128::from_hex(hash);
    if (!m || !w || !r || !h) return std::nullopt;
    chunk_key k{*m, static_cast<std::uint16_t>(*w), static_cast<std::uint16_t>(*r), *h};
    if (key_of(k) != whole) return std::nullopt;  // not key_of's spelling ("007", "+7"): not ours
    return k;
  }

  /// The nodes that hold the keyspace (a listing SCANs each): the masters of the last slot
  /// map (cluster) or the server (standalone). Empty while the slot map is unknown. On the
  /// strand.
  [[nodiscard]] std::vector<redis_node*> keyspace_nodes() const { return options_.cluster ? masters_ : seeds_; }

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
  [[nodiscard]] bool is_shut_down() const noexcept { return shut_down_; }

  // --- what the operations (redis_operations.hpp) record ----------------------------------
  /// Pins the keys found (lookup_and_pin).
  void pin(std::span<const chunk_key> keys, const bitmap& found) {
    std::lock_guard g(pins_mutex_);
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (found.test(i)) ++pins_[keys[i]];
  }
  /// Whether each key is pinned here (a remove leaves those alone).
  [[nodiscard]] std::vector<bool> pinned(std::span<const chunk_key> keys) const {
    std::vector<bool> p(keys.size());
    std::lock_guard g(pins_mutex_);
    for (std::size_t i = 0; i < keys.size(); ++i) p[i] = pins_.contains(keys[i]);
    return p;
  }
  /// A store or remove changed the database: adjusts the usage estimate until the next refresh.
  void note_mutation(std::int64_t objects, std::int64_t bytes) {
    ++mutations_;
    std::lock_guard g(state_mutex_);
    usage_.objects =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, static_cast<std::int64_t>(usage_.objects) + objects));
    usage_.bytes_used =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, static_cast<std::int64_t>(usage_.bytes_used) + bytes));
  }
  /// Replaces the key listener (any thread; empty: none).
  void set_key_listener(key_listener l) {
    std::lock_guard g(listener_mutex_);
    listener_ = std::move(l);
  }
  /// Tells the key listener that key changed (on the strand, as the server's reply arrives).
  void tell(key_change c, bus::key_removal why, const chunk_key& key) const {
    std::lock_guard g(listener_mutex_);
    if (listener_) listener_(c, why, {&key, 1});
  }
  /// Counts n failures of kind k and logs them (throttled per kind).
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

  // --- health ----------------------------------------------------------------------------
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

  // --- background refresh ----------------------------------------------------------------
  static boost::asio::awaitable<void> refresh_loop(std::shared_ptr<redis_client> self) {
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
  mutable std::mutex listener_mutex_;  ///< set_key_listener from any thread, calls on the strand
  key_listener listener_;
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/l2/redis/detail/impl/redis_batch.hpp>
