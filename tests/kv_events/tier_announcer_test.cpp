// tier_announcer (kv_events/tier_announcer.hpp): what each tier holds, announced as vLLM's
// BlockStored / BlockRemoved once the chunk's description is known, and only then.

#include <kvtier/kv_events/tier_announcer.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <numeric>
#include <set>
#include <variant>
#include <vector>

using namespace kvtier;
using namespace kvtier::kv_events;

namespace {

struct capture final : kv_event_transport {
  std::vector<kv_event> events;
  bool refuse = false;
  bool offer(kv_event ev) noexcept override {
    if (refuse) return false;
    events.push_back(std::move(ev));
    return true;
  }
};

constexpr std::uint64_t model = 0x1234;

chunk_key key_of(std::uint64_t h, std::uint16_t rank = 0, std::uint16_t world = 1) {
  return chunk_key{model, world, rank, hash128{h, ~h}};
}

// Two chunks of 8 tokens (blocks of 4) of one prompt: hashes 1 then 2.
bus::chunks_described two_chunks(std::uint16_t world = 1) {
  bus::chunks_described d;
  d.model_id = model;
  d.world_size = world;
  d.chunk_tokens = 8;
  d.block_size = 4;
  d.chunk_hashes = {hash128{1, ~std::uint64_t{1}}, hash128{2, ~std::uint64_t{2}}};
  d.token_ids.resize(16);
  std::iota(d.token_ids.begin(), d.token_ids.end(), 100U);
  d.lora_name = "adapter";
  d.lora_id = 7;
  return d;
}

bus::tier_keys_stored stored(std::uint8_t tier, std::vector<chunk_key> keys) { return {tier, std::move(keys)}; }
bus::tier_keys_removed removed(std::uint8_t tier, std::vector<chunk_key> keys) {
  return {tier, bus::key_removal::evicted, std::move(keys)};
}

}  // namespace

TEST_CASE("tier_announcer: a described chunk a tier takes is a BlockStored with its blocks, tokens and parent",
          "[kv_events][announcer]") {
  capture out;
  tier_announcer a({{"CPU", "DISK"}}, out);
  a.on(two_chunks());
  a.on(stored(bus::l1_tier, {key_of(1), key_of(2)}));
  REQUIRE(out.events.size() == 2);
  const auto& first = std::get<block_stored>(out.events[0]);
  CHECK(first.block_hashes == std::vector<block_hash>{block_hash_of(key_of(1), 0), block_hash_of(key_of(1), 1)});
  CHECK(!first.parent_block_hash);
  CHECK(first.token_ids == std::vector<std::uint32_t>{100, 101, 102, 103, 104, 105, 106, 107});
  CHECK(first.block_size == 4);
  CHECK(first.medium == "CPU");
  CHECK(first.lora_name == "adapter");
  CHECK(first.lora_id == 7);
  const auto& second = std::get<block_stored>(out.events[1]);
  REQUIRE(second.parent_block_hash);
  CHECK(*second.parent_block_hash == block_hash{block_hash_of(key_of(1), 1)});  // the previous block
  CHECK(second.token_ids.front() == 108);
  CHECK(a.stats().chunks_stored == 2);
  CHECK(a.stats().blocks_stored == 4);
}

TEST_CASE("tier_announcer: removals name the announced blocks of that tier, once", "[kv_events][announcer]") {
  capture out;
  tier_announcer a({{"CPU", "DISK"}}, out);
  a.on(two_chunks());
  a.on(stored(bus::l1_tier, {key_of(1)}));
  a.on(stored(bus::l2_tier(0), {key_of(1)}));
  a.on(removed(bus::l1_tier, {key_of(1)}));
  a.on(removed(bus::l1_tier, {key_of(1)}));  // again: nothing held, nothing said
  a.on(removed(bus::l1_tier, {key_of(9)}));  // never held
  REQUIRE(out.events.size() == 3);
  const auto& gone = std::get<block_removed>(out.events[2]);
  CHECK(gone.medium == "CPU");
  CHECK(gone.block_hashes == std::vector<block_hash>{block_hash_of(key_of(1), 0), block_hash_of(key_of(1), 1)});
  CHECK(a.announced_in(bus::l1_tier) == 0);
  CHECK(a.announced_in(bus::l2_tier(0)) == 1);
}

TEST_CASE("tier_announcer: a chunk taken before its description is announced when the description comes",
          "[kv_events][announcer]") {
  capture out;
  tier_announcer a({{"CPU", "DISK"}}, out);
  a.on(stored(bus::l2_tier(0), {key_of(2)}));  // e.g. found on disk after a restart
  CHECK(out.events.empty());
  CHECK(a.stats().undescribed == 1);
  a.on(two_chunks());
  REQUIRE(out.events.size() == 1);
  CHECK(std::get<block_stored>(out.events[0]).medium == "DISK");
  a.on(two_chunks());  // described again: already announced
  CHECK(out.events.size() == 1);
}

TEST_CASE("tier_announcer: an undescribed chunk's removal is not announced; ranks other than 0 are not chunks",
          "[kv_events][announcer]") {
  capture out;
  tier_announcer a({{"CPU"}}, out);
  a.on(stored(bus::l1_tier, {key_of(5)}));
  a.on(removed(bus::l1_tier, {key_of(5)}));
  CHECK(out.events.empty());
  a.on(two_chunks(2));
  a.on(stored(bus::l1_tier, {key_of(1, 1, 2)}));  // rank 1's shard
  CHECK(out.events.empty());
  a.on(stored(bus::l1_tier, {key_of(1, 0, 2)}));
  CHECK(out.events.size() == 1);
}

TEST_CASE("tier_announcer: tiers without a medium are not announced; clear_all starts with AllBlocksCleared",
          "[kv_events][announcer]") {
  capture out;
  tier_announcer a({{"CPU", ""}}, out);
  a.on(two_chunks());
  a.on(stored(bus::l2_tier(0), {key_of(1)}));
  CHECK(out.events.empty());
  a.on(stored(bus::l1_tier, {key_of(1)}));
  a.clear_all();
  REQUIRE(out.events.size() == 2);
  CHECK(std::holds_alternative<all_blocks_cleared>(out.events[1]));
  a.on(removed(bus::l1_tier, {key_of(1)}));  // forgotten by the clear: no removal
  CHECK(out.events.size() == 2);
}

TEST_CASE("tier_announcer: descriptions are bounded (oldest out) and malformed ones refused",
          "[kv_events][announcer]") {
  capture out;
  tier_announcer_options o{{"CPU"}};
  o.description_bytes = 1;  // room for none: each is dropped as soon as it is kept
  tier_announcer a(o, out);
  a.on(two_chunks());
  CHECK(a.stats().descriptions_evicted == 2);
  CHECK(a.stats().descriptions_held == 0);
  a.on(stored(bus::l1_tier, {key_of(1)}));
  CHECK(out.events.empty());
  auto bad = two_chunks();
  bad.token_ids.pop_back();
  a.on(bad);
  bad = two_chunks();
  bad.block_size = 3;
  a.on(bad);
  CHECK(a.stats().descriptions_refused == 2);
}

TEST_CASE("tier_announcer: a transport that refuses counts drops", "[kv_events][announcer]") {
  capture out;
  out.refuse = true;
  tier_announcer a({{"CPU"}}, out);
  a.on(two_chunks());
  a.on(stored(bus::l1_tier, {key_of(1), key_of(2)}));
  CHECK(a.stats().transport_drops == 2);
}
