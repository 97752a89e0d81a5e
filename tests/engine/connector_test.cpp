#include <kvtier/engine/connector.hpp>

#include <catch2/catch.hpp>

#include "engine/connector_fixtures.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_connector_test {

using namespace kvtier;
using namespace std::chrono_literals;
namespace p = kvtier::protocol;
using engine::connector;
using engine::connector_options;
using kvtier::test::event_recorder;
using kvtier::test::fake_server;
using kvtier::test::temp_dir;
using test_bus = kvtier::test::connector_test_bus;
using ids = std::vector<std::string>;
using blocks = std::vector<std::uint32_t>;

namespace {

constexpr std::uint32_t ct = kvtier::test::connector_chunk_tokens;  // 2 blocks of 4
const paged_kv_layout layout{{2, 2, 16, dtype_kind::bf16, attention_kind::mha}, 4, 32};
using record = event_recorder::record;

kv_region make_region() {
  auto r = kv_region::create(layout);
  if (!r) throw std::runtime_error("kv_region::create failed");
  return std::move(*r);
}

std::vector<token_id> tokens(std::size_t n, token_id seed) {
  std::vector<token_id> t(n);
  std::iota(t.begin(), t.end(), seed * 1000);
  return t;
}

/// Every byte of `block` (all layers, K and V) set to v.
void fill_block(kv_region& r, std::uint32_t block, std::uint8_t v) {
  for (std::byte* layer : r.layers())
    for (std::uint32_t plane = 0; plane < layout.model.planes(); ++plane)
      std::memset(layer + layout.offset_in_layer(plane, block), v, layout.segment_bytes());
}

bool block_is(const kv_region& r, std::uint32_t block, std::uint8_t v) {
  for (std::byte* layer : r.layers())
    for (std::uint32_t plane = 0; plane < layout.model.planes(); ++plane) {
      const std::byte* s = layer + layout.offset_in_layer(plane, block);
      for (std::size_t i = 0; i < layout.segment_bytes(); ++i)
        if (s[i] != std::byte{v}) return false;
    }
  return true;
}

blocks range(std::uint32_t first, std::uint32_t n) {
  blocks b(n);
  std::iota(b.begin(), b.end(), first);
  return b;
}

blocks sorted(blocks b) {
  std::sort(b.begin(), b.end());
  return b;
}

struct harness : kvtier::test::connector_harness {
  harness() : connector_harness(layout) {}

  /// Fills the blocks of chunks [0, n) (blocks first .. first + 2n) with values v0, v0+1, ...
  void fill(std::uint32_t first, std::uint32_t count, std::uint8_t v0, kv_region* r = nullptr) {
    for (std::uint32_t i = 0; i < count; ++i) fill_block(r ? *r : region, first + i, static_cast<std::uint8_t>(v0 + i));
    if (server) server->sync();
  }

  template <class C>
  void store_and_wait(C& c, const std::string& id, const std::vector<token_id>& toks, std::uint32_t first_chunk,
                      std::uint32_t chunks, const blocks& b) {
    const std::size_t before = rec.snapshot().stores.size();
    c.store(id, toks, first_chunk, chunks, b);
    REQUIRE(wait([&](const record& r) { return r.stores.size() > before; }));
  }

  /// Stores the first `chunks` chunks of `toks` under request `id` from blocks
  /// [0, 2 x chunks), filled with 1, 2, ... first.
  template <class C>
  void store_prefix(C& c, const std::string& id, const std::vector<token_id>& toks, std::uint32_t chunks) {
    fill(0, 2 * chunks, 1);
    store_and_wait(c, id, toks, 0, chunks, range(0, 2 * chunks));
  }
};

}  // namespace

TEST_CASE("a lookup costs one request frame when the server's answer is ready", "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.describe_chunks = false;  // a description is a frame of its own (its tests: connector_describe_test.cpp)
  auto& c = h.connect(o);
  const auto toks = tokens(3 * ct, 21);
  h.store_prefix(c, "s", toks, 2);
  const std::size_t frames = h.server->received_work();
  c.lookup("one", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  CHECK(c.lookup_result("one") == std::optional<std::size_t>(2 * ct));
  CHECK(h.server->received_work() == frames + 1);  // the lookup itself, nothing after it
  CHECK(h.server->received(p::message_type::lookup_request) == 1);
  CHECK(h.server->received(p::message_type::query_prefetch_request) == 0);
  CHECK(h.server->lookups().at(0).answer_when_decided);  // the server answers when decided
}

namespace {

/// Lookups, each answered before the next, until one is written by the calling thread (the
/// connector's thread then has nothing in the socket's queue); returns how many were made.
std::size_t lookups_until_the_caller_writes(connector<test_bus>& c) {
  std::size_t n = 0;
  for (; c.stats().calls_sent_by_caller == 0 && n < 100; ++n) {
    const std::string id = "l" + std::to_string(n);
    c.lookup_hashes(id, {hash128{7, n}});
    REQUIRE(c.wait_lookups(ids{id}, 60s));
  }
  REQUIRE(c.stats().calls_sent_by_caller > 0);
  return n;
}

}  // namespace

TEST_CASE("an engine thread writes its calls itself; a full socket hands their rest to the connector's thread whole",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.describe_chunks = false;
  o.timeouts.ping_interval = 60s;  // no ping write of the connector's thread in the socket's queue
  auto& c = h.connect(o);
  const auto big = [](std::uint64_t seed) {  // a lookup of 1 MiB: more than a Unix socket holds
    std::vector<hash128> hs(p::max_chunk_hashes);
    for (std::size_t i = 0; i < hs.size(); ++i) hs[i] = hash128{seed, i};
    return hs;
  };

  // The registration's and the first ping's writes finish on the connector's thread; from
  // then on every call is written by its caller.
  REQUIRE(h.server->wait_received(p::message_type::ping_request, 1));
  const std::size_t n = lookups_until_the_caller_writes(c);
  REQUIRE(h.server->wait_received(p::message_type::lookup_request, n));
  const std::uint64_t before = c.stats().calls_sent_by_caller;

  SECTION("an idle connection: the engine's thread writes the lookup") {
    c.lookup_hashes("direct", {hash128{8, 8}});
    CHECK(c.stats().calls_sent_by_caller == before + 1);
    REQUIRE(h.server->wait_received(p::message_type::lookup_request, n + 1));
    REQUIRE(c.wait_lookups(ids{"direct"}, 60s));
    CHECK(c.lookup_result("direct") == std::optional<std::size_t>(0));
  }

  SECTION("a stopped server: frames queue up behind the unsent end of a write, and arrive whole and in order") {
    h.server->freeze();
    constexpr std::uint64_t lookups = 6;
    ids all;
    for (std::uint64_t i = 0; i < lookups; ++i) {
      all.push_back("big" + std::to_string(i));
      c.lookup_hashes(all.back(), big(i));  // returns at once: nothing waits for the socket
      all.push_back("small" + std::to_string(i));
      c.lookup_hashes(all.back(), {hash128{i, 99}});
    }
    // The first one was written here, in part; the others waited behind its end.
    CHECK(c.stats().calls_sent_by_caller == before + 1);
    CHECK(c.healthy());
    h.server->thaw();
    REQUIRE(h.server->wait_received(p::message_type::lookup_request, n + 2 * lookups));
    REQUIRE(c.wait_lookups(all, 60s));
    auto got = h.server->lookups();
    REQUIRE(got.size() == n + 2 * lookups);
    got.erase(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n));
    for (std::uint64_t i = 0; i < lookups; ++i) {
      CHECK(got[2 * i].request_key == all[2 * i]);
      CHECK(got[2 * i].chunk_hashes == big(i));
      CHECK(got[2 * i + 1].request_key == all[2 * i + 1]);
      CHECK(got[2 * i + 1].chunk_hashes == std::vector<hash128>{hash128{i, 99}});
    }
    CHECK(c.healthy());
    CHECK(c.stats().registrations == 1);  // the stream never broke
  }
}

