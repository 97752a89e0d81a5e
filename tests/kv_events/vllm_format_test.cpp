// kv_events/vllm_format.hpp: vLLM's EventBatch in its forms. The expected bytes were
// produced by python3-msgpack from the Python objects vLLM's msgspec encodes (same smallest
// forms: tests/python/test_kv_events_format.py checks the same against our dump program);
// the omit_defaults rules, bytes against int hashes and nil fields are checked by structure.
#include <kvtier/kv_events/vllm_format.hpp>

#include "kv_events/sample_events.hpp"

#include "kv_events/msgpack_reader.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace file_vllm_format_test {

using namespace kvtier::kv_events;
using namespace kvtier::test::kv_event_samples;
using kvtier::test::msgpack_reader;
using kvtier::test::msgpack_value;

std::string encoded_event(const kv_event& ev, event_form form) {
  std::string out;
  msgpack_writer w(out);
  write_event(w, ev, form);
  return out;
}

TEST_CASE("an AllBlocksCleared batch is byte for byte what msgspec writes, in both forms", "[kv_events][format]") {
  const event_batch batch{1.5, {all_blocks_cleared{}}, 0};
  CHECK(hex(encode(batch, event_form::map)) ==
        "83a27473cb3ff8000000000000a66576656e74739181a474797065b0416c6c426c6f636b73436c6561726564"
        "b2646174615f706172616c6c656c5f72616e6b00");
  // Without a data-parallel rank, the array form is [ts, events].
  const event_batch no_rank{1.5, {all_blocks_cleared{}}, std::nullopt};
  CHECK(hex(encode(no_rank, event_form::array)) == "92cb3ff80000000000009191b0416c6c426c6f636b73436c6561726564");
}

TEST_CASE("BlockRemoved: int hashes, a medium, no group index left out in both forms", "[kv_events][format]") {
  const block_removed e{{std::uint64_t{1}, std::int64_t{-1}}, std::string(medium_cpu), std::nullopt};
  CHECK(hex(encoded_event(e, event_form::map)) ==
        "83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739201ffa66d656469756da3435055");
  CHECK(hex(encoded_event(e, event_form::array)) == "93ac426c6f636b52656d6f7665649201ffa3435055");
}

TEST_CASE("BlockRemoved: a missing medium (no default) is nil, a group index is written", "[kv_events][format]") {
  const block_removed e{{byte_string{"\x01\x02"}}, std::nullopt, 3};
  CHECK(hex(encoded_event(e, event_form::map)) ==
        "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c4020102a66d656469756dc0a967726f75705f69"
        "647803");
  CHECK(hex(encoded_event(e, event_form::array)) == "94ac426c6f636b52656d6f76656491c4020102c003");
}

TEST_CASE("BlockStored without optional fields: the seven without a default, nil where empty", "[kv_events][format]") {
  const block_stored e = minimal_stored();
  std::string hashes = "92c420";  // [32 bytes of 0xab as bin8, 0xfedcba9876543210 as uint64]
  for (int i = 0; i < 32; ++i) hashes += "ab";
  hashes += "cffedcba9876543210";
  CHECK(hex(encoded_event(e, event_form::map)) ==
        "88a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573" + hashes +
            "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473930102ce0002505baa626c6f636b5f73697a"
            "6510a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0");
  CHECK(hex(encoded_event(e, event_form::array)) ==
        "98ab426c6f636b53746f726564" + hashes + "c0930102ce0002505b10c0a3435055c0");
}

