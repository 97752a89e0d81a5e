// The server in-process (server::server on its own thread and io_context) driven by raw
// protocol clients with engine regions: registration, every request's semantics (the
// engine <-> server contract in docs/server.md), fencing, world size 2, lock release,
// reaping, and hostile clients that must never disturb another client.
#include <kvtier/server/config/disk_backend_type.hpp>
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

// Reads until the server closes the connection (checking it ended with EOF, or a reset when
// it closed with our bytes unread); returns what came before.
std::vector<p::message> closed(raw_client& c) {
  auto [got, ec] = c.read_until_closed();
  CHECK((ec == asio::error::eof || ec == asio::error::connection_reset));
  return got;
}

// lookup + query until done, without Catch2 (for the multi-threaded test).
std::uint32_t hits(raw_client& c, std::uint64_t model_id, const std::vector<hash128>& hashes, const std::string& key) {
  c.expect(p::lookup_request{key, model_id, 1, hashes});
  for (;;) {
    auto q = c.expect(p::query_prefetch_request{key});
    if (q.state == p::prefetch_state::done) return q.hit_chunks;
    if (q.state != p::prefetch_state::pending) return 0;
  }
}

const json* client_entry(const json& status, std::uint64_t client_id) {
  for (const auto& c : status["clients"])
    if (c["client_id"] == client_id) return &c;
  return nullptr;
}

}  // namespace

TEST_CASE("a registered client gets the boot token, its client id and the model id", "[server]") {
  running_server s;
  raw_client c(s.path());
  const std::uint64_t token = c.ping();
  CHECK(token == s.srv->boot_token());
  CHECK(c.ping() == token);  // the same token on every call
  CHECK(c.ok(p::get_chunk_size_request{}).chunk_tokens == test_chunk_tokens);

  engine_region r;
  const auto reg = c.register_region(r);
  CHECK(reg.boot_token == token);
  CHECK(reg.chunk_tokens == test_chunk_tokens);
  CHECK(reg.model_id == make_model_id("test/model", small_model()));
  CHECK(reg.client_id != 0);

  const json st = c.status();
  CHECK(st["boot_token"] == token);
  CHECK(st["chunk_tokens"] == test_chunk_tokens);
  CHECK(st["l1"]["bytes_capacity"] == 256 * 4096);
  const json* me = client_entry(st, reg.client_id);
  REQUIRE(me != nullptr);
  CHECK((*me)["registered"] == true);
  CHECK((*me)["rank"] == 0);
  CHECK((*me)["world_size"] == 1);
  CHECK((*me)["model"] == "test/model");
  CHECK((*me)["instance_id"] == static_cast<std::uint64_t>(::getpid()));

  // Registering again on the same connection replaces the registration (same client id).
  const auto again = c.register_region(r);
  CHECK(again.client_id == reg.client_id);
  CHECK(c.status()["clients"].size() == 1);
}

TEST_CASE("a registration is refused with a message that says what to change", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;

  SECTION("another chunk size") {
    const auto e = c.refused(r.registration(0, 1, "test/model", 32), r.region.fd());
    CHECK(e.code == static_cast<std::uint32_t>(errc::layout_mismatch));
    CHECK_THAT(e.message, Catch::Contains("--chunk-size") && Catch::Contains("16"));
  }
  SECTION("a chunk object larger than an L1 slot") {
    engine_region big(model_shape{4, 4, 64, dtype_kind::bf16, attention_kind::mha}, test_block_size,
                      8);  // 64 KiB chunks
    const auto e = c.refused(big.registration(), big.region.fd());
    CHECK(e.code == static_cast<std::uint32_t>(errc::layout_mismatch));
    CHECK_THAT(e.message, Catch::Contains("--l1-slot-bytes 65536") && Catch::Contains("l1_slot_bytes"));
  }
  SECTION("no fd beside the frame") {
    const auto e = c.refused(r.registration());
    CHECK(e.code == static_cast<std::uint32_t>(errc::invalid_argument));
    CHECK_THAT(e.message, Catch::Contains("memfd"));
  }
  SECTION("region_bytes that do not match the layout") {
    auto req = r.registration();
    req.region_bytes += 4096;
    CHECK(c.refused(req, r.region.fd()).code == static_cast<std::uint32_t>(errc::layout_mismatch));
  }
  SECTION("an fd that is not sealed against resizing") {
    const int fd = ::memfd_create("unsealed", MFD_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(r.region.bytes())) == 0);
    const auto e = c.refused(r.registration(), fd);
    ::close(fd);
    CHECK(e.code == static_cast<std::uint32_t>(errc::layout_mismatch));
    CHECK_THAT(e.message, Catch::Contains("sealed"));
  }
  SECTION("an fd of the wrong size") {
    engine_region smaller(small_model(), test_block_size, 32);
    CHECK(c.refused(r.registration(), smaller.region.fd()).code == static_cast<std::uint32_t>(errc::layout_mismatch));
  }
  SECTION("a rank that is not below the world size") {
    CHECK(c.refused(r.registration(2, 2), r.region.fd()).code == static_cast<std::uint32_t>(errc::invalid_argument));
  }
  SECTION("a world size above 1024") {
    CHECK(c.refused(r.registration(0, 2000), r.region.fd()).code == static_cast<std::uint32_t>(errc::invalid_argument));
  }
  SECTION("a chunk that is not a whole number of blocks") {
    engine_region odd(small_model(), 3, 30);
    CHECK(c.refused(odd.registration(), odd.region.fd()).code == static_cast<std::uint32_t>(errc::layout_mismatch));
  }
  // The connection stays usable and unregistered.
  CHECK(c.ping() == s.srv->boot_token());
  CHECK(c.refused(p::query_prefetch_request{"x"}).code == static_cast<std::uint32_t>(errc::not_registered));
  CHECK(c.status()["clients"][0]["registered"] == false);
}