TEST_CASE("an engine thread's own write that fails (EPIPE) makes the connection unhealthy and the connector reconnects",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.describe_chunks = false;
  o.timeouts.ping_interval = 60s;  // one ping, at the start: none meets the error first
  o.timeouts.lookup_timeout = 5s;  // an unseen error would end the lookup as a timeout
  auto& c = h.connect(o);
  REQUIRE(h.server->wait_received(p::message_type::ping_request, 1));
  (void)lookups_until_the_caller_writes(c);
  const std::uint64_t before = c.stats().calls_sent_by_caller;

  // The server's read side is shut and it is frozen: no EOF reaches the connector's reads,
  // so only the engine thread's sendmsg (EPIPE) can tell it.
  h.server->shut_reads_and_freeze();
  c.lookup_hashes("after", {hash128{9, 9}});
  CHECK(c.stats().calls_sent_by_caller == before + 1);  // written (tried) by this thread
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  CHECK(h.rec.snapshot().unhealthy.at(0).reason.view() == "eof");  // broken pipe: the server closed
  REQUIRE(c.wait_lookups(ids{"after"}, 60s));
  CHECK(c.lookup_result("after") == std::optional<std::size_t>(0));  // a miss, not an error
  CHECK(h.rec.snapshot().lookups.back().outcome == bus::connector_outcome::unhealthy);
  CHECK_FALSE(c.healthy());

  h.server->thaw();
  REQUIRE(h.wait([](const record& r) { return r.reconnected.size() == 1; }));
  CHECK(c.wait_ready(60s));
  CHECK(c.stats().registrations == 2);
  c.lookup_hashes("again", {hash128{10, 10}});
  REQUIRE(c.wait_lookups(ids{"again"}, 60s));
  CHECK(c.lookup_result("again") == std::optional<std::size_t>(0));
  CHECK(h.rec.snapshot().lookups.back().outcome == bus::connector_outcome::ok);
}

TEST_CASE("a lookup waits for the server's decision up to the lookup deadline, not the call deadline",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.request_timeout = 500ms;  // the small calls' deadline: the lookup must not use it
  o.describe_chunks = false;           // only the lookup's frames are counted
  auto& c = h.connect(o);
  h.server->hold(p::message_type::lookup_request);  // a server still deciding
  c.lookup("q", tokens(2 * ct, 1));
  REQUIRE(h.server->wait_received(p::message_type::lookup_request, 1));
  // Time passes (pings every 20 ms: 40 of them outlast request_timeout): the lookup is
  // still waiting, unanswered, and nothing was sent about it again.
  const std::size_t pings = h.server->received(p::message_type::ping_request);
  REQUIRE(h.server->wait_received(p::message_type::ping_request, pings + 40));  // > 0.8 s
  CHECK_FALSE(c.lookup_result("q").has_value());
  CHECK(h.server->received_work() == h.server->received(p::message_type::lookup_request) + 2);  // + handshake
  h.server->hold(p::message_type::lookup_request, false);
  h.server->release_held();  // decided: answered
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  CHECK(h.rec.snapshot().lookups.at(0).outcome == bus::connector_outcome::ok);
  CHECK(h.server->received(p::message_type::lookup_request) == 1);
  CHECK(h.server->received(p::message_type::query_prefetch_request) == 0);
}

TEST_CASE("a lookup answers the tokens of the cached chunk prefix, asking again while the server says pending",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(4 * ct + 3, 1);  // 4 full chunks and a partial one
  h.store_prefix(c, "s", toks, 3);

  h.server->set_pending_answers(3);  // a server that answers before the decision
  c.lookup("q", toks);
  c.lookup("q", toks);  // idempotent per request id
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  CHECK(c.lookup_result("q") == std::optional<std::size_t>(3 * ct));
  CHECK(c.lookup_result("q") == std::optional<std::size_t>(3 * ct));  // stable
  CHECK(h.server->received(p::message_type::lookup_request) == 1);
  // The lookup's answer and 2 queries' pending, then done.
  CHECK(h.server->received(p::message_type::query_prefetch_request) == 3);
  const auto e = h.rec.snapshot().lookups.at(0);
  CHECK(e.outcome == bus::connector_outcome::ok);
  CHECK(e.requested_chunks == 4);
  CHECK(e.hit_chunks == 3);

  // A prompt that shares only its first chunk with the stored one.
  auto other = toks;
  other[ct + 1] += 1;
  h.server->set_pending_answers(0);
  c.lookup("q2", other);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 2; }));
  CHECK(c.lookup_result("q2") == std::optional<std::size_t>(ct));

  CHECK(c.lookup_result("never-looked-up") == std::optional<std::size_t>(0));
  c.end_request("q");
  CHECK(c.lookup_result("q") == std::optional<std::size_t>(0));  // the answer went with the request
  CHECK(h.server->wait_received(p::message_type::end_request_request, 1));
}

TEST_CASE("a retrieve writes the cached KV into the engine's blocks and reports each id once",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(4 * ct, 2);
  h.store_prefix(c, "s", toks, 3);
  CHECK(c.get_finished(ids{"s"}).sending == ids{"s"});

  c.retrieve("r", toks, 0, range(10, 6));
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  auto f = c.get_finished(ids{});
  CHECK(f.recving == ids{"r"});
  CHECK(f.sending.empty());
  CHECK(c.get_finished(ids{}).recving.empty());
  h.server->sync();
  for (std::uint32_t k = 0; k < 6; ++k) CHECK(block_is(h.region, 10 + k, static_cast<std::uint8_t>(1 + k)));
  CHECK(c.take_load_error_blocks().empty());
  CHECK(h.rec.snapshot().retrieves.at(0).outcome == bus::connector_outcome::ok);

  SECTION("a shorter prefix: the blocks of the missing chunks are load errors") {
    c.retrieve("p", toks, 0, range(16, 8));
    REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 2; }));
    const auto ev = h.rec.snapshot().retrieves.at(1);
    CHECK(ev.outcome == bus::connector_outcome::partial);
    CHECK(ev.retrieved_chunks == 3);
    CHECK(sorted(c.take_load_error_blocks()) == blocks{22, 23});
    CHECK(c.take_load_error_blocks().empty());  // each once
    CHECK(c.get_finished(ids{}).recving == ids{"p"});
    CHECK(c.quarantined_blocks().empty());  // the server answered: nothing to fence
  }
  SECTION("skipped tokens the engine already has are not overwritten") {
    fill_block(h.region, 24, 99);
    fill_block(h.region, 25, 0);
    h.server->sync();
    c.retrieve("k", toks, 1, blocks{24, 25}, 4);  // chunk 1, its first block already computed
    REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 2; }));
    h.server->sync();
    CHECK(block_is(h.region, 24, 99));
    CHECK(block_is(h.region, 25, 4));  // block 3 held chunk 1's second half
    CHECK(c.take_load_error_blocks().empty());
  }
}

