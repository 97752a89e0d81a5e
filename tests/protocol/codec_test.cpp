#include <kvtier/protocol/codec.hpp>

#include <catch2/catch.hpp>

#include "protocol/protocol_fixtures.hpp"
#include "support/allocation_probe.hpp"

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <variant>
#include <vector>

using namespace kvtier;
namespace p = kvtier::protocol;
using kvtier::test::bytes_builder;
using kvtier::test::largest_allocation;
using kvtier::test::make_frame;

namespace {

/// Decodes a whole frame (header + body) with the public codec.
p::decode_result<p::message> decode_whole(const std::vector<std::byte>& bytes, const p::limits& lim = {}) {
  REQUIRE(bytes.size() >= p::frame_header_size);
  const auto h = p::read_header(std::span<const std::byte, p::frame_header_size>(bytes.data(), p::frame_header_size));
  return p::decode_message(h, std::span<const std::byte>(bytes).subspan(p::frame_header_size), lim);
}

template <class T>
std::vector<std::byte> encode_raw(const T& msg, std::uint64_t call_id = 1) {
  return p::detail::encode_unchecked(p::frame_header{p::protocol_version, T::type, call_id, 0}, msg);
}

/// One below, at and one above a field limit: encode and decode accept the first two; the
/// third is refused by encode, and a frame built anyway is refused by decode, both with
/// message_too_large and a reason naming the field.
template <class T, class Resize>
void check_field_limit(T msg, std::string_view field, std::uint32_t limit, Resize resize) {
  INFO("field " << field << ", limit " << limit);
  for (std::uint64_t n : {std::uint64_t{limit} - 1, std::uint64_t{limit}}) {
    resize(msg, static_cast<std::size_t>(n));
    auto bytes = p::encode_frame(9, msg);
    REQUIRE(bytes.has_value());
    auto back = decode_whole(*bytes);
    REQUIRE(back.has_value());
    CHECK(std::get<T>(*back) == msg);
  }
  resize(msg, std::size_t{limit} + 1);
  auto refused = p::encode_frame(9, msg);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error() == errc::message_too_large);
  auto decoded = decode_whole(encode_raw(msg, 77));
  REQUIRE_FALSE(decoded.has_value());
  CHECK(decoded.error().code == errc::message_too_large);
  CHECK(decoded.error().call_id == 77);
  CHECK(decoded.error().reason.find(field) != std::string::npos);
}

}  // namespace

TEST_CASE("every message type survives an encode and decode round trip", "[protocol][codec]") {
  const auto samples = kvtier::test::sample_messages();
  std::set<std::size_t> covered;
  std::uint64_t call_id = 0x0102030405060708ULL;
  for (const auto& m : samples) {
    INFO(p::name(p::type_of(m)));
    covered.insert(m.index());
    auto bytes = p::encode_frame(call_id, m);
    REQUIRE(bytes.has_value());
    const auto h =
        p::read_header(std::span<const std::byte, p::frame_header_size>(bytes->data(), p::frame_header_size));
    CHECK(h.version == p::protocol_version);
    CHECK(h.type == p::type_of(m));
    CHECK(h.call_id == call_id);
    CHECK(h.body_bytes == bytes->size() - p::frame_header_size);
    auto back = decode_whole(*bytes);
    REQUIRE(back.has_value());
    CHECK(*back == m);
    ++call_id;
  }
  CHECK(covered.size() == std::variant_size_v<p::message>);
}

