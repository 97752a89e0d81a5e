#include <kvtier/protocol/unix_socket.hpp>

#include <catch2/catch.hpp>

#include "support/asio.hpp"
#include "support/process.hpp"

#include <kvtier/protocol/connection.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

using namespace kvtier;
namespace p = kvtier::protocol;
namespace asio = boost::asio;
using kvtier::test::run_sync;
using kvtier::test::temp_dir;

namespace {

::mode_t mode_of(const std::string& path) {
  struct ::stat st{};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  return st.st_mode;
}

/// Leaves a socket file nobody listens on: bound, then closed without unlinking (what a
/// crashed server leaves behind).
void make_stale_socket(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  REQUIRE(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  ::close(fd);
}

}  // namespace

TEST_CASE("the listening socket is created with mode 0600 and accepts a client", "[protocol][unix_socket]") {
  temp_dir dir("kvtier-proto");
  const std::string path = (dir.path() / "server.sock").string();
  asio::io_context io;
  const ::mode_t old_umask = ::umask(0);  // a permissive umask must not widen the mode
  auto acceptor = p::listen_unix(io.get_executor(), path);
  ::umask(old_umask);
  REQUIRE(acceptor.has_value());
  CHECK(S_ISSOCK(mode_of(path)));
  CHECK((mode_of(path) & 0777) == 0600);

  run_sync(io, [&]() -> asio::awaitable<void> {
    auto [cec, client_socket] =
        co_await p::async_connect_unix(io.get_executor(), path, asio::as_tuple(asio::use_awaitable));
    REQUIRE_FALSE(cec);
    auto server_socket = co_await acceptor->async_accept(asio::use_awaitable);
    p::connection client(std::move(client_socket));
    p::connection server(std::move(server_socket));
    co_await client.async_send(1, p::ping_request{3}, asio::use_awaitable);
    p::frame f = co_await server.async_read_frame(asio::use_awaitable);
    CHECK(f.header.type == p::message_type::ping_request);
  }());

  auto sync_client = p::connect_unix(io.get_executor(), path);
  CHECK(sync_client.has_value());
}

TEST_CASE("listen_unix refuses to replace a live socket or a file that is not a socket", "[protocol][unix_socket]") {
  temp_dir dir("kvtier-proto");
  const std::string path = (dir.path() / "server.sock").string();
  asio::io_context io;
  auto first = p::listen_unix(io.get_executor(), path);
  REQUIRE(first.has_value());
  auto second = p::listen_unix(io.get_executor(), path);
  REQUIRE_FALSE(second.has_value());
  CHECK(second.error() == asio::error::address_in_use);
  // The live server still accepts connections: nothing was unlinked.
  CHECK(p::connect_unix(io.get_executor(), path).has_value());

  const std::string file = (dir.path() / "not-a-socket").string();
  std::ofstream(file) << "keep me";
  auto refused = p::listen_unix(io.get_executor(), file);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error() == boost::system::errc::file_exists);
  std::ifstream in(file);
  std::string kept;
  std::getline(in, kept);
  CHECK(kept == "keep me");
}

TEST_CASE("listen_unix replaces a stale socket file", "[protocol][unix_socket]") {
  temp_dir dir("kvtier-proto");
  const std::string path = (dir.path() / "server.sock").string();
  make_stale_socket(path);
  asio::io_context io;
  REQUIRE_FALSE(p::connect_unix(io.get_executor(), path).has_value());  // stale: refused
  auto acceptor = p::listen_unix(io.get_executor(), path);
  REQUIRE(acceptor.has_value());
  CHECK((mode_of(path) & 0777) == 0600);
  CHECK(p::connect_unix(io.get_executor(), path).has_value());
}

TEST_CASE("bad paths and absent servers are errors, not exceptions", "[protocol][unix_socket]") {
  temp_dir dir("kvtier-proto");
  asio::io_context io;
  const std::string too_long = (dir.path() / std::string(200, 'x')).string();
  auto l = p::listen_unix(io.get_executor(), too_long);
  REQUIRE_FALSE(l.has_value());
  CHECK(l.error() == errc::invalid_argument);
  auto empty = p::connect_unix(io.get_executor(), "");
  REQUIRE_FALSE(empty.has_value());
  CHECK(empty.error() == errc::invalid_argument);

  const std::string absent = (dir.path() / "nobody.sock").string();
  auto c = p::connect_unix(io.get_executor(), absent);
  REQUIRE_FALSE(c.has_value());
  CHECK(c.error() == boost::system::errc::no_such_file_or_directory);
  run_sync(io, [&]() -> asio::awaitable<void> {
    auto [ec, s] = co_await p::async_connect_unix(io.get_executor(), too_long, asio::as_tuple(asio::use_awaitable));
    CHECK(ec == errc::invalid_argument);
    auto [ec2, s2] = co_await p::async_connect_unix(io.get_executor(), absent, asio::as_tuple(asio::use_awaitable));
    CHECK(ec2 == boost::system::errc::no_such_file_or_directory);
  }());
}
