// The connector's descriptions of chunks (issue 28: KV events for routers): lookup() describes
// the chunks it looks up, once per chunk (and salt) per connection, as runs of consecutive
// chunks with their parent; a connection whose server answers described=false (or refuses a
// description) sends no more until it reconnects; describe_chunks carries the extras and
// refuses malformed arguments before anything is sent.
#include <kvtier/engine/connector.hpp>

#include <catch2/catch.hpp>

#include "engine/connector_fixtures.hpp"

#include <chrono>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_connector_describe_test {

using namespace kvtier;
using namespace std::chrono_literals;
namespace p = kvtier::protocol;
using kvtier::test::event_recorder;

namespace {

constexpr std::uint32_t ct = kvtier::test::connector_chunk_tokens;  // 2 blocks of 4
const paged_kv_layout layout{{2, 2, 16, dtype_kind::bf16, attention_kind::mha}, 4, 32};
using record = event_recorder::record;

std::vector<token_id> tokens(std::size_t n, token_id seed) {
  std::vector<token_id> t(n);
  std::iota(t.begin(), t.end(), seed * 1000);
  return t;
}

struct harness : kvtier::test::connector_harness {
  harness() : connector_harness(layout) {}

  /// The descriptions the server got, once it has processed at least `n` (60 s at most).
  std::vector<p::describe_chunks_request> descriptions(std::size_t n) {
    const auto until = std::chrono::steady_clock::now() + 60s;
    for (;;) {
      auto d = server->descriptions();
      if (d.size() >= n || std::chrono::steady_clock::now() > until) return d;
      std::this_thread::sleep_for(1ms);
    }
  }

  /// A lookup that describes nothing, answered: every frame sent before it was answered
  /// first (the server answers in order, the connector handles the answers in order).
  template <class C>
  void barrier(C& c, const std::string& id) {
    c.lookup_hashes(id, {hash128{0xba, 0x55}});
    for (;;) {  // other lookups' answers may come first
      const std::size_t before = rec.snapshot().lookups.size();
      if (c.lookup_result(id).has_value()) return;
      REQUIRE(wait([&](const record& r) { return r.lookups.size() > before; }));
    }
  }
};

std::vector<token_id> slice(const std::vector<token_id>& t, std::size_t first_chunk, std::size_t chunks) {
  return {t.begin() + static_cast<std::ptrdiff_t>(first_chunk * ct),
          t.begin() + static_cast<std::ptrdiff_t>((first_chunk + chunks) * ct)};
}

}  // namespace

TEST_CASE("lookup describes each new chunk once per connection and stops after described=false",
          "[engine][connector][describe]") {
  harness h;
  h.start_server();
  h.server->set_described(true);
  auto& c = h.connect();

  // A prompt of 3 chunks and 2 tokens: its 3 full chunks, in blocks of the region's size.
  const auto a = tokens(3 * ct + 2, 1);
  const auto ha = c.chunk_hashes(a);
  c.lookup("a", a);
  auto d = h.descriptions(1);
  REQUIRE(d.size() == 1);
  CHECK(d[0].chunk_hashes == ha);
  CHECK(d[0].token_ids == slice(a, 0, 3));
  CHECK(d[0].block_size == layout.block_size);
  CHECK_FALSE(d[0].has_parent);
  CHECK(d[0].world_size == 1);
  CHECK(d[0].cache_salt.empty());
  CHECK(d[0].lora_id == -1);
  CHECK(d[0].lora_name.empty());
  CHECK(d[0].block_extra_keys.empty());
  CHECK(d[0].model_id == h.server->lookups().at(0).model_id);

  // A longer prompt sharing those 3 chunks: only its 2 new ones, after their parent.
  auto b = a;
  b.resize(3 * ct);
  const auto more = tokens(2 * ct, 2);
  b.insert(b.end(), more.begin(), more.end());
  const auto hb = c.chunk_hashes(b);
  c.lookup("b", b);
  d = h.descriptions(2);
  REQUIRE(d.size() == 2);
  CHECK(d[1].chunk_hashes == std::vector<hash128>(hb.begin() + 3, hb.end()));
  CHECK(d[1].token_ids == slice(b, 3, 2));
  CHECK(d[1].has_parent);
  CHECK(d[1].parent_hash == hb[2]);

  // The same chunks under another salt are other chunks; the same prompt again is nothing.
  c.lookup("a-salted", a, "tenant");
  d = h.descriptions(3);
  REQUIRE(d.size() == 3);
  CHECK(d[2].chunk_hashes == ha);
  CHECK(d[2].cache_salt == "tenant");
  c.lookup("a-again", a);
  h.barrier(c, "sync-1");
  CHECK(h.server->received(p::message_type::describe_chunks_request) == 3);
  CHECK(c.stats().descriptions_sent == 3);
  CHECK(c.stats().chunks_described == 3 + 2 + 3);

  // The server stops publishing: its answer to the next description turns them off.
  CHECK(c.describes_chunks());
  h.server->set_described(false);
  c.lookup("f", tokens(2 * ct, 3));
  h.barrier(c, "sync-2");
  CHECK(h.server->received(p::message_type::describe_chunks_request) == 4);
  CHECK_FALSE(c.describes_chunks());
  c.lookup("g", tokens(2 * ct, 4));
  c.describe_chunks(c.chunk_hashes(tokens(ct, 5)), tokens(ct, 5));
  h.barrier(c, "sync-3");
  CHECK(h.server->received(p::message_type::describe_chunks_request) == 4);
  CHECK(c.lookup_result("g").has_value());  // the lookups themselves go on

  // A new connection asks afresh, and has described nothing yet.
  h.server->set_described(true);
  h.server->close_connections();
  REQUIRE(h.wait([](const record& r) { return r.healthy.size() == 2; }));
  CHECK(c.describes_chunks());
  c.lookup("a-reconnected", a);
  d = h.descriptions(5);
  REQUIRE(d.size() == 5);
  CHECK(d[4].chunk_hashes == ha);
}