TEST_CASE("wait_progress wakes an idle engine at a lookup's answer and a retrieve's end, and times out otherwise",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(4 * ct, 3);
  h.store_prefix(c, "s", toks, 3);
  CHECK(c.get_finished(ids{"s"}).sending == ids{"s"});

  std::uint64_t seen = c.progress();
  CHECK_FALSE(c.wait_progress(seen, 20ms));  // nothing in flight: nothing moves it
  CHECK(c.progress() == seen);

  c.lookup("q", toks);
  REQUIRE(c.wait_progress(seen, 60s));  // the answer
  CHECK(c.lookup_result("q") == std::optional<std::size_t>(3 * ct));
  CHECK(c.progress() != seen);
  CHECK(c.wait_progress(seen, 0us));  // it moved before the wait: no sleep, nothing missed

  // A retrieve moves it at its progress and at its end; the engine sleeps between them.
  seen = c.progress();
  c.retrieve("r", toks, 0, range(10, 6));
  std::vector<std::string> recving;
  for (int turns = 0; recving.empty(); ++turns) {
    REQUIRE(turns < 64);
    REQUIRE(c.wait_progress(seen, 60s));
    seen = c.progress();
    recving = c.get_finished(ids{}).recving;
  }
  CHECK(recving == ids{"r"});
  CHECK(c.take_load_error_blocks().empty());
  CHECK_FALSE(c.wait_progress(seen, 20ms));  // all done: it rests again
}

TEST_CASE("a timed-out retrieve is a load error and its blocks stay quarantined until the late reply",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.retrieve_timeout = 100ms;
  auto& c = h.connect(o);
  const auto toks = tokens(2 * ct, 3);
  h.store_prefix(c, "s", toks, 2);

  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("t", toks, 0, range(8, 4));
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  const auto ev = h.rec.snapshot().retrieves.at(0);
  CHECK(ev.outcome == bus::connector_outcome::timeout);
  CHECK(ev.load_error_blocks == 4);
  CHECK(c.get_finished(ids{}).recving == ids{"t"});  // never silent, never stuck
  CHECK(sorted(c.take_load_error_blocks()) == range(8, 4));
  CHECK(c.quarantined_blocks() == range(8, 4));
  CHECK(c.block_is_quarantined(9));
  const auto g8 = h.region.generation(8);
  CHECK_FALSE(c.block_reused(8));  // the engine must recompute elsewhere
  CHECK(h.region.generation(8) == g8);
  CHECK(c.block_reused(12));
  // The same for a batch, in one call: the quarantined ones come back, the others are fenced.
  const auto g12 = h.region.generation(12);
  const auto g13 = h.region.generation(13);
  CHECK(c.blocks_reused(blocks{12, 9, 13, 8}) == blocks{9, 8});
  CHECK(h.region.generation(8) == g8);
  CHECK(h.region.generation(12) != g12);
  CHECK(h.region.generation(13) != g13);
  CHECK_THROWS_AS(c.blocks_reused(blocks{14, 32}), std::out_of_range);
  CHECK(c.healthy());  // one slow call is not a dead server
  CHECK(h.rec.snapshot().quarantine.at(0).held_blocks == 4);

  h.server->release_held();  // the server wakes up, writes the blocks and answers late
  REQUIRE(h.wait([](const record& r) { return r.released_blocks() == 4; }));
  CHECK(c.quarantined_blocks().empty());
  CHECK(c.block_reused(8));
  CHECK(c.stats().late_replies == 1);
  CHECK(c.get_finished(ids{}).recving.empty());  // the late reply reports nothing again
}

TEST_CASE("load errors and quarantined blocks polled while the connector adds them: each taken once",
          "[engine][connector][concurrency]") {
  // Another thread polls take_load_error_blocks, quarantined_blocks and block_is_quarantined
  // while the connector's thread adds load errors and quarantines blocks (retrieves that time
  // out), as an engine's thread would. (They take the mutex: a caller that saw an event the
  // connector published under it must see the state of the same critical section.)
  harness h;
  auto o = h.options();
  o.timeouts.retrieve_timeout = 50ms;
  o.breaker_threshold = 100;  // these timeouts are no dead server
  auto& c = h.connect(o);
  const auto toks = tokens(2 * ct, 4);
  h.store_prefix(c, "s", toks, 2);
  h.server->hold(p::message_type::retrieve_request);
  std::atomic<bool> done{false};
  blocks taken;
  std::size_t polls = 0;
  bool strange = false;  // (Catch's checks are for the test's thread)
  std::thread poller([&] {
    while (!done.load()) {
      for (std::uint32_t b : c.take_load_error_blocks()) taken.push_back(b);
      for (std::uint32_t b : c.quarantined_blocks()) strange = strange || b < 8 || b >= 24;
      (void)c.block_is_quarantined(8);
      ++polls;
    }
  });
  constexpr std::uint32_t n = 4;
  for (std::uint32_t i = 0; i < n; ++i) c.retrieve("t" + std::to_string(i), toks, 0, range(8 + 4 * i, 4));
  REQUIRE(h.wait([&](const record& r) { return r.retrieves.size() == n; }));
  done = true;
  poller.join();
  for (std::uint32_t b : c.take_load_error_blocks()) taken.push_back(b);
  CHECK(polls > 0);
  CHECK_FALSE(strange);
  CHECK(sorted(taken) == range(8, 4 * n));  // each block once, whichever thread took it
  CHECK(c.take_load_error_blocks().empty());
  CHECK(sorted(c.quarantined_blocks()) == range(8, 4 * n));
  CHECK(c.block_is_quarantined(23));
  h.server->release_held();
  REQUIRE(h.wait([&](const record& r) { return r.released_blocks() == 4 * n; }));
  CHECK(c.quarantined_blocks().empty());
  CHECK_FALSE(c.block_is_quarantined(8));
}

TEST_CASE("finished reporting: no id with a pending retrieve is finished sending, stores are waited for",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(2 * ct, 4);
  h.store_prefix(c, "setup", toks, 2);

  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("a", toks, 0, range(8, 4));
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  for (int i = 0; i < 3; ++i) {  // the engine finished it (and re-reports it) while it loads
    const auto f = c.get_finished(ids{"a"});
    CHECK(f.sending.empty());
    CHECK(f.recving.empty());
  }
  h.server->hold(p::message_type::retrieve_request, false);
  h.server->release_held();
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  auto f = c.get_finished(ids{});
  CHECK(f.recving == ids{"a"});
  CHECK(f.sending.empty());
  CHECK(c.get_finished(ids{"a"}).sending.empty());  // retired with its receiving report

  h.server->hold(p::message_type::store_request);
  c.store("b", toks, 0, 2, range(0, 4));
  REQUIRE(h.server->wait_received(p::message_type::store_request, 2));
  CHECK(c.get_finished(ids{"b"}).sending.empty());
  CHECK(c.get_finished(ids{"b"}).sending.empty());
  h.server->release_held();
  REQUIRE(h.wait([](const record& r) { return r.stores.size() == 2; }));
  f = c.get_finished(ids{});
  CHECK(f.sending == ids{"b"});
  CHECK(f.recving.empty());
  CHECK(c.get_finished(ids{"b"}).sending.empty());
  CHECK(c.get_finished(ids{"setup", "b"}).sending == ids{"setup"});  // first report of "setup"
  CHECK(c.get_finished(ids{"setup", "b"}).sending.empty());
  CHECK(c.stats().tracked_requests == 0);
}

