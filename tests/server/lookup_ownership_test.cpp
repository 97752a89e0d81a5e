// Lookups belong to the engine that made them (issue 13, item 3; issue 24, problems 3 and 4).
// Two engines of one model that number their requests alike ("0", "1", ... in vLLM's offline
// mode) never see, replace, release or end each other's lookups. A connection registered
// without an engine id is an engine of its own: a scheduler's lookup there is queried,
// freed and ended by the scheduler only, and a worker's retrieve of the same request id
// copies but leaves the scheduler's holds alone. Connections declared as one engine
// (register_kv_request::engine_id, with the peer's uid) share its lookups: a worker's
// retrieve copies through the scheduler's lookup, each chunk as its L2 load lands, every
// rank the whole hit, and each rank's holds go back when its retrieve ends; a registration
// that disagrees with its engine is refused.
//
// For the L2 loads still landing the backend is a memory backend whose loads hang until the
// test lets them go (l2::fault_injecting_backend, fault_kind::hang): the retrieves start
// while every load is in flight, exactly as long as the test says, no timing.
#include <kvtier/server/server.hpp>

#include <kvtier/l2/fault_injecting_backend.hpp>
#include <kvtier/l2/memory_backend.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <boost/asio/post.hpp>

#include <memory>
#include <string>
#include <vector>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

/// Stores `hashes` from blocks `first`.. of `r`, filled with a pattern of `seed` first;
/// returns the blocks.
std::vector<std::uint32_t> store_prompt(raw_client& c, const engine_region& r, const std::vector<hash128>& hashes,
                                        std::uint32_t first, std::uint32_t seed) {
  const auto blocks = block_range(first, hashes.size() * blocks_per_chunk);
  r.fill_blocks(blocks, seed);
  REQUIRE(c.ok(store_req(r, hashes, blocks, 0, "store-" + std::to_string(seed))).stored == hashes.size());
  return blocks;
}

/// Queries `key` until its prefetch is done (or unknown); returns the answer.
p::query_prefetch_response query_done(raw_client& c, const std::string& key) {
  const auto deadline = std::chrono::steady_clock::now() + server_deadline;
  for (;;) {
    auto q = c.ok(p::query_prefetch_request{key});
    if (q.state != p::prefetch_state::pending) return q;
    REQUIRE(std::chrono::steady_clock::now() < deadline);
  }
}

/// Retrieves `hashes` into blocks from `first` on and checks every token against
/// `source_blocks` of `source`, where they were stored from.
void retrieve_exact(raw_client& c, const engine_region& r, const std::vector<hash128>& hashes, std::uint32_t first,
                    const engine_region& source, const std::vector<std::uint32_t>& source_blocks,
                    const std::string& key) {
  const auto blocks = block_range(first, hashes.size() * blocks_per_chunk);
  for (auto b : blocks) r.zero_block(b, 0xEE);
  REQUIRE(c.ok(retrieve_req(hashes, blocks, 0, 0, key)).retrieved_chunks == hashes.size());
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) REQUIRE(r.same_token(blocks[i], source_blocks[i], t, &source));
}

std::size_t lookups_of(const json& status, std::uint64_t client_id) {
  for (const auto& c : status["clients"])
    if (c["client_id"] == client_id) return c["lookups"].get<std::size_t>();
  return 0;
}

}  // namespace

