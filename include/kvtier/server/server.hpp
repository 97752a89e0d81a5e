#pragma once
// server: the kvtier cache server in one object. It owns its I/O thread (run(): the
// protocol, the pipelines' coroutines, lookups, pings), the worker pool, the event bus and
// metrics registry, the HTTP endpoint (http_exporter.hpp), the L2 backends and the cache
// (make_cache.hpp), the registrations, engines and lookups (session/), the listening socket
// (listener.hpp) with one session per connection, the reaper, and a random boot token.
//
//   kvtier::server::server s(config);        // the checks, then the set-up: throws config_error,
//                                             // std::runtime_error (socket, port), std::bad_alloc
//   s.start();                                // serves: accepts, faults L1 in behind the requests
//   std::thread t([&] { s.run(); });          // or run() on the main thread
//   s.stop();                                 // any thread: orderly shutdown, run() returns
//
// docs/server.md says what it does and in which order: "Start-up" (the checks before any
// work, then the work the first request needs, then serving while L1 is faulted in),
// "Threads", "Trust" (who may connect), "Reaping", "Shutdown", "The HTTP endpoint".

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/kv_events/tier_announcer.hpp>
#include <kvtier/kv_events/tier_key_relay.hpp>
#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/heap_trim.hpp>
#include <kvtier/server/http_exporter.hpp>
#include <kvtier/server/l1_residency.hpp>
#include <kvtier/server/listener.hpp>
#include <kvtier/server/make_cache.hpp>
#include <kvtier/server/session/any_cache.hpp>
#include <kvtier/server/session/client_budget.hpp>
#include <kvtier/server/session/engine_table.hpp>
#include <kvtier/server/session/lookup_table.hpp>
#include <kvtier/server/session/region_registry.hpp>
#include <kvtier/server/session/server_context.hpp>
#include <kvtier/server/session/session.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/log_escaped.hpp>
#include <kvtier/telemetry/logger.hpp>
#include <kvtier/telemetry/logging_subscriber.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <nlohmann/json.hpp>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

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
  /// Builds the transport of the KV events for config.kv_events (kvtier-server: ZMQ,
  /// kv_events/zmq_transport.hpp). Empty: a configuration with "kv_events" is refused.
  std::function<std::unique_ptr<kv_events::kv_event_transport>(const kv_events_config&)> kv_event_transport;
};

class server final : private session_host {
 public:
  /// The start-up checks, then the set-up the first request needs (docs/server.md,
  /// "Start-up"): binds the metrics port and the socket (connections wait in the backlog
  /// until start()). Throws config_error for a configuration to change (a value that does
  /// not validate, a disk directory that cannot be trusted), std::runtime_error saying what
  /// to change when the socket or the port cannot be had or a backend cannot be built,
  /// std::invalid_argument or std::bad_alloc when L1 cannot be set up; nothing is left
  /// behind then (no socket file).
  explicit server(server_config config, server_options options = {},
                  const backend_factory& factory = backend_factory::builtin())
      : config_((config.validate(factory), std::move(config))),
        options_(std::move(options)),
        log_(config_.log_level, "kvtier-server",
             options_.log_sink ? options_.log_sink : telemetry::logger::stderr_sink()),
        bus_(telemetry::metrics_subscriber{registry_}, telemetry::logging_subscriber{log_}, kv_events::tier_key_relay{}),
        boot_token_(make_boot_token()),
        started_at_(std::chrono::steady_clock::now()),
        clients_(region_registry::requirements{config_.chunk_tokens, static_cast<std::size_t>(config_.l1_slot_bytes)}),
        budget_(client_budget::limits{config_.max_connections, config_.max_connections_per_uid,
                                      config_.lookup_keys_total(), config_.lookup_keys_per_client()}),
        listener_(io_.get_executor(), config_, budget_, log_),
        reap_timer_(io_) {
    // 1. The checks (the configuration was validated above).
    std::vector<backend_spec> specs = factory.parse_all(config_.l2_backends);
    for (const auto& spec : specs)
      if (spec.check) spec.check(spec.name);
    // Signals before the socket exists: a client may connect and send SIGTERM at once.
    if (options_.handle_signals) {
      signals_.emplace(io_, SIGTERM, SIGINT);
      signals_->async_wait([this](error_code ec, int sig) {
        if (ec) return;
        log_.info("signal {} received: shutting down", sig);
        begin_shutdown();
      });
    }
    // The HTTP endpoint before the socket: a port in use leaves no socket file behind.
    if (config_.metrics_enabled()) start_http();
    try {
      listener_.listen();
      // 2. The work the first request needs. (The listener's destructor removes the socket
      // file if this throws.)
      backend_context bctx{io_.get_executor(), &log_, &registry_};
      std::vector<l2::any_backend> backends;
      for (auto& spec : specs) {
        backends.push_back(spec.create(bctx, spec.name));
        backend_lines_.push_back(spec.name + " (" + spec.description + ")");
        backend_types_.push_back(spec.type);
      }
      cache_ = make_cache(config_, io_.get_executor(), bus_, std::move(backends), worker_pool_.get_executor());
      setup_kv_events();
    } catch (...) {  // (kv_detach_ detaches the announcer as the members go)
      stop_http();
      throw;
    }
    prepare_l1_residency();
    ctx_.emplace(server_context{
        config_, *cache_, clients_, lookups_, engines_, bus_, log_, boot_token_, options_.hooks, &budget_,
        worker_pool_.get_executor(),
        std::chrono::duration_cast<std::chrono::milliseconds>(cache_options_from(config_).prefetch.load_timeout)});
    add_metrics();
    add_kv_events_metrics();
  }