TEST_CASE("the server's EOF makes the connector unhealthy at once and releases every pending request",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(2 * ct, 5);
  h.store_prefix(c, "setup", toks, 2);

  h.server->hold(p::message_type::retrieve_request);
  h.server->hold(p::message_type::store_request);
  h.server->hold(p::message_type::lookup_request);  // a lookup still deciding
  c.lookup("l", toks);
  c.retrieve("r", toks, 0, range(8, 4));
  c.store("s", toks, 0, 2, range(0, 4));
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  REQUIRE(h.server->wait_received(p::message_type::store_request, 2));
  REQUIRE(h.server->wait_received(p::message_type::lookup_request, 1));
  CHECK_FALSE(c.lookup_result("l").has_value());  // pending

  h.server->close_connections();
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  const auto u = h.rec.snapshot().unhealthy.at(0);
  CHECK(u.reason.view() == "eof");
  CHECK(u.released_requests == 3);
  CHECK(c.lookup_result("l") == std::optional<std::size_t>(0));
  const auto f = c.get_finished(ids{"s"});
  CHECK(f.recving == ids{"r"});
  CHECK(f.sending == ids{"s"});
  CHECK(sorted(c.take_load_error_blocks()) == range(8, 4));
  // The server closes a connection only after every copy it started for it has ended
  // (docs/protocol.md): after its EOF nothing can write the blocks, so none is fenced.
  CHECK(c.quarantined_blocks().empty());
  const auto s = h.rec.snapshot();
  CHECK(s.quarantine.empty());
  CHECK(s.stores.back().outcome == bus::connector_outcome::unhealthy);
  CHECK(s.retrieves.back().outcome == bus::connector_outcome::unhealthy);
  CHECK(s.lookups.back().outcome == bus::connector_outcome::unhealthy);

  // It reconnects to the same server (same boot token).
  REQUIRE(h.wait([](const record& r) { return r.reconnected.size() == 1; }));
  CHECK_FALSE(h.rec.snapshot().reconnected.at(0).server_restarted);
  CHECK(c.wait_ready(60s));
  CHECK(c.quarantined_blocks().empty());
  CHECK(h.server->received(p::message_type::register_kv_request) == 2);
}

TEST_CASE("a hung server that closes the old connection instead of answering releases its quarantine",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.ping_timeout = 100ms;
  o.timeouts.request_timeout = 200ms;
  o.timeouts.quarantine_limit = 0ms;  // off: only a proof releases
  auto& c = h.connect(o);
  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("h", tokens(ct, 15), 0, blocks{8, 9});
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  h.server->hang();
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  CHECK(c.quarantined_blocks() == blocks{8, 9});  // its connection is kept open for the late answer

  // It wakes up and reaps the silent connection (EOF) without answering the retrieve.
  h.server->close_connections();
  REQUIRE(h.wait([](const record& r) { return r.released_blocks() == 2; }));
  CHECK(c.quarantined_blocks().empty());
  CHECK(c.block_reused(8));
  h.server->hang(false);
  REQUIRE(h.wait([](const record& r) { return r.healthy.size() == 2; }));
  CHECK(c.stats().open_connections == 1);  // the old one is gone, the new one serves
  CHECK(c.get_finished(ids{}).recving == ids{"h"});
}

TEST_CASE("a hung server is declared unhealthy by the ping timeout, and recovery follows",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.ping_timeout = 100ms;
  o.timeouts.request_timeout = 200ms;
  auto& c = h.connect(o);
  CHECK(c.stats().unhealthy_ns == 0);
  // A retrieve is in flight when the server stops.
  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("h", tokens(ct, 14), 0, blocks{8, 9});
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));

  h.server->hang();  // stopped (SIGSTOP): the socket stays open, nothing is answered
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  // The time without a server counts while it lasts (what the vLLM connector's degraded_s
  // reports between two samples), and grows.
  const std::uint64_t outage_so_far = c.stats().unhealthy_ns;
  CHECK(outage_so_far > 0);
  std::uint64_t later = c.stats().unhealthy_ns;
  for (int i = 0; i < 1'000'000 && later == outage_so_far; ++i) later = c.stats().unhealthy_ns;  // the clock's tick
  CHECK(later > outage_so_far);
  const auto u = h.rec.snapshot().unhealthy.at(0);
  CHECK(u.reason.view() == "ping_timeout");
  CHECK(u.released_requests == 1);
  CHECK_FALSE(c.healthy());
  CHECK_THAT(c.last_error(), Catch::Contains("ping unanswered"));
  CHECK(c.get_finished(ids{}).recving == ids{"h"});
  CHECK(sorted(c.take_load_error_blocks()) == blocks{8, 9});
  CHECK(c.quarantined_blocks() == blocks{8, 9});  // the server may wake up and write them

  // It wakes up (SIGCONT): it answers the retrieve on the old connection, which the
  // connector kept open for that, and the connector reconnects.
  h.server->hang(false);
  h.server->release_held();
  REQUIRE(h.wait([](const record& r) { return r.released_blocks() == 2; }));
  CHECK(c.quarantined_blocks().empty());
  REQUIRE(h.wait([](const record& r) { return r.healthy.size() == 2; }));
  const auto s = h.rec.snapshot();
  CHECK(s.healthy.at(1).unhealthy_ns > 0);
  // Once healthy again, stats() holds exactly the outage the event reported, and stays.
  CHECK(c.stats().unhealthy_ns == s.healthy.at(1).unhealthy_ns);
  CHECK(c.stats().unhealthy_ns == s.healthy.at(1).unhealthy_ns);
  CHECK_FALSE(s.reconnected.at(0).server_restarted);
  CHECK(c.healthy());
  CHECK(c.get_finished(ids{}).recving.empty());  // the late reply reports nothing again
}

TEST_CASE("without any proof, quarantined blocks are released after quarantine_limit, which is bounded by default",
          "[engine][connector][concurrency]") {
  CHECK(engine::connector_timeouts{}.quarantine_limit > 0ms);
  CHECK(engine::connector_timeouts{}.quarantine_limit >= 20 * engine::connector_timeouts{}.ping_timeout);
  harness h;
  auto o = h.options();
  o.timeouts.retrieve_timeout = 100ms;
  o.timeouts.quarantine_limit = 300ms;
  auto& c = h.connect(o);
  h.server->hold(p::message_type::retrieve_request);  // never answered, connection kept open
  c.retrieve("q", tokens(ct, 16), 0, blocks{4, 5});
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  CHECK(c.quarantined_blocks() == blocks{4, 5});
  REQUIRE(h.wait([](const record& r) { return r.released_blocks() == 2; }));
  CHECK(c.quarantined_blocks().empty());
  CHECK(c.healthy());
}

TEST_CASE("after a server restart the connector registers its region again and reports the restart",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto first_boot = c.boot_token();
  CHECK(first_boot == h.server->boot_token());

  h.server->restart();
  REQUIRE(h.wait([](const record& r) { return r.reconnected.size() == 1; }));
  const auto s = h.rec.snapshot();
  CHECK(s.reconnected.at(0).server_restarted);
  CHECK(s.unhealthy.at(0).reason.view() == "eof");
  CHECK(c.wait_ready(60s));
  CHECK(c.boot_token() == h.server->boot_token());
  CHECK(c.boot_token() != first_boot);
  CHECK(h.server->received(p::message_type::register_kv_request) == 2);
  CHECK(c.stats().registrations == 2);

  // And it works again: a store reaches the new server.
  const auto toks = tokens(ct, 6);
  h.store_prefix(c, "after", toks, 1);
  CHECK(h.rec.snapshot().stores.back().stored_chunks == 1);
}