TEST_CASE("two engines of one model with the same request ids keep their own lookups, hits and holds",
          "[server][lookups]") {
  running_server s;
  raw_client a(s.path());
  raw_client b(s.path());
  engine_region ra, rb;
  const auto rega = a.register_region(ra);
  const auto regb = b.register_region(rb);
  REQUIRE(rega.model_id == regb.model_id);  // one model: one namespace of chunks

  // Each engine caches its own prompts (different chunks), then both number their
  // requests "0" and "1".
  const auto a0 = chunk_hashes(100, 3);
  const auto a1 = chunk_hashes(101, 1);
  const auto b0 = chunk_hashes(200, 2);
  const auto b1 = chunk_hashes(201, 4);
  const auto a0_blocks = store_prompt(a, ra, a0, 0, 10);
  const auto a1_blocks = store_prompt(a, ra, a1, 12, 11);
  store_prompt(b, rb, b0, 0, 20);
  const auto b1_blocks = store_prompt(b, rb, b1, 8, 21);

  // Interleaved lookups under the same keys.
  a.ok(p::lookup_request{"0", rega.model_id, 1, a0});
  b.ok(p::lookup_request{"0", regb.model_id, 1, b0});
  b.ok(p::lookup_request{"1", regb.model_id, 1, b1});
  a.ok(p::lookup_request{"1", rega.model_id, 1, a1});
  CHECK(query_done(a, "0").hit_chunks == 3);
  CHECK(query_done(b, "0").hit_chunks == 2);
  CHECK(query_done(a, "1").hit_chunks == 1);
  CHECK(query_done(b, "1").hit_chunks == 4);
  json st = a.status();
  CHECK(st["lookups"] == 4);
  CHECK(lookups_of(st, rega.client_id) == 2);
  CHECK(lookups_of(st, regb.client_id) == 2);

  // B retrieves its "1" (its chunks, its bytes) and ends both of its requests: A's lookups
  // under the same keys are untouched.
  retrieve_exact(b, rb, b1, 32, rb, b1_blocks, "1");
  b.ok(p::free_lookup_locks_request{"0"});
  b.ok(p::end_request_request{"0"});
  b.ok(p::end_request_request{"1"});
  CHECK(query_done(b, "0").state == p::prefetch_state::unknown);
  const auto qa = query_done(a, "0");
  CHECK(qa.state == p::prefetch_state::done);
  CHECK(qa.hit_chunks == 3);
  st = a.status();
  CHECK(st["lookups"] == 2);
  CHECK(lookups_of(st, rega.client_id) == 2);
  CHECK(lookups_of(st, regb.client_id) == 0);

  // L1 pressure: B stores far more than L1 holds (into blocks 48..63, so its other blocks
  // keep their bytes). Only A's held chunks are sure to stay.
  for (std::uint32_t round = 0; round < 72; ++round) {
    const auto filler = chunk_hashes(1000 + round, 4);
    b.ok(store_req(rb, filler, block_range(48, filler.size() * blocks_per_chunk), 0, "filler"));
  }
  CHECK(lookup_done(b, regb.model_id, b0, 1, "probe").hit_chunks == 0);  // B's own unheld chunks went
  b.ok(p::end_request_request{"probe"});

  // A's retrieves land every chunk with A's bytes.
  retrieve_exact(a, ra, a0, 32, ra, a0_blocks, "0");
  retrieve_exact(a, ra, a1, 48, ra, a1_blocks, "1");
  a.ok(p::end_request_request{"0"});
  a.ok(p::end_request_request{"1"});
  CHECK(a.status()["lookups"] == 0);
}

TEST_CASE("a scheduler's lookup is its own; a worker retrieves the same request id without releasing it",
          "[server][lookups]") {
  running_server s;
  raw_client worker(s.path());
  raw_client sched(s.path());
  engine_region r;
  const auto wreg = worker.register_region(r);
  p::register_kv_request sr;
  sr.instance_id = static_cast<std::uint64_t>(::getpid());
  sr.world_size = 1;
  sr.model_name = "test/model";
  sr.model = small_model();
  sr.chunk_tokens = test_chunk_tokens;
  sr.region = p::region_kind::none;
  const auto sreg = sched.expect(sr);
  REQUIRE(sreg.model_id == wreg.model_id);

  const auto hashes = chunk_hashes(300, 3);
  const auto src = store_prompt(worker, r, hashes, 0, 30);
  auto evictable = [&] { return sched.status()["l1"]["evictable"].get<std::size_t>(); };
  CHECK(evictable() == 3);

  CHECK(lookup_done(sched, sreg.model_id, hashes, 1, "0").hit_chunks == 3);
  CHECK(evictable() == 0);
  // The worker holds no lookup under "0": it cannot query the scheduler's.
  CHECK(worker.ok(p::query_prefetch_request{"0"}).state == p::prefetch_state::unknown);
  // Its retrieve copies the chunks and leaves the scheduler's holds in place.
  retrieve_exact(worker, r, hashes, 32, r, src, "0");
  CHECK(evictable() == 0);
  // Neither may the worker end or free them.
  worker.ok(p::free_lookup_locks_request{"0"});
  worker.ok(p::end_request_request{"0"});
  CHECK(evictable() == 0);
  const auto q = sched.ok(p::query_prefetch_request{"0"});
  CHECK(q.state == p::prefetch_state::done);
  CHECK(q.hit_chunks == 3);
  json st = sched.status();
  CHECK(lookups_of(st, sreg.client_id) == 1);
  CHECK(lookups_of(st, wreg.client_id) == 0);

  // The scheduler's end_request gives them back.
  sched.ok(p::end_request_request{"0"});
  CHECK(evictable() == 3);
  CHECK(sched.status()["lookups"] == 0);

  SECTION("or the scheduler's connection going away") {
    CHECK(lookup_done(sched, sreg.model_id, hashes, 1, "1").hit_chunks == 3);
    CHECK(evictable() == 0);
    sched.ok(p::unregister_kv_request{});
    CHECK(evictable() == 3);
  }
}