TEST_CASE("the wire image of a message is pinned little-endian bytes", "[protocol][codec]") {
  SECTION("a ping request") {
    auto bytes = p::encode_frame(0x1122334455667788ULL, p::ping_request{0x0102030405060708ULL});
    REQUIRE(bytes.has_value());
    bytes_builder want;
    want.raw("KVT1").u16(p::protocol_version).u16(0x0009).u64(0x1122334455667788ULL).u32(8).u64(0x0102030405060708ULL);
    CHECK(*bytes == want.bytes);
  }
  SECTION("a lookup request with a string, a vector of hashes and its answer_when_decided flag") {
    auto bytes = p::encode_frame(3, p::lookup_request{"ab", 5, 2, {hash128{1, 2}}, "", true});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.str("ab").u64(5).u16(2).u32(1).u64(1).u64(2).str("").u8(1);
    CHECK(*bytes == make_frame(p::message_type::lookup_request, 3, body.bytes));
  }
  SECTION("a retrieve request with its progress flag last") {
    auto bytes = p::encode_frame(6, p::retrieve_request{"r", 1, 2, {hash128{3, 4}}, {5, 6}, 7, "s", true});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.str("r").u16(1).u32(2).u32(1).u64(3).u64(4).u32(2).u32(5).u32(6).u32(7).str("s").u8(1);
    CHECK(*bytes == make_frame(p::message_type::retrieve_request, 6, body.bytes));
  }
  SECTION("a retrieve progress: type 0x4005, the retrieve's call id, the layers and chunks ready") {
    auto bytes = p::encode_frame(0x99, p::retrieve_progress{12, 5});
    REQUIRE(bytes.has_value());
    bytes_builder want;
    want.raw("KVT1").u16(p::protocol_version).u16(0x4005).u64(0x99).u32(8).u32(12).u32(5);
    CHECK(*bytes == want.bytes);
  }
  SECTION("a register response with the server's load budget last") {
    auto bytes = p::encode_frame(2, p::register_kv_response{0xb007, 7, 0xabcdef, 256, 30000});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.u64(0xb007).u64(7).u64(0xabcdef).u32(256).u32(30000);
    CHECK(*bytes == make_frame(p::message_type::register_kv_response, 2, body.bytes));
  }
  SECTION("a lookup response: the prefetch's state and counts, as a query's") {
    auto bytes = p::encode_frame(4, p::lookup_response{p::prefetch_state::done, 7, 3});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.u8(1).u32(7).u32(3);
    CHECK(*bytes == make_frame(p::message_type::lookup_response, 4, body.bytes));
  }
  SECTION("a register request with its nested model shape") {
    p::register_kv_request r;
    r.instance_id = 1;
    r.rank = 2;
    r.world_size = 4;
    r.model_name = "m";
    r.model = model_shape{32, 1, 576, dtype_kind::bf16, attention_kind::mla};
    r.block_size = 64;
    r.num_blocks = 10;
    r.chunk_tokens = 256;
    r.region_bytes = 1 << 20;
    auto bytes = p::encode_frame(1, r);
    REQUIRE(bytes.has_value());
    bytes_builder body;
    // model shape: u32 layers, heads, head dim, u8 dtype kind (bf16 = 2), u8 attention (MLA = 1);
    // then u8 layout kind (NHD = 0), u8 region kind (cpu_memfd = 1), descriptor, salt, rate,
    // the five u64 strides (0: dense), the engine id.
    body.u64(1).u16(2).u16(4).str("m").u32(32).u32(1).u32(576).u8(2).u8(1).u32(64).u32(10).u32(256).u64(1 << 20);
    body.u8(0).u8(1).str("").str("").u64(0).u64(0).u64(0).u64(0).u64(0).u64(0).str("");
    CHECK(*bytes == make_frame(p::message_type::register_kv_request, 1, body.bytes));
    CHECK(r.layout().total_bytes() == std::size_t{32} * 10 * 64 * 576 * 2);
    // Explicit strides travel in order layer, plane, block, token, head; layout() has them.
    r.strides = {0x10000000, 0, 1152 * 64 + 128, 1152, 0};
    auto strided = p::encode_frame(1, r);
    REQUIRE(strided.has_value());
    bytes_builder sbody;
    sbody.u64(1).u16(2).u16(4).str("m").u32(32).u32(1).u32(576).u8(2).u8(1).u32(64).u32(10).u32(256).u64(1 << 20);
    sbody.u8(0).u8(1).str("").str("").u64(0).u64(0x10000000).u64(0).u64(1152 * 64 + 128).u64(1152).u64(0).str("");
    CHECK(*strided == make_frame(p::message_type::register_kv_request, 1, sbody.bytes));
    CHECK(r.layout().strides == r.strides);
  }
  SECTION("an evict request: type 0x000e, its selection, tiers and force flag; its answer 0x800e") {
    auto bytes = p::encode_frame(5, p::evict_request{false, true, "m", true, "", false, 0x77, "l1,disk", true});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.u8(0).u8(1).str("m").u8(1).str("").u8(0).u64(0x77).str("l1,disk").u8(1);
    CHECK(*bytes == make_frame(p::message_type::evict_request, 5, body.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::evict_request) == 0x000e);
    auto answer = p::encode_frame(5, p::evict_response{3, 4096, 1, 0, "{}"});
    REQUIRE(answer.has_value());
    bytes_builder abody;
    abody.u64(3).u64(4096).u64(1).u64(0).str("{}");
    CHECK(*answer == make_frame(p::message_type::evict_response, 5, abody.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::list_objects_request) == 0x000d);
    CHECK(static_cast<std::uint16_t>(p::message_type::list_objects_response) == 0x800d);
  }
  SECTION("a list_keys request: type 0x0010, the tier and max_keys; its answer 0x8010, a JSON document") {
    auto bytes = p::encode_frame(6, p::list_keys_request{"disk", 100});
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.str("disk").u32(100);
    CHECK(*bytes == make_frame(p::message_type::list_keys_request, 6, body.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::list_keys_request) == 0x0010);
    auto answer = p::encode_frame(6, p::list_keys_response{"{}"});
    REQUIRE(answer.has_value());
    bytes_builder abody;
    abody.str("{}");
    CHECK(*answer == make_frame(p::message_type::list_keys_response, 6, abody.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::list_keys_response) == 0x8010);
    CHECK(p::is_admin(p::message_type::list_keys_request));
  }
  SECTION("a describe_chunks request: type 0x000f, lora_id as a two's complement u64, extra keys as strings") {
    p::describe_chunks_request d;
    d.model_id = 5;
    d.world_size = 2;
    d.cache_salt = "s";
    d.block_size = 1;
    d.has_parent = true;
    d.parent_hash = hash128{8, 9};
    d.chunk_hashes = {hash128{1, 2}};
    d.token_ids = {10, 11};
    d.lora_name = "L";
    d.lora_id = -1;
    d.block_extra_keys = {"\xc0", "ab"};
    auto bytes = p::encode_frame(4, d);
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.u64(5).u16(2).str("s").u32(1).u8(1).u64(8).u64(9).u32(1).u64(1).u64(2).u32(2).u32(10).u32(11);
    body.str("L").u64(0xffffffffffffffffULL).u32(2).str("\xc0").str("ab");
    CHECK(*bytes == make_frame(p::message_type::describe_chunks_request, 4, body.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::describe_chunks_request) == 0x000f);
    auto answer = p::encode_frame(4, p::describe_chunks_response{true});
    REQUIRE(answer.has_value());
    bytes_builder abody;
    abody.u8(1);
    CHECK(*answer == make_frame(p::message_type::describe_chunks_response, 4, abody.bytes));
    CHECK(static_cast<std::uint16_t>(p::message_type::describe_chunks_response) == 0x800f);
  }
  SECTION("a scheduler's register request: region none, salt, prefill rate and engine id") {
    p::register_kv_request r;
    r.instance_id = 9;
    r.world_size = 8;
    r.model_name = "q";
    r.model = model_shape{24, 1, 64, dtype_kind::fp16, attention_kind::mha};
    r.chunk_tokens = 256;
    r.layout_kind = kv_layout_kind::hnd;
    r.region = p::region_kind::none;
    r.cache_salt = "t";
    r.prefill_tokens_per_second = 50000;
    r.engine_id = "e1";
    auto bytes = p::encode_frame(2, r);
    REQUIRE(bytes.has_value());
    bytes_builder body;
    body.u64(9).u16(0).u16(8).str("q").u32(24).u32(1).u32(64).u8(1).u8(0).u32(0).u32(0).u32(256).u64(0);
    body.u8(1).u8(0).str("").str("t").u64(50000).u64(0).u64(0).u64(0).u64(0).u64(0).str("e1");
    CHECK(*bytes == make_frame(p::message_type::register_kv_request, 2, body.bytes));
  }
}

