#include <kvtier/server/http_exporter.hpp>
#include <kvtier/telemetry/registry.hpp>

#include <catch2/catch.hpp>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <string>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_http_exporter_test {

using namespace kvtier;
using namespace kvtier::server;
using kvtier::telemetry::registry;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// The exporter on its own io_context thread; the test talks to it with blocking sockets.
struct fixture {
  asio::io_context io;
  registry reg;
  http_exporter http;
  std::uint16_t port = 0;
  std::thread runner;

  explicit fixture(http_exporter_options o = {}) : http(io.get_executor(), o) {
    reg.add_counter("kvtier_test_hits_total", "Hits").inc(7);
    http.route("/metrics", [this] { return http_response::metrics(reg); });
    http.route("/healthz", [] { return http_response::json(200, R"({"status":"serving"})"); });
    auto p = http.start();
    REQUIRE(p.has_value());
    port = *p;
    runner = std::thread([this] {
      auto guard = asio::make_work_guard(io);
      io.run();
    });
  }
  ~fixture() {
    asio::post(io, [this] {
      http.stop();
      io.stop();
    });
    runner.join();
  }

  // Sends raw bytes and reads until the server closes the connection.
  std::string exchange(const std::string& request) {
    asio::io_context client;
    tcp::socket s(client);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    asio::write(s, asio::buffer(request));
    std::string out;
    error_code ec;
    char buf[4096];
    for (;;) {
      const std::size_t n = s.read_some(asio::buffer(buf), ec);
      out.append(buf, n);
      if (ec) break;
    }
    return out;
  }
};

std::string get(const std::string& path, const std::string& extra = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + "\r\n";
}

}  // namespace

TEST_CASE("GET /metrics serves the exposition with the Prometheus content type", "[server][http]") {
  fixture f;
  const auto r = f.exchange(get("/metrics"));
  CHECK(r.starts_with("HTTP/1.1 200 OK\r\n"));
  CHECK(r.find("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n") != std::string::npos);
  CHECK(r.find("kvtier_test_hits_total 7\n") != std::string::npos);
  CHECK(f.exchange(get("/metrics?x=1")).find("kvtier_test_hits_total 7") != std::string::npos);
}

