// The status document's "held" (docs/server.md, "Status JSON"): what the server hands out
// and must get back, each read where it is held. Every field is 0 on a fresh server and
// again once the clients are quiet; a lookup's L1 read locks and keys, and a retrieve's copy
// blocked on the worker pool (server_hooks::during_copy), show while they are held.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <set>
#include <string>

using namespace kvtier;
using namespace kvtier::test;
using nlohmann::json;

namespace {

/// Whether every field of status["held"] is 0.
bool all_given_back(const json& status) {
  for (const auto& field : status["held"].items())
    if (field.value() != 0) return false;
  return true;
}

std::size_t held_field(const json& status, const char* name) { return status["held"][name].get<std::size_t>(); }

}  // namespace

TEST_CASE("held is all 0 on a fresh server, shows a lookup's L1 read locks and keys, and is 0 once it is freed",
          "[server][status]") {
  running_server s;
  raw_client c(s.path());
  json st = c.status();
  REQUIRE(st["held"].is_object());
  std::set<std::string> names;
  for (const auto& field : st["held"].items()) names.insert(field.key());
  CHECK(names == std::set<std::string>{"l1_read_locked", "l1_write_locked", "lookup_keys", "requests_in_flight",
                                       "copies_in_flight", "store_staged_bytes"});
  CHECK(all_given_back(st));

  engine_region r;
  const auto reg = c.register_region(r);
  const auto hashes = chunk_hashes(41, 3);
  const auto blocks = block_range(0, hashes.size() * blocks_per_chunk);
  r.fill_blocks(blocks, 41);
  REQUIRE(c.ok(store_req(r, hashes, blocks)).stored == hashes.size());
  wait_for_status(c, all_given_back);  // the store, and its pipeline, gave everything back

  REQUIRE(lookup_done(c, reg.model_id, hashes, 1, "req-held").hit_chunks == hashes.size());
  st = c.status();
  CHECK(held_field(st, "l1_read_locked") == hashes.size());  // the lookup's holds, one object each
  CHECK(held_field(st, "lookup_keys") == hashes.size());     // chunks x world size 1
  CHECK(held_field(st, "l1_write_locked") == 0);
  CHECK(held_field(st, "requests_in_flight") == 0);  // the status request does not count itself
  CHECK(held_field(st, "copies_in_flight") == 0);

  c.ok(p::free_lookup_locks_request{"req-held"});
  st = c.status();
  CHECK(held_field(st, "l1_read_locked") == 0);
  CHECK(held_field(st, "lookup_keys") == 0);
  CHECK(all_given_back(st));
}

TEST_CASE("held counts a retrieve whose copy runs on the worker pool, and is 0 once it is answered",
          "[server][status][concurrency]") {
  hook_gate copy(false);
  server::server_options opts;
  opts.hooks.during_copy = [&](std::uint64_t) { copy.pass(); };
  running_server s({}, std::move(opts));
  raw_client c(s.path());
  raw_client watcher(s.path());  // c's lane is busy with the retrieve: the status comes from here
  engine_region r;
  c.register_region(r);
  const auto hashes = chunk_hashes(42, 2);
  const auto src = block_range(0, hashes.size() * blocks_per_chunk);
  r.fill_blocks(src, 42);
  REQUIRE(c.ok(store_req(r, hashes, src)).stored == hashes.size());
  wait_for_status(watcher, all_given_back);

  copy.arm();
  REQUIRE_FALSE(c.send(7, retrieve_req(hashes, block_range(20, hashes.size() * blocks_per_chunk))));
  REQUIRE(copy.wait_entered());
  json st = watcher.status();
  CHECK(held_field(st, "copies_in_flight") == 1);
  CHECK(held_field(st, "requests_in_flight") == 1);
  CHECK(held_field(st, "l1_read_locked") == hashes.size());  // the copy pins what it copies
  CHECK(held_field(st, "lookup_keys") == 0);
  copy.open();
  auto [ec, f] = c.read_frame();
  REQUIRE_FALSE(ec);
  CHECK(f.header.call_id == 7);
  CHECK(f.header.type == p::message_type::retrieve_response);
  // The answer goes out once the copy's completion ran: nothing is held by then.
  CHECK(all_given_back(watcher.status()));
}
