// The server's shutdown sequence (server/impl/server_shutdown.hpp) with a retrieve whose copy
// waits for an L2 load when the shutdown begins. The L2 backend holds its loads until the
// test completes them (tests/cache/gated_backend.hpp), so the load is in flight exactly as
// long as the test says: no timing.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "cache/gated_backend.hpp"
#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <boost/asio/post.hpp>

#include <condition_variable>
#include <future>
#include <mutex>
#include <stdexcept>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

/// Runs f() on the server's I/O thread (where the backend lives) and returns its result.
template <class F>
bool on_server_thread(server::server& srv, F f) {
  std::promise<bool> done;
  asio::post(srv.io_context(), [&] { done.set_value(f()); });
  auto fut = done.get_future();
  if (fut.wait_for(server_deadline) != std::future_status::ready)
    throw std::runtime_error("the server's I/O thread did not run the task");
  return fut.get();
}

}  // namespace

TEST_CASE("a shutdown closes a connection whose retrieve waits for an L2 load without waiting for the load",
          "[server]") {
  // Nothing reads what a prefetch loads once every connection is closing, so the shutdown
  // stops the prefetches at once: the copy that waits for a load ends, and so does its
  // connection. Before, it waited for the load to land, or for the cache to stop after the
  // whole session wait and shutdown_timeout.
  std::shared_ptr<gated_backend> backend;
  std::mutex m;
  std::condition_variable cv;
  bool armed = false, copying = false;
  server::server_options opts;
  opts.hooks.during_copy = [&](std::uint64_t) {
    std::lock_guard g(m);
    if (!armed) return;
    copying = true;
    cv.notify_all();
  };
  running_server s(
      [](server::server_config& cfg) {
        cfg.l2_backends = {json{{"type", "gated"}}};
        // Neither the lookup's wait budget nor the shutdown's wait for L2 work ends the
        // load's wait during the test: only the shutdown's own steps can.
        cfg.prefetch_policy = server::prefetch_wait_kind::wait_complete;
        cfg.prefetch_timeout_cap_ms = 3'600'000;
        cfg.shutdown_timeout_s = 3600;
      },
      std::move(opts), factory_with("gated", backend));
  server::server& srv = *s.srv;
  // At the end (or a failure), the load ends: the shutdown, which waits for the backend
  // operation, then finishes and running_server joins it.
  struct complete_at_exit {
    server::server& srv;
    std::shared_ptr<gated_backend>& backend;
    ~complete_at_exit() {
      asio::post(srv.io_context(), [b = backend] {
        if (b && b->loading()) b->complete();
      });
    }
  } guard{srv, backend};

  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(91, 2);
  // Chunk 0 in L1; chunk 1 only in L2, where its load waits for the test.
  const auto src = block_range(0, blocks_per_chunk);
  r.fill_blocks(src, 3);
  REQUIRE(c.ok(store_req(r, {hashes[0]}, src)).stored == 1);
  REQUIRE(on_server_thread(srv, [&] {
    backend->put(chunk_key{reg.model_id, 1, 0, hashes[1]}, std::vector<std::byte>(4096, std::byte{7}));
    return true;
  }));
  const auto q = lookup_done(c, reg.model_id, hashes);  // decided: chunk 0 held, chunk 1 loading
  REQUIRE(q.hit_chunks == 2);
  REQUIRE(on_server_thread(srv, [&] { return backend->loading(); }));

  // The retrieve copies chunk 0, then waits for chunk 1's load.
  {
    std::lock_guard g(m);
    armed = true;
  }
  REQUIRE_FALSE(c.send(77, retrieve_req(hashes, block_range(20, 2 * blocks_per_chunk))));
  {
    std::unique_lock g(m);
    REQUIRE(cv.wait_for(g, server_deadline, [&] { return copying; }));
  }

  program::stop_server(srv);  // the shutdown begins (running_server joins it at the end)
  bool closed = false;
  try {
    closed = closed_or_reset(c);  // the retrieve is not answered: its connection closed
  } catch (const std::runtime_error&) {
    // nothing within the deadline: still waiting for the load
  }
  CHECK(closed);
  CHECK(on_server_thread(srv, [&] { return backend->loading(); }));  // closed before the load ended
}