TEST_CASE("a signed field round-trips its extremes, -1 and 0 through its two's complement", "[protocol][codec]") {
  for (const std::int64_t v : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}, std::int64_t{-2},
                               std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()}) {
    INFO(v);
    p::describe_chunks_request d;
    d.lora_id = v;
    auto bytes = p::encode_frame(1, d);
    REQUIRE(bytes.has_value());
    auto back = decode_whole(*bytes);
    REQUIRE(back.has_value());
    CHECK(std::get<p::describe_chunks_request>(*back).lora_id == v);
    // The last field before the (empty) extra keys: its 8 bytes, little-endian.
    const std::size_t at = bytes->size() - 4 - 8;
    std::uint64_t wire = 0;
    for (std::size_t i = 0; i < 8; ++i) wire |= std::uint64_t(std::to_integer<std::uint8_t>((*bytes)[at + i])) << (8 * i);
    CHECK(wire == static_cast<std::uint64_t>(v));
  }
}

TEST_CASE("every message type has a name and counts as known", "[protocol][messages]") {
  for (const auto& m : kvtier::test::sample_messages()) {
    const auto t = p::type_of(m);
    CHECK(p::is_known(static_cast<std::uint16_t>(t)));
    CHECK(p::name(t) != "unknown");
  }
  CHECK_FALSE(p::is_known(0x0777));
  CHECK(p::name(static_cast<p::message_type>(0x0777)) == "unknown");
  CHECK(p::is_progress(p::message_type::retrieve_progress));
  CHECK_FALSE(p::is_response(p::message_type::retrieve_progress));
  CHECK_FALSE(p::is_progress(p::message_type::retrieve_response));
  CHECK_FALSE(p::is_progress(p::message_type::retrieve_request));
  CHECK(p::from_server(p::message_type::retrieve_progress));
  CHECK(p::from_server(p::message_type::error_response));
  CHECK_FALSE(p::from_server(p::message_type::retrieve_request));
  CHECK(p::carries_fd(p::message_type::register_kv_request));
  CHECK_FALSE(p::carries_fd(p::message_type::store_request));
  static_assert(std::is_same_v<p::lookup_request::response_type, p::lookup_response>);
}

