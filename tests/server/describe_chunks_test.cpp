// describe_chunks_request (issue 28: KV events for routers): a server with no KV event
// subscriber keeps nothing and answers described=false; with one attached (the key relay's
// sink) the description reaches it on the bus's deferred path as bus::chunks_described, with
// the request's salt folded into the model id exactly as a lookup folds it; malformed
// descriptions are refused with reasons and the connection stays usable.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

#include <kvtier/core/model_id.hpp>
#include <kvtier/kv_events/tier_key_relay.hpp>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_describe_chunks_test {

using namespace kvtier;
using namespace kvtier::test;

/// A tier_key_sink that keeps the descriptions it is handed (on the bus's drain thread).
class description_sink final : public kv_events::tier_key_sink {
 public:
  void on(const bus::tier_keys_stored&) override {}
  void on(const bus::tier_keys_removed&) override {}
  void on(const bus::chunks_described& e) override {
    std::lock_guard g(m_);
    got_.push_back(e);
    cv_.notify_all();
  }
  /// Waits until `n` descriptions arrived; all of them (fewer after server_deadline).
  std::vector<bus::chunks_described> wait(std::size_t n) {
    std::unique_lock l(m_);
    cv_.wait_for(l, server_deadline, [&] { return got_.size() >= n; });
    return got_;
  }
  std::size_t count() {
    std::lock_guard g(m_);
    return got_.size();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<bus::chunks_described> got_;
};

/// A scheduler's registration (no region) of the test model.
p::register_kv_request scheduler_registration(std::uint16_t world_size = 1) {
  p::register_kv_request r;
  r.instance_id = static_cast<std::uint64_t>(::getpid());
  r.world_size = world_size;
  r.model_name = "test/model";
  r.model = small_model();
  r.chunk_tokens = test_chunk_tokens;
  r.region = p::region_kind::none;
  return r;
}

/// A valid description of `chunks` chunks (tokens 1000 * seed + i) in blocks of 4.
p::describe_chunks_request description(const p::register_kv_response& reg, std::uint16_t world_size, std::uint32_t seed,
                                       std::size_t chunks, std::string salt = {}) {
  p::describe_chunks_request d;
  d.model_id = reg.model_id;
  d.world_size = world_size;
  d.cache_salt = std::move(salt);
  d.block_size = test_block_size;
  d.chunk_hashes = chunk_hashes(seed, chunks);
  for (std::uint32_t i = 0; i < chunks * test_chunk_tokens; ++i) d.token_ids.push_back(1000 * seed + i);
  return d;
}

TEST_CASE("server::detail::is_one_msgpack_value accepts exactly one complete value", "[server][describe]") {
  using server::detail::is_one_msgpack_value;
  using namespace std::string_literals;
  for (const std::string& v : {"\xc0"s, "\x01"s, "\xff"s, "\x93\x01\xa1x\xc3"s, "\x81\xa1k\x92\x01\x02"s,
                               "\xd9\x03"
                               "abc"s,
                               "\xcd\x01\x02"s, "\xd3\x00\x00\x00\x00\x00\x00\x00\x01"s, "\xc4\x02\x00\x00"s,
                               "\xd4\x01\x02"s, "\xdc\x00\x02\xc2\xc2"s, "\xc7\x01\x05x"s, "\x90"s, "\x80"s}) {
    INFO(v.size() << " bytes");
    CHECK(is_one_msgpack_value(v));
  }
  for (const std::string& v : {""s, "\xc1"s, "\xc0\xc0"s, "\x92\x01"s,
                               "\xd9\x05"
                               "ab"s,
                               "\xdd\xff\xff\xff\xff"s, "\xcf\x01"s, "\x81\xa1k"s,
                               "\xa3"
                               "ab"s,
                               "\xc7\x02\x05x"s}) {
    INFO(v.size() << " bytes");
    CHECK_FALSE(is_one_msgpack_value(v));
  }
  // Deep nesting is no recursion: 100000 nested one-element arrays around a nil.
  std::string deep(100000, '\x91');
  deep.push_back('\xc0');
  CHECK(is_one_msgpack_value(deep));
  deep.pop_back();
  CHECK_FALSE(is_one_msgpack_value(deep));
}

TEST_CASE("a server without a KV event subscriber answers described=false and keeps nothing", "[server][describe]") {
  description_sink sink;  // outlives the server; never attached here
  running_server s;
  REQUIRE_FALSE(bus::wants_kind<bus::chunks_described>(s.srv->bus()));
  raw_client c(s.path());
  const auto reg = c.expect(scheduler_registration());
  CHECK_FALSE(c.ok(description(reg, 1, 3, 2)).described);
  // Still checked: a malformed description is refused by every server.
  auto bad = description(reg, 1, 3, 2);
  bad.token_ids.pop_back();
  CHECK(c.refused(bad).error() == errc::invalid_argument);
  CHECK(sink.count() == 0);
}

TEST_CASE("with a KV event subscriber, a description reaches it with the salted model id and the tokens",
          "[server][describe]") {
  description_sink sink;
  running_server s;
  s.srv->bus().subscriber<kv_events::tier_key_relay>().attach(&sink);
  REQUIRE(bus::wants_kind<bus::chunks_described>(s.srv->bus()));

  // The scheduler (no region, world size 2) describes two chunks that follow a parent, with
  // a LoRA adapter and one extra key per block; the worker (rank 0 with a region) one chunk.
  raw_client sched(s.path());
  const auto reg = sched.expect(scheduler_registration(2));
  auto d = description(reg, 2, 5, 2, "tenant-a");
  d.has_parent = true;
  d.parent_hash = hash128{0x1234, 0x5678};
  d.lora_name = "adapter-7";
  d.lora_id = 7;
  for (std::size_t b = 0; b < 2 * blocks_per_chunk; ++b)
    d.block_extra_keys.push_back("\x91\xa1" + std::string(1, 'a' + b));
  CHECK(sched.ok(d).described);

  raw_client worker(s.path());
  engine_region r;
  const auto wreg = worker.register_region(r);
  auto w = description(wreg, 1, 9, 1);
  w.parent_hash = hash128{7, 7};  // without has_parent: not passed on
  CHECK(worker.ok(w).described);

  const auto got = sink.wait(2);
  REQUIRE(got.size() == 2);
  const bus::chunks_described& e = got[0];
  CHECK(e.model_id == salted_model_id(reg.model_id, "tenant-a"));
  CHECK(e.model_id != reg.model_id);
  CHECK(e.world_size == 2);
  CHECK(e.chunk_tokens == test_chunk_tokens);
  CHECK(e.block_size == test_block_size);
  CHECK(e.has_parent);
  CHECK(e.parent_hash == d.parent_hash);
  CHECK(e.chunk_hashes == d.chunk_hashes);
  CHECK(e.token_ids == d.token_ids);
  CHECK(e.lora_name == "adapter-7");
  CHECK(e.lora_id == 7);
  CHECK(e.block_extra_keys == d.block_extra_keys);

  const bus::chunks_described& f = got[1];
  CHECK(f.model_id == wreg.model_id);  // no request salt: the registration's id
  CHECK(f.world_size == 1);
  CHECK_FALSE(f.has_parent);
  CHECK(f.parent_hash == hash128{});
  CHECK(f.token_ids == w.token_ids);
  CHECK(f.lora_id == -1);
  CHECK(f.block_extra_keys.empty());
}

TEST_CASE("malformed descriptions are refused with a reason and the connection stays usable", "[server][describe]") {
  description_sink sink;
  running_server s;
  s.srv->bus().subscriber<kv_events::tier_key_relay>().attach(&sink);

  raw_client unregistered(s.path());
  const auto nr = unregistered.refused(p::describe_chunks_request{});
  CHECK(nr.error() == errc::not_registered);
  CHECK(nr.message.find("describe_chunks_request") != std::string::npos);

  raw_client c(s.path());
  const auto reg = c.expect(scheduler_registration());
  struct bad_case {
    const char* what;
    void (*spoil)(p::describe_chunks_request&);
    const char* reason;  ///< a part of the error message
  };
  const bad_case cases[] = {
      {"another model id", [](p::describe_chunks_request& d) { ++d.model_id; }, "model_id"},
      {"another world size", [](p::describe_chunks_request& d) { d.world_size = 2; }, "world_size"},
      {"no chunk",
       [](p::describe_chunks_request& d) {
         d.chunk_hashes.clear();
         d.token_ids.clear();
       },
       "no chunk_hashes"},
      {"a token short", [](p::describe_chunks_request& d) { d.token_ids.pop_back(); }, "token ids for 2 chunks"},
      {"a token too many", [](p::describe_chunks_request& d) { d.token_ids.push_back(1); }, "token ids"},
      {"block size 0", [](p::describe_chunks_request& d) { d.block_size = 0; }, "block_size"},
      {"a block size that does not divide the chunk", [](p::describe_chunks_request& d) { d.block_size = 5; },
       "does not divide"},
      {"extra keys for some blocks only", [](p::describe_chunks_request& d) { d.block_extra_keys = {"\xc0"}; },
       "block_extra_keys"},
      {"an extra key that is not msgpack",
       [](p::describe_chunks_request& d) {
         d.block_extra_keys.assign(2 * blocks_per_chunk, "\xc0");
         d.block_extra_keys[3] = "\x92\x01";
       },
       "block_extra_keys[3]"},
      {"lora_id below -1", [](p::describe_chunks_request& d) { d.lora_id = -2; }, "lora_id"},
  };
  for (const bad_case& b : cases) {
    INFO(b.what);
    auto d = description(reg, 1, 4, 2);
    b.spoil(d);
    const auto e = c.refused(d);
    CHECK(e.error() == errc::invalid_argument);
    CHECK(e.message.find(b.reason) != std::string::npos);
    CHECK(e.message.find("describe_chunks_request") != std::string::npos);
  }
  // The same connection describes and looks up afterwards; nothing refused was published.
  CHECK(c.ok(description(reg, 1, 4, 2)).described);
  CHECK(c.ok(p::lookup_request{"r", reg.model_id, 1, chunk_hashes(4, 2), "", false}).state !=
        p::prefetch_state::unknown);
  const auto got = sink.wait(1);
  CHECK(got.size() == 1);
}

}  // namespace file_describe_chunks_test