// --- one engine across connections (issue 24) ------------------------------------------

namespace {

struct l2_memory_holder {
  explicit l2_memory_holder(boost::asio::any_io_executor ex) : mem(std::move(ex), l2::memory_backend_options{}) {}
  l2::memory_backend mem;
};

/// A memory L2 backend behind a fault injector (its loads are made to hang).
struct hanging_l2_backend : l2_memory_holder, l2::fault_injecting_backend<l2::memory_backend> {
  explicit hanging_l2_backend(boost::asio::any_io_executor ex)
      : l2_memory_holder(std::move(ex)), l2::fault_injecting_backend<l2::memory_backend>(mem) {}
};

/// A scheduler's registration of engine `engine_id`: no region, the workers' shape.
p::register_kv_request scheduler_of_engine(std::string engine_id, std::uint16_t world_size,
                                    std::string model = "test/model") {
  p::register_kv_request r;
  r.instance_id = static_cast<std::uint64_t>(::getpid());
  r.world_size = world_size;
  r.model_name = std::move(model);
  r.model = small_model();
  r.chunk_tokens = test_chunk_tokens;
  r.region = p::region_kind::none;
  r.engine_id = std::move(engine_id);
  return r;
}

/// Worker rank `rank` of engine `engine_id` registers its region on `c`.
p::register_kv_response register_engine_worker(raw_client& c, const engine_region& r, std::string engine_id,
                                        std::uint16_t rank, std::uint16_t world_size) {
  auto req = r.registration(rank, world_size);
  req.engine_id = std::move(engine_id);
  return c.expect(req, r.region.fd());
}

/// Reads `c`'s frames of call `call_id` until its retrieve_response; counts the progress
/// frames before it (each one's chunks_ready non-decreasing).
p::retrieve_response read_retrieve_answer(raw_client& c, std::uint64_t call_id, std::size_t* progress = nullptr) {
  std::uint32_t chunks_ready = 0;
  for (;;) {
    auto [ec, f] = c.read_frame();
    REQUIRE_FALSE(ec);
    REQUIRE(f.header.call_id == call_id);
    auto m = p::decode_message(f);
    REQUIRE(m.has_value());
    if (const auto* pr = std::get_if<p::retrieve_progress>(&*m)) {
      CHECK(pr->chunks_ready >= chunks_ready);
      chunks_ready = pr->chunks_ready;
      if (progress != nullptr) ++*progress;
      continue;
    }
    REQUIRE(std::holds_alternative<p::retrieve_response>(*m));
    const auto answer = std::get<p::retrieve_response>(*m);
    CHECK(answer.retrieved_chunks >= chunks_ready);  // progress said these were final
    return answer;
  }
}

std::uint64_t requests_handled(const json& status, std::uint64_t client_id) {
  for (const auto& c : status["clients"])
    if (c["client_id"] == client_id) return c["requests"].get<std::uint64_t>();
  return 0;
}

}  // namespace