TEST_CASE("describe_chunks carries the extras, sends runs of new chunks with their parents and stops on a refusal",
          "[engine][connector][describe]") {
  harness h;
  h.start_server();
  h.server->set_described(true);
  auto o = h.options();
  o.describe_chunks = true;
  auto& c = h.connect(o);
  const auto t = tokens(6 * ct, 7);
  const auto hs = c.chunk_hashes(t);

  // Chunks 2 and 4 alone first, with the extras: blocks of 2 tokens, the parent, the LoRA
  // adapter and one extra key per block.
  engine::chunk_description_extras x;
  x.block_size = 2;
  x.parent = hs[1];
  x.lora_name = "adapter-a";
  x.lora_id = 3;
  x.block_extra_keys = {
      "\x91\xa1"
      "a",
      "\x91\xa1"
      "b",
      "\x91\xa1"
      "c",
      "\x91\xa1"
      "d"};
  const auto t2 = slice(t, 2, 1);
  c.describe_chunks(std::span(hs).subspan(2, 1), t2, "s", x);
  auto d = h.descriptions(1);
  REQUIRE(d.size() == 1);
  CHECK(d[0].chunk_hashes == std::vector<hash128>{hs[2]});
  CHECK(d[0].token_ids == t2);
  CHECK(d[0].block_size == 2);
  CHECK(d[0].has_parent);
  CHECK(d[0].parent_hash == hs[1]);
  CHECK(d[0].lora_name == "adapter-a");
  CHECK(d[0].lora_id == 3);
  CHECK(d[0].block_extra_keys == x.block_extra_keys);
  CHECK(d[0].cache_salt == "s");
  engine::chunk_description_extras y;
  y.parent = hs[3];
  c.describe_chunks(std::span(hs).subspan(4, 1), slice(t, 4, 1), "s", y);

  // Then the whole prompt (more tokens than its chunks: the rest is ignored): the runs
  // [0, 2), [3, 4) and [5, 6), each after its parent; the extra keys of their blocks.
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < 6 * 4; ++i) keys.push_back(std::string(1, static_cast<char>(i)));  // fixints
  engine::chunk_description_extras z;
  z.block_size = 2;
  z.block_extra_keys = keys;
  auto longer = t;
  longer.push_back(1);
  c.describe_chunks(hs, longer, "s", z);
  d = h.descriptions(5);
  REQUIRE(d.size() == 5);
  CHECK(d[2].chunk_hashes == std::vector<hash128>{hs[0], hs[1]});
  CHECK_FALSE(d[2].has_parent);
  CHECK(d[2].token_ids == slice(t, 0, 2));
  CHECK(d[2].block_extra_keys == std::vector<std::string>(keys.begin(), keys.begin() + 8));
  CHECK(d[3].chunk_hashes == std::vector<hash128>{hs[3]});
  CHECK(d[3].parent_hash == hs[2]);
  CHECK(d[3].block_extra_keys == std::vector<std::string>(keys.begin() + 12, keys.begin() + 16));
  CHECK(d[4].chunk_hashes == std::vector<hash128>{hs[5]});
  CHECK(d[4].has_parent);
  CHECK(d[4].parent_hash == hs[4]);
  CHECK(d[4].token_ids == slice(t, 5, 1));

  // Malformed arguments throw, and send nothing.
  const std::size_t sent = c.stats().descriptions_sent;
  const auto fresh = tokens(2 * ct, 8);
  const auto hf = c.chunk_hashes(fresh);
  CHECK_THROWS_AS(c.describe_chunks(hf, slice(fresh, 0, 1)), std::invalid_argument);  // too few tokens
  engine::chunk_description_extras bad;
  bad.block_size = 3;  // does not divide 8
  CHECK_THROWS_AS(c.describe_chunks(hf, fresh, "", bad), std::invalid_argument);
  bad = {};
  bad.block_extra_keys = {"\xc0"};  // not one per block
  CHECK_THROWS_AS(c.describe_chunks(hf, fresh, "", bad), std::invalid_argument);
  bad = {};
  bad.lora_id = -2;
  CHECK_THROWS_AS(c.describe_chunks(hf, fresh, "", bad), std::invalid_argument);
  bad = {};
  bad.lora_name.assign(257, 'l');
  CHECK_THROWS_AS(c.describe_chunks(hf, fresh, "", bad), std::invalid_argument);
  CHECK_THROWS_AS(c.describe_chunks(hf, fresh, std::string(257, 's')), std::invalid_argument);
  CHECK(c.stats().descriptions_sent == sent);

  // A server that refuses a description (an older one does not know the message) gets no
  // more on this connection.
  h.server->set_described(true, errc::protocol_error);
  c.describe_chunks(hf, fresh);
  h.barrier(c, "sync-1");
  c.describe_chunks(c.chunk_hashes(tokens(ct, 9)), tokens(ct, 9));
  h.barrier(c, "sync-2");
  CHECK(h.server->received(p::message_type::describe_chunks_request) == 6);
}

