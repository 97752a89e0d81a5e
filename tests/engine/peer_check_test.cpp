// The connector checks who listens on the socket before it sends anything: a server that
// runs as another user (a local user who listened on the path first) is refused before the
// KV region's memfd could travel, with a clear last_error(), an unhealthy reason and a
// counter; a server run by the uid the connector is told to expect (a service account) is
// accepted. The other user is played by a forked child that drops to `nobody` and runs the
// scripted fake server (tests/engine/fake_server.hpp).
#include <kvtier/engine/connector.hpp>

#include <catch2/catch.hpp>

#include "engine/connector_fixtures.hpp"
#include "support/other_user.hpp"

#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_peer_check_test {

using namespace kvtier;
using namespace std::chrono_literals;
namespace p = kvtier::protocol;
using kvtier::test::fake_server;
using kvtier::test::temp_dir;

namespace {

constexpr std::uint32_t ct = kvtier::test::connector_chunk_tokens;
const paged_kv_layout layout{{2, 2, 16, dtype_kind::fp16, attention_kind::mha}, 4, 32};

/// Bits of the fake server child's exit code: what reached it.
enum : int { got_any_request = 1, got_register = 2 };

/// A fake server run by `nobody` at `path` until `stop_fd` reads EOF; exits with the bits
/// above. Forked while the test process has one thread.
class fake_server_as_nobody {
 public:
  explicit fake_server_as_nobody(std::string path) : path_(std::move(path)) {
    int ctl[2];
    REQUIRE(::pipe(ctl) == 0);
    const int read_end = ctl[0];
    const std::string sock = path_;
    child_.emplace(kvtier::test::nobody(), [read_end, sock, write_end = ctl[1]] {
      ::close(write_end);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      fake_server srv(sock, ct);
      srv.start();
      char c = 0;
      while (::read(read_end, &c, 1) > 0) {
      }
      const int bits = (srv.received(p::message_type::get_chunk_size_request) > 0 ? got_any_request : 0) |
                       (srv.received(p::message_type::register_kv_request) > 0 ? got_register : 0);
      srv.stop();
      return bits;
    });
    ::close(read_end);
    stop_fd_ = ctl[1];
  }
  ~fake_server_as_nobody() {
    if (stop_fd_ >= 0) ::close(stop_fd_);
  }

  /// Waits until the socket exists (the child listens).
  void wait_listening() const {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!std::filesystem::exists(path_)) {
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(2ms);
    }
  }

  /// Stops the child and returns what reached it.
  int finish() {
    ::close(std::exchange(stop_fd_, -1));
    auto rc = child_->wait(60s);
    REQUIRE(rc.has_value());
    return *rc;
  }

 private:
  std::string path_;
  std::optional<kvtier::test::process_as> child_;
  int stop_fd_ = -1;
};

/// A directory `nobody` may create its socket in.
std::string socket_dir_for_nobody(const temp_dir& dir) {
  const auto d = dir.path() / "other";
  std::filesystem::create_directory(d);
  kvtier::test::give_to(d, kvtier::test::nobody());
  ::chmod(dir.path().c_str(), 0711);
  return d.string();
}

/// The fake server run by `nobody`, listening on a socket in a directory of its own.
struct nobody_server {
  temp_dir dir{"kvtier-peer"};
  std::string path = socket_dir_for_nobody(dir) + "/kvtier.sock";
  fake_server_as_nobody fake{path};

  nobody_server() { fake.wait_listening(); }
};

/// Whether this process can play a second user (root); says so when not.
bool can_play_other_user() {
  if (kvtier::test::can_play_other_user()) return true;
  WARN("not root: cannot play a second user");
  return false;
}

}  // namespace

TEST_CASE("the connector refuses a server run by another user before it sends its KV region",
          "[engine][connector][peer]") {
  if (!can_play_other_user()) return;
  nobody_server srv;
  {
    kvtier::test::recording_bus b;
    auto region = kv_region::create(layout);
    REQUIRE(region.has_value());
    engine::connector<kvtier::test::connector_test_bus> c(kvtier::test::connector_test_options(srv.path), *region,
                                                          b.bus);
    CHECK_FALSE(c.wait_ready(1s));
    // Several attempts (reconnect backoff): each refused the same way.
    REQUIRE(b.rec.wait([](const kvtier::test::event_recorder::record& r) { return !r.unhealthy.empty(); }));
    const auto first = b.rec.snapshot().unhealthy.front();
    CHECK(first.reason.view() == "peer_refused");
    const std::string why = c.last_error();
    INFO(why);
    CHECK_THAT(why, Catch::Contains(srv.path) && Catch::Contains("uid " + std::to_string(kvtier::test::nobody().uid)) &&
                        Catch::Contains("server_uid"));
    CHECK_FALSE(c.healthy());
    CHECK(b.reg.value("kvtier_connector_peer_refusals_total").value_or(0) >= 1);
  }
  CHECK(srv.fake.finish() == 0);  // not a byte reached the impostor, let alone the memfd
}

TEST_CASE("the connector accepts a server run by the uid it is told to expect", "[engine][connector][peer]") {
  if (!can_play_other_user()) return;
  nobody_server srv;
  {
    auto region = kv_region::create(layout);
    REQUIRE(region.has_value());
    auto o = kvtier::test::connector_test_options(srv.path);
    o.server_uid = kvtier::test::nobody().uid;  // the server's service account
    engine::connector<bus::null_bus> c(o, *region);
    CHECK(c.wait_ready(30s));
    CHECK(c.healthy());
  }
  CHECK(srv.fake.finish() == (got_any_request | got_register));
}

}  // namespace file_peer_check_test