TEST_CASE("a scheduler's lookup serves every rank's retrieve on other connections while its L2 loads land",
          "[server][engine]") {
  std::shared_ptr<hanging_l2_backend> backend;
  running_server s(
      [](server::server_config& c) {
        c.l2_backends = {json{{"type", "hanging"}}};
        c.prefetch_policy = server::prefetch_wait_kind::wait_complete;
      },
      {}, factory_with("hanging", backend));
  const std::string engine = "9f1c2d3e-engine";
  constexpr std::uint16_t ws = 2;
  constexpr std::size_t n = 4;  // chunks of the prompt
  raw_client sched(s.path());
  raw_client w0(s.path());
  raw_client w1(s.path());
  engine_region r0, r1;
  const auto sreg = sched.expect(scheduler_of_engine(engine, ws));
  const auto reg0 = register_engine_worker(w0, r0, engine, 0, ws);
  const auto reg1 = register_engine_worker(w1, r1, engine, 1, ws);
  REQUIRE(sreg.model_id == reg0.model_id);
  CHECK(sreg.load_budget_ms == 30000);  // the prefetch load timeout
  CHECK(sched.status()["engines"] == 1);

  // Each rank stores its shard of the prompt; the store pipeline puts all 8 objects in L2,
  // then L1 is emptied: every hit must come from L2.
  const auto hashes = chunk_hashes(2400, n);
  const auto src = block_range(0, n * blocks_per_chunk);
  r0.fill_blocks(src, 100);
  r1.fill_blocks(src, 200);
  REQUIRE(w0.ok(store_req(r0, hashes, src, 0, "store")).stored == n);
  REQUIRE(w1.ok(store_req(r1, hashes, src, 1, "store")).stored == n);
  wait_for_status(sched, [&](const json& j) {
    return j["backends"][0]["objects"] == ws * n && j["store"]["inflight_tasks"] == 0;
  });
  sched.ok(p::clear_request{false});
  REQUIRE(sched.status()["l1"]["objects"] == 0);

  // Every load hangs: the scheduler's lookup is decided (the hit is known) with all of
  // them still in flight.
  backend->inject(l2::fault{l2::fault_op::load, l2::fault_kind::hang});
  const auto answer = sched.ok(p::lookup_request{"req-0", sreg.model_id, ws, hashes, "", true});
  REQUIRE(answer.state == p::prefetch_state::done);
  CHECK(answer.hit_chunks == n);
  CHECK(answer.l1_hit_chunks == 0);

  // Rank 0 retrieves the whole hit; rank 1 only chunks 1..3 (the engine had chunk 0), as
  // vLLM's workers do, each on its own connection, with progress.
  const auto dst = block_range(32, n * blocks_per_chunk);
  for (auto b : dst) {
    r0.zero_block(b, 0xEE);
    r1.zero_block(b, 0xEE);
  }
  auto q0 = retrieve_req(hashes, dst, 0, 0, "req-0");
  q0.progress = true;
  auto q1 = retrieve_req(std::vector<hash128>(hashes.begin() + 1, hashes.end()),
                         block_range(32 + blocks_per_chunk, (n - 1) * blocks_per_chunk), 0, 1, "req-0");
  q1.first_chunk = 1;
  q1.progress = true;
  const std::uint64_t before0 = requests_handled(sched.status(), reg0.client_id);
  const std::uint64_t before1 = requests_handled(sched.status(), reg1.client_id);
  REQUIRE_FALSE(w0.send(500, q0));
  REQUIRE_FALSE(w1.send(501, q1));
  // Both retrieves are being handled (waiting for the loads) before any load may land.
  wait_for_status(sched, [&](const json& j) {
    return requests_handled(j, reg0.client_id) > before0 && requests_handled(j, reg1.client_id) > before1;
  });
  json held = sched.status();
  CHECK(held["l1"]["slots_used"] == ws * n);  // the lookup's loads, reserved
  CHECK(held["l1"]["evictable"] == 0);
  boost::asio::post(s.srv->io_context(), [b = backend] { b->release_hung(); });

  std::size_t progress0 = 0;
  const auto a0 = read_retrieve_answer(w0, 500, &progress0);
  const auto a1 = read_retrieve_answer(w1, 501);
  CHECK(a0.retrieved_chunks == n);      // every chunk served: 0 load errors
  CHECK(a1.retrieved_chunks == n - 1);  // all it asked for
  CHECK(progress0 >= 1);
  for (std::size_t i = 0; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) {
      INFO("block " << dst[i] << " token " << t);
      REQUIRE(r0.same_token(dst[i], src[i], t));
      if (i >= blocks_per_chunk) REQUIRE(r1.same_token(dst[i], src[i], t));
    }
  CHECK(r1.token_is(dst[0], 0, 0xEE));  // rank 1's chunk 0 was not asked for: not written

  // The last rank copied: every hold of the lookup is back (rank 1's chunk 0 shard too),
  // although the scheduler has not ended the request, so L1 freed the objects it loaded
  // for this one reader (temporary: L2 has them); the lookup still answers.
  const json st = sched.status();
  CHECK(st["l1"]["objects"] == 0);
  CHECK(st["l1"]["slots_used"] == 0);
  CHECK(st["lookups"] == 1);
  const auto q = sched.ok(p::query_prefetch_request{"req-0"});
  CHECK(q.state == p::prefetch_state::done);
  CHECK(q.hit_chunks == n);
  // Any connection of the engine may end it.
  w1.ok(p::end_request_request{"req-0"});
  CHECK(sched.status()["lookups"] == 0);
  CHECK(sched.ok(p::query_prefetch_request{"req-0"}).state == p::prefetch_state::unknown);
}

