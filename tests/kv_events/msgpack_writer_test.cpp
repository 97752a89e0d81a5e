// kv_events/msgpack_writer.hpp: every value in the bytes the msgpack spec gives for it, in
// its smallest form, at each boundary between two forms.
#include <kvtier/kv_events/msgpack_writer.hpp>

#include "kv_events/sample_events.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace file_msgpack_writer_test {

using kvtier::kv_events::msgpack_writer;

// Bytes as "c0 ff 01": a failure shows both sides readably.
std::string hex(const std::string& bytes) { return kvtier::test::kv_event_samples::hex(bytes, " "); }

std::string bytes(std::initializer_list<int> list) {
  std::string out;
  for (int b : list) out.push_back(static_cast<char>(b));
  return out;
}

std::string written(const std::function<void(msgpack_writer&)>& write) {
  std::string out;
  msgpack_writer w(out);
  write(w);
  return out;
}

std::string encoded_unsigned(std::uint64_t v) {
  return hex(written([&](msgpack_writer& w) { w.unsigned_int(v); }));
}
std::string encoded_signed(std::int64_t v) {
  return hex(written([&](msgpack_writer& w) { w.signed_int(v); }));
}

TEST_CASE("nil and booleans are their one-byte markers", "[kv_events][msgpack]") {
  CHECK(hex(written([](msgpack_writer& w) { w.nil(); })) == "c0");
  CHECK(hex(written([](msgpack_writer& w) { w.boolean(false); })) == "c2");
  CHECK(hex(written([](msgpack_writer& w) { w.boolean(true); })) == "c3");
}

TEST_CASE("unsigned integers take positive fixint, uint8, uint16, uint32 or uint64, the smallest that holds them",
          "[kv_events][msgpack]") {
  CHECK(encoded_unsigned(0) == "00");
  CHECK(encoded_unsigned(127) == "7f");
  CHECK(encoded_unsigned(128) == "cc 80");
  CHECK(encoded_unsigned(255) == "cc ff");
  CHECK(encoded_unsigned(256) == "cd 01 00");
  CHECK(encoded_unsigned(65535) == "cd ff ff");
  CHECK(encoded_unsigned(65536) == "ce 00 01 00 00");
  CHECK(encoded_unsigned(0xffffffffULL) == "ce ff ff ff ff");
  CHECK(encoded_unsigned(0x100000000ULL) == "cf 00 00 00 01 00 00 00 00");
  CHECK(encoded_unsigned(std::numeric_limits<std::uint64_t>::max()) == "cf ff ff ff ff ff ff ff ff");
}

TEST_CASE(
    "signed integers: non-negative ones as unsigned, negative ones as negative fixint, int8, int16, int32 "
    "or int64",
    "[kv_events][msgpack]") {
  CHECK(encoded_signed(0) == "00");
  CHECK(encoded_signed(127) == "7f");
  CHECK(encoded_signed(200) == "cc c8");
  CHECK(encoded_signed(std::numeric_limits<std::int64_t>::max()) == "cf 7f ff ff ff ff ff ff ff");
  CHECK(encoded_signed(-1) == "ff");
  CHECK(encoded_signed(-32) == "e0");
  CHECK(encoded_signed(-33) == "d0 df");
  CHECK(encoded_signed(-128) == "d0 80");
  CHECK(encoded_signed(-129) == "d1 ff 7f");
  CHECK(encoded_signed(-32768) == "d1 80 00");
  CHECK(encoded_signed(-32769) == "d2 ff ff 7f ff");
  CHECK(encoded_signed(std::numeric_limits<std::int32_t>::min()) == "d2 80 00 00 00");
  CHECK(encoded_signed(std::int64_t{std::numeric_limits<std::int32_t>::min()} - 1) == "d3 ff ff ff ff 7f ff ff ff");
  CHECK(encoded_signed(std::numeric_limits<std::int64_t>::min()) == "d3 80 00 00 00 00 00 00 00");
}

TEST_CASE("floats are always float64, big-endian IEEE 754", "[kv_events][msgpack]") {
  CHECK(hex(written([](msgpack_writer& w) { w.float64(1.0); })) == "cb 3f f0 00 00 00 00 00 00");
  CHECK(hex(written([](msgpack_writer& w) { w.float64(-2.5); })) == "cb c0 04 00 00 00 00 00 00");
  CHECK(hex(written([](msgpack_writer& w) { w.float64(0.0); })) == "cb 00 00 00 00 00 00 00 00");
  // 1.7e9 seconds, a timestamp of 2023: 0x41d954fc40000000.
  CHECK(hex(written([](msgpack_writer& w) { w.float64(1.7e9); })) == "cb 41 d9 54 fc 40 00 00 00");
}