TEST_CASE("requests before registration answer not_registered and the connection keeps serving", "[server]") {
  running_server s;
  raw_client c(s.path());
  const auto not_registered = static_cast<std::uint32_t>(errc::not_registered);
  CHECK(c.refused(p::lookup_request{"k", 1, 1, chunk_hashes(1, 2)}).code == not_registered);
  CHECK(c.refused(p::query_prefetch_request{"k"}).code == not_registered);
  CHECK(c.refused(retrieve_req(chunk_hashes(1, 1), block_range(0, blocks_per_chunk))).code == not_registered);
  p::store_request st;
  st.chunk_hashes = chunk_hashes(1, 1);
  st.block_ids = block_range(0, blocks_per_chunk);
  st.block_generations.assign(blocks_per_chunk, 0);
  CHECK(c.refused(st).code == not_registered);
  CHECK(c.refused(p::free_lookup_locks_request{"k"}).code == not_registered);
  CHECK(c.refused(p::end_request_request{"k"}).code == not_registered);
  const auto e = c.refused(p::unregister_kv_request{});
  CHECK(e.code == not_registered);
  CHECK_THAT(e.message, Catch::Contains("register_kv_request"));
  // The four requests that need no registration.
  CHECK(c.ping() == s.srv->boot_token());
  CHECK(c.ok(p::get_chunk_size_request{}).chunk_tokens == test_chunk_tokens);
  c.ok(p::clear_request{false});
  CHECK(c.status()["lookups"] == 0);
}

TEST_CASE("store, lookup and retrieve move the exact bytes into the right blocks", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(7, 3);
  const auto src = block_range(0, 3 * blocks_per_chunk);  // blocks 0..11
  r.fill_blocks(src, 1000);

  const auto stored = c.ok(store_req(r, hashes, src));
  CHECK(stored.stored == 3);
  CHECK(stored.already_present == 0);
  CHECK(stored.failed == 0);
  CHECK(c.status()["l1"]["objects"] == 3);

  const auto q = lookup_done(c, reg.model_id, hashes);
  CHECK(q.hit_chunks == 3);
  CHECK(q.l1_hit_chunks == 3);
  // A finished lookup keeps answering done with the same numbers.
  CHECK(c.ok(p::query_prefetch_request{"req-1"}) == q);

  // Retrieve into other blocks (30..41, filled with 0xee) skipping the first 6 tokens:
  // block 30 (tokens 0-3) and tokens 0-1 of block 31 stay as they were.
  const auto dst = block_range(30, 3 * blocks_per_chunk);
  for (auto b : dst) r.zero_block(b, 0xee);
  const auto got = c.ok(retrieve_req(hashes, dst, 6));
  CHECK(got.retrieved_chunks == 3);
  for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(r.token_is(dst[0], t, 0xee));
  CHECK(r.token_is(dst[1], 0, 0xee));
  CHECK(r.token_is(dst[1], 1, 0xee));
  CHECK(r.same_token(dst[1], src[1], 2));
  CHECK(r.same_token(dst[1], src[1], 3));
  for (std::size_t i = 2; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) {
      INFO("block " << dst[i] << " token " << t);
      CHECK(r.same_token(dst[i], src[i], t));
    }

  // Storing the same chunks again copies nothing.
  const auto again = c.ok(store_req(r, hashes, src));
  CHECK(again.stored == 0);
  CHECK(again.already_present == 3);

  // end_request forgets the lookup.
  c.ok(p::end_request_request{"req-1"});
  CHECK(c.ok(p::query_prefetch_request{"req-1"}).state == p::prefetch_state::unknown);
  CHECK(c.ok(p::query_prefetch_request{"never-looked-up"}).state == p::prefetch_state::unknown);
}

TEST_CASE("a layer-wise retrieve of an L1 hit sends non-decreasing layer progress before its answer, none after",
          "[server][layerwise]") {
  // 4 layers: an 8 KiB chunk object.
  const model_shape m{4, 2, 16, dtype_kind::bf16, attention_kind::mha};
  running_server s([](server::server_config& c) {
    c.l1_slot_bytes = 8192;
    c.l1_size_bytes = 64 * 8192;
  });
  raw_client c(s.path());
  engine_region r(m);
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(21, 3);
  const auto src = block_range(0, 3 * blocks_per_chunk);
  r.fill_blocks(src, 300);
  REQUIRE(c.ok(store_req(r, hashes, src)).stored == 3);
  REQUIRE(lookup_done(c, reg.model_id, hashes).l1_hit_chunks == 3);

  const auto dst = block_range(30, 3 * blocks_per_chunk);
  for (auto b : dst) r.zero_block(b, 0xee);
  auto req = retrieve_req(hashes, dst, 6);
  req.progress = true;
  constexpr std::uint64_t call = 1000;
  REQUIRE_FALSE(c.send(call, req));
  std::vector<std::uint32_t> progress;
  std::optional<p::retrieve_response> answer;
  while (!answer) {
    auto [ec, f] = c.read_frame();
    REQUIRE_FALSE(ec);
    CHECK(f.header.call_id == call);
    auto msg = p::decode_message(f);
    REQUIRE(msg.has_value());
    if (auto* pr = std::get_if<p::retrieve_progress>(&*msg)) {
      progress.push_back(pr->layers_ready);
    } else {
      REQUIRE(std::holds_alternative<p::retrieve_response>(*msg));
      answer = std::get<p::retrieve_response>(*msg);
    }
  }
  CHECK(answer->retrieved_chunks == 3);
  // Every chunk was in L1: the copy went layer by layer, and at least the first layer was
  // reported (a progress is queued before the copy's completion is).
  REQUIRE_FALSE(progress.empty());
  CHECK(std::is_sorted(progress.begin(), progress.end()));
  CHECK(progress.front() >= 1);
  CHECK(progress.back() < m.num_layers);  // the answer itself means every layer
  // The bytes: the same as a whole-chunk retrieve writes (tokens 0-5 skipped).
  for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(r.token_is(dst[0], t, 0xee));
  CHECK(r.token_is(dst[1], 1, 0xee));
  CHECK(r.same_token(dst[1], src[1], 2));
  for (std::size_t i = 2; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) {
      INFO("block " << dst[i] << " token " << t);
      CHECK(r.same_token(dst[i], src[i], t));
    }
  // Nothing follows the answer: the next frame is the next request's.
  CHECK(c.ping() == s.srv->boot_token());
  // Without the flag, a retrieve is answered without progress (ok() takes the first frame).
  c.ok(p::lookup_request{"req-2", reg.model_id, 1, hashes});
  CHECK(c.ok(retrieve_req(hashes, block_range(50, 3 * blocks_per_chunk), 0, 0, "req-2")).retrieved_chunks == 3);
  // A client may not send what only the server sends.
  const auto e = c.refused(p::retrieve_progress{1});
  CHECK(e.code == static_cast<std::uint32_t>(errc::protocol_error));
  CHECK_THAT(e.message, Catch::Contains("server"));
}