TEST_CASE("without a server the connector runs degraded: stores skipped, retrieves fail fast, lookups 0",
          "[engine][connector][concurrency]") {
  harness h;  // no server yet
  connector<test_bus> c(h.options(), h.region, h.bus);
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  CHECK(h.rec.snapshot().unhealthy.at(0).reason.view() == "connect_failed");
  CHECK(c.state() == engine::health_state::unhealthy);
  CHECK_FALSE(c.wait_ready(1ms));
  CHECK_THAT(c.last_error(), Catch::Contains("cannot connect"));

  const auto toks = tokens(2 * ct, 7);
  c.store("s", toks, 0, 2, range(0, 4));
  c.retrieve("r", toks, 0, range(4, 4));
  c.lookup("l", toks);
  CHECK(c.lookup_result("l") == std::optional<std::size_t>(0));
  auto s = h.rec.snapshot();
  CHECK(s.stores.at(0).outcome == bus::connector_outcome::unhealthy);
  CHECK(s.retrieves.at(0).outcome == bus::connector_outcome::unhealthy);
  CHECK(s.lookups.at(0).outcome == bus::connector_outcome::unhealthy);
  const auto f = c.get_finished(ids{"s"});
  CHECK(f.sending == ids{"s"});
  CHECK(f.recving == ids{"r"});
  CHECK(sorted(c.take_load_error_blocks()) == range(4, 4));
  CHECK(c.quarantined_blocks().empty());  // never sent: nothing can write them

  h.start_server();
  REQUIRE(c.wait_ready(60s));
  REQUIRE(h.wait([](const record& r) { return r.healthy.size() == 1; }));
  s = h.rec.snapshot();
  CHECK(s.healthy.at(0).unhealthy_ns > 0);
  CHECK(c.stats().unhealthy_ns == s.healthy.at(0).unhealthy_ns);  // from the failed first connect on
  CHECK(s.reconnected.empty());  // the first registration is no reconnection
  CHECK(h.server->received(p::message_type::store_request) == 0);
}

TEST_CASE("fencing: a block reused after its store was issued is never stored under the old key",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(2 * ct, 8);
  h.fill(0, 4, 1);
  std::vector<std::uint64_t> at_issue;
  for (std::uint32_t b = 0; b < 4; ++b) at_issue.push_back(h.region.generation(b));

  h.server->hold(p::message_type::store_request);
  c.store("f", toks, 0, 2, range(0, 4));
  REQUIRE(h.server->wait_received(p::message_type::store_request, 1));
  REQUIRE(c.block_reused(3));  // the engine frees and reuses chunk 1's second block
  CHECK(h.region.generation(3) == at_issue[3] + 1);
  fill_block(h.region, 3, 77);
  h.server->sync();
  h.server->release_held();  // the server copies now: chunk 1 holds new bytes in block 3
  REQUIRE(h.wait([](const record& r) { return r.stores.size() == 1; }));
  const auto ev = h.rec.snapshot().stores.at(0);
  CHECK(ev.stored_chunks == 1);
  CHECK(ev.failed_chunks == 1);
  const auto sent = h.server->stores();
  REQUIRE(sent.size() == 1);
  CHECK(sent[0].block_generations == at_issue);  // read at issue time, not at copy time
  const auto hashes = c.chunk_hashes(toks);
  const std::uint64_t model = make_model_id("test-model", layout.model);
  CHECK(h.server->has_chunk(chunk_key{model, 1, 0, hashes[0]}));
  CHECK_FALSE(h.server->has_chunk(chunk_key{model, 1, 0, hashes[1]}));

  // Stored again with its final content, chunk 1 is accepted.
  h.server->hold(p::message_type::store_request, false);
  h.store_and_wait(c, "f2", toks, 1, 1, blocks{2, 3});
  CHECK(h.rec.snapshot().stores.back().stored_chunks == 1);
  CHECK(h.server->has_chunk(chunk_key{model, 1, 0, hashes[1]}));
}

TEST_CASE("world size 2: a chunk is a hit only when both ranks' shards are cached",
          "[engine][connector][concurrency]") {
  harness h;
  h.start_server();
  kv_region region1 = make_region();
  connector<test_bus> c0(h.options(0, 2), h.region, h.bus);
  connector<test_bus> c1(h.options(1, 2), region1, h.bus);
  REQUIRE(c0.wait_ready(60s));
  REQUIRE(c1.wait_ready(60s));
  const auto toks = tokens(4 * ct, 9);
  h.fill(0, 8, 10);
  h.fill(0, 8, 50, &region1);
  h.store_and_wait(c0, "w", toks, 0, 4, range(0, 8));
  h.store_and_wait(c1, "w", toks, 0, 2, range(0, 4));

  c0.lookup("x", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  CHECK(c0.lookup_result("x") == std::optional<std::size_t>(2 * ct));
  CHECK_THROWS_AS(c1.lookup("x", toks), std::logic_error);  // lookups are the scheduler's

  h.store_and_wait(c1, "w2", toks, 2, 2, range(4, 4));
  c0.lookup("y", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 2; }));
  CHECK(c0.lookup_result("y") == std::optional<std::size_t>(4 * ct));

  // Each rank retrieves its own shard into its own region.
  c1.retrieve("y", toks, 0, range(16, 8));
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  CHECK(c1.get_finished(ids{}).recving == ids{"y"});
  CHECK(c0.get_finished(ids{}).recving.empty());
  h.server->sync();
  for (std::uint32_t k = 0; k < 8; ++k) CHECK(block_is(region1, 16 + k, static_cast<std::uint8_t>(50 + k)));
  CHECK(h.rec.snapshot().retrieves.at(0).rank == 1);
}

TEST_CASE("the connector's events and metrics count a session exactly", "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(4 * ct, 10);
  h.store_prefix(c, "m", toks, 2);
  c.lookup("m", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  c.retrieve("m", toks, 0, range(8, 4));
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  c.retrieve("n", toks, 0, range(12, 6));  // 3 chunks, 2 cached
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 2; }));

  const auto s = h.rec.snapshot();
  CHECK(s.count<bus::connector_healthy>() == 1);
  CHECK(s.count<bus::connector_unhealthy>() == 0);
  CHECK(s.count<bus::connector_reconnected>() == 0);
  CHECK(s.count<bus::connector_store_completed>() == 1);
  CHECK(s.count<bus::connector_lookup_completed>() == 1);
  CHECK(s.count<bus::connector_retrieve_completed>() == 2);
  CHECK(s.count<bus::connector_load_error>() == 1);
  CHECK(s.count<bus::connector_quarantine_changed>() == 0);
  CHECK(s.load_errors.at(0).block_count == 2);
  CHECK(s.load_errors.at(0).reason == bus::connector_outcome::partial);

  const auto& reg = h.reg;
  CHECK(reg.value("kvtier_connector_healthy") == 1.0);
  CHECK(reg.value("kvtier_connector_stores_total", {{"outcome", "ok"}}) == 1.0);
  CHECK(reg.value("kvtier_connector_store_requested_chunks_total") == 2.0);
  CHECK(reg.value("kvtier_connector_store_chunks_total", {{"result", "stored"}}) == 2.0);
  CHECK(reg.value("kvtier_connector_lookups_total", {{"outcome", "ok"}}) == 1.0);
  CHECK(reg.value("kvtier_connector_lookup_requested_tokens_total") == 4.0 * ct);
  CHECK(reg.value("kvtier_connector_lookup_hit_tokens_total") == 2.0 * ct);
  CHECK(reg.value("kvtier_connector_retrieves_total", {{"outcome", "ok"}}) == 1.0);
  CHECK(reg.value("kvtier_connector_retrieves_total", {{"outcome", "partial"}}) == 1.0);
  CHECK(reg.value("kvtier_connector_retrieve_requested_chunks_total") == 5.0);
  CHECK(reg.value("kvtier_connector_retrieved_chunks_total") == 4.0);
  CHECK(reg.value("kvtier_connector_load_error_blocks_total", {{"reason", "partial"}}) == 2.0);
  CHECK(reg.value("kvtier_connector_quarantined_blocks") == 0.0);
}