TEST_CASE("every field limit accepts one below and at the limit and refuses one above", "[protocol][codec]") {
  auto resize_string = [](auto member) { return [member](auto& m, std::size_t n) { (m.*member).assign(n, 'k'); }; };
  check_field_limit(p::lookup_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::lookup_request::request_key));
  check_field_limit(p::query_prefetch_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::query_prefetch_request::request_key));
  check_field_limit(p::retrieve_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::retrieve_request::request_key));
  check_field_limit(p::store_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::store_request::request_key));
  check_field_limit(p::free_lookup_locks_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::free_lookup_locks_request::request_key));
  check_field_limit(p::end_request_request{}, "request_key", p::max_request_key_bytes,
                    resize_string(&p::end_request_request::request_key));
  check_field_limit(p::register_kv_request{}, "model_name", p::max_model_name_bytes,
                    resize_string(&p::register_kv_request::model_name));
  check_field_limit(p::register_kv_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::register_kv_request::cache_salt));
  check_field_limit(p::register_kv_request{}, "region_descriptor", p::max_region_descriptor_bytes,
                    resize_string(&p::register_kv_request::region_descriptor));
  check_field_limit(p::register_kv_request{}, "engine_id", p::max_engine_id_bytes,
                    resize_string(&p::register_kv_request::engine_id));
  check_field_limit(p::lookup_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::lookup_request::cache_salt));
  check_field_limit(p::retrieve_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::retrieve_request::cache_salt));
  check_field_limit(p::store_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::store_request::cache_salt));
  check_field_limit(p::error_response{}, "message", p::max_error_message_bytes,
                    resize_string(&p::error_response::message));
  check_field_limit(p::status_response{}, "json", p::max_status_json_bytes, resize_string(&p::status_response::json));
  check_field_limit(p::list_objects_response{}, "json", p::max_status_json_bytes,
                    resize_string(&p::list_objects_response::json));
  check_field_limit(p::evict_response{}, "json", p::max_status_json_bytes, resize_string(&p::evict_response::json));
  check_field_limit(p::evict_request{}, "model_name", p::max_model_name_bytes,
                    resize_string(&p::evict_request::model_name));
  check_field_limit(p::evict_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::evict_request::cache_salt));
  check_field_limit(p::evict_request{}, "tiers", p::max_tier_list_bytes, resize_string(&p::evict_request::tiers));
  check_field_limit(p::describe_chunks_request{}, "cache_salt", p::max_cache_salt_bytes,
                    resize_string(&p::describe_chunks_request::cache_salt));
  check_field_limit(p::describe_chunks_request{}, "lora_name", p::max_lora_name_bytes,
                    resize_string(&p::describe_chunks_request::lora_name));
  check_field_limit(p::describe_chunks_request{}, "chunk_hashes", p::max_chunk_hashes,
                    [](p::describe_chunks_request& m, std::size_t n) { m.chunk_hashes.assign(n, hash128{1, 2}); });
  check_field_limit(p::describe_chunks_request{}, "token_ids", p::max_described_tokens,
                    [](p::describe_chunks_request& m, std::size_t n) { m.token_ids.assign(n, 3u); });
  check_field_limit(p::describe_chunks_request{}, "block_extra_keys", p::max_block_extra_keys,
                    [](p::describe_chunks_request& m, std::size_t n) { m.block_extra_keys.assign(n, "\xc0"); });
  check_field_limit(p::describe_chunks_request{{}, 1, {}, 0, false, {}, {}, {}, {}, -1, {"", "", ""}},
                    "block_extra_keys", p::max_block_extra_key_bytes,
                    [](p::describe_chunks_request& m, std::size_t n) { m.block_extra_keys[1].assign(n, 'x'); });
  check_field_limit(p::lookup_request{"r", 1, 1, {}}, "chunk_hashes", p::max_chunk_hashes,
                    [](p::lookup_request& m, std::size_t n) {
                      m.chunk_hashes.assign(n, hash128{1, 2});
                    });
  check_field_limit(p::retrieve_request{}, "chunk_hashes", p::max_chunk_hashes,
                    [](p::retrieve_request& m, std::size_t n) {
                      m.chunk_hashes.assign(n, hash128{3, 4});
                    });
  check_field_limit(p::retrieve_request{}, "block_ids", p::max_block_ids,
                    [](p::retrieve_request& m, std::size_t n) { m.block_ids.assign(n, 7u); });
  check_field_limit(p::store_request{}, "chunk_hashes", p::max_chunk_hashes, [](p::store_request& m, std::size_t n) {
    m.chunk_hashes.assign(n, hash128{5, 6});
  });
  check_field_limit(p::store_request{}, "block_ids", p::max_block_ids, [](p::store_request& m, std::size_t n) {
    m.block_ids.assign(n, 9u);
    m.block_generations.assign(n, 10u);
  });
}

