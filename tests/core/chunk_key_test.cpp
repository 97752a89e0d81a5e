#include <kvtier/core/chunk_key.hpp>

#include <catch2/catch.hpp>

#include <unordered_set>

using kvtier::chunk_key;
using kvtier::hash128;

TEST_CASE("hash128 round-trips through hex", "[core][chunk_key]") {
  const hash128 h{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  CHECK(h.to_hex() == "fedcba98765432100123456789abcdef");
  CHECK(hash128::from_hex(h.to_hex()) == h);
  CHECK_FALSE(hash128::from_hex("xyz").has_value());
  CHECK_FALSE(hash128::from_hex("FEDCBA98765432100123456789ABCDEF").has_value());
}

TEST_CASE("chunk_key encodes to 28 little-endian bytes and back", "[core][chunk_key]") {
  const chunk_key k{0x1122334455667788ULL, 2, 1, {0xa1a2a3a4a5a6a7a8ULL, 0xb1b2b3b4b5b6b7b8ULL}};
  const auto bytes = k.encode();
  REQUIRE(bytes.size() == 28);
  CHECK(bytes[0] == std::byte{0x88});
  CHECK(bytes[7] == std::byte{0x11});
  CHECK(bytes[8] == std::byte{2});
  CHECK(bytes[10] == std::byte{1});
  CHECK(bytes[12] == std::byte{0xa8});
  CHECK(bytes[27] == std::byte{0xb1});
  CHECK(chunk_key::decode(bytes) == k);
}

TEST_CASE("chunk keys differing in any field are different and hash apart", "[core][chunk_key]") {
  const chunk_key base{7, 2, 0, {1, 2}};
  std::unordered_set<chunk_key> set{base};
  chunk_key k = base;
  k.rank = 1;
  set.insert(k);
  k = base;
  k.world_size = 4;
  set.insert(k);
  k = base;
  k.model_id = 8;
  set.insert(k);
  k = base;
  k.hash.hi = 3;
  set.insert(k);
  set.insert(base);
  CHECK(set.size() == 5);
  CHECK(base.to_string() == "0000000000000007/2/0/00000000000000020000000000000001");
}