TEST_CASE("a retrieve answers the contiguous prefix that is in L1 and writes nothing past it", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(8, 3);
  r.fill_blocks(block_range(0, 3 * blocks_per_chunk), 5);
  // Chunks 0 and 2 are stored, chunk 1 is not: only chunk 0 can be retrieved.
  c.ok(store_req(r, {hashes[0]}, block_range(0, blocks_per_chunk)));
  c.ok(store_req(r, {hashes[2]}, block_range(2 * blocks_per_chunk, blocks_per_chunk)));
  CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 1);
  const auto dst = block_range(40, 3 * blocks_per_chunk);
  for (auto b : dst) r.zero_block(b, 0x11);
  CHECK(c.ok(retrieve_req(hashes, dst)).retrieved_chunks == 1);
  CHECK(r.same_token(dst[0], 0, 0));
  for (std::size_t i = blocks_per_chunk; i < dst.size(); ++i) CHECK(r.token_is(dst[i], 0, 0x11));
}

TEST_CASE("a retrieve or store with bad counts, block ids or rank is refused and copies nothing", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(9, 1);
  r.fill_blocks(block_range(0, blocks_per_chunk), 3);
  c.ok(store_req(r, hashes, block_range(0, blocks_per_chunk)));
  lookup_done(c, reg.model_id, hashes);
  for (auto b : block_range(8, blocks_per_chunk)) r.zero_block(b, 0x22);
  const auto invalid = static_cast<std::uint32_t>(errc::invalid_argument);

  auto out_of_range = block_range(8, blocks_per_chunk);
  out_of_range.back() = 64;  // the region has 64 blocks
  auto e = c.refused(retrieve_req(hashes, out_of_range));
  CHECK(e.code == invalid);
  CHECK_THAT(e.message, Catch::Contains("block id 64"));
  CHECK(c.refused(retrieve_req(hashes, block_range(8, blocks_per_chunk - 1))).code == invalid);
  CHECK(c.refused(retrieve_req(hashes, block_range(8, blocks_per_chunk), 0, 1)).code == invalid);
  for (auto b : block_range(8, blocks_per_chunk)) CHECK(r.token_is(b, 0, 0x22));

  auto st = store_req(r, chunk_hashes(10, 1), block_range(0, blocks_per_chunk));
  st.block_ids[0] = 1000;
  CHECK(c.refused(st).code == invalid);
  CHECK(c.refused(store_req(r, chunk_hashes(10, 1), block_range(0, blocks_per_chunk), 1)).code == invalid);
  CHECK(c.status()["l1"]["objects"] == 1);

  // A lookup for another model or world size is refused too.
  CHECK(c.refused(p::lookup_request{"k", reg.model_id + 1, 1, hashes}).code == invalid);
  CHECK(c.refused(p::lookup_request{"k", reg.model_id, 2, hashes}).code == invalid);
}

TEST_CASE("a ping is answered while a retrieve of the same connection is still copying", "[server][concurrency]") {
  // Issue 13 item 10: the connector judges the server's health by its pings, on the same
  // connection as its retrieves and stores; a ping must never wait behind a copy. The copy
  // of chunk 0 blocks in the hook until the ping's answer has arrived.
  hook_gate copy(false);
  server::server_options opts;
  opts.hooks.during_copy = [&](std::uint64_t) { copy.pass(); };
  running_server s({}, std::move(opts));
  raw_client c(s.path());
  engine_region r;
  c.register_region(r);
  const auto hashes = chunk_hashes(78, 2);
  const auto src = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(src, 6);
  REQUIRE(c.ok(store_req(r, hashes, src)).stored == 2);
  copy.arm();
  REQUIRE_FALSE(c.send(101, retrieve_req(hashes, block_range(20, 2 * blocks_per_chunk), 0)));
  REQUIRE(copy.wait_entered());
  REQUIRE_FALSE(c.send(102, p::ping_request{42}));
  auto [ec, f] = c.read_frame();  // the copy is still blocked: only the ping can be answered
  REQUIRE_FALSE(ec);
  CHECK(f.header.call_id == 102);
  CHECK(f.header.type == p::message_type::ping_response);
  copy.open();
  auto [ec2, f2] = c.read_frame();
  REQUIRE_FALSE(ec2);
  CHECK(f2.header.call_id == 101);
  auto reply = p::decode_message(f2);
  REQUIRE(reply.has_value());
  REQUIRE(std::holds_alternative<p::retrieve_response>(*reply));
  CHECK(std::get<p::retrieve_response>(*reply).retrieved_chunks == 2);
}