TEST_CASE("strings take fixstr up to 31 bytes, then str8, str16, str32", "[kv_events][msgpack]") {
  CHECK(hex(written([](msgpack_writer& w) { w.str(""); })) == "a0");
  CHECK(hex(written([](msgpack_writer& w) { w.str("CPU"); })) == "a3 43 50 55");
  auto header = [](std::size_t n, std::size_t header_bytes) {
    const std::string s(n, 'x');
    const std::string out = written([&](msgpack_writer& w) { w.str(s); });
    REQUIRE(out.size() == n + header_bytes);
    CHECK(out.substr(header_bytes) == s);
    return hex(out.substr(0, header_bytes));
  };
  CHECK(header(31, 1) == "bf");
  CHECK(header(32, 2) == "d9 20");
  CHECK(header(255, 2) == "d9 ff");
  CHECK(header(256, 3) == "da 01 00");
  CHECK(header(65535, 3) == "da ff ff");
  CHECK(header(65536, 5) == "db 00 01 00 00");
}

TEST_CASE("bytes take bin8, bin16 or bin32 and are copied as they are", "[kv_events][msgpack]") {
  CHECK(hex(written([](msgpack_writer& w) { w.bin(std::string_view{}); })) == "c4 00");
  CHECK(hex(written([](msgpack_writer& w) { w.bin(bytes({0x00, 0xff, 0x10})); })) == "c4 03 00 ff 10");
  const std::vector<std::byte> raw{std::byte{1}, std::byte{2}};
  CHECK(hex(written([&](msgpack_writer& w) { w.bin(raw); })) == "c4 02 01 02");
  auto header = [](std::size_t n, std::size_t header_bytes) {
    const std::string s(n, '\x7f');
    const std::string out = written([&](msgpack_writer& w) { w.bin(s); });
    REQUIRE(out.size() == n + header_bytes);
    return hex(out.substr(0, header_bytes));
  };
  CHECK(header(255, 2) == "c4 ff");
  CHECK(header(256, 3) == "c5 01 00");
  CHECK(header(65535, 3) == "c5 ff ff");
  CHECK(header(65536, 5) == "c6 00 01 00 00");
}

TEST_CASE("array and map headers take the fix form up to 15 entries, then 16 and 32 bits", "[kv_events][msgpack]") {
  CHECK(hex(written([](msgpack_writer& w) { w.array_header(0); })) == "90");
  CHECK(hex(written([](msgpack_writer& w) { w.array_header(15); })) == "9f");
  CHECK(hex(written([](msgpack_writer& w) { w.array_header(16); })) == "dc 00 10");
  CHECK(hex(written([](msgpack_writer& w) { w.array_header(65535); })) == "dc ff ff");
  CHECK(hex(written([](msgpack_writer& w) { w.array_header(65536); })) == "dd 00 01 00 00");
  CHECK(hex(written([](msgpack_writer& w) { w.map_header(0); })) == "80");
  CHECK(hex(written([](msgpack_writer& w) { w.map_header(15); })) == "8f");
  CHECK(hex(written([](msgpack_writer& w) { w.map_header(16); })) == "de 00 10");
  CHECK(hex(written([](msgpack_writer& w) { w.map_header(65536); })) == "df 00 01 00 00");
}

TEST_CASE("a count beyond 2^32-1 is refused, not truncated", "[kv_events][msgpack]") {
  std::string out;
  msgpack_writer w(out);
  CHECK_THROWS_AS(w.array_header(std::size_t{1} << 32), std::length_error);
  CHECK_THROWS_AS(w.map_header(std::size_t{1} << 32), std::length_error);
  CHECK(out.empty());
}

TEST_CASE("values append one after another to the caller's string", "[kv_events][msgpack]") {
  std::string out = "x";
  msgpack_writer w(out);
  w.map_header(1);
  w.str("a");
  w.array_header(3);
  w.unsigned_int(1);
  w.nil();
  w.signed_int(-2);
  CHECK(hex(out) == "78 81 a1 61 93 01 c0 fe");
  CHECK(&w.out() == &out);
}

}  // namespace file_msgpack_writer_test