  server(const server&) = delete;
  server& operator=(const server&) = delete;

  ~server() {
    // The L1 prefault's thread, and a task still on the worker pool (a registration's prefault
    // that outlived the shutdown's wait for the sessions), refer to L1, or to the registry
    // and its session: they end first. (The copies ended when the cache stopped.)
    stop_l1_prefault();  // it stops before its next slice
    if (l1_prefault_thread_.joinable()) l1_prefault_thread_.join();
    worker_pool_.join();
    // Sessions first (their sockets belong to io_), then the cache; io_ outlives both.
    sessions_.clear();
    signals_.reset();
  }

  /// Serves: the accept loop (the socket listens since the constructor), the reaper, and the
  /// L1 prefault behind the first requests (docs/server.md, "Start-up"). The requests are
  /// served once run() runs the I/O thread.
  void start() {
    if (started_) return;
    started_ = true;
    bus_.start_drain_thread();
    auto accept = [this] {
      listener_.start([this](std::uint64_t id, listener::socket_type socket) { open_session(id, std::move(socket)); });
    };
    if (kv_announcer_) {
      // What the L2 tiers hold already goes out before anything a connection changes.
      boost::asio::co_spawn(
          io_,
          [this, accept]() -> boost::asio::awaitable<void> {
            co_await announce_l2_contents();
            if (!stopping_) accept();
          },
          telemetry::log_escaped{&log_, "kv_events start"});
    } else {
      accept();
    }
    boost::asio::co_spawn(io_, reap_loop(), telemetry::log_escaped{&log_, "reaper"});
    start_l1_prefault();
    log_.debug("{}", startup_line());
  }

  /// Runs the I/O thread until the shutdown completes (starts first when needed). Returns 0.
  int run() {
    start();
    io_.run();
    return 0;
  }

  /// Begins an orderly shutdown (docs/server.md, "Shutdown"). Any thread; idempotent.
  void stop() {
    boost::asio::post(io_, [this] { begin_shutdown(); });
  }

  [[nodiscard]] const server_config& config() const noexcept { return config_; }
  [[nodiscard]] std::uint64_t boot_token() const noexcept { return boot_token_; }
  [[nodiscard]] boost::asio::io_context& io_context() noexcept { return io_; }
  [[nodiscard]] any_cache& cache() noexcept { return *cache_; }
  [[nodiscard]] telemetry::logger& log() noexcept { return log_; }
  [[nodiscard]] server_event_bus& bus() noexcept { return bus_; }
  /// The metrics registry (every kvtier_* series of this server).
  [[nodiscard]] telemetry::registry& metrics() noexcept { return registry_; }
  /// The Prometheus text exposition of metrics().
  [[nodiscard]] std::string metrics_text() const { return telemetry::prometheus_text(registry_); }
  /// The bound port of the HTTP endpoint after start() (0: off).
  [[nodiscard]] std::uint16_t metrics_port() const noexcept { return metrics_port_; }
  /// "http://127.0.0.1:9464" (the endpoint's base URL), or empty when it is off.
  [[nodiscard]] std::string metrics_url() const;
  /// The /healthz document: {"status": "serving" | "stopping", "boot_token", "uptime_s", ...}.
  [[nodiscard]] std::string health_json() const;
  /// The one line the program prints when it is up.
  [[nodiscard]] std::string startup_line() const;
  /// The status document (status_request, /status): I/O thread only.
  [[nodiscard]] std::string status_json() override;
  /// Where the L1 arena stands (l1_residency.hpp): any thread.
  [[nodiscard]] l1_residency_state l1_residency() const noexcept {
    return l1_residency_.load(std::memory_order_acquire);
  }

 private:
  /// An admitted connection (listener): its session, started.
  void open_session(std::uint64_t id, listener::socket_type socket) {
    session_host& host = *this;
    auto s =
        std::make_shared<session>(id, session::connection_type(std::move(socket), options_.frame_limits), *ctx_, host);
    sessions_.emplace(id, s);
    connections_.store(sessions_.size(), std::memory_order_relaxed);
    log_.debug("client {}: connected", id);
    s->start();
  }