TEST_CASE("BlockStored's fields come in vLLM's declaration order after the type", "[kv_events][format]") {
  block_stored e = minimal_stored();
  e.extra_keys = std::vector<std::optional<std::vector<extra_key>>>{std::nullopt, std::nullopt};
  e.group_idx = 1;
  e.kv_cache_spec_kind = "full_attention";
  e.kv_cache_spec_sliding_window = 4096;
  const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
  CHECK(m.keys() == std::vector<std::string>{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                             "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                             "kv_cache_spec_kind", "kv_cache_spec_sliding_window"});
  CHECK(m.at("type").s == "BlockStored");
  const msgpack_value a = msgpack_reader::decode(encoded_event(e, event_form::array));
  REQUIRE(a.size() == 12);
  CHECK(a[0].s == "BlockStored");
  CHECK(a[4].integer() == 16);
  CHECK(a[9].integer() == 1);
  CHECK(a[10].s == "full_attention");
  CHECK(a[11].integer() == 4096);
}

TEST_CASE(
    "omit_defaults: the map form leaves out every defaulted field that is none, the array form only the "
    "trailing ones",
    "[kv_events][format]") {
  block_stored e = minimal_stored();
  SECTION("a group index of 0 is not the default (none) and is written") {
    e.group_idx = 0;
    const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
    CHECK(m.size() == 9);
    CHECK_FALSE(m.has("extra_keys"));
    CHECK(m.at("group_idx").integer() == 0);
    const msgpack_value a = msgpack_reader::decode(encoded_event(e, event_form::array));
    REQUIRE(a.size() == 10);  // tag, 7 fields, extra_keys as nil, group_idx
    CHECK(a[8].is_nil());
    CHECK(a[9].integer() == 0);
  }
  SECTION("only the last field set: every defaulted field before it is nil in the array form") {
    e.kv_cache_spec_sliding_window = 128;
    const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
    CHECK(m.size() == 9);
    CHECK(m.keys().back() == "kv_cache_spec_sliding_window");
    const msgpack_value a = msgpack_reader::decode(encoded_event(e, event_form::array));
    REQUIRE(a.size() == 12);
    CHECK(a[8].is_nil());
    CHECK(a[9].is_nil());
    CHECK(a[10].is_nil());
    CHECK(a[11].integer() == 128);
  }
  SECTION("fields without a default are written even when none") {
    e.medium.reset();
    const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
    CHECK(m.at("medium").is_nil());
    CHECK(m.at("lora_id").is_nil());
    CHECK(m.at("lora_name").is_nil());
    CHECK(m.at("parent_block_hash").is_nil());
  }
}

TEST_CASE("hashes: bytes are bin, ints are ints of their sign and size, a parent hash likewise",
          "[kv_events][format]") {
  block_stored e = minimal_stored();
  e.block_hashes = {byte_string{std::string("\x00\xff", 2)}, std::uint64_t{0xffffffffffffffffULL},
                    std::int64_t{-9'000'000'000'000'000'000LL}, std::int64_t{42}};
  e.parent_block_hash = std::int64_t{-5};
  const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
  const msgpack_value& h = m.at("block_hashes");
  REQUIRE(h.size() == 4);
  CHECK(h[0].k == msgpack_value::kind::bin);
  CHECK(h[0].s == std::string("\x00\xff", 2));
  CHECK(h[1].k == msgpack_value::kind::uint);
  CHECK(h[1].u == 0xffffffffffffffffULL);
  CHECK(h[2].k == msgpack_value::kind::sint);
  CHECK(h[2].i == -9'000'000'000'000'000'000LL);
  CHECK(h[3].integer() == 42);
  CHECK(m.at("parent_block_hash").integer() == -5);
}

TEST_CASE("BlockStored's optional text and numbers, and extra keys one entry per block", "[kv_events][format]") {
  block_stored e = minimal_stored();
  e.lora_id = 3;
  e.lora_name = "adapter";
  e.extra_keys = std::vector<std::optional<std::vector<extra_key>>>{
      std::nullopt, std::vector<extra_key>{std::string("salt"), std::int64_t{7}, byte_string{"\x01"}}};
  const msgpack_value m = msgpack_reader::decode(encoded_event(e, event_form::map));
  CHECK(m.at("lora_id").integer() == 3);
  CHECK(m.at("lora_name").s == "adapter");
  const msgpack_value& keys = m.at("extra_keys");
  REQUIRE(keys.size() == 2);
  CHECK(keys[0].is_nil());
  REQUIRE(keys[1].size() == 3);
  CHECK(keys[1][0].k == msgpack_value::kind::str);
  CHECK(keys[1][0].s == "salt");
  CHECK(keys[1][1].integer() == 7);
  CHECK(keys[1][2].k == msgpack_value::kind::bin);
}

TEST_CASE("a batch holds its events in order, with ts and the data-parallel rank", "[kv_events][format]") {
  event_batch batch{1'700'000'000.25,
                    {minimal_stored(), block_removed{{std::uint64_t{9}}, "STORAGE", std::nullopt}, all_blocks_cleared{}},
                    7};
  const msgpack_value m = msgpack_reader::decode(encode(batch, event_form::map));
  CHECK(m.keys() == std::vector<std::string>{"ts", "events", "data_parallel_rank"});
  CHECK(m.at("ts").d == 1'700'000'000.25);
  CHECK(m.at("data_parallel_rank").integer() == 7);
  const msgpack_value& events = m.at("events");
  REQUIRE(events.size() == 3);
  CHECK(events[0].at("type").s == "BlockStored");
  CHECK(events[1].at("type").s == "BlockRemoved");
  CHECK(events[1].at("medium").s == medium_storage);
  CHECK(events[2].at("type").s == "AllBlocksCleared");

  const msgpack_value a = msgpack_reader::decode(encode(batch, event_form::array));
  REQUIRE(a.size() == 3);
  CHECK(a[0].d == 1'700'000'000.25);
  REQUIRE(a[1].size() == 3);
  CHECK(a[1][0][0].s == "BlockStored");
  CHECK(a[1][1][0].s == "BlockRemoved");
  CHECK(a[1][2].size() == 1);
  CHECK(a[2].integer() == 7);

  CHECK(msgpack_reader::decode(encode(event_batch{2.0, {}, std::nullopt}, event_form::map)).keys() ==
        std::vector<std::string>{"ts", "events"});
}

TEST_CASE("the array_batch form: the batch an array, its events maps", "[kv_events][format]") {
  const event_batch batch{1.5, {all_blocks_cleared{}, block_removed{{std::uint64_t{1}}, "CPU", std::nullopt}}, 0};
  const msgpack_value a = msgpack_reader::decode(encode(batch, event_form::array_batch));
  REQUIRE(a.k == msgpack_value::kind::array);
  REQUIRE(a.size() == 3);
  CHECK(a[0].d == 1.5);
  CHECK(a[2].integer() == 0);
  REQUIRE(a[1].size() == 2);
  CHECK(a[1][0].keys() == std::vector<std::string>{"type"});
  CHECK(a[1][1].keys() == std::vector<std::string>{"type", "block_hashes", "medium"});
  // The events are byte for byte those of the map form.
  const std::string events_of_map = encoded_event(batch.events[1], event_form::map);
  CHECK(encode(batch, event_form::array_batch).find(events_of_map) != std::string::npos);
  CHECK(encoded_event(batch.events[1], event_form::array_batch) == events_of_map);
}

TEST_CASE("event forms parse from and print as map, array and array_batch", "[kv_events][format]") {
  CHECK(parse_event_form("map") == event_form::map);
  CHECK(parse_event_form("array") == event_form::array);
  CHECK(parse_event_form("array_batch") == event_form::array_batch);
  CHECK(to_string(event_form::array_batch) == "array_batch");
  CHECK_FALSE(parse_event_form("tuple").has_value());
  CHECK_FALSE(parse_event_form("").has_value());
  CHECK(to_string(event_form::map) == "map");
  CHECK(to_string(event_form::array) == "array");
  static_assert(parse_event_form(to_string(event_form::array)) == event_form::array);
}

}  // namespace file_vllm_format_test