TEST_CASE("the largest legal store fits the default body limit and a smaller limit refuses it", "[protocol][codec]") {
  p::store_request s;
  s.request_key.assign(p::max_request_key_bytes, 'x');
  s.chunk_hashes.assign(p::max_chunk_hashes, hash128{1, 1});
  s.block_ids.assign(p::max_block_ids, 3);
  s.block_generations.assign(p::max_block_ids, 4);
  auto bytes = p::encode_frame(1, s);
  REQUIRE(bytes.has_value());
  CHECK(bytes->size() < p::default_max_body_bytes);
  auto back = decode_whole(*bytes);
  REQUIRE(back.has_value());
  CHECK(std::get<p::store_request>(*back) == s);

  const p::limits small{1 << 20};
  auto refused = p::encode_frame(1, s, small);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error() == errc::message_too_large);
  auto too_large = decode_whole(*bytes, small);
  REQUIRE_FALSE(too_large.has_value());
  CHECK(too_large.error().code == errc::message_too_large);
}

TEST_CASE("a length that the body does not hold is refused before anything is allocated", "[protocol][codec]") {
  SECTION("a vector count within its limit but past the end of the body") {
    bytes_builder body;
    body.str("r").u64(1).u16(1).u32(p::max_chunk_hashes).u64(1).u64(2);  // claims 65536, holds 1
    const auto frame = make_frame(p::message_type::lookup_request, 5, body.bytes);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("chunk_hashes") != std::string::npos);
    CHECK(largest < 4096);
  }
  SECTION("a vector count far above its limit") {
    bytes_builder body;
    body.str("r").u16(0).u32(0).u32(0xffffffffu);  // retrieve_request: chunk_hashes count 4 G
    const auto frame = make_frame(p::message_type::retrieve_request, 5, body.bytes);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::message_too_large);
    CHECK(largest < 4096);
  }
  SECTION("a string list whose count the body cannot hold (each string takes at least 4 bytes)") {
    bytes_builder body;
    body.u64(1).u16(1).str("").u32(1).u8(0).u64(0).u64(0).u32(0).u32(0).str("").u64(0);
    body.u32(p::max_block_extra_keys).u32(0);  // claims 131072 strings, holds one (empty)
    const auto frame = make_frame(p::message_type::describe_chunks_request, 5, body.bytes);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("describe_chunks_request.block_extra_keys") != std::string::npos);
    CHECK(largest < 4096);
  }
  SECTION("a string of a string list longer than the body") {
    bytes_builder body;
    body.u64(1).u16(1).str("").u32(1).u8(0).u64(0).u64(0).u32(0).u32(0).str("").u64(0);
    body.u32(1).u32(p::max_block_extra_key_bytes).raw("ab");
    const auto frame = make_frame(p::message_type::describe_chunks_request, 5, body.bytes);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(largest < 8192);
  }
  SECTION("a string length past the end of the body") {
    bytes_builder body;
    body.u32(200).raw("short");
    const auto frame = make_frame(p::message_type::query_prefetch_request, 5, body.bytes);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(largest < 4096);
  }
  SECTION("while a legal large body does allocate (the tracker sees allocations)") {
    p::lookup_request big{"r", 1, 1, std::vector<hash128>(p::max_chunk_hashes, hash128{1, 1})};
    const auto frame = encode_raw(big);
    p::decode_result<p::message> r = p::message{};
    const std::size_t largest = largest_allocation([&] { r = decode_whole(frame); });
    REQUIRE(r.has_value());
    CHECK(largest >= p::max_chunk_hashes * sizeof(hash128));
  }
}