  static std::uint64_t make_boot_token() {
    std::random_device rd;
    const std::uint64_t t = (std::uint64_t{rd()} << 32) ^ std::uint64_t{rd()} ^
                            static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return t == 0 ? 1 : t;
  }

  // --- L1 residency (impl/server_l1_residency.hpp) ---------------------------------------
  void prepare_l1_residency();
  void start_l1_prefault();
  void stop_l1_prefault() noexcept;
  void l1_prefault_ended(l1_prefault_outcome o);
  void register_l1_step();

  // --- what the server tells about itself (impl/server_status.hpp) ----------------------
  void add_metrics();
  void log_l1_residency(const l1_residency_report& r);
  void start_http();
  void stop_http();

  // --- KV events for routers (impl/server_kv_events.hpp) ---------------------------------
  void setup_kv_events();
  boost::asio::awaitable<void> announce_l2_contents();
  void add_kv_events_metrics();
  [[nodiscard]] nlohmann::json kv_events_status() const;

  // --- the reaper (impl/server_reaper.hpp) ----------------------------------------------
  boost::asio::awaitable<void> reap_loop();
  void session_closed(std::uint64_t id) noexcept override;

  // --- the shutdown sequence (impl/server_shutdown.hpp) ---------------------------------
  void begin_shutdown();
  boost::asio::awaitable<void> shutdown();

  server_config config_;
  server_options options_;
  telemetry::logger log_;
  telemetry::registry registry_;
  server_event_bus bus_;
  boost::asio::io_context io_{1};
  /// The copies' threads; before cache_, so destroyed (joined) after it: the cache's
  /// async_stop has waited for every copy by then.
  boost::asio::thread_pool worker_pool_{config_.worker_thread_count()};
  std::optional<http_exporter> http_;  ///< after io_: destroyed before it
  std::uint16_t metrics_port_ = 0;
  std::uint64_t boot_token_;
  std::chrono::steady_clock::time_point started_at_;
  std::vector<std::string> backend_lines_;
  std::vector<std::string> backend_types_;
  std::unique_ptr<any_cache> cache_;
  /// KV events (config kv_events): the transport, and the announcer the bus's key relay feeds
  /// (detached by the destructor before either goes).
  std::unique_ptr<kv_events::kv_event_transport> kv_transport_;
  std::unique_ptr<kv_events::tier_announcer> kv_announcer_;
  /// Detaches the announcer from the bus before it goes (after the drain thread delivered
  /// what was queued): declared after it, so destroyed first, also when a constructor step
  /// after setup_kv_events throws.
  struct announcer_detach {
    server_event_bus& bus;
    explicit announcer_detach(server_event_bus& b) noexcept : bus(b) {}
    announcer_detach(const announcer_detach&) = delete;
    announcer_detach& operator=(const announcer_detach&) = delete;
    ~announcer_detach() {
      auto& relay = bus.subscriber<kv_events::tier_key_relay>();
      if (!relay.attached()) return;
      bus.stop_drain_thread();
      bus.drain();
      relay.attach(nullptr);
    }
  } kv_detach_{bus_};
  region_registry clients_;
  lookup_table lookups_;
  engine_table engines_;
  client_budget budget_;
  listener listener_;  ///< after budget_, log_, config_: it refers to them
  std::optional<server_context> ctx_;
  std::optional<boost::asio::signal_set> signals_;
  boost::asio::steady_timer reap_timer_;
  heap_trimmer heap_trimmer_;  ///< the reaper gives the heap's free pages back (heap_trim.hpp)
  std::unordered_map<std::uint64_t, std::shared_ptr<session>> sessions_;
  bool started_ = false;
  bool stopping_ = false;
  /// L1 residency: the state (written on the I/O thread, before run() by the constructor),
  /// the bytes the prefault faulted in so far (written by its thread), the flag that stops it
  /// (set by the shutdown and the destructor) and its thread (joined by the destructor).
  std::atomic<l1_residency_state> l1_residency_{l1_residency_state::off};
  std::atomic<std::size_t> l1_prefaulted_bytes_{0};
  std::atomic<bool> l1_prefault_stop_{false};
  std::thread l1_prefault_thread_;
  /// The registration with the L2 backends, a piece per turn, and what the log line will say
  /// (I/O thread).
  std::optional<cache::l1_registration> l1_registration_;
  l1_residency_report l1_report_;
  std::atomic<std::size_t> connections_{0};
  std::atomic<std::uint64_t> reaped_{0};
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/server/impl/server_l1_residency.hpp>
#include <kvtier/server/impl/server_kv_events.hpp>
#include <kvtier/server/impl/server_reaper.hpp>
#include <kvtier/server/impl/server_shutdown.hpp>
#include <kvtier/server/impl/server_status.hpp>