TEST_CASE("a server that answers pings but no work trips the breaker", "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.store_timeout = 50ms;
  o.breaker_threshold = 3;
  auto& c = h.connect(o);
  h.server->hold(p::message_type::store_request);
  const auto toks = tokens(ct, 11);
  for (int i = 0; i < 3; ++i) c.store("b" + std::to_string(i), toks, 0, 1, range(0, 2));
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
  const auto s = h.rec.snapshot();
  CHECK(s.unhealthy.at(0).reason.view() == "timeouts");
  CHECK(std::count_if(s.stores.begin(), s.stores.end(),
                      [](const auto& e) { return e.outcome == bus::connector_outcome::timeout; }) == 3);
  CHECK(c.get_finished(ids{"b0", "b1", "b2"}).sending.size() == 3);
}

TEST_CASE("a server that lost the registration gets it again", "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  h.server->forget_registrations();
  c.store("x", tokens(ct, 15), 0, 1, range(0, 2));
  REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1 && r.healthy.size() == 2; }));
  const auto s = h.rec.snapshot();
  CHECK(s.unhealthy.at(0).reason.view() == "not_registered");
  CHECK(s.stores.at(0).outcome == bus::connector_outcome::failed);
  CHECK(h.server->received(p::message_type::register_kv_request) == 2);
}

TEST_CASE("a refused registration or another chunk size keeps the connector degraded and says why",
          "[engine][connector][concurrency]") {
  SECTION("refused registration") {
    harness h;
    h.start_server();
    h.server->reject_registrations(errc::layout_mismatch);
    connector<test_bus> c(h.options(), h.region, h.bus);
    REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
    CHECK(h.rec.snapshot().unhealthy.at(0).reason.view() == "register_failed");
    CHECK_THAT(c.last_error(), Catch::Contains("rejected by the test script"));
    CHECK_FALSE(c.healthy());
    h.server->reject_registrations(std::nullopt);
    CHECK(c.wait_ready(60s));
  }
  SECTION("chunk size mismatch") {
    harness h;
    h.start_server(2 * ct);
    connector<test_bus> c(h.options(), h.region, h.bus);
    REQUIRE(h.wait([](const record& r) { return r.unhealthy.size() == 1; }));
    CHECK(h.rec.snapshot().unhealthy.at(0).reason.view() == "chunk_size_mismatch");
    CHECK_THAT(c.last_error(), Catch::Contains("chunk_tokens=16"));
    CHECK(h.server->received(p::message_type::register_kv_request) == 0);
  }
}

TEST_CASE("bad arguments and bad options are refused before anything is sent", "[engine][connector]") {
  harness h;
  auto o = h.options();
  o.chunk_tokens = 6;  // not a multiple of the block size (4)
  CHECK_THROWS_AS(connector<test_bus>(o, h.region, h.bus), std::invalid_argument);
  o = h.options();
  o.rank = 1;  // world_size 1
  CHECK_THROWS_AS(connector<test_bus>(o, h.region, h.bus), std::invalid_argument);
  connector<test_bus> c(h.options(), h.region, h.bus);
  const auto toks = tokens(2 * ct, 12);
  CHECK_THROWS_AS(c.retrieve("x", toks, 0, blocks{0, 1, 2}), std::invalid_argument);  // not whole chunks
  CHECK_THROWS_AS(c.retrieve("x", toks, 1, range(0, 4)), std::invalid_argument);      // too few tokens
  CHECK_THROWS_AS(c.store("x", toks, 0, 1, blocks{0, 99}), std::invalid_argument);    // block out of range
  CHECK_THROWS_AS(c.store("", toks, 0, 1, blocks{0, 1}), std::invalid_argument);      // empty id
  CHECK_THROWS_AS(c.lookup(std::string(300, 'x'), toks), std::invalid_argument);      // id too long
  CHECK_THROWS_AS((void)c.block_reused(32), std::out_of_range);
  CHECK(c.stats().calls_issued == 0);
}

TEST_CASE("quarantined blocks are released when the server's process is gone", "[engine][connector][concurrency]") {
  temp_dir dir("kvtier-engine");
  const std::string path = (dir.path() / "server.sock").string();
  // The server runs in a child process (forked while this process has one thread), so that
  // it can die. It never answers retrieves.
  const ::pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    try {
      fake_server srv(path, ct);
      srv.hold(p::message_type::retrieve_request);
      srv.run();
    } catch (...) {
    }
    ::_exit(1);
  }
  {
    kvtier::test::recording_bus b;
    auto& rec = b.rec;
    kv_region region = make_region();
    auto o = kvtier::test::connector_test_options(path);
    o.timeouts.retrieve_timeout = 100ms;
    connector<test_bus> c(o, region, b.bus);
    REQUIRE(c.wait_ready(60s));
    c.retrieve("g", tokens(ct, 13), 0, blocks{6, 7});
    REQUIRE(rec.wait([](const record& r) { return r.retrieves.size() == 1; }));
    CHECK(rec.snapshot().retrieves.at(0).outcome == bus::connector_outcome::timeout);
    CHECK(c.quarantined_blocks() == blocks{6, 7});

    // (The connector may have started before the child listened: count edges from here.)
    const std::size_t edges = rec.snapshot().unhealthy.size();
    REQUIRE(::kill(child, SIGKILL) == 0);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE(rec.wait([](const record& r) { return r.released_blocks() == 2; }));
    CHECK(c.quarantined_blocks().empty());
    CHECK(c.block_reused(6));
    REQUIRE(rec.wait([&](const record& r) { return r.unhealthy.size() == edges + 1; }));
    CHECK(rec.snapshot().unhealthy.back().reason.view() == "eof");
    CHECK(c.stats().open_connections == 0);
  }
}

TEST_CASE("a scheduler's connector registers without a region and looks up the workers' chunks",
          "[engine][connector][concurrency]") {
  harness h;
  h.start_server();
  connector<test_bus> worker(h.options(0, 1), h.region, h.bus);
  REQUIRE(worker.wait_ready(60s));
  auto so = h.options(0, 1);
  so.model = layout.model;  // one rank's shape: what the workers register
  connector<test_bus> sched(so, h.bus);
  REQUIRE(sched.wait_ready(60s));
  CHECK_FALSE(sched.has_region());
  CHECK(worker.has_region());
  const auto regs = h.server->registrations();
  REQUIRE(regs.size() == 2);
  CHECK(regs[0].region == p::region_kind::cpu_memfd);
  CHECK(regs[1].region == p::region_kind::none);
  CHECK(regs[1].model == layout.model);
  CHECK(regs[1].num_blocks == 0);

  const auto toks = tokens(3 * ct, 4);
  h.store_prefix(worker, "s", toks, 3);
  sched.lookup("q", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 1; }));
  CHECK(sched.lookup_result("q") == std::optional<std::size_t>(3 * ct));

  // Only the scheduler's side of the interface exists without a region.
  CHECK_THROWS_AS(sched.retrieve("r", toks, 0, range(10, 6)), std::logic_error);
  CHECK_THROWS_AS(sched.store("w", toks, 0, 3, range(0, 6)), std::logic_error);
  CHECK_THROWS_AS((void)sched.block_reused(0), std::logic_error);
}