TEST_CASE("a rank's retrieve gives back that rank's holds; the other rank's stay until it retrieves",
          "[server][engine]") {
  running_server s;
  const std::string engine = "engine-holds";
  raw_client sched(s.path());
  raw_client w0(s.path());
  raw_client w1(s.path());
  engine_region r0, r1;
  const auto sreg = sched.expect(scheduler_of_engine(engine, 2));
  register_engine_worker(w0, r0, engine, 0, 2);
  register_engine_worker(w1, r1, engine, 1, 2);
  const auto hashes = chunk_hashes(2500, 3);
  const auto src = block_range(0, 3 * blocks_per_chunk);
  r0.fill_blocks(src, 10);
  r1.fill_blocks(src, 20);
  REQUIRE(w0.ok(store_req(r0, hashes, src, 0)).stored == 3);
  REQUIRE(w1.ok(store_req(r1, hashes, src, 1)).stored == 3);
  auto evictable = [&] { return sched.status()["l1"]["evictable"].get<std::size_t>(); };
  REQUIRE(evictable() == 6);
  REQUIRE(lookup_done(sched, sreg.model_id, hashes, 2, "r").hit_chunks == 3);
  CHECK(evictable() == 0);
  // Rank 0 asks for chunk 2 only: all three of its shards go back.
  auto q0 = retrieve_req({hashes[2]}, block_range(40, blocks_per_chunk), 0, 0, "r");
  q0.first_chunk = 2;
  CHECK(w0.ok(q0).retrieved_chunks == 1);
  CHECK(evictable() == 3);
  CHECK(r0.same_token(40, src[2 * blocks_per_chunk], 1));
  // Rank 1's holds stayed for its retrieve, which gets every chunk it asks for.
  CHECK(w1.ok(retrieve_req(hashes, block_range(40, 3 * blocks_per_chunk), 0, 1, "r")).retrieved_chunks == 3);
  CHECK(evictable() == 6);
  CHECK(sched.status()["lookups"] == 1);  // the scheduler still ends it
  sched.ok(p::end_request_request{"r"});
  CHECK(sched.status()["lookups"] == 0);
}

