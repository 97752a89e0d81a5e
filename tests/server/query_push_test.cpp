// No polling on the wire (issue 16): the server answers query_prefetch when the lookup's
// prefetch is decided, not `pending` at once, and keeps answering the connection's other
// requests meanwhile (the answers carry their call ids). The L2 backend here holds every
// lookup until the test lets it go, so the prefetch stays undecided exactly as long as the
// test says: no timing. A lookup may ask for the same: its own answer then waits for the
// decision (one round trip), or goes out `unknown` at once when the lookup is released first.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"
#include "support/stub_backend.hpp"

#include <boost/asio/post.hpp>

#include <future>
#include <mutex>
#include <optional>
#include <utility>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

/// An L2 backend whose lookups complete (finding nothing: it holds no object) only when
/// release_lookups() is called: the test stub holding its lookups. Runs on the server's I/O
/// thread; release_lookups() posts there.
class held_lookup_backend : public stub_backend {
 public:
  explicit held_lookup_backend(executor_type ex)
      : stub_backend(std::move(ex), {.name = "held", .hold_lookups = true}) {}
};

/// A server whose L2 backend is a held_lookup_backend (running_server), and a client
/// registered with it (a region of its own).
struct held_server {
  std::shared_ptr<held_lookup_backend> backend;
  running_server server{[](server::server_config& c) {
                          c.l2_backends = {json{{"type", "held"}}};
                          c.prefetch_policy = server::prefetch_wait_kind::wait_complete;
                        },
                        {}, factory_with("held", backend)};
  server::server& srv = *server.srv;
  std::optional<raw_client> client;
  engine_region region;
  p::register_kv_response reg;

  held_server() {
    client.emplace(server.path());
    reg = client->register_region(region);
  }
  ~held_server() { client.reset(); }

  /// Waits until `n` lookups have reached the backend (the last one's prefetch is undecided
  /// until release_lookups()).
  bool wait_held(std::size_t n = 1) {
    std::promise<void> held;
    backend->when_lookups_held(n, [&] { held.set_value(); });
    return held.get_future().wait_for(server_deadline) == std::future_status::ready;
  }
};

/// The next frame of `c`, decoded; its call id in `call_id`.
p::message next_message(raw_client& c, std::uint64_t& call_id) {
  auto [ec, frame] = c.read_frame();
  REQUIRE_FALSE(ec);
  call_id = frame.header.call_id;
  auto m = p::decode_message(frame);
  REQUIRE(m.has_value());
  return std::move(*m);
}

}  // namespace

TEST_CASE("query_prefetch is answered when the prefetch is decided, and the connection is served meanwhile",
          "[server]") {
  held_server s;
  raw_client& c = *s.client;
  const auto& reg = s.reg;
  const auto hashes = chunk_hashes(31, 3);
  // A lookup that does not ask to wait is answered at once: pending.
  CHECK(c.ok(p::lookup_request{"req-1", reg.model_id, 1, hashes}).state == p::prefetch_state::pending);
  REQUIRE(s.wait_held());

  // The query of the undecided lookup is not answered `pending`: a ping sent after it is
  // answered first (call() checks that the reply is the ping's).
  constexpr std::uint64_t query_call = 1'000'000;
  REQUIRE_FALSE(c.send(query_call, p::query_prefetch_request{"req-1"}));
  CHECK(c.ping() == s.srv.boot_token());
  CHECK(c.ok(p::get_chunk_size_request{}).chunk_tokens == test_chunk_tokens);

  s.backend->release_lookups();  // decided now: nothing in L2
  std::uint64_t call = 0;
  const auto m = next_message(c, call);
  CHECK(call == query_call);
  REQUIRE(std::holds_alternative<p::query_prefetch_response>(m));
  const auto& q = std::get<p::query_prefetch_response>(m);
  CHECK(q.state == p::prefetch_state::done);
  CHECK(q.hit_chunks == 0);
  // Decided: later queries answer at once.
  CHECK(c.ok(p::query_prefetch_request{"req-1"}) == q);
}