TEST_CASE("a description above 4 MiB is split into requests that chain by their parents",
          "[engine][connector][describe]") {
  harness h;
  h.start_server();
  h.server->set_described(true);
  auto& c = h.connect();
  // 600 chunks of 2 blocks, each block with 4000 bytes of extra keys (a msgpack bin16):
  // ~4.8 MiB, so two requests.
  const auto t = tokens(600 * ct, 11);
  const auto hs = c.chunk_hashes(t);
  engine::chunk_description_extras x;
  std::string key = "\xc5\x0f\x9d";
  key.resize(4000, 'k');
  x.block_extra_keys.assign(2 * 600, key);
  c.describe_chunks(hs, t, "", x);
  const auto d = h.descriptions(2);
  REQUIRE(d.size() == 2);
  CHECK(d[0].chunk_hashes.size() + d[1].chunk_hashes.size() == 600);
  CHECK(d[0].chunk_hashes.size() > 400);
  CHECK_FALSE(d[0].has_parent);
  CHECK(d[1].has_parent);
  CHECK(d[1].parent_hash == d[0].chunk_hashes.back());
  CHECK(d[1].chunk_hashes.back() == hs.back());
  CHECK(d[1].token_ids.size() == d[1].chunk_hashes.size() * ct);
  CHECK(d[1].block_extra_keys.size() == 2 * d[1].chunk_hashes.size());
  CHECK(p::body_size(d[0]) <= (std::size_t{4} << 20));
  CHECK(c.stats().chunks_described == 600);
}

TEST_CASE("descriptions are off with the option, and skipped while unhealthy", "[engine][connector][describe]") {
  harness h;
  h.start_server();
  h.server->set_described(true);
  auto o = h.options();
  o.describe_chunks = false;
  auto& c = h.connect(o);
  CHECK_FALSE(c.describes_chunks());
  c.lookup("a", tokens(2 * ct, 1));
  c.describe_chunks(c.chunk_hashes(tokens(ct, 2)), tokens(ct, 2));
  h.barrier(c, "sync");
  CHECK(h.server->received(p::message_type::describe_chunks_request) == 0);
  CHECK(c.stats().descriptions_sent == 0);

  // No server: nothing is sent (and nothing throws).
  kvtier::test::temp_dir dir{"kvtier-describe"};
  auto lonely = kvtier::test::connector_test_options((dir.path() / "none.sock").string());
  engine::connector<kvtier::test::connector_test_bus> u(lonely, h.region, h.bus);
  u.describe_chunks(u.chunk_hashes(tokens(ct, 3)), tokens(ct, 3));
  CHECK(u.stats().descriptions_sent == 0);
  CHECK_FALSE(u.healthy());

  // A worker's block size must be its region's.
  auto w = h.options();
  w.block_size = 2;
  CHECK_THROWS_AS(engine::connector<kvtier::test::connector_test_bus>(w, h.region, h.bus), std::invalid_argument);
  w.block_size = 3;
  CHECK_FALSE(w.validation_error().empty());
}

}  // namespace file_connector_describe_test