TEST_CASE("two engines with the same request ids keep their lookups apart across their connections",
          "[server][engine]") {
  running_server s;
  raw_client sa(s.path()), wa(s.path()), sb(s.path()), wb(s.path()), lone(s.path());
  engine_region ra, rb, rl;
  const auto rega = sa.expect(scheduler_of_engine("engine-a", 1));
  const auto regb = sb.expect(scheduler_of_engine("engine-b", 1));
  register_engine_worker(wa, ra, "engine-a", 0, 1);
  register_engine_worker(wb, rb, "engine-b", 0, 1);
  lone.register_region(rl);  // no engine id: an engine of its own
  REQUIRE(rega.model_id == regb.model_id);
  CHECK(sa.status()["engines"] == 2);

  const auto ha = chunk_hashes(2600, 3);
  const auto hb = chunk_hashes(2601, 2);
  const auto src = block_range(0, 3 * blocks_per_chunk);
  ra.fill_blocks(src, 30);
  rb.fill_blocks(src, 40);
  REQUIRE(wa.ok(store_req(ra, ha, src)).stored == 3);
  REQUIRE(wb.ok(store_req(rb, hb, block_range(0, 2 * blocks_per_chunk))).stored == 2);

  // Both schedulers (and the lone engine) look up request "0", each its own prompt.
  CHECK(lookup_done(sa, rega.model_id, ha, 1, "0").hit_chunks == 3);
  CHECK(lookup_done(sb, regb.model_id, hb, 1, "0").hit_chunks == 2);
  CHECK(lookup_done(lone, rega.model_id, hb, 1, "0").hit_chunks == 2);
  CHECK(sa.status()["lookups"] == 3);
  // Each engine's worker sees its own scheduler's lookup.
  CHECK(wa.ok(p::query_prefetch_request{"0"}).hit_chunks == 3);
  CHECK(wb.ok(p::query_prefetch_request{"0"}).hit_chunks == 2);
  // B's worker retrieves B's "0" (B's bytes) and ends it: A's and the lone one stay.
  const auto dst = block_range(32, 2 * blocks_per_chunk);
  CHECK(wb.ok(retrieve_req(hb, dst, 0, 0, "0")).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i) CHECK(rb.same_token(dst[i], src[i], 2));
  wb.ok(p::end_request_request{"0"});
  CHECK(sb.ok(p::query_prefetch_request{"0"}).state == p::prefetch_state::unknown);
  const auto qa = sa.ok(p::query_prefetch_request{"0"});
  CHECK(qa.state == p::prefetch_state::done);
  CHECK(qa.hit_chunks == 3);
  CHECK(lone.ok(p::query_prefetch_request{"0"}).hit_chunks == 2);
  CHECK(sa.status()["lookups"] == 2);
  // A's lookup goes with A's scheduler's connection (it issued it), not with its worker's.
  wa.ok(p::unregister_kv_request{});
  CHECK(sa.status()["lookups"] == 2);
  sa.ok(p::unregister_kv_request{});
  CHECK(lone.status()["lookups"] == 1);
}

TEST_CASE("a registration that disagrees with its engine on the model or world size is refused",
          "[server][engine]") {
  running_server s;
  raw_client sched(s.path());
  raw_client w(s.path());
  engine_region r;
  sched.expect(scheduler_of_engine("engine-x", 2));

  SECTION("another world size") {
    auto req = r.registration(0, 1);
    req.engine_id = "engine-x";
    const auto e = w.refused(req, r.region.fd());
    CHECK(e.code == static_cast<std::uint32_t>(errc::invalid_argument));
    CHECK_THAT(e.message, Catch::Contains("engine_id 'engine-x'") && Catch::Contains("world size 2") &&
                              Catch::Contains("world size 1"));
  }
  SECTION("another model") {
    auto req = r.registration(0, 2, "other/model");
    req.engine_id = "engine-x";
    const auto e = w.refused(req, r.region.fd());
    CHECK_THAT(e.message, Catch::Contains("'test/model'") && Catch::Contains("'other/model'"));
  }
  SECTION("another registration salt") {
    auto req = r.registration(0, 2);
    req.engine_id = "engine-x";
    req.cache_salt = "tenant";
    CHECK_THAT(w.refused(req, r.region.fd()).message, Catch::Contains("cache salt"));
  }
  // Refused, the connection is not registered; agreeing, it joins.
  CHECK(w.refused(p::query_prefetch_request{"q"}).code == static_cast<std::uint32_t>(errc::not_registered));
  auto ok = r.registration(1, 2);
  ok.engine_id = "engine-x";
  w.expect(ok, r.region.fd());
  const json st = sched.status();
  CHECK(st["engines"] == 1);
  for (const auto& c : st["clients"]) CHECK(c["engine_connections"] == 2);
  // Registering again with the same engine keeps the scope: the connection's lookups stay.
  sched.ok(p::unregister_kv_request{});
  const auto again = w.expect(ok, r.region.fd());
  REQUIRE(lookup_done(w, again.model_id, chunk_hashes(2700, 1), 2, "kept").state == p::prefetch_state::done);
  w.expect(ok, r.region.fd());
  CHECK(w.status()["lookups"] == 1);
  // Without the scheduler the engine's only member may change its model (a new engine).
  auto other = r.registration(0, 1, "other/model");
  other.engine_id = "engine-x";
  w.expect(other, r.region.fd());
}