TEST_CASE("a region-less connector must be a scheduler with a valid model shape", "[engine][connector]") {
  harness h;
  auto o = h.options(1, 2);  // rank 1: not the scheduler by default
  o.model = layout.model;
  CHECK_THROWS_AS(connector<test_bus>(o, h.bus), std::invalid_argument);
  auto o2 = h.options(0, 2);
  CHECK_THROWS_AS(connector<test_bus>(o2, h.bus), std::invalid_argument);  // no model shape
  auto o3 = h.options();
  o3.model = layout.model;  // a worker's shape comes from its region
  CHECK_THROWS_AS(connector<test_bus>(o3, h.region, h.bus), std::invalid_argument);
}

TEST_CASE("cache salts travel with lookups, retrieves and stores; other salts miss",
          "[engine][connector][concurrency]") {
  harness h;
  auto& c = h.connect();
  const auto toks = tokens(2 * ct, 5);
  h.fill(0, 4, 1);
  const std::size_t before = h.rec.snapshot().stores.size();
  c.store("s", toks, 0, 2, range(0, 4), "tenant-a");
  REQUIRE(h.wait([&](const record& r) { return r.stores.size() > before; }));
  c.lookup("qa", toks, "tenant-a");
  c.lookup("qb", toks, "tenant-b");
  c.lookup("qn", toks);
  REQUIRE(h.wait([](const record& r) { return r.lookups.size() == 3; }));
  CHECK(c.lookup_result("qa") == std::optional<std::size_t>(2 * ct));
  CHECK(c.lookup_result("qb") == std::optional<std::size_t>(0));
  CHECK(c.lookup_result("qn") == std::optional<std::size_t>(0));
  c.retrieve("ra", toks, 0, range(10, 4), 0, "tenant-a");
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  CHECK(c.take_load_error_blocks().empty());
  h.server->sync();
  for (std::uint32_t k = 0; k < 4; ++k) CHECK(block_is(h.region, 10 + k, static_cast<std::uint8_t>(1 + k)));
  CHECK_THROWS_AS(c.lookup("long", toks, std::string(300, 's')), std::invalid_argument);
}

// --- layer-wise loading --------------------------------------------------------------------

namespace {

constexpr engine::retrieve_options layerwise{true};  // synchronous

}  // namespace

TEST_CASE("a layer-wise retrieve: wait_layers returns on progress and on completion, and times out between",
          "[engine][connector][layerwise][concurrency]") {
  harness h;
  auto& c = h.connect();
  const std::uint32_t layers = layout.model.num_layers;  // 2
  const auto toks = tokens(2 * ct, 31);
  h.store_prefix(c, "s", toks, 2);
  (void)c.get_finished(ids{"s"});

  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("w", toks, 0, range(8, 4), 0, {}, layerwise);
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  const ids w{"w"};
  CHECK(c.layers_ready("w") == 0);
  CHECK(c.layers_ready("not-retrieving") == layers);  // nothing in flight: nothing to wait for
  CHECK_FALSE(c.wait_layers(w, 1, 30ms));               // nothing arrived: the timeout
  CHECK(c.wait_layers(ids{"other"}, layers, 0ms));     // another request waits for nothing

  REQUIRE(h.server->send_progress_to_held(1) == 1);
  REQUIRE(c.wait_layers(w, 1, 60s));
  CHECK(c.layers_ready("w") == 1);
  CHECK_FALSE(c.wait_layers(w, 2, 30ms));
  CHECK_FALSE(c.wait_retrieves(w, 30ms));  // progress is no completion

  // A progress for a call the connector never made is ignored; frames of one connection
  // arrive in order, so once the retrieve completed the stray one was read.
  h.server->send_progress(987654321, 2);
  h.server->hold(p::message_type::retrieve_request, false);
  h.server->release_held();
  REQUIRE(c.wait_retrieves(w, 60s));
  CHECK(c.wait_layers(w, layers, 0ms));
  CHECK(c.layers_ready("w") == layers);
  CHECK(c.stats().progress_messages == 1);
  CHECK(c.stats().ignored_progress == 1);
  CHECK(h.server->retrieves().at(0).progress);
  h.server->sync();
  for (std::uint32_t k = 0; k < 4; ++k) CHECK(block_is(h.region, 8 + k, static_cast<std::uint8_t>(1 + k)));
  CHECK(c.take_load_error_blocks().empty());
  // A synchronous load is never reported finished receiving (vLLM asserts on it), but its
  // request gets its finished_sending once the engine finishes it.
  CHECK(c.get_finished(ids{}).recving.empty());
  const auto f = c.get_finished(w);
  CHECK(f.recving.empty());
  CHECK(f.sending == w);
  CHECK(c.stats().tracked_requests == 0);
}

TEST_CASE("wait_layers and wait_retrieves return when a layer-wise retrieve fails, and its blocks are load errors",
          "[engine][connector][layerwise][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.ping_timeout = 100ms;
  o.timeouts.request_timeout = 200ms;
  SECTION("a shorter prefix than asked for") {
    auto& c = h.connect(o);
    const auto toks = tokens(3 * ct, 32);
    h.store_prefix(c, "s", toks, 2);
    c.retrieve("p", toks, 0, range(8, 6), 0, {}, layerwise);
    REQUIRE(c.wait_layers(ids{"p"}, layout.model.num_layers, 60s));
    REQUIRE(c.wait_retrieves(ids{"p"}, 60s));
    CHECK(sorted(c.take_load_error_blocks()) == blocks{12, 13});
    CHECK(c.get_finished(ids{}).recving.empty());
  }
  SECTION("the server closes the connection while a waiter is blocked") {
    auto& c = h.connect(o);
    h.server->hold(p::message_type::retrieve_request);
    c.retrieve("e", tokens(ct, 33), 0, blocks{8, 9}, 0, {}, layerwise);
    REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
    bool returned = false;
    std::thread waiter([&] { returned = c.wait_layers(ids{"e"}, 1, 60s); });
    h.server->close_connections();
    waiter.join();
    CHECK(returned);
    CHECK(sorted(c.take_load_error_blocks()) == blocks{8, 9});
    CHECK(c.quarantined_blocks().empty());  // the server's EOF: no copy can follow
    CHECK(c.get_finished(ids{}).recving.empty());
  }
  SECTION("the deadline of the retrieve passes") {
    o.timeouts.retrieve_timeout = 100ms;
    auto& c = h.connect(o);
    h.server->hold(p::message_type::retrieve_request);
    c.retrieve("t", tokens(ct, 34), 0, blocks{8, 9}, 0, {}, layerwise);
    REQUIRE(c.wait_retrieves(ids{"t"}, 60s));
    CHECK(c.healthy());
    CHECK(sorted(c.take_load_error_blocks()) == blocks{8, 9});
    CHECK(c.quarantined_blocks() == blocks{8, 9});
    // Progress for the call given up on is ignored; the late answer releases the blocks.
    CHECK(h.server->send_progress_to_held(1) == 1);
    CHECK_FALSE(c.wait_released(blocks{9}, 30ms));
    h.server->release_held();
    REQUIRE(c.wait_released(blocks{8, 9}, 60s));
    CHECK(c.stats().ignored_progress == 1);
    CHECK(c.stats().progress_messages == 0);
    CHECK(c.get_finished(ids{}).recving.empty());
  }
  SECTION("the server hangs: the ping timeout's unhealthy edge releases the waiter") {
    auto& c = h.connect(o);
    h.server->hold(p::message_type::retrieve_request);
    c.retrieve("u", tokens(ct, 35), 0, blocks{10, 11}, 0, {}, layerwise);
    REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
    h.server->hang();
    REQUIRE(c.wait_layers(ids{"u"}, 1, 60s));
    CHECK_FALSE(c.healthy());
    CHECK(sorted(c.take_load_error_blocks()) == blocks{10, 11});
    CHECK(c.quarantined_blocks() == blocks{10, 11});  // it may still wake up and write them
    h.server->hang(false);
    h.server->release_held();
    REQUIRE(c.wait_released(blocks{10, 11}, 60s));
    CHECK(c.get_finished(ids{}).recving.empty());
  }
}