TEST_CASE("a registration is answered before its region's pages are faulted in, and pings meanwhile",
          "[server][concurrency]") {
  // Faulting a region's pages in takes as long as allocating them: tens of seconds for the KV
  // cache of a large engine, far beyond the connector's 2 s deadline for a registration (the
  // engine never registered). On the I/O thread it also held up every connection's pings.
  // The prefault blocks in the hook until the registration and the pings of another
  // connection and of the registering one were answered.
  if (!kv_region::populate_supported()) {
    WARN("this kernel has no MADV_POPULATE_WRITE: the registry prefaults before answering");
    SUCCEED();
    return;
  }
  hook_gate prefault(true);
  server::server_options opts;
  opts.hooks.during_prefault = [&](std::uint64_t) { prefault.pass(); };
  running_server s({}, std::move(opts));
  raw_client other(s.path());
  raw_client c(s.path());
  engine_region r;
  REQUIRE_FALSE(c.send(7, r.registration(), r.region.fd()));
  REQUIRE(prefault.wait_entered());
  auto [ec, f] = c.read_frame();
  REQUIRE_FALSE(ec);
  CHECK(f.header.call_id == 7);
  auto reply = p::decode_message(f);
  REQUIRE(reply.has_value());
  REQUIRE(std::holds_alternative<p::register_kv_response>(*reply));
  CHECK(std::get<p::register_kv_response>(*reply).boot_token == s.srv->boot_token());
  CHECK(other.ping() == s.srv->boot_token());
  CHECK(c.ping() == s.srv->boot_token());
  CHECK(prefault.inside());  // answered while the prefault was blocked, not after the hook gave up
  prefault.open();
  // Registered: a store and a retrieve through the region (behind the prefault's slices).
  const auto hashes = chunk_hashes(79, 1);
  const auto src = block_range(0, blocks_per_chunk);
  r.fill_blocks(src, 9);
  REQUIRE(c.ok(store_req(r, hashes, src)).stored == 1);
  const auto dst = block_range(30, blocks_per_chunk);
  REQUIRE(c.ok(retrieve_req(hashes, dst)).retrieved_chunks == 1);
  for (std::uint32_t i = 0; i < blocks_per_chunk; ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(r.same_token(dst[i], src[i], t));
}

TEST_CASE("a region unregistered while its pages are being faulted in stops the prefault, and nothing breaks",
          "[server][concurrency]") {
  if (!kv_region::populate_supported()) {
    WARN("this kernel has no MADV_POPULATE_WRITE: the registry prefaults before answering");
    SUCCEED();
    return;
  }
  hook_gate prefault(true);
  server::server_options opts;
  opts.hooks.during_prefault = [&](std::uint64_t) { prefault.pass(); };
  running_server s({}, std::move(opts));
  {
    raw_client c(s.path());
    engine_region r;
    c.register_region(r);
    REQUIRE(prefault.wait_entered());
  }  // the connection closes: the server reaps the registration and unmaps the region
  raw_client other(s.path());
  wait_for_status(other, [](const nlohmann::json& st) { return st["clients"].size() == 1; });  // `other` only
  prefault.open();
  // The prefault went on to an unmapped range (it stops, it does not crash); a new engine
  // registers and copies as usual.
  engine_region r2;
  raw_client c2(s.path());
  c2.register_region(r2);
  const auto hashes = chunk_hashes(81, 1);
  const auto src = block_range(0, blocks_per_chunk);
  r2.fill_blocks(src, 5);
  REQUIRE(c2.ok(store_req(r2, hashes, src)).stored == 1);
  CHECK(other.ping() == s.srv->boot_token());
}

TEST_CASE("a connection closed while its copy runs on the worker pool closes only once the copy ended",
          "[server][concurrency]") {
  // The promise engines rely on (quarantine release): EOF on a connection proves that no
  // copy for it runs any more. The copy of chunk 0 blocks in the hook while the server
  // decides to close the connection (shutdown); EOF must not come before it was let go.
  std::mutex m;
  std::condition_variable cv;
  bool armed = false, in_copy = false, go = false;
  std::atomic<bool> released{false};
  server::server_options opts;
  opts.hooks.during_copy = [&](std::uint64_t) {
    std::unique_lock g(m);
    if (!armed) return;
    armed = false;
    in_copy = true;
    cv.notify_all();
    cv.wait(g, [&] { return go; });
  };
  running_server s({}, std::move(opts));
  raw_client c(s.path());
  engine_region r;
  c.register_region(r);
  const auto hashes = chunk_hashes(77, 2);
  const auto src = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(src, 5);
  REQUIRE(c.ok(store_req(r, hashes, src)).stored == 2);
  {
    std::lock_guard g(m);
    armed = true;
  }
  std::atomic<bool> eof_before_release{false}, answered{false};
  std::thread client([&] {
    try {
      c.call(retrieve_req(hashes, block_range(20, 2 * blocks_per_chunk), 0));
      answered = true;  // a reply that came before the close is fine too
    } catch (const std::runtime_error&) {
      eof_before_release = !released.load();  // the connection ended: was the copy let go?
    }
  });
  {
    std::unique_lock g(m);
    REQUIRE(cv.wait_for(g, server_deadline, [&] { return in_copy; }));
  }
  // Decide the close (shutdown closes every connection) and wait until the I/O thread ran
  // past it: the shutdown coroutine starts on the turn after stop()'s, so two hops.
  program::stop_server(*s.srv);
  std::promise<void> past_close;
  asio::post(s.srv->io_context(), [&] { asio::post(s.srv->io_context(), [&] { past_close.set_value(); }); });
  REQUIRE(past_close.get_future().wait_for(server_deadline) == std::future_status::ready);
  released = true;
  {
    std::lock_guard g(m);
    go = true;
  }
  cv.notify_all();
  client.join();
  CHECK_FALSE(eof_before_release);
}

TEST_CASE("a store whose blocks were reused is fenced: counted failed, key absent", "[server]") {
  std::atomic<int> bumps{0};
  engine_region r;
  server::server_options opts;
  // The engine "reuses" the first block of every store while the server copies.
  std::atomic<bool> reuse_during_copy{false};
  opts.hooks.after_store_copy = [&](std::uint64_t, std::span<const std::uint32_t> blocks) {
    if (!reuse_during_copy.load()) return;
    r.region.begin_reuse(blocks[0]);
    bumps.fetch_add(1);
  };
  running_server s({}, std::move(opts));
  raw_client c(s.path());
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(11, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(blocks, 9);

  SECTION("generations that changed before the request arrived") {
    auto req = store_req(r, hashes, blocks);
    r.region.begin_reuse(blocks[blocks_per_chunk + 1]);  // a block of chunk 1
    const auto res = c.ok(req);
    CHECK(res.stored == 1);
    CHECK(res.failed == 1);
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 1);
    c.ok(p::end_request_request{"req-1"});
    CHECK(lookup_done(c, reg.model_id, {hashes[1]}).hit_chunks == 0);
  }
  SECTION("a generation bumped while the server copies") {
    reuse_during_copy = true;
    const auto res = c.ok(store_req(r, hashes, blocks));
    CHECK(bumps.load() == 1);
    CHECK(res.stored == 1);  // chunk 1's blocks were untouched
    CHECK(res.failed == 1);
    CHECK(lookup_done(c, reg.model_id, {hashes[0]}).hit_chunks == 0);
  }
  CHECK(c.status()["l1"]["objects"] == 1);
}

TEST_CASE("world size 2: a chunk hits only when both ranks stored their shard; each rank retrieves its own",
          "[server]") {
  running_server s;
  raw_client c0(s.path()), c1(s.path());
  engine_region r0, r1;
  const auto reg0 = c0.register_region(r0, 0, 2);
  const auto reg1 = c1.register_region(r1, 1, 2);
  CHECK(reg0.model_id == reg1.model_id);
  const auto hashes = chunk_hashes(12, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  r0.fill_blocks(blocks, 100);
  r1.fill_blocks(blocks, 200);  // another shard: other bytes
  CHECK(c0.ok(store_req(r0, hashes, blocks, 0)).stored == 2);
  CHECK(c1.ok(store_req(r1, {hashes[0]}, block_range(0, blocks_per_chunk), 1)).stored == 1);

  // The scheduler (rank 0) looks up for both ranks: chunk 1 lacks rank 1's shard.
  const auto q = lookup_done(c0, reg0.model_id, hashes, 2);
  CHECK(q.hit_chunks == 1);
  // The lookup is the scheduler's connection's own: rank 1 holds none under that key.
  CHECK(c1.ok(p::query_prefetch_request{"req-1"}).state == p::prefetch_state::unknown);

  const auto dst = block_range(20, blocks_per_chunk);
  CHECK(c1.ok(retrieve_req({hashes[0]}, dst, 0, 1)).retrieved_chunks == 1);
  CHECK(c0.ok(retrieve_req({hashes[0]}, dst, 0, 0)).retrieved_chunks == 1);
  for (std::uint32_t i = 0; i < blocks_per_chunk; ++i) {
    CHECK(r0.same_token(dst[i], blocks[i], 1));
    CHECK(r1.same_token(dst[i], blocks[i], 1));
    CHECK_FALSE(r0.same_token(dst[i], dst[i], 1, &r1));  // rank 0 got rank 0's shard, not rank 1's
  }
  // Rank 1 asking with rank 0's rank is refused.
  CHECK(c1.refused(retrieve_req({hashes[0]}, dst, 0, 0)).code == static_cast<std::uint32_t>(errc::invalid_argument));
}

TEST_CASE("free_lookup_locks and end_request give the lookup's locks back", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(13, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(blocks, 1);
  c.ok(store_req(r, hashes, blocks));
  auto evictable = [&] { return c.status()["l1"]["evictable"].get<std::size_t>(); };
  CHECK(evictable() == 2);

  SECTION("free_lookup_locks") {
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 2);
    CHECK(evictable() == 0);  // read-locked for the retrieve
    const json st = c.status();
    CHECK(st["lookups"] == 1);
    CHECK((*client_entry(st, reg.client_id))["lookups"] == 1);
    c.ok(p::free_lookup_locks_request{"req-1"});
  }
  SECTION("end_request") {
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 2);
    c.ok(p::end_request_request{"req-1"});
  }
  SECTION("a retrieve releases the keys it was given") {
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 2);
    CHECK(c.ok(retrieve_req(hashes, block_range(30, 2 * blocks_per_chunk))).retrieved_chunks == 2);
    CHECK(evictable() == 2);
    c.ok(p::end_request_request{"req-1"});
  }
  SECTION("a second lookup under the same key replaces the first") {
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 2);
    CHECK(lookup_done(c, reg.model_id, {hashes[0]}).hit_chunks == 1);
    CHECK(evictable() == 1);
    c.ok(p::end_request_request{"req-1"});
  }
  CHECK(evictable() == 2);
  CHECK(c.status()["lookups"] == 0);
  c.ok(p::free_lookup_locks_request{"unknown keys are fine"});
}

