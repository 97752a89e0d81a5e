#pragma once
// server: the kvtier cache server in one object. It owns
//   - its io_context: ONE thread (run()) carries the protocol, the pipelines' coroutines,
//     lookups and pings (docs/architecture.md);
//   - the copy pool (copy_threads threads): the copies between engine regions and L1 of
//     retrieves and stores (tiered_cache::async_copy_out / async_copy_in), so a large copy
//     never holds up the I/O thread;
//   - the event bus (metrics inline, logs on the bus's drain thread: the second thread);
//   - the metrics registry (metrics(), metrics_text()) and, when metrics_port is set, the
//     HTTP endpoint on this same executor: /metrics (Prometheus text), /healthz (200 with
//     the boot token while serving, 503 while shutting down), /status (status_json());
//   - the L2 backends (backend_factory), the tiered cache (any_cache), the registrations and
//     lookups (region_registry.hpp), the listening socket and one session per connection;
//   - a reaper timer: expires L1 locks and lookups past their TTL, and closes connections
//     silent for client_reap_timeout (a connection that dies is reaped at once: EOF),
//     releasing the lookups each one owned; like every close, on the I/O thread, and a
//     connection with a copy in flight is closed once it ended, so no copy for the
//     connection runs or starts after (session.hpp);
//   - a random boot token, answered to ping and register (a new one reveals a restart);
//   - who may connect: every accepted connection's peer is checked with SO_PEERCRED (the
//     server's own uid, root, allowed_uids, allowed_gids) and against the connection caps
//     (client_budget.hpp) before a byte of it is read; a refused peer gets one
//     error_response saying why and is closed, with one (throttled) log line and a count in
//     kvtier_server_connections_refused_total{reason}. The default socket's directory is
//     created 0700 and verified at start (protocol/unix_socket.hpp).
//
//   kvtier::server::server s(config);        // throws config_error, std::bad_alloc (L1 arena)
//   s.start();                                // listens; throws std::runtime_error saying why not
//   std::thread t([&] { s.run(); });          // or run() on the main thread
//   s.stop();                                 // any thread: orderly shutdown, run() returns
//
// Shutdown (stop(), or SIGTERM/SIGINT when server_options::handle_signals): stop accepting,
// close every connection (their registrations and lookups are reaped), release the
// remaining lookups, wait for in-flight L2 work up to shutdown_timeout, stop the cache's
// pipelines (queued stores dropped; operations in flight waited for, every coroutine of the
// cache ended), remove the socket file, and return from run(). Logs are flushed when the
// server is destroyed (the bus drains its queue).
//
// Threading: stop() may be called from any thread; everything else (and every hook) runs on
// the thread in run(), or before run() starts. Destroy the server after run() returned.

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/protocol/connection.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier/server/any_cache.hpp>
#include <kvtier/server/backend_factory.hpp>
#include <kvtier/server/client_budget.hpp>
#include <kvtier/server/server_config.hpp>
#include <kvtier/server/http_exporter.hpp>
#include <kvtier/server/region_registry.hpp>
#include <kvtier/server/session.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/logger.hpp>
#include <kvtier/telemetry/logging_subscriber.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>
#include <kvtier/telemetry/registry.hpp>
#include <kvtier/version.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// How the server is embedded (not configuration: the program or the test decides).
struct server_options {
  /// SIGTERM and SIGINT stop the server (the kvtier-server program sets this; a test that
  /// runs a server in its own process must not take the process's signals).
  bool handle_signals = false;
  /// Where log lines go; empty: stderr.
  telemetry::logger::sink_fn log_sink;
  /// Hooks into request handling (tests).
  server_hooks hooks;
  /// Frame limits of every connection.
  protocol::limits frame_limits;
};

class server final : private session_host {
 public:
  using acceptor_type =
      boost::asio::basic_socket_acceptor<boost::asio::local::stream_protocol, boost::asio::any_io_executor>;