TEST_CASE("unknown paths are 404, other methods 405, HEAD has no body", "[server][http]") {
  fixture f;
  CHECK(f.exchange(get("/nope")).starts_with("HTTP/1.1 404 Not Found"));
  const auto post = f.exchange("POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
  CHECK(post.starts_with("HTTP/1.1 405"));
  CHECK(post.find("Allow: GET, HEAD") != std::string::npos);
  const auto head = f.exchange("HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  CHECK(head.starts_with("HTTP/1.1 200"));
  CHECK(head.find("serving") == std::string::npos);
  const auto health = f.exchange(get("/healthz"));
  CHECK(health.find("application/json") != std::string::npos);
  CHECK(health.find(R"({"status":"serving"})") != std::string::npos);
}

TEST_CASE("a keep-alive connection serves several requests", "[server][http]") {
  fixture f;
  const std::string two = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  const auto r = f.exchange(two);
  std::size_t count = 0;
  for (std::size_t at = 0; (at = r.find("HTTP/1.1 200", at)) != std::string::npos; ++at) ++count;
  CHECK(count == 2);
}

TEST_CASE("malformed and oversized requests close that connection only", "[server][http]") {
  fixture f;
  const auto garbage = f.exchange("\x01\x02 not http at all\r\n\r\n");
  CHECK(garbage.find("200") == std::string::npos);
  const auto huge = f.exchange(get("/metrics", "X-Big: " + std::string(20000, 'a') + "\r\n"));
  CHECK(huge.find("200 OK") == std::string::npos);
  CHECK(f.exchange(get("/metrics")).starts_with("HTTP/1.1 200 OK"));  // still serving
}

namespace {

tcp::socket connect_to(asio::io_context& client, std::uint16_t port) {
  tcp::socket s(client);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  return s;
}

/// Waits (bounded) until pred() holds: the server counts a close just after the client sees it
/// (Beast closes the socket the moment a deadline passes, the coroutine resumes later).
template <class Pred>
bool eventually(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// Blocks until the server closes `s`; true when it did (EOF or reset) without sending a byte.
bool closed_silently(tcp::socket& s) {
  char c;
  error_code ec;
  const std::size_t n = s.read_some(asio::buffer(&c, 1), ec);
  return n == 0 && (ec == asio::error::eof || ec == asio::error::connection_reset);
}

}  // namespace

TEST_CASE("a new connection that sends no request is closed after the header timeout", "[server][http]") {
  http_exporter_options o;
  o.header_timeout = std::chrono::milliseconds(100);
  fixture f(o);
  asio::io_context client;
  tcp::socket s = connect_to(client, f.port);
  CHECK(closed_silently(s));  // blocks until the server closes
  CHECK(eventually([&] { return f.http.stats().header_timeouts == 1; }));
}

TEST_CASE("a request header trickled byte by byte is cut off at the header timeout", "[server][http]") {
  http_exporter_options o;
  o.header_timeout = std::chrono::milliseconds(300);
  fixture f(o);
  asio::io_context client;
  tcp::socket s = connect_to(client, f.port);
  const std::string header = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(1000, 'a');
  error_code ec;
  std::size_t sent = 0;
  // One byte every 10 ms would take 10 s; the server closes at 0.3 s.
  while (sent < header.size()) {
    asio::write(s, asio::buffer(header.data() + sent, 1), ec);
    if (ec) break;
    ++sent;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(sent < header.size());  // the write failed: the server had closed
  CHECK(eventually([&] { return f.http.stats().header_timeouts == 1; }));
  CHECK(f.http.stats().requests == 0);
}

TEST_CASE("a kept-alive connection is closed after the idle timeout", "[server][http]") {
  http_exporter_options o;
  o.idle_timeout = std::chrono::milliseconds(100);
  fixture f(o);
  asio::io_context client;
  tcp::socket s = connect_to(client, f.port);
  asio::write(s, asio::buffer(std::string("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")));
  std::string got;
  char buf[4096];
  error_code ec;
  for (;;) {  // the answer, then EOF after the idle timeout
    const std::size_t n = s.read_some(asio::buffer(buf), ec);
    got.append(buf, n);
    if (ec) break;
  }
  CHECK(got.starts_with("HTTP/1.1 200"));
  CHECK(ec == asio::error::eof);
  CHECK(eventually([&] { return f.http.stats().idle_timeouts == 1; }));
}

TEST_CASE("at the connection cap the connection idle longest makes room for a new one", "[server][http]") {
  http_exporter_options o;
  o.max_connections = 2;
  fixture f(o);
  asio::io_context client;
  tcp::socket oldest = connect_to(client, f.port);
  tcp::socket slow = connect_to(client, f.port);
  asio::write(slow, asio::buffer(std::string("GET /metrics HTTP/1.1\r\nX-Slow: ")));  // a header begun
  // Both are open: a probe still gets in, and the idle one (no byte of a request) goes first.
  const auto r = f.exchange(get("/metrics"));
  CHECK(r.starts_with("HTTP/1.1 200 OK"));
  CHECK(closed_silently(oldest));
  // With no idle connection left, the one that has waited longest for its header goes.
  tcp::socket slower = connect_to(client, f.port);
  asio::write(slower, asio::buffer(std::string("GET /metrics HTTP/1.1\r\nX-Slow: ")));
  CHECK(f.exchange(get("/healthz")).starts_with("HTTP/1.1 200 OK"));
  CHECK(closed_silently(slow));
  CHECK(f.http.stats().dropped_at_cap == 2);
}

TEST_CASE("every method but GET and HEAD is 405, with or without a body", "[server][http]") {
  fixture f;
  const std::string big(200000, 'x');
  for (const std::string& req : std::vector<std::string>{
           std::string("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"),
           "PUT /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(big.size()) + "\r\n\r\n" + big,
           std::string(
               "POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
           std::string("DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
           std::string("BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n"),
       }) {
    INFO(req.substr(0, 40));
    const auto r = f.exchange(req);  // the server answers and closes
    CHECK(r.starts_with("HTTP/1.1 405"));
    CHECK(r.find("Allow: GET, HEAD") != std::string::npos);
  }
  CHECK(f.exchange(get("/metrics")).starts_with("HTTP/1.1 200 OK"));
}

TEST_CASE("binding a bad address is a clear error", "[server][http]") {
  asio::io_context io;
  http_exporter_options o;
  o.address = "not-an-address";
  http_exporter h(io.get_executor(), o);
  auto r = h.start();
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error() == errc::invalid_config);
}

}  // namespace file_http_exporter_test