TEST_CASE("a lookup that asks to be answered when decided costs one round trip, or is answered unknown when released",
          "[server]") {
  held_server s;
  raw_client& c = *s.client;
  const auto& reg = s.reg;
  constexpr std::uint64_t lookup_call = 1'000'000;
  REQUIRE_FALSE(c.send(lookup_call, p::lookup_request{"req-1", reg.model_id, 1, chunk_hashes(31, 3), "", true}));
  REQUIRE(s.wait_held());
  CHECK(c.ping() == s.srv.boot_token());  // undecided: no answer yet, the connection is served
  std::uint64_t call = 0;

  SECTION("decided: the answer carries the counts") {
    s.backend->release_lookups();
    const auto m = next_message(c, call);
    CHECK(call == lookup_call);
    REQUIRE(std::holds_alternative<p::lookup_response>(m));
    CHECK(std::get<p::lookup_response>(m) == p::lookup_response{p::prefetch_state::done, 0, 0});
    CHECK(c.ok(p::query_prefetch_request{"req-1"}).state == p::prefetch_state::done);
  }
  SECTION("ended first: the held answer goes out at once, unknown, before the end_request's") {
    REQUIRE_FALSE(c.send(lookup_call + 1, p::end_request_request{"req-1"}));
    auto m = next_message(c, call);
    CHECK(call == lookup_call);
    REQUIRE(std::holds_alternative<p::lookup_response>(m));
    CHECK(std::get<p::lookup_response>(m).state == p::prefetch_state::unknown);
    m = next_message(c, call);
    CHECK(call == lookup_call + 1);
    CHECK(std::holds_alternative<p::end_request_response>(m));
    s.backend->release_lookups();
    CHECK(c.ping() == s.srv.boot_token());  // nothing else was sent for the lookup
  }
  SECTION("replaced: the old lookup's answer is unknown, the new one's is its own") {
    REQUIRE_FALSE(c.send(lookup_call + 1, p::lookup_request{"req-1", reg.model_id, 1, chunk_hashes(31, 2), "", true}));
    auto m = next_message(c, call);
    CHECK(call == lookup_call);
    CHECK(std::get<p::lookup_response>(m).state == p::prefetch_state::unknown);
    REQUIRE(s.wait_held(2));
    s.backend->release_lookups();
    m = next_message(c, call);
    CHECK(call == lookup_call + 1);
    CHECK(std::get<p::lookup_response>(m) == p::lookup_response{p::prefetch_state::done, 0, 0});
  }
}

// Found by the soak (bench/soak, a server SIGSTOPped: the engines' lookups timed out and their
// connections closed with the answers still held): a held answer dropped with its connection
// must still end its request, or kvtier_server_requests_in_flight{type="lookup"} stays up
// for ever.
TEST_CASE("a connection closed with a lookup answer held leaves no request in flight", "[server]") {
  held_server s;
  const auto model = s.reg.model_id;
  REQUIRE_FALSE(s.client->send(1'000'000, p::lookup_request{"req-1", model, 1, chunk_hashes(31, 3), "", true}));
  REQUIRE(s.wait_held());
  const auto lookups_in_flight = [&] {
    return metric_value(s.srv.metrics_text(), R"(kvtier_server_requests_in_flight{type="lookup"})").value_or(-1);
  };
  CHECK(lookups_in_flight() == 1);
  s.client.reset();  // the engine gives up and closes its connection

  raw_client other(s.server.path());
  wait_for_status(other, [](const json& j) { return j["connections"] == 1; });  // the old session was reaped
  CHECK(lookups_in_flight() == 0);
  CHECK(other.status()["held"]["requests_in_flight"] == 0);
  s.backend->release_lookups();
  CHECK(other.ping() == s.srv.boot_token());
}
