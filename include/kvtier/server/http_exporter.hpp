#pragma once
// http_exporter: a small HTTP/1.1 server (Boost.Beast) for /metrics and friends, running on
// the host's executor (the cache server's one I/O thread): no thread of its own. The server
// serves /metrics, /healthz and /status with it (server.hpp); telemetry/ only writes the
// exposition text it serves.
//
//   server::http_exporter http(executor, {.address = "127.0.0.1", .port = 9100});
//   http.route("/metrics", [&] { return http_response::metrics(registry); });
//   http.route("/healthz", [&] { return http_response::json(200, R"({"status":"serving"})"); });
//   auto port = http.start();      // result<std::uint16_t>: the bound port (0 asks for any)
//
// GET and HEAD only; nobody can starve it (header, idle and write timeouts, the oldest
// waiting connection closed for room): docs/server.md, "The HTTP endpoint", and the
// options below. Route handlers run on the executor and must be quick. start() and stop()
// on the executor's thread or before it runs; stop() closes every connection.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/telemetry/exposition.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

struct http_response {
  unsigned status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;

  /// The Prometheus exposition of `reg`.
  [[nodiscard]] static http_response metrics(const telemetry::registry& reg) {
    return {200, std::string(telemetry::prometheus_content_type), telemetry::prometheus_text(reg)};
  }
  [[nodiscard]] static http_response json(unsigned status, std::string body) {
    return {status, "application/json", std::move(body)};
  }
};

struct http_exporter_options {
  std::string address = "127.0.0.1";  ///< loopback by default: metrics are not for the world
  std::uint16_t port = 0;              ///< 0: any free port (start() returns it)
  std::size_t max_connections = 64;
  /// From a connection's accept (or a request's first byte) to its complete header.
  std::chrono::nanoseconds header_timeout = std::chrono::seconds(5);
  /// A kept-alive connection without a new request.
  std::chrono::nanoseconds idle_timeout = std::chrono::seconds(30);
  /// Writing one response.
  std::chrono::nanoseconds write_timeout = std::chrono::seconds(10);
};

/// What the endpoint did (a snapshot).
struct http_exporter_stats {
  std::uint64_t requests = 0;         ///< requests answered (any status)
  std::uint64_t dropped_at_cap = 0;   ///< connections closed to make room for a new one
  std::uint64_t header_timeouts = 0;  ///< connections whose request header did not come in time
  std::uint64_t idle_timeouts = 0;    ///< kept-alive connections idle past idle_timeout
  std::uint64_t bad_requests = 0;     ///< malformed or oversized headers (400)
};

class http_exporter {
 public:
  using executor_type = boost::asio::any_io_executor;
  using route_handler = std::function<http_response()>;

  http_exporter(executor_type executor, http_exporter_options options)
      : executor_(std::move(executor)), options_(std::move(options)), acceptor_(executor_) {}

  http_exporter(const http_exporter&) = delete;
  http_exporter& operator=(const http_exporter&) = delete;
  ~http_exporter() { stop(); }

  /// Serves `path` (exact match, e.g. "/metrics") with `handler`.
  void route(std::string path, route_handler handler) { routes_[std::move(path)] = std::move(handler); }

