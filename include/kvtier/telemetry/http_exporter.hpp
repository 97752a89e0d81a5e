#pragma once
// http_exporter: a small HTTP/1.1 server (Boost.Beast) for /metrics and friends, running on
// the host's executor (the cache server's one I/O thread): no thread of its own.
//
//   telemetry::http_exporter http(executor, {.address = "127.0.0.1", .port = 9100});
//   http.route("/metrics", [&] { return http_response::metrics(registry); });
//   http.route("/healthz", [&] { return http_response::json(200, R"({"status":"serving"})"); });
//   auto port = http.start();      // result<std::uint16_t>: the bound port (0 asks for any)
//
// GET and HEAD only (405 otherwise), 404 for unknown paths, a query string is ignored.
// Requests are bounded (8 KiB of headers, no body), connections are closed after
// idle_timeout without a request and when more than max_connections are open, so a misbehaving
// scraper can neither exhaust memory nor hold the I/O thread: every read and write is async.
// Route handlers run on the executor and must be quick (they build a response string).
//
// Threading: start() and stop() on the executor's thread or before it runs; stop() closes
// the listener and every connection.

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

namespace kvtier::inline KVTIER_ABI_TAG::telemetry {

struct http_response {
  unsigned status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;

  /// The Prometheus exposition of `reg`.
  [[nodiscard]] static http_response metrics(const registry& reg) {
    return {200, std::string(prometheus_content_type), prometheus_text(reg)};
  }
  [[nodiscard]] static http_response json(unsigned status, std::string body) {
    return {status, "application/json", std::move(body)};
  }
};

struct http_exporter_options {
  std::string address = "127.0.0.1";  ///< loopback by default: metrics are not for the world
  std::uint16_t port = 0;              ///< 0: any free port (start() returns it)
  std::size_t max_connections = 64;
  std::chrono::nanoseconds idle_timeout = std::chrono::seconds(30);
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
    for (auto* s : connections_) s->close();
  }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  [[nodiscard]] std::size_t open_connections() const noexcept { return connections_.size(); }
  [[nodiscard]] std::uint64_t requests_served() const noexcept { return served_; }

 private:
  using tcp = boost::asio::ip::tcp;

  boost::asio::awaitable<void> accept_loop() {
    while (running_) {
      auto [ec, socket] = co_await acceptor_.async_accept(boost::asio::as_tuple(boost::asio::use_awaitable));
      if (ec) {
        if (!running_ || ec == boost::asio::error::operation_aborted) co_return;
        continue;  // EMFILE and friends: keep serving the connections we have
      }
      if (connections_.size() >= options_.max_connections) {
        error_code ignored;
        socket.close(ignored);
        continue;
      }
      boost::asio::co_spawn(executor_, serve(boost::beast::tcp_stream(std::move(socket))), boost::asio::detached);
    }
  }

  boost::asio::awaitable<void> serve(boost::beast::tcp_stream stream) {
    namespace http = boost::beast::http;
    connections_.push_back(&stream);
    const auto self = std::prev(connections_.end());
    boost::beast::flat_buffer buffer(8192);
    for (;;) {
      http::request_parser<http::empty_body> parser;
      parser.header_limit(8192);
      parser.body_limit(0);
      stream.expires_after(options_.idle_timeout);
      auto [rec, n] = co_await http::async_read(stream, buffer, parser, boost::asio::as_tuple(boost::asio::use_awaitable));
      if (rec) break;  // EOF, timeout, malformed or oversized request: close
      const auto& req = parser.get();
      http::response<http::string_body> res;
      res.version(req.version());
      res.keep_alive(req.keep_alive());
      res.set(http::field::server, "kvtier");
      if (req.method() != http::verb::get && req.method() != http::verb::head) {
        res.result(http::status::method_not_allowed);
        res.set(http::field::allow, "GET, HEAD");
        res.set(http::field::content_type, "text/plain; charset=utf-8");
        res.body() = "method not allowed\n";
      } else {
        std::string_view target = req.target();
        if (auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
        auto it = routes_.find(std::string(target));
        http_response r = it == routes_.end() ? http_response{404, "text/plain; charset=utf-8", "not found\n"}
                                              : it->second();
        res.result(r.status);
        res.set(http::field::content_type, r.content_type);
        res.body() = std::move(r.body);
      }
      res.prepare_payload();
      if (req.method() == http::verb::head) res.body().clear();  // Content-Length stays that of GET
      ++served_;
      stream.expires_after(options_.idle_timeout);
      auto [wec, m] = co_await http::async_write(stream, res, boost::asio::as_tuple(boost::asio::use_awaitable));
      if (wec || !res.keep_alive()) break;
    }
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
    connections_.erase(self);
  }

  executor_type executor_;
  http_exporter_options options_;
  tcp::acceptor acceptor_;
  std::map<std::string, route_handler> routes_;
  std::list<boost::beast::tcp_stream*> connections_;
  std::uint16_t port_ = 0;
  bool running_ = false;
  std::uint64_t served_ = 0;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::telemetry
