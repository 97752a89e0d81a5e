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

#include <cstdlib>
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

TEST_CASE("peer_credentials names the process at the other end of a Unix socket", "[protocol][unix_socket][peer]") {
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  auto who = p::peer_credentials(fds[0]);
  ::close(fds[0]);
  ::close(fds[1]);
  REQUIRE(who.has_value());
  CHECK(who->pid == ::getpid());
  CHECK(who->uid == ::geteuid());
  CHECK(who->gid == ::getegid());
  CHECK(who->describe() == "uid " + std::to_string(::geteuid()) + " (pid " + std::to_string(::getpid()) + ")");
  CHECK_FALSE(p::peer_credentials(-1).has_value());  // not a socket: an error, not garbage
}

TEST_CASE("a peer_policy serves its own uid, root and the uids and groups it names", "[protocol][unix_socket][peer]") {
  const ::uid_t me = ::geteuid();
  const ::uid_t other = me == 4242 ? 4343 : 4242;
  p::peer_policy own;
  CHECK(own.allows({1, me, 7, {}}));
  CHECK(own.allows({1, 0, 0, {}}));
  CHECK_FALSE(own.allows({1, other, 7, {}}));
  p::peer_policy shared{{other}, {900}};
  CHECK(shared.allows({1, other, 7, {}}));
  CHECK_FALSE(shared.allows({1, other + 1, 7, {}}));
  CHECK(shared.allows({1, other + 1, 900, {}}));      // primary group
  CHECK(shared.allows({1, other + 1, 7, {5, 900}}));  // supplementary group
  CHECK_FALSE(shared.allows({1, other + 1, 7, {5, 901}}));
}

TEST_CASE("the default socket directory follows XDG_RUNTIME_DIR, root and TMPDIR", "[protocol][unix_socket][peer]") {
  const char* old_xdg = std::getenv("XDG_RUNTIME_DIR");
  const std::string saved = old_xdg ? old_xdg : "";
  ::setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
  CHECK(p::default_socket_directory() == "/run/user/1000/kvtier");
  CHECK(p::default_socket_path() == "/run/user/1000/kvtier/kvtier.sock");
  ::unsetenv("XDG_RUNTIME_DIR");
  if (::geteuid() == 0)
    CHECK(p::default_socket_directory() == "/run/kvtier");
  else
    CHECK(p::default_socket_directory().ends_with("/kvtier-" + std::to_string(::geteuid())));
  if (old_xdg) ::setenv("XDG_RUNTIME_DIR", saved.c_str(), 1);
}

TEST_CASE("prepare_private_directory creates 0700 whatever the umask and refuses what others could use",
          "[protocol][unix_socket][peer]") {
  temp_dir dir("kvtier-proto");
  const std::string d = (dir.path() / "kvtier").string();
  const ::mode_t old_umask = ::umask(0);
  CHECK(p::prepare_private_directory(d).empty());
  ::umask(old_umask);
  CHECK((mode_of(d) & 07777) == 0700);
  CHECK(p::prepare_private_directory(d).empty());  // again: already there, ours
  ::chmod(d.c_str(), 0775);
  CHECK_THAT(p::prepare_private_directory(d), Catch::Contains("has mode 0775") && Catch::Contains("chmod 700"));
  ::chmod(d.c_str(), 0755);  // readable by others is fine: the socket file itself is 0600
  CHECK(p::prepare_private_directory(d).empty());
  const std::string link = (dir.path() / "link").string();
  REQUIRE(::symlink(d.c_str(), link.c_str()) == 0);
  CHECK_THAT(p::prepare_private_directory(link), Catch::Contains("is not a directory"));
  if (::geteuid() == 0) {
    REQUIRE(::chown(d.c_str(), 65534, 65534) == 0);
    CHECK_THAT(p::prepare_private_directory(d), Catch::Contains("is owned by uid 65534"));
  }
  CHECK_THAT(p::prepare_private_directory((dir.path() / "no" / "parent").string()),
             Catch::Contains("cannot create the socket directory"));
}