TEST_CASE("the open lookups of one connection are bounded by max_lookups_per_client", "[server]") {
  running_server s([](server::server_config& c) { c.max_lookups_per_client = 2; });
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto h = chunk_hashes(18, 1);
  c.ok(p::lookup_request{"a", reg.model_id, 1, h});
  c.ok(p::lookup_request{"b", reg.model_id, 1, h});
  const auto e = c.refused(p::lookup_request{"c", reg.model_id, 1, h});
  CHECK(e.code == static_cast<std::uint32_t>(errc::out_of_memory));
  CHECK_THAT(e.message, Catch::Contains("end_request"));
  c.ok(p::lookup_request{"a", reg.model_id, 1, h});  // replacing its own lookup is fine
  c.ok(p::end_request_request{"b"});
  c.ok(p::lookup_request{"c", reg.model_id, 1, h});
  CHECK(c.status()["lookups"] == 2);
}

TEST_CASE("a client that disconnects or unregisters is reaped: registration and lookups released", "[server]") {
  running_server s;
  raw_client observer(s.path());
  engine_region r;
  const auto hashes = chunk_hashes(14, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(blocks, 4);
  std::uint64_t gone = 0;
  {
    raw_client c(s.path());
    const auto reg = c.register_region(r);
    gone = reg.client_id;
    c.ok(store_req(r, hashes, blocks));
    CHECK(lookup_done(c, reg.model_id, hashes).hit_chunks == 2);
    CHECK(observer.status()["l1"]["evictable"] == 0);
    SECTION("unregister") {
      c.ok(p::unregister_kv_request{});
      const json st = observer.status();
      CHECK(st["lookups"] == 0);
      CHECK((*client_entry(st, gone))["registered"] == false);
      CHECK(c.refused(p::query_prefetch_request{"req-1"}).code == static_cast<std::uint32_t>(errc::not_registered));
    }
    SECTION("disconnect") { CHECK(c.ping() == s.srv->boot_token()); }
  }  // the client's socket closes here
  const json st = wait_for_status(observer, [&](const json& j) { return client_entry(j, gone) == nullptr; });
  CHECK(st["lookups"] == 0);
  CHECK(st["l1"]["evictable"] == 2);  // the locks went with the client; the data stays
  CHECK(st["clients"].size() == 1);
}

TEST_CASE("a silent client is reaped after client_reap_timeout", "[server]") {
  running_server s([](server::server_config& c) { c.client_reap_timeout_s = 0.3; });
  raw_client c(s.path());
  engine_region r;
  c.register_region(r);
  c.ok(p::lookup_request{"req-1", make_model_id("test/model", small_model()), 1, chunk_hashes(1, 1)});
  // Silent from here on: the server closes the connection (EOF on our side).
  CHECK(closed(c).empty());
  raw_client after(s.path());
  const json st = after.status();
  CHECK(st["clients"].size() == 1);  // only `after`
  CHECK(st["lookups"] == 0);
  CHECK(s.srv->metrics().value("kvtier_server_clients_reaped_total").value_or(0) >= 1);
}

TEST_CASE("malformed, truncated, oversized and random frames affect only their own connection", "[server]") {
  running_server s;
  raw_client good(s.path());
  engine_region r;
  const auto reg = good.register_region(r);
  const auto hashes = chunk_hashes(15, 1);
  r.fill_blocks(block_range(0, blocks_per_chunk), 8);
  good.ok(store_req(r, hashes, block_range(0, blocks_per_chunk)));

  auto header = [](std::uint16_t version, std::uint16_t type, std::uint64_t call_id, std::uint32_t body) {
    std::vector<std::byte> b(p::frame_header_size);
    p::encode_header(p::frame_header{version, static_cast<p::message_type>(type), call_id, body},
                     std::span<std::byte, p::frame_header_size>(b.data(), p::frame_header_size));
    return b;
  };
  auto code_of = [](const p::message& m) {
    REQUIRE(std::holds_alternative<p::error_response>(m));
    return std::get<p::error_response>(m).code;
  };

  SECTION("garbage bytes: an error, then the connection is closed") {
    raw_client bad(s.path());
    std::vector<std::byte> junk(100);
    for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<std::byte>(i * 37 + 1);
    REQUIRE_FALSE(bad.send_bytes(junk));
    const auto got = closed(bad);
    REQUIRE(got.size() == 1);
    CHECK(code_of(got[0]) == static_cast<std::uint32_t>(errc::protocol_error));
  }
  SECTION("an oversized frame: message_too_large with its call id, then closed") {
    raw_client bad(s.path());
    REQUIRE_FALSE(bad.send_bytes(header(p::protocol_version, 0x0003, 77, p::default_max_body_bytes + 1)));
    auto [ec, f] = bad.read_frame();
    REQUIRE_FALSE(ec);
    CHECK(f.header.call_id == 77);
    auto m = p::decode_message(f);
    REQUIRE(m.has_value());
    CHECK(code_of(*m) == static_cast<std::uint32_t>(errc::message_too_large));
    CHECK(closed(bad).empty());
  }
  SECTION("another protocol version: version_mismatch, then closed") {
    raw_client bad(s.path());
    REQUIRE_FALSE(bad.send_bytes(header(p::protocol_version + 1, 0x0009, 5, 8)));
    const auto got = closed(bad);
    REQUIRE(got.size() == 1);
    CHECK(code_of(got[0]) == static_cast<std::uint32_t>(errc::version_mismatch));
  }
  SECTION("a truncated frame, then EOF: the server closes") {
    raw_client bad(s.path());
    auto frame = p::encode_frame(9, p::lookup_request{"k", reg.model_id, 1, chunk_hashes(1, 4)}).value();
    frame.resize(frame.size() / 2);
    REQUIRE_FALSE(bad.send_bytes(frame));
    bad.shutdown_write();
    CHECK(closed(bad).empty());
  }
  SECTION("answerable errors keep the connection: unknown type, a response, a field too long, a short body") {
    raw_client bad(s.path());
    REQUIRE_FALSE(bad.send_bytes(header(p::protocol_version, 0x0777, 1, 0)));
    auto [ec1, f1] = bad.read_frame();
    REQUIRE_FALSE(ec1);
    CHECK(code_of(p::decode_message(f1).value()) == static_cast<std::uint32_t>(errc::protocol_error));

    REQUIRE_FALSE(bad.send_bytes(p::encode_frame(2, p::ping_response{1, 2}).value()));
    auto [ec2, f2] = bad.read_frame();
    REQUIRE_FALSE(ec2);
    CHECK(f2.header.call_id == 2);
    CHECK(code_of(p::decode_message(f2).value()) == static_cast<std::uint32_t>(errc::protocol_error));

    p::query_prefetch_request long_key{std::string(p::max_request_key_bytes + 1, 'k')};
    REQUIRE_FALSE(bad.send_bytes(
        p::detail::encode_unchecked(p::frame_header{p::protocol_version, long_key.type, 3, 0}, long_key)));
    auto [ec3, f3] = bad.read_frame();
    REQUIRE_FALSE(ec3);
    CHECK(code_of(p::decode_message(f3).value()) == static_cast<std::uint32_t>(errc::message_too_large));

    auto body_short = header(p::protocol_version, 0x0009, 4, 3);  // ping needs 8 bytes
    body_short.insert(body_short.end(), 3, std::byte{1});
    REQUIRE_FALSE(bad.send_bytes(body_short));
    auto [ec4, f4] = bad.read_frame();
    REQUIRE_FALSE(ec4);
    CHECK(code_of(p::decode_message(f4).value()) == static_cast<std::uint32_t>(errc::protocol_error));

    CHECK(bad.ping() == s.srv->boot_token());  // still served
  }
  SECTION("random frames: each is answered or the connection closed, never a crash") {
    std::mt19937_64 rng(20240501);
    for (int round = 0; round < 20; ++round) {
      raw_client bad(s.path());
      for (int i = 0; i < 20; ++i) {
        std::vector<std::byte> f;
        const auto pick = rng() % 4;
        const std::uint16_t type =
            pick == 0 ? static_cast<std::uint16_t>(rng()) : static_cast<std::uint16_t>(1 + rng() % 12);
        const std::uint32_t body = static_cast<std::uint32_t>(rng() % 64);
        f = header(pick == 1 ? static_cast<std::uint16_t>(rng() % 3) : p::protocol_version, type, rng(), body);
        for (std::uint32_t k = 0; k < body; ++k) f.push_back(static_cast<std::byte>(rng()));
        if (pick == 3) f.resize(rng() % f.size());  // cut anywhere, also inside the header
        if (bad.send_bytes(f)) break;               // the server closed on us: fine
      }
      bad.shutdown_write();
      (void)closed(bad);  // answers (any), then EOF, within the deadline
    }
  }

  // The well-behaved client never noticed.
  CHECK(good.ping() == s.srv->boot_token());
  const json st = good.status();
  const json* me = client_entry(st, reg.client_id);
  REQUIRE(me != nullptr);
  CHECK((*me)["registered"] == true);
  CHECK(lookup_done(good, reg.model_id, hashes, 1, "after").hit_chunks <= 1);  // a random clear may have run
  CHECK(good.ok(p::get_chunk_size_request{}).chunk_tokens == test_chunk_tokens);
}

TEST_CASE("clear drops unlocked L1 objects, and with force the locked ones too", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(16, 2);
  r.fill_blocks(block_range(0, 2 * blocks_per_chunk), 2);
  c.ok(store_req(r, hashes, block_range(0, 2 * blocks_per_chunk)));
  CHECK(lookup_done(c, reg.model_id, {hashes[0]}).hit_chunks == 1);  // chunk 0 locked
  c.ok(p::clear_request{false});
  CHECK(c.status()["l1"]["objects"] == 1);
  c.ok(p::clear_request{true});
  CHECK(c.status()["l1"]["objects"] == 0);
  c.ok(p::end_request_request{"req-1"});
  CHECK(c.status()["l1"]["slots_used"] == 0);
}

TEST_CASE("the server registers L1 with a disk backend (fixed buffers) once resident, unless l1_prefault is off",
          "[server][disk]") {
  for (const bool prefault : {true, false}) {
    CAPTURE(prefault);
    temp_dir disk{"kvtier-disk"};
    server::backend_factory factory = server::backend_factory::builtin_copy();
    server::add_disk_backend_type(factory);
    running_server s(
        [&](server::server_config& c) {
          c.l2_backends = {
              json{{"type", "disk"}, {"path", (disk.path() / "l2").string()}, {"capacity_bytes", 64 << 20}}};
          c.l1_prefault = prefault;
        },
        {}, factory);
    {
      // The prefault and the registration run behind the first requests.
      raw_client c(s.path());
      const auto st = wait_for_status(c, [](const json& j) {
        return j["l1"]["residency"] != "faulting" && j["l1"]["residency"] != "registering";
      });
      CHECK(st["l1"]["residency"] == (prefault ? "resident" : "off"));
    }
    const std::string page = s.srv->metrics_text();
    const auto uring = metric_value(page, "kvtier_io_uring_enabled");
    REQUIRE(uring.has_value());
    if (*uring != 1.0) {
      WARN("io_uring refused here: the disk backend reads with pread, nothing to register");
      continue;
    }
    const auto bytes_v = metric_value(page, "kvtier_io_fixed_buffer_bytes");
    const auto refused_v = metric_value(page, "kvtier_io_fixed_buffer_registration_failures_total");
    REQUIRE(bytes_v.has_value());
    REQUIRE(refused_v.has_value());
    const double bytes = *bytes_v, refused = *refused_v;
    if (!prefault) {
      CHECK(bytes == 0);
      CHECK(refused == 0);
    } else if (refused > 0) {
      WARN("the kernel refused the fixed buffers here (RLIMIT_MEMLOCK?): counted, reads go on without them");
      CHECK(bytes == 0);
    } else {
      CHECK(bytes == static_cast<double>(s.cfg.l1_size_bytes));  // the whole arena
    }
  }
}

TEST_CASE("an L2 backend serves chunks L1 dropped, through the prefetch", "[server]") {
  running_server s([](server::server_config& c) {
    c.l2_backends = {json{{"type", "memory"}, {"name", "mem"}, {"capacity_mb", 16}}};
    c.prefetch_policy = server::prefetch_wait_kind::wait_complete;
  });
  raw_client c(s.path());
  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(17, 2);
  const auto src = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(src, 77);
  CHECK(c.ok(store_req(r, hashes, src)).stored == 2);
  // Wait until the store pipeline put both in L2, then drop L1.
  wait_for_status(c,
                  [](const json& j) { return j["backends"][0]["objects"] == 2 && j["store"]["inflight_tasks"] == 0; });
  c.ok(p::clear_request{false});
  CHECK(c.status()["l1"]["objects"] == 0);
  const auto q = lookup_done(c, reg.model_id, hashes);
  CHECK(q.hit_chunks == 2);
  CHECK(q.l1_hit_chunks == 0);
  const auto dst = block_range(40, 2 * blocks_per_chunk);
  CHECK(c.ok(retrieve_req(hashes, dst)).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i) CHECK(r.same_token(dst[i], src[i], 3));
  c.ok(p::end_request_request{"req-1"});
  CHECK(c.status()["backends"][0]["name"] == "mem");
}

namespace {

struct http_answer {
  int status = 0;
  std::string body;
};

// One GET over a fresh connection (Connection: close), every read bounded by SO_RCVTIMEO.
http_answer http_get(std::uint16_t port, const std::string& path) {
  asio::io_context io;
  asio::ip::tcp::socket sock(io);
  sock.connect(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  const timeval tv{static_cast<time_t>(std::chrono::duration_cast<std::chrono::seconds>(server_deadline).count()), 0};
  ::setsockopt(sock.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  asio::write(sock, asio::buffer(req));
  std::string out;
  error_code ec;
  char buf[4096];
  for (;;) {
    const std::size_t n = sock.read_some(asio::buffer(buf), ec);
    out.append(buf, n);
    if (ec) break;
  }
  http_answer a;
  REQUIRE(out.starts_with("HTTP/1.1 "));
  a.status = std::stoi(out.substr(9, 3));
  const auto head_end = out.find("\r\n\r\n");
  REQUIRE(head_end != std::string::npos);
  a.body = out.substr(head_end + 4);
  return a;
}

// The value of the sample `series` (name with its labels, as exposed) in a Prometheus text.
std::optional<double> sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(series + " ")) return std::stod(line.substr(series.size() + 1));
  return std::nullopt;
}

}  // namespace

TEST_CASE("the HTTP endpoint serves /metrics at zero from start-up, /healthz with the boot token, and /status",
          "[server][http]") {
  running_server s([](server::server_config& c) {
    c.metrics_any_port = true;
    c.l2_backends = {json{{"type", "memory"}, {"name", "mem"}, {"capacity_mb", 16}}};
  });
  const std::uint16_t port = s.srv->metrics_port();
  REQUIRE(port != 0);
  CHECK(s.srv->metrics_url() == fmt::format("http://127.0.0.1:{}", port));
  CHECK_THAT(s.srv->startup_line(), Catch::Contains(fmt::format("metrics http://127.0.0.1:{}/metrics", port)));

  // Before any traffic: every series the gate and the dashboard read is there, at zero.
  const http_answer first = http_get(port, "/metrics");
  CHECK(first.status == 200);
  for (const char* series :
       {"kvtier_l1_write_keys_total", "kvtier_l2_store_keys_total{backend=\"mem\"}",
        "kvtier_l2_store_succeeded_keys_total{backend=\"mem\"}", "kvtier_l2_prefetch_lookups_total",
        "kvtier_l2_prefetch_hit_keys_total", "kvtier_l2_prefetch_loaded_keys_total",
        "kvtier_lookup_requested_tokens_total", "kvtier_lookup_hit_tokens_total{tier=\"l1\"}",
        "kvtier_lookup_hit_tokens_total{tier=\"l2\"}", "kvtier_l1_bytes_used", "kvtier_l2_bytes_used{backend=\"mem\"}",
        "kvtier_prefetch_requests_active", "kvtier_prefetch_inflight_load_bytes", "kvtier_store_inflight_bytes",
        "kvtier_server_connections", "kvtier_event_bus_dropped_events_total"}) {
    INFO(series);
    CHECK(sample(first.body, series) == 0.0);
  }
  CHECK(sample(first.body, "kvtier_l1_bytes_capacity") == 256.0 * 4096);

  const http_answer health = http_get(port, "/healthz");
  CHECK(health.status == 200);
  const json h = json::parse(health.body);
  CHECK(h["status"] == "serving");
  CHECK(h["boot_token"] == s.srv->boot_token());
  CHECK(http_get(port, "/no-such-page").status == 404);

  // Traffic moves the counters and the gauges.
  raw_client c(s.path());
  engine_region r;
  c.register_region(r);
  const auto hashes = chunk_hashes(18, 2);
  const auto src = block_range(0, 2 * blocks_per_chunk);
  r.fill_blocks(src, 5);
  CHECK(c.ok(store_req(r, hashes, src)).stored == 2);
  wait_for_status(c,
                  [](const json& j) { return j["backends"][0]["objects"] == 2 && j["store"]["inflight_tasks"] == 0; });
  const std::string text = http_get(port, "/metrics").body;
  CHECK(sample(text, "kvtier_l1_write_keys_total") == 2.0);
  CHECK(sample(text, "kvtier_l2_store_keys_total{backend=\"mem\"}") == 2.0);
  CHECK(sample(text, "kvtier_l2_store_succeeded_keys_total{backend=\"mem\"}") == 2.0);
  CHECK(sample(text, "kvtier_server_connections") == 1.0);
  CHECK(sample(text, "kvtier_l1_bytes_used") == 2.0 * 4096);

  const http_answer st = http_get(port, "/status");
  CHECK(st.status == 200);
  const json j = json::parse(st.body);
  CHECK(j["connections"] == 1);
  CHECK(j["clients"].size() == 1);
  CHECK(j["backends"][0]["objects"] == 2);
  CHECK(j["backends"][0]["healthy"] == true);
  CHECK(j["l1"]["objects"] == 2);
  CHECK(j["metrics_url"] == s.srv->metrics_url());
}

TEST_CASE("many clients storing, looking up and retrieving at once, beside a hostile one", "[server][concurrency]") {
  running_server s([](server::server_config& c) { c.l1_size_bytes = 1024 * 4096; });
  constexpr int clients = 3;
  constexpr int rounds = 15;
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < clients; ++t)
    threads.emplace_back([&, t] {
      try {
        raw_client c(s.path());
        engine_region r;
        const auto reg = c.register_region(r);
        for (int i = 0; i < rounds; ++i) {
          const std::string key = fmt::format("t{}-{}", t, i);
          const auto hashes = chunk_hashes(static_cast<std::uint32_t>(1000 * t + i), 2);
          const auto src = block_range(0, 2 * blocks_per_chunk);
          r.fill_blocks(src, static_cast<std::uint32_t>(t * 50 + i));
          if (c.expect(store_req(r, hashes, src, 0, key)).stored != 2) failures.fetch_add(1);
          if (hits(c, reg.model_id, hashes, key) != 2) failures.fetch_add(1);
          const auto dst = block_range(32, 2 * blocks_per_chunk);
          if (c.expect(retrieve_req(hashes, dst, 0, 0, key)).retrieved_chunks != 2) failures.fetch_add(1);
          for (std::size_t b = 0; b < dst.size(); ++b)
            if (!r.same_token(dst[b], src[b], 2)) failures.fetch_add(1);
          c.expect(p::end_request_request{key});
        }
      } catch (const std::exception&) {
        failures.fetch_add(1000);
      }
    });
  std::thread hostile([&] {
    std::mt19937 rng(7);
    try {
      while (!done.load()) {
        raw_client bad(s.path());
        std::vector<std::byte> junk(1 + rng() % 200);
        for (auto& b : junk) b = static_cast<std::byte>(rng());
        (void)bad.send_bytes(junk);
        bad.shutdown_write();
        (void)bad.read_until_closed();
      }
    } catch (const std::exception&) {
      failures.fetch_add(1000);
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  hostile.join();
  CHECK(failures.load() == 0);
  raw_client c(s.path());
  const json st = wait_for_status(c, [](const json& j) { return j["clients"].size() == 1; });
  CHECK(st["lookups"] == 0);
}