  /// Binds and starts accepting; returns the bound port.
  result<std::uint16_t> start() {
    namespace ip = boost::asio::ip;
    error_code ec;
    const auto addr = ip::make_address(options_.address, ec);
    if (ec) return make_error_code(errc::invalid_config);
    const ip::tcp::endpoint ep(addr, options_.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
    if (ec) {
      error_code ignored;
      acceptor_.close(ignored);
      return ec;
    }
    port_ = acceptor_.local_endpoint(ec).port();
    running_ = true;
    boost::asio::co_spawn(executor_, accept_loop(), boost::asio::detached);
    return port_;
  }

  /// Closes the listener and every open connection.
  void stop() {
    running_ = false;
    error_code ec;
    acceptor_.close(ec);
    for (auto& c : connections_) c->close();
  }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  [[nodiscard]] std::size_t open_connections() const noexcept { return connections_.size(); }
  [[nodiscard]] std::uint64_t requests_served() const noexcept { return stats().requests; }
  /// A snapshot of the counters (any thread).
  [[nodiscard]] http_exporter_stats stats() const noexcept {
    auto get = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    return {get(counters_.requests), get(counters_.dropped_at_cap), get(counters_.header_timeouts),
            get(counters_.idle_timeouts), get(counters_.bad_requests)};
  }

 private:
  using tcp = boost::asio::ip::tcp;
  using clock = std::chrono::steady_clock;

  /// One connection. `state` and `since` decide who makes room at the cap.
  struct connection {
    enum class state : std::uint8_t { idle, reading, writing };
    explicit connection(tcp::socket s) : stream(std::move(s)) {}
    void close() {
      error_code ignored;
      stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
      stream.close();
    }
    boost::beast::tcp_stream stream;
    state st = state::idle;
    clock::time_point since = clock::now();
    bool evicted = false;  ///< closed to make room (already out of the list)
    std::list<std::shared_ptr<connection>>::iterator self;
  };
  using connection_ptr = std::shared_ptr<connection>;

  boost::asio::awaitable<void> accept_loop() {
    while (running_) {
      auto [ec, socket] = co_await acceptor_.async_accept(boost::asio::as_tuple(boost::asio::use_awaitable));
      if (ec) {
        if (!running_ || ec == boost::asio::error::operation_aborted) co_return;
        continue;  // EMFILE and friends: keep serving the connections we have
      }
      if (connections_.size() >= options_.max_connections && !make_room()) {
        error_code ignored;
        socket.close(ignored);  // every connection is being answered: the new one waits its turn
        bump(counters_.dropped_at_cap);
        continue;
      }
      auto c = std::make_shared<connection>(std::move(socket));
      connections_.push_back(c);
      c->self = std::prev(connections_.end());
      boost::asio::co_spawn(executor_, serve(c), boost::asio::detached);
    }
  }

  /// Closes the connection that has waited longest for a request (idle before reading);
  /// false when every connection is being answered.
  bool make_room() {
    connection* victim = nullptr;
    for (const auto& c : connections_) {
      if (c->st == connection::state::writing) continue;
      if (victim == nullptr || c->st < victim->st || (c->st == victim->st && c->since < victim->since))
        victim = c.get();
    }
    if (victim == nullptr) return false;
    victim->evicted = true;
    connections_.erase(victim->self);
    victim->close();
    bump(counters_.dropped_at_cap);
    return true;
  }

  /// The 400 answered to a malformed or oversized header; the connection closes after it.
  static boost::beast::http::response<boost::beast::http::string_body> bad_request() {
    namespace http = boost::beast::http;
    http::response<http::string_body> bad{http::status::bad_request, 11};
    bad.set(http::field::server, "kvtier");
    bad.set(http::field::content_type, "text/plain; charset=utf-8");
    bad.body() = "bad request\n";
    bad.keep_alive(false);
    bad.prepare_payload();
    return bad;
  }

  /// The answer to a request whose header was read: its route's (GET, HEAD), 404, or 405
  /// for another method; kept alive only for GET and HEAD without a body.
  boost::beast::http::response<boost::beast::http::string_body> answer(
      const boost::beast::http::request<boost::beast::http::empty_body>& req, bool has_body) {
    namespace http = boost::beast::http;
    http::response<http::string_body> res;
    res.version(req.version());
    res.set(http::field::server, "kvtier");
    const bool allowed = req.method() == http::verb::get || req.method() == http::verb::head;
    if (!allowed) {
      res.result(http::status::method_not_allowed);
      res.set(http::field::allow, "GET, HEAD");
      res.set(http::field::content_type, "text/plain; charset=utf-8");
      res.body() = "method not allowed\n";
    } else {
      std::string_view target = req.target();
      if (auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
      auto it = routes_.find(std::string(target));
      http_response r =
          it == routes_.end() ? http_response{404, "text/plain; charset=utf-8", "not found\n"} : it->second();
      res.result(r.status);
      res.set(http::field::content_type, r.content_type);
      res.body() = std::move(r.body);
    }
    res.keep_alive(req.keep_alive() && allowed && !has_body);
    res.prepare_payload();
    if (req.method() == http::verb::head) res.body().clear();  // Content-Length stays that of GET
    return res;
  }

  boost::asio::awaitable<void> serve(connection_ptr c) {
    namespace http = boost::beast::http;
    using boost::asio::as_tuple;
    using boost::asio::use_awaitable;
    auto& stream = c->stream;
    boost::beast::flat_buffer buffer(8192);
    bool first = true;
    for (;;) {
      // Wait for the first byte of a request: a new connection gets header_timeout for all
      // of its header, a kept-alive one idle_timeout before its next request starts.
      c->st = connection::state::idle;
      c->since = clock::now();
      const auto header_deadline = c->since + options_.header_timeout;
      if (buffer.size() == 0) {
        stream.expires_after(first ? options_.header_timeout : options_.idle_timeout);
        auto [ec, n] = co_await stream.async_read_some(buffer.prepare(4096), as_tuple(use_awaitable));
        if (ec) {
          if (ec == boost::beast::error::timeout) bump(first ? counters_.header_timeouts : counters_.idle_timeouts);
          break;
        }
        buffer.commit(n);
      }
      c->st = connection::state::reading;
      if (!first) c->since = clock::now();
      stream.expires_at(first ? header_deadline : c->since + options_.header_timeout);
      first = false;
      http::request_parser<http::empty_body> parser;
      parser.header_limit(8192);
      auto [rec, rn] = co_await http::async_read_header(stream, buffer, parser, as_tuple(use_awaitable));
      (void)rn;
      if (rec == boost::beast::error::timeout) {
        bump(counters_.header_timeouts);
        break;
      }
      if (rec) {
        if (c->evicted || rec == boost::asio::error::eof || rec == boost::asio::error::operation_aborted ||
            rec == http::error::end_of_stream)
          break;
        bump(counters_.bad_requests);
        auto bad = bad_request();
        co_await write(c, bad);
        break;
      }
      // A body is never read: the answer closes the connection when the request has one.
      const bool has_body = parser.chunked() || (parser.content_length() && *parser.content_length() > 0);
      auto res = answer(parser.get(), has_body);
      bump(counters_.requests);
      if (!co_await write(c, res) || !res.keep_alive()) {
        if (has_body) co_await drain(c, buffer);
        break;
      }
    }
    c->close();
    if (!c->evicted) connections_.erase(c->self);
  }

  /// Writes `res` within write_timeout; false on an error.
  template <class Response>
  boost::asio::awaitable<bool> write(const connection_ptr& c, Response& res) {
    c->st = connection::state::writing;
    c->since = clock::now();
    c->stream.expires_after(options_.write_timeout);
    auto [ec, n] =
        co_await boost::beast::http::async_write(c->stream, res, boost::asio::as_tuple(boost::asio::use_awaitable));
    (void)n;
    co_return !ec;
  }

  /// After an answer to a request whose body was not read: stop sending, and read (and drop)
  /// what the client still sends for a moment, so that closing with unread bytes does not
  /// reset the connection before the client has read the answer.
  boost::asio::awaitable<void> drain(const connection_ptr& c, boost::beast::flat_buffer& buffer) {
    error_code ignored;
    c->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
    c->st = connection::state::idle;
    c->stream.expires_after(std::chrono::seconds(1));
    std::size_t total = 0;
    while (total < (std::size_t{1} << 20) && !c->evicted) {
      buffer.consume(buffer.size());
      auto [ec, n] =
          co_await c->stream.async_read_some(buffer.prepare(16384), boost::asio::as_tuple(boost::asio::use_awaitable));
      if (ec) break;
      total += n;
    }
  }

  executor_type executor_;
  http_exporter_options options_;
  tcp::acceptor acceptor_;
  std::map<std::string, route_handler> routes_;
  std::list<connection_ptr> connections_;
  std::uint16_t port_ = 0;
  bool running_ = false;
  struct counters {
    std::atomic<std::uint64_t> requests{0}, dropped_at_cap{0}, header_timeouts{0}, idle_timeouts{0}, bad_requests{0};
  };
  static void bump(std::atomic<std::uint64_t>& c) noexcept { c.fetch_add(1, std::memory_order_relaxed); }
  counters counters_;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
