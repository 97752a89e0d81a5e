// No polling on the wire (issue 16): the server answers query_prefetch when the lookup's
// prefetch is decided, not `pending` at once, and keeps answering the connection's other
// requests meanwhile (the answers carry their call ids). The L2 backend here holds every
// lookup until the test lets it go, so the prefetch stays undecided exactly as long as the
// test says: no timing.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <boost/asio/post.hpp>

#include <future>
#include <mutex>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

/// An L2 backend whose lookups complete (finding nothing) only when release() is called.
/// Runs on the server's I/O thread; release() posts there.
class held_lookup_backend {
 public:
  using executor_type = boost::asio::any_io_executor;
  using lookup_handler = boost::asio::any_completion_handler<void(error_code, bitmap)>;

  explicit held_lookup_backend(executor_type ex) : ex_(std::move(ex)) {}

  [[nodiscard]] std::string_view name() const { return "held"; }
  [[nodiscard]] executor_type get_executor() const { return ex_; }
  [[nodiscard]] l2::usage_info usage() const { return {}; }
  [[nodiscard]] l2::health_info health() const { return {}; }
  void unpin(std::span<const chunk_key>) {}

  template <class Token>
  auto async_lookup_and_pin(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, bitmap)>(
        [this, n = keys.size()](auto handler) {
          held_.emplace_back(lookup_handler(std::move(handler)), n);
          if (on_held_) on_held_();
        },
        token);
  }
  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>>, l2::deadline, Token&& token) {
    return done(keys.size(), std::forward<Token>(token));
  }
  template <class Token>
  auto async_store(std::span<const chunk_key> keys, std::span<const std::span<const std::byte>>, l2::deadline,
                   Token&& token) {
    return done(keys.size(), std::forward<Token>(token));
  }
  template <class Token>
  auto async_remove(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return done(keys.size(), std::forward<Token>(token));
  }

  /// Calls f (on the I/O thread) once a lookup is held.
  void when_held(std::function<void()> f) {
    boost::asio::post(ex_, [this, f = std::move(f)] {
      if (!held_.empty())
        f();
      else
        on_held_ = f;
    });
  }
  /// Completes every held lookup (found nothing).
  void release() {
    boost::asio::post(ex_, [this] {
      auto held = std::move(held_);
      held_.clear();
      for (auto& [h, n] : held) std::move(h)(error_code{}, bitmap(n));
    });
  }

 private:
  template <class Token>
  auto done(std::size_t n, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, l2::batch_result)>(
        [this, n](auto handler) {
          boost::asio::post(ex_, [h = std::move(handler), n]() mutable {
            std::move(h)(error_code{}, l2::batch_result(n, l2::key_outcome::ok));
          });
        },
        token);
  }

  executor_type ex_;
  std::vector<std::pair<lookup_handler, std::size_t>> held_;
  std::function<void()> on_held_;
};

}  // namespace

TEST_CASE("query_prefetch is answered when the prefetch is decided, and the connection is served meanwhile",
          "[server]") {
  std::shared_ptr<held_lookup_backend> backend;
  running_server s(
      [](server::server_config& cfg) {
        cfg.l2_backends = {json{{"type", "held"}}};
        cfg.prefetch_policy = server::prefetch_wait_kind::wait_complete;
      },
      {}, factory_with("held", backend));

  {
    raw_client c(s.path());
    engine_region r;
    const auto reg = c.register_region(r);
    const auto hashes = chunk_hashes(31, 3);
    c.ok(p::lookup_request{"req-1", reg.model_id, 1, hashes});
    std::promise<void> held;
    backend->when_held([&] { held.set_value(); });
    REQUIRE(held.get_future().wait_for(server_deadline) == std::future_status::ready);

    // The query of the undecided lookup is not answered `pending`: a ping sent after it is
    // answered first (call() checks that the reply is the ping's).
    constexpr std::uint64_t query_call = 1'000'000;
    REQUIRE_FALSE(c.send(query_call, p::query_prefetch_request{"req-1"}));
    CHECK(c.ping() == s.srv->boot_token());
    CHECK(c.ok(p::get_chunk_size_request{}).chunk_tokens == test_chunk_tokens);

    backend->release();  // decided now: nothing in L2
    auto [ec, frame] = c.read_frame();
    REQUIRE_FALSE(ec);
    CHECK(frame.header.call_id == query_call);
    auto m = p::decode_message(frame);
    REQUIRE(m.has_value());
    REQUIRE(std::holds_alternative<p::query_prefetch_response>(*m));
    const auto& q = std::get<p::query_prefetch_response>(*m);
    CHECK(q.state == p::prefetch_state::done);
    CHECK(q.hit_chunks == 0);
    // Decided: later queries answer at once.
    CHECK(c.ok(p::query_prefetch_request{"req-1"}) == q);
  }
}
