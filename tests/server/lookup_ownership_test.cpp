// Lookups belong to the connection that made them (issue 13, item 3). Two engines of one
// model that number their requests alike ("0", "1", ... in vLLM's offline mode) never see,
// replace, release or end each other's lookups; a scheduler's lookup is queried, freed and
// ended by the scheduler only, and a worker's retrieve of the same request id copies but
// leaves the scheduler's holds alone.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

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