TEST_CASE("malformed bodies are protocol errors with a reason", "[protocol][codec]") {
  SECTION("trailing bytes after the last field") {
    bytes_builder body;
    body.u64(1).u8(0);
    auto r = decode_whole(make_frame(p::message_type::ping_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().call_id == 8);
    CHECK(r.error().reason.find("trailing") != std::string::npos);
  }
  SECTION("a body shorter than its fixed fields") {
    bytes_builder body;
    body.u32(1);
    auto r = decode_whole(make_frame(p::message_type::ping_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("ping_request.instance_id") != std::string::npos);
  }
  SECTION("a boolean byte other than 0 or 1") {
    bytes_builder body;
    body.u8(2);
    auto r = decode_whole(make_frame(p::message_type::clear_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
  }
  SECTION("a lookup body of protocol version 2 (no answer_when_decided byte)") {
    bytes_builder body;
    body.str("ab").u64(5).u16(1).u32(0).str("");
    auto r = decode_whole(make_frame(p::message_type::lookup_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("lookup_request.answer_when_decided") != std::string::npos);
  }
  SECTION("a retrieve body of protocol version 3 (no progress byte)") {
    bytes_builder body;
    body.str("r").u16(0).u32(0).u32(0).u32(0).u32(0).str("");
    auto r = decode_whole(make_frame(p::message_type::retrieve_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("retrieve_request.progress") != std::string::npos);
  }
  SECTION("a retrieve progress of protocol version 4 (no chunks_ready)") {
    bytes_builder body;
    body.u32(3);
    auto r = decode_whole(make_frame(p::message_type::retrieve_progress, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("retrieve_progress.chunks_ready") != std::string::npos);
  }
  SECTION("an enumeration value past the last known one") {
    bytes_builder body;
    body.u8(3).u32(0).u32(0);
    auto r = decode_whole(make_frame(p::message_type::query_prefetch_response, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("state") != std::string::npos);
  }
  SECTION("an attention kind that is neither MHA nor MLA") {
    bytes_builder body;
    body.u64(1).u16(0).u16(1).str("m").u32(1).u32(1).u32(1).u8(2).u8(2).u32(16).u32(1).u32(256).u64(4096);
    body.u8(0).u8(1).str("").str("").u64(0).u64(0).u64(0).u64(0).u64(0).u64(0);
    auto r = decode_whole(make_frame(p::message_type::register_kv_request, 8, body.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("attention") != std::string::npos);
  }
  SECTION("a dtype kind, layout kind or region kind past the last known one") {
    auto reg = [](std::uint8_t dtype, std::uint8_t layout, std::uint8_t region) {
      bytes_builder body;
      body.u64(1).u16(0).u16(1).str("m").u32(1).u32(1).u32(1).u8(dtype).u8(0).u32(16).u32(1).u32(256).u64(4096);
      body.u8(layout).u8(region).str("").str("").u64(0).u64(0).u64(0).u64(0).u64(0).u64(0).str("");
      return decode_whole(make_frame(p::message_type::register_kv_request, 8, body.bytes));
    };
    CHECK(reg(5, 2, 2).has_value());  // int8, MLA, cuda_ipc: the last known values decode
    auto d = reg(6, 0, 1);
    REQUIRE_FALSE(d.has_value());
    CHECK(d.error().reason.find("dtype") != std::string::npos);
    auto l = reg(2, 3, 1);
    REQUIRE_FALSE(l.has_value());
    CHECK(l.error().reason.find("layout_kind") != std::string::npos);
    auto g = reg(2, 0, 3);
    REQUIRE_FALSE(g.has_value());
    CHECK(g.error().reason.find("region") != std::string::npos);
  }
  SECTION("a store whose generations do not match its block ids") {
    p::store_request s{"k", 0, 0, {hash128{1, 1}}, {1, 2}, {1}};
    auto refused = p::encode_frame(1, s);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error() == errc::invalid_argument);
    auto r = decode_whole(encode_raw(s));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
  }
  SECTION("a describe_chunks body cut inside its lora_id, and one with a bad has_parent byte") {
    bytes_builder cut;
    cut.u64(1).u16(1).str("").u32(1).u8(0).u64(0).u64(0).u32(0).u32(0).str("").u32(7);
    auto r = decode_whole(make_frame(p::message_type::describe_chunks_request, 8, cut.bytes));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().reason.find("describe_chunks_request.lora_id") != std::string::npos);
    bytes_builder flag;
    flag.u64(1).u16(1).str("").u32(1).u8(2).u64(0).u64(0).u32(0).u32(0).str("").u64(0).u32(0);
    auto f = decode_whole(make_frame(p::message_type::describe_chunks_request, 8, flag.bytes));
    REQUIRE_FALSE(f.has_value());
    CHECK(f.error().code == errc::protocol_error);
    CHECK(f.error().reason.find("has_parent") != std::string::npos);
    bytes_builder trailing;
    trailing.u64(1).u16(1).str("").u32(1).u8(0).u64(0).u64(0).u32(0).u32(0).str("").u64(0).u32(0).u8(0);
    auto t = decode_whole(make_frame(p::message_type::describe_chunks_request, 8, trailing.bytes));
    REQUIRE_FALSE(t.has_value());
    CHECK(t.error().reason.find("trailing") != std::string::npos);
  }
  SECTION("an unknown message type") {
    auto r = decode_whole(make_frame(static_cast<p::message_type>(0x0777), 8, {}));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
    CHECK(r.error().call_id == 8);
  }
  SECTION("a header from another version") {
    auto r = decode_whole(make_frame(p::message_type::status_request, 8, {}, p::protocol_version + 1));
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::version_mismatch);
  }
  SECTION("a body whose size disagrees with its header") {
    p::frame_header h{p::protocol_version, p::message_type::ping_request, 8, 9};
    std::vector<std::byte> body(8);
    auto r = p::decode_message(h, body);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == errc::protocol_error);
  }
}

TEST_CASE("decode errors throw only when their value is asked for", "[protocol][codec]") {
  auto r = decode_whole(make_frame(p::message_type::ping_request, 8, {}));
  REQUIRE_FALSE(r.has_value());
  CHECK_THROWS_AS(r.value(), boost::system::system_error);
}

TEST_CASE("an error reply is cut to its limit and names a kvtier error", "[protocol][messages]") {
  auto e = p::error_response::make(errc::not_registered, std::string(10000, 'e'));
  CHECK(e.message.size() == p::max_error_message_bytes);
  CHECK(e.error() == errc::not_registered);
  CHECK(p::encode_frame(1, e).has_value());
}