  /// Builds everything but the listening socket. Throws config_error for a configuration
  /// that does not validate, std::invalid_argument or std::bad_alloc when L1 cannot be set
  /// up.
  explicit server(server_config config, server_options options = {},
                  const backend_factory& factory = backend_factory::builtin())
      : config_((config.validate(factory), std::move(config))),
        options_(std::move(options)),
        log_(config_.log_level, "kvtier-server",
             options_.log_sink ? options_.log_sink : telemetry::logger::stderr_sink()),
        bus_(telemetry::metrics_subscriber{registry_}, telemetry::logging_subscriber{log_}),
        boot_token_(make_boot_token()),
        started_at_(std::chrono::steady_clock::now()),
        clients_(region_registry::requirements{config_.chunk_tokens, static_cast<std::size_t>(config_.l1_slot_bytes)}),
        budget_(client_budget::limits{config_.max_connections, config_.max_connections_per_uid,
                                      config_.lookup_keys_total(), config_.lookup_keys_per_client()}),
        peers_(config_.peer_policy()),
        reap_timer_(io_) {
    backend_context bctx{io_.get_executor(), &log_, &registry_};
    std::vector<l2::any_backend> backends;
    for (auto& spec : factory.parse_all(config_.l2_backends)) {
      backends.push_back(spec.create(bctx, spec.name));
      backend_lines_.push_back(spec.name + " (" + spec.description + ")");
      backend_types_.push_back(spec.type);
    }
    cache_ = make_cache(config_, io_.get_executor(), bus_, std::move(backends), copy_pool_.get_executor());
    ctx_.emplace(
        server_context{config_, *cache_, clients_, lookups_, bus_, log_, boot_token_, options_.hooks, &budget_});
    telemetry::collect_cache(registry_, *cache_);
    telemetry::collect_bus(registry_, bus_);
    using telemetry::metric_type;
    registry_.add_callback("kvtier_server_connections", "Open client connections", metric_type::gauge, {},
                           [this] { return static_cast<double>(connections_.load(std::memory_order_relaxed)); });
    registry_.add_callback("kvtier_server_registrations", "Registered KV regions (engine workers)", metric_type::gauge,
                           {}, [this] { return static_cast<double>(clients_.size()); });
    registry_.add_callback(
        "kvtier_server_uptime_seconds", "Seconds since the server started", metric_type::gauge, {},
        [this] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count(); });
    registry_.add_callback("kvtier_server_info", "Always 1; the labels describe the server", metric_type::gauge,
                           {{"version", std::string(version_string)},
                            {"boot_token", fmt::format("{:016x}", boot_token_)},
                            {"eviction_policy", std::string(cache_->eviction_policy())},
                            {"store_policy", std::string(name(config_.store_policy))},
                            {"prefetch_policy", std::string(name(config_.prefetch_policy))}},
                           [] { return 1.0; });
    registry_.add_callback("kvtier_server_clients_reaped_total",
                           "Connections closed by the server: idle past client_reap_timeout, or a broken stream",
                           metric_type::counter, {},
                           [this] { return static_cast<double>(reaped_.load(std::memory_order_relaxed)); });
    for (std::size_t r = 0; r < client_budget::refusal_count; ++r)
      registry_.add_callback(
          "kvtier_server_connections_refused_total",
          "Connections refused at accept: a peer uid not allowed, or a connection cap (max_connections, "
          "max_connections_per_uid)",
          metric_type::counter, {{"reason", std::string(client_budget::refusal_names[r])}},
          [this, r] { return static_cast<double>(budget_.refused(static_cast<client_budget::refusal>(r))); });
    registry_.add_callback("kvtier_server_lookups_refused_total",
                           "Lookups refused because a lookup key budget (max_lookup_keys, "
                           "max_lookup_keys_per_client) was spent",
                           metric_type::counter, {}, [this] { return static_cast<double>(budget_.lookups_refused()); });
    static constexpr std::array<std::string_view, 4> http_reasons = {"cap", "header_timeout", "idle_timeout",
                                                                     "bad_request"};
    for (std::size_t r = 0; r < http_reasons.size(); ++r)
      registry_.add_callback(
          "kvtier_http_connections_dropped_total",
          "HTTP endpoint connections closed by the server: to make room at the cap (idle first), "
          "a request header not complete in time, idle past the timeout, a malformed request",
          metric_type::counter, {{"reason", std::string(http_reasons[r])}}, [this, r] {
            if (!http_) return 0.0;
            const auto st = http_->stats();
            const std::uint64_t v[] = {st.dropped_at_cap, st.header_timeouts, st.idle_timeouts, st.bad_requests};
            return static_cast<double>(v[r]);
          });
  }

  server(const server&) = delete;
  server& operator=(const server&) = delete;

  ~server() {
    // Sessions first (their sockets belong to io_), then the cache; io_ outlives both.
    sessions_.clear();
    acceptor_.reset();
    signals_.reset();
  }

  /// Listens on the socket and starts the accept loop, the reaper and the signal handler.
  /// Throws std::runtime_error with what to change when the socket cannot be created.
  void start() {
    if (started_) return;
    // Signals first: once the socket listens a client may connect and send SIGTERM at once.
    if (options_.handle_signals && !signals_) {
      signals_.emplace(io_, SIGTERM, SIGINT);
      signals_->async_wait([this](error_code ec, int sig) {
        if (ec) return;
        log_.info("signal {} received: shutting down", sig);
        begin_shutdown();
      });
    }
    // The HTTP endpoint before the socket: a port in use fails start-up before any client
    // can connect (and leaves no socket file behind).
    if (config_.metrics_enabled() && !http_) start_http();
    // The default socket's directory: created 0700, and only used when it is ours and
    // nobody else may write in it (another user could otherwise put their socket there).
    if (const auto dir = protocol::default_socket_directory(); config_.socket_path == dir + "/kvtier.sock") {
      if (std::string why = protocol::prepare_private_directory(dir); !why.empty()) {
        stop_http();
        throw std::runtime_error(why);
      }
    }
    protocol::listen_options lo;
    lo.mode = static_cast<::mode_t>(config_.socket_mode);
    auto acc = protocol::listen_unix(boost::asio::any_io_executor(io_.get_executor()), config_.socket_path, lo);
    if (!acc) {
      stop_http();
      throw std::runtime_error(listen_error(acc.error()));
    }
    acceptor_.emplace(std::move(*acc));
    started_ = true;
    bus_.start_drain_thread();
    boost::asio::co_spawn(io_, accept_loop(), boost::asio::detached);
    boost::asio::co_spawn(io_, reap_loop(), boost::asio::detached);
    log_.debug("{}", startup_line());
  }

  /// Runs the I/O thread until the shutdown completes (starts first when needed). Returns 0.
  int run() {
    start();
    io_.run();
    return 0;
  }

  /// Begins an orderly shutdown (see the header comment). Any thread; idempotent.
  void stop() {
    boost::asio::post(io_, [this] { begin_shutdown(); });
  }

  [[nodiscard]] const server_config& config() const noexcept { return config_; }
  [[nodiscard]] std::uint64_t boot_token() const noexcept { return boot_token_; }
  [[nodiscard]] boost::asio::io_context& io_context() noexcept { return io_; }
  [[nodiscard]] any_cache& cache() noexcept { return *cache_; }
  [[nodiscard]] telemetry::logger& log() noexcept { return log_; }
  [[nodiscard]] default_event_bus& bus() noexcept { return bus_; }
  /// The metrics registry (every kvtier_* series of this server).
  [[nodiscard]] telemetry::registry& metrics() noexcept { return registry_; }
  /// The Prometheus text exposition of metrics().
  [[nodiscard]] std::string metrics_text() const { return telemetry::prometheus_text(registry_); }
  /// The bound port of the HTTP endpoint after start() (0: off).
  [[nodiscard]] std::uint16_t metrics_port() const noexcept { return metrics_port_; }
  /// "http://127.0.0.1:9464" (the endpoint's base URL), or empty when it is off.
  [[nodiscard]] std::string metrics_url() const {
    if (metrics_port_ == 0) return {};
    const bool v6 = config_.metrics_address.find(':') != std::string::npos;
    return v6 ? fmt::format("http://[{}]:{}", config_.metrics_address, metrics_port_)
              : fmt::format("http://{}:{}", config_.metrics_address, metrics_port_);
  }

  /// The /healthz document: {"status": "serving" | "stopping", "boot_token", "uptime_s", ...}.
  [[nodiscard]] std::string health_json() const {
    nlohmann::json j;
    j["status"] = stopping_ ? "stopping" : "serving";
    j["boot_token"] = boot_token_;
    j["boot_token_hex"] = fmt::format("{:016x}", boot_token_);
    j["version"] = version_string;
    j["pid"] = ::getpid();
    j["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count();
    return j.dump();
  }

  /// The one line the program prints when it is up.
  [[nodiscard]] std::string startup_line() const {
    std::string backends;
    for (const auto& b : backend_lines_) backends += (backends.empty() ? "" : ", ") + b;
    return fmt::format(
        "kvtier-server {} listening on {} (boot token {:016x}, pid {}): L1 {} MiB in {} slots of {} KiB, eviction {}, "
        "chunk {} tokens, L2 backends: {}, store {}, prefetch {}, {} copy threads, metrics {}",
        version_string, config_.socket_path, boot_token_, ::getpid(),
        (cache_->slot_count() * cache_->slot_bytes()) >> 20, cache_->slot_count(), cache_->slot_bytes() >> 10,
        cache_->eviction_policy(), config_.chunk_tokens, backends.empty() ? std::string("none") : backends,
        name(config_.store_policy), name(config_.prefetch_policy), config_.copy_thread_count(),
        metrics_port_ ? metrics_url() + "/metrics" : std::string("off"));
  }

  /// The status document (status_request): I/O thread only.
  [[nodiscard]] std::string status_json() override {
    using nlohmann::json;
    const auto now = std::chrono::steady_clock::now();
    auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
    json j;
    j["boot_token"] = boot_token_;
    j["version"] = version_string;
    j["protocol_version"] = protocol::protocol_version;
    j["pid"] = ::getpid();
    j["uptime_s"] = secs(now - started_at_);
    j["socket"] = config_.socket_path;
    j["metrics_url"] = metrics_url();
    j["connections"] = sessions_.size();
    j["chunk_tokens"] = config_.chunk_tokens;
    j["eviction_policy"] = std::string(cache_->eviction_policy());
    j["store_policy"] = std::string(name(config_.store_policy));
    j["prefetch_policy"] = std::string(name(config_.prefetch_policy));
    json clients = json::array();
    std::vector<std::uint64_t> ids;
    for (const auto& [id, s] : sessions_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (std::uint64_t id : ids) {
      const session& s = *sessions_.at(id);
      json c;
      c["client_id"] = id;
      const registration* reg = clients_.find(id);
      c["registered"] = reg != nullptr;
      if (reg) {
        c["instance_id"] = reg->instance_id;
        c["rank"] = reg->rank;
        c["world_size"] = reg->world_size;
        c["model"] = reg->model_name;
        c["model_id"] = reg->model_id;
        c["region_kind"] = std::string(protocol::name(reg->kind));
        c["dtype"] = std::string(name(reg->chunk.model.dtype));
        c["layout_kind"] = std::string(name(reg->layout.kind()));
        c["prefill_tokens_per_second"] = reg->prefill_tokens_per_second;
        c["num_blocks"] = reg->layout.num_blocks;
        c["block_size"] = reg->layout.block_size;
        c["region_bytes"] = reg->region.bytes();
      } else {
        c["instance_id"] = nullptr;
        c["rank"] = nullptr;
        c["world_size"] = nullptr;
        c["model"] = nullptr;
        c["model_id"] = nullptr;
      }
      c["idle_s"] = secs(now - s.last_activity());
      c["requests"] = s.requests();
      c["lookups"] = lookups_.owned(id);
      clients.push_back(std::move(c));
    }
    j["clients"] = std::move(clients);
    j["lookups"] = lookups_.size();
    const cache::cache_status cs = cache_->status();
    j["l1"] = {{"bytes_used", cs.l1.bytes_used},     {"bytes_capacity", cs.l1.bytes_capacity},
               {"objects", cs.l1.objects},           {"slots_used", cs.l1.slots_used},
               {"slot_bytes", cache_->slot_bytes()}, {"slot_count", cache_->slot_count()},
               {"evictable", cs.l1.evictable},       {"removing", cs.l1.removing},
               {"object_bytes", cs.l1.object_bytes}, {"cache_lookups", cs.lookups}};
    json backends = json::array();
    for (std::size_t b = 0; b < cs.backends.size(); ++b) {
      const auto& x = cs.backends[b];
      backends.push_back({{"name", x.name},
                          {"type", b < backend_types_.size() ? backend_types_[b] : std::string()},
                          {"bytes_used", x.usage.bytes_used},
                          {"bytes_capacity", x.usage.bytes_capacity},
                          {"objects", x.usage.objects},
                          {"healthy", x.health.healthy},
                          {"reason", x.health.reason}});
    }
    j["backends"] = std::move(backends);
    j["prefetch"] = {{"active", cs.prefetches_active}, {"inflight_bytes", cs.prefetch_inflight_bytes}};
    j["store"] = {{"inflight_tasks", cs.store_inflight_tasks},
                  {"inflight_bytes", cs.store_inflight_bytes},
                  {"pending_keys", cs.store_pending_keys}};
    std::string text = j.dump();
    if (text.size() > protocol::max_status_json_bytes) {
      // Thousands of connections: keep the totals, drop the per-client list.
      j["clients"] = json::array();
      j["clients_truncated"] = ids.size();
      text = j.dump();
    }
    return text;
  }

 private:
  void start_http() {
    http_exporter_options o;
    o.address = config_.metrics_address;
    o.port = config_.metrics_any_port ? 0 : config_.metrics_port;
    http_.emplace(boost::asio::any_io_executor(io_.get_executor()), std::move(o));
    http_->route("/metrics", [this] { return http_response::metrics(registry_); });
    http_->route("/healthz", [this] { return http_response::json(stopping_ ? 503 : 200, health_json()); });
    http_->route("/status", [this] { return http_response::json(200, status_json()); });
    auto port = http_->start();
    if (!port) {
      const error_code ec = port.error();
      http_.reset();
      throw std::runtime_error(fmt::format(
          "cannot serve metrics on {}:{} ({}): {}", config_.metrics_address, config_.metrics_port, ec.message(),
          ec == boost::asio::error::address_in_use
              ? "another program uses that port: choose another --metrics-port, \"auto\", or 0 to turn it off"
              : "check --metrics-address (an address of this machine) and --metrics-port (ports below 1024 need "
                "privileges)"));
    }
    metrics_port_ = *port;
  }

  void stop_http() {
    if (http_) http_->stop();
  }

  static std::uint64_t make_boot_token() {
    std::random_device rd;
    const std::uint64_t t = (std::uint64_t{rd()} << 32) ^ std::uint64_t{rd()} ^
                            static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return t == 0 ? 1 : t;
  }

  std::string listen_error(error_code ec) const {
    std::string fix;
    if (ec == boost::asio::error::address_in_use)
      fix = "another server is listening there: stop it or choose another --socket";
    else if (ec == boost::system::errc::file_exists)
      fix = "a file that is not a socket is in the way: remove it or choose another --socket";
    else if (ec == errc::invalid_argument)
      fix = "the path is empty or too long for a Unix socket: choose a shorter --socket";
    else
      fix = "check that the directory exists and that this user may create files there, or choose another --socket";
    return "cannot listen on " + config_.socket_path + " (" + ec.message() + "): " + fix;
  }

  boost::asio::awaitable<void> accept_loop() {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    telemetry::log_throttle throttle(std::chrono::seconds(10));
    for (;;) {
      auto [ec, socket] = co_await acceptor_->async_accept(as_tuple(use_awaitable));
      if (stopping_ || ec == boost::asio::error::operation_aborted) co_return;
      if (ec) {
        if (auto hidden = throttle.allow()) log_.warn("accept failed: {} ({} more since)", ec.message(), *hidden);
        // Out of fds (EMFILE) and the like: back off instead of spinning on the error.
        boost::asio::steady_timer t(io_, std::chrono::milliseconds(100));
        co_await t.async_wait(as_tuple(use_awaitable));
        continue;
      }
      const std::uint64_t id = next_client_id_++;
      if (!admit(id, socket)) continue;
      session_host& host = *this;
      auto s = std::make_shared<session>(id, session::connection_type(std::move(socket), options_.frame_limits), *ctx_,
                                         host);
      sessions_.emplace(id, s);
      connections_.store(sessions_.size(), std::memory_order_relaxed);
      log_.debug("client {}: connected", id);
      s->start();
    }
  }

  boost::asio::awaitable<void> reap_loop() {
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
    }
  }

  /// The checks of a new connection before anything of it is read: its peer's uid (SO_PEERCRED)
  /// and the connection caps. A refused connection gets one error_response and is closed.
  template <class Socket>
  bool admit(std::uint64_t id, Socket& socket) {
    auto peer = protocol::peer_credentials(socket.native_handle());
    std::optional<client_budget::refusal> refusal;
    ::uid_t uid = static_cast<::uid_t>(-1);
    if (!peer) {
      refusal = client_budget::refusal::peer_uid;  // unknown credentials: not served
    } else {
      uid = peer->uid;
      if (!peers_.allows(*peer))
        refusal = client_budget::refusal::peer_uid;
      else
        refusal = budget_.admit(id, peer->uid);
    }
    if (!refusal) return true;
    budget_.count(*refusal);
    const errc code = *refusal == client_budget::refusal::peer_uid ? errc::permission_denied : errc::over_budget;
    const std::string why = peer ? budget_.refusal_message(*refusal, uid)
                                 : "cannot read the peer's credentials (" + peer.error().message() + ")";
    // A small frame into an empty socket buffer: never blocks, and the peer can read why.
    if (auto frame = protocol::encode_frame(0, protocol::error_response::make(code, why)))
      (void)::send(socket.native_handle(), frame->data(), frame->size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    error_code ignored;
    socket.close(ignored);
    auto& throttle = refusal_log_[static_cast<std::size_t>(*refusal)];
    if (auto hidden = throttle.allow())
      log_.warn("refused a connection from {}: {}{}", peer ? peer->describe() : std::string("an unknown peer"), why,
                *hidden ? fmt::format(" ({} more refused since)", *hidden) : std::string());
    return false;
  }

  void session_closed(std::uint64_t id) noexcept override {
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
    const bool had_registration = clients_.remove(id);
    connections_.store(sessions_.size(), std::memory_order_relaxed);
    if (s->close_reason().starts_with("protocol error")) reaped_.fetch_add(1, std::memory_order_relaxed);
    const bool notable = had_registration || released > 0 || !s->close_reason().starts_with("disconnected");
    log_.log(notable && !stopping_ ? telemetry::log_level::info : telemetry::log_level::debug, "client {}: {}{}{}", id,
             s->close_reason(), had_registration ? "; registration dropped" : "",
             released ? fmt::format("; {} lookups released", released) : std::string());
  }

  void begin_shutdown() {
    if (stopping_) return;
    stopping_ = true;
    boost::asio::co_spawn(io_, shutdown(), boost::asio::detached);
  }

  boost::asio::awaitable<void> shutdown() {
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    error_code ignored;
    if (acceptor_) acceptor_->close(ignored);
    if (signals_) signals_->cancel(ignored);
    reap_timer_.cancel();
    std::vector<std::shared_ptr<session>> open;
    for (const auto& [id, s] : sessions_) open.push_back(s);
    for (auto& s : open) s->close("server shutting down");
    open.clear();
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
    stop_http();  // last: /healthz answered 503 "stopping" until now
    if (started_) ::unlink(config_.socket_path.c_str());
    log_.info("stopped (boot token {:016x})", boot_token_);
    io_.stop();
  }

  server_config config_;
  server_options options_;
  telemetry::logger log_;
  telemetry::registry registry_;
  default_event_bus bus_;
  boost::asio::io_context io_{1};
  /// The copies' threads; before cache_, so destroyed (joined) after it: the cache's
  /// async_stop has waited for every copy by then.
  boost::asio::thread_pool copy_pool_{config_.copy_thread_count()};
  std::optional<http_exporter> http_;  ///< after io_: destroyed before it
  std::uint16_t metrics_port_ = 0;
  std::uint64_t boot_token_;
  std::chrono::steady_clock::time_point started_at_;
  std::vector<std::string> backend_lines_;
  std::vector<std::string> backend_types_;
  std::unique_ptr<any_cache> cache_;
  region_registry clients_;
  lookup_table lookups_;
  client_budget budget_;
  protocol::peer_policy peers_;
  /// One throttle per refusal reason: each refusal is a line, but a peer that reconnects in a
  /// loop makes at most 20 lines per 10 s, the next one with the count of those held back.
  std::array<telemetry::log_throttle, client_budget::refusal_count> refusal_log_{
      telemetry::log_throttle(std::chrono::seconds(10), 20), telemetry::log_throttle(std::chrono::seconds(10), 20),
      telemetry::log_throttle(std::chrono::seconds(10), 20)};
  std::optional<server_context> ctx_;
  std::optional<acceptor_type> acceptor_;
  std::optional<boost::asio::signal_set> signals_;
  boost::asio::steady_timer reap_timer_;
  std::unordered_map<std::uint64_t, std::shared_ptr<session>> sessions_;
  std::uint64_t next_client_id_ = 1;
  bool started_ = false;
  bool stopping_ = false;
  std::atomic<std::size_t> connections_{0};
  std::atomic<std::uint64_t> reaped_{0};
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