TEST_CASE("a scheduler's connector has no layers to wait for", "[engine][connector][layerwise]") {
  harness h;
  auto o = h.options();
  o.model = layout.model;
  connector<test_bus> c(o, h.bus);
  CHECK_THROWS_AS((void)c.layers_ready("x"), std::logic_error);
  CHECK_THROWS_AS(c.wait_layers(ids{"x"}, 1, 0ms), std::logic_error);
  CHECK_THROWS_AS(c.wait_retrieves(ids{"x"}, 0ms), std::logic_error);
}

// --- deadlines that agree with the server (issue 24) ------------------------------------------

namespace {

/// Waits until the fake server has answered `n` more pings (the connector pings every
/// ping_interval, 20 ms here): how the tests let time pass without sleeping blind.
void let_pings_pass(kvtier::test::fake_server& s, std::size_t n) {
  REQUIRE(s.wait_received(p::message_type::ping_request, s.received(p::message_type::ping_request) + n));
}

}  // namespace

TEST_CASE("every retrieve asks for progress, and the registration names the connector's engine",
          "[engine][connector]") {
  harness h;
  auto o = h.options();
  o.engine_id = "0b6c7e5e-8f1a-4c2d-9e3b-5a7d1c2e4f60";
  auto& c = h.connect(o);
  const auto toks = tokens(2 * ct, 40);
  h.store_prefix(c, "s", toks, 2);
  c.retrieve("r", toks, 0, range(10, 4));  // default retrieve_options
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  CHECK(h.server->retrieves().at(0).progress);
  CHECK(h.server->registrations().at(0).engine_id == o.engine_id);
  o.engine_id.assign(129, 'e');
  CHECK_THAT(o.validation_error(), Catch::Contains("engine_id"));
}

TEST_CASE("a retrieve's progress keeps it alive past retrieve_timeout, and it completes whole",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.retrieve_timeout = 300ms;  // the server's load budget: 30 s
  auto& c = h.connect(o);
  const auto toks = tokens(4 * ct, 41);
  h.store_prefix(c, "s", toks, 4);

  h.server->hold(p::message_type::retrieve_request);
  const auto start = std::chrono::steady_clock::now();
  c.retrieve("r", toks, 0, range(10, 8));
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  // News about every 100 ms (5 pings), for three times the retrieve timeout: each one
  // moves the deadline (a retrieve loading a long hit from a slow L2).
  std::uint32_t sent = 0;
  while (std::chrono::steady_clock::now() - start < 3 * o.scaled(o.timeouts.retrieve_timeout)) {
    REQUIRE(h.server->send_progress_to_held(0, std::min<std::uint32_t>(++sent, 3)) == 1);
    let_pings_pass(*h.server, 5);
  }
  CHECK(h.rec.snapshot().retrieves.empty());  // still in flight: not timed out
  CHECK(c.stats().progress_messages == sent);
  h.server->release_held();
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  const auto ev = h.rec.snapshot().retrieves.at(0);
  CHECK(ev.outcome == bus::connector_outcome::ok);
  CHECK(ev.retrieved_chunks == 4);
  CHECK(c.take_load_error_blocks().empty());
  CHECK(c.quarantined_blocks().empty());
  h.server->sync();
  for (std::uint32_t k = 0; k < 8; ++k) CHECK(block_is(h.region, 10 + k, static_cast<std::uint8_t>(1 + k)));
}

TEST_CASE("a retrieve's deadline stops at the server's load budget; ended early it counts the chunks ready",
          "[engine][connector][concurrency]") {
  harness h;
  h.start_server();
  h.server->set_load_budget_ms(200);
  auto o = h.options();
  o.timeouts.retrieve_timeout = 300ms;  // at most 500 ms after its start, whatever progress says
  auto& c = h.connect(o);
  const auto toks = tokens(4 * ct, 42);
  h.store_prefix(c, "s", toks, 4);
  for (std::uint32_t b = 10; b < 18; ++b) fill_block(h.region, b, 0);
  h.server->sync();

  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("r", toks, 0, range(10, 8));
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  // Chunks 0 and 1 are in the blocks; the server keeps saying so, and the deadline still
  // passes (the server itself gives up on a load past its budget).
  const auto give_up = std::chrono::steady_clock::now() + 20 * o.scaled(o.timeouts.retrieve_timeout);
  while (h.rec.snapshot().retrieves.empty() && std::chrono::steady_clock::now() < give_up) {
    h.server->send_progress_to_held(0, 2);
    let_pings_pass(*h.server, 5);
  }
  REQUIRE(h.rec.snapshot().retrieves.size() == 1);
  const auto ev = h.rec.snapshot().retrieves.at(0);
  CHECK(ev.outcome == bus::connector_outcome::timeout);
  CHECK(ev.retrieved_chunks == 2);
  CHECK(ev.load_error_blocks == 4);
  // Only the blocks of chunks 2 and 3 are load errors, and only they stay fenced.
  CHECK(sorted(c.take_load_error_blocks()) == range(14, 4));
  CHECK(c.quarantined_blocks() == range(14, 4));
  h.server->sync();
  for (std::uint32_t k = 0; k < 4; ++k) CHECK(block_is(h.region, 10 + k, static_cast<std::uint8_t>(1 + k)));
  CHECK(c.get_finished(ids{}).recving == ids{"r"});
  h.server->release_held();  // the late answer: the server's copy is over
  REQUIRE(c.wait_released(range(14, 4), 60s));
}

TEST_CASE("a retrieve ended by the server's close counts the chunks ready and fences nothing",
          "[engine][connector][concurrency]") {
  harness h;
  auto o = h.options();
  o.timeouts.ping_timeout = 100ms;
  auto& c = h.connect(o);
  const auto toks = tokens(3 * ct, 43);
  h.store_prefix(c, "s", toks, 3);
  h.server->hold(p::message_type::retrieve_request);
  c.retrieve("r", toks, 0, range(10, 6));
  REQUIRE(h.server->wait_received(p::message_type::retrieve_request, 1));
  REQUIRE(h.server->send_progress_to_held(0, 1) == 1);
  // The progress is read before the EOF (one connection, in order).
  h.server->close_connections();
  REQUIRE(h.wait([](const record& r) { return r.retrieves.size() == 1; }));
  const auto ev = h.rec.snapshot().retrieves.at(0);
  CHECK(ev.outcome == bus::connector_outcome::unhealthy);
  CHECK(ev.retrieved_chunks == 1);
  CHECK(sorted(c.take_load_error_blocks()) == range(12, 4));
  CHECK(c.quarantined_blocks().empty());  // the server's EOF: no copy can follow
  h.server->sync();
  for (std::uint32_t k = 0; k < 2; ++k) CHECK(block_is(h.region, 10 + k, static_cast<std::uint8_t>(1 + k)));
}

}  // namespace file_connector_test
