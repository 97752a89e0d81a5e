#include <kvtier/core/token_hasher.hpp>

#include <kvtier/core/model_id.hpp>

#include <catch2/catch.hpp>

#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

using namespace kvtier;

// Fixed vectors. They were computed independently of this code: the root with
// `printf 'kvtier.root.v1' | xxh128sum` (and sha256sum), each chunk with xxh128sum / Python's
// hashlib over the documented encoding (16-byte LE prefix || u32 LE tokens). A change here
// means every stored object in every deployment becomes unreachable: never edit them.
namespace {
std::vector<token_id> iota_tokens(std::size_t n, token_id first = 0) {
  std::vector<token_id> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}
}  // namespace

TEST_CASE("xxh3_128 chunk hashes match the fixed vectors", "[core][token_hasher]") {
  const token_hasher h;  // chunk 256, xxh3_128
  CHECK(h.root().to_hex() == "a9adbf7e4da9281782e3516ed994567f");
  const auto hashes = h.chunk_hashes(iota_tokens(600));
  REQUIRE(hashes.size() == 2);  // the trailing 88 tokens are never hashed
  CHECK(hashes[0].to_hex() == "9f311b23a6bc6c2337626271ec95a508");
  CHECK(hashes[1].to_hex() == "768727cfdd544fb1b74c592482262470");

  const token_hasher small(4);
  const auto s = small.chunk_hashes(iota_tokens(9, 1));
  REQUIRE(s.size() == 2);
  CHECK(s[0].to_hex() == "b2747f92442d1de6a116da93a5f46f04");
  CHECK(s[1].to_hex() == "ae68132fb20f392f36a0a116d05eb1db");
}

TEST_CASE("sha256 chunk hashes match the fixed vectors", "[core][token_hasher]") {
  const token_hasher h(256, hash_algorithm::sha256);
  CHECK(h.root().to_hex() == "42bbdc48c68f1629087069220f379916");
  const auto hashes = h.chunk_hashes(iota_tokens(512));
  REQUIRE(hashes.size() == 2);
  CHECK(hashes[0].to_hex() == "5000c50809eed98d6922d874a96cf1fe");
  CHECK(hashes[1].to_hex() == "7ba390336af54d8523e9bd783e596573");
  const auto s = token_hasher(4, hash_algorithm::sha256).chunk_hashes(iota_tokens(8, 1));
  REQUIRE(s.size() == 2);
  CHECK(s[0].to_hex() == "3b4dd38f2c01a69dbb6a817677c71554");
  CHECK(s[1].to_hex() == "ee619338be8a67f4ab2a11dfb0758537");
}

TEST_CASE("a chunk hash depends on the whole prefix", "[core][token_hasher]") {
  const token_hasher h(4);
  auto a = iota_tokens(8);
  auto b = a;
  b[0] = 99;  // first chunk differs, second chunk identical
  const auto ha = h.chunk_hashes(a);
  const auto hb = h.chunk_hashes(b);
  CHECK(ha[0] != hb[0]);
  CHECK(ha[1] != hb[1]);
  // Same tokens, same hashes; sequences that share a prefix share its hashes.
  auto c = iota_tokens(12);
  const auto hc = h.chunk_hashes(c);
  CHECK(hc[0] == ha[0]);
  CHECK(hc[1] == ha[1]);
}

TEST_CASE("hashing can continue from a stored prefix hash", "[core][token_hasher]") {
  const token_hasher h(4);
  const auto all = iota_tokens(12);
  const auto whole = h.chunk_hashes(all);
  std::vector<hash128> parts;
  const hash128 last = h.append_chunk_hashes(std::span(all).first(4), parts);
  h.append_chunk_hashes(std::span(all).subspan(4), parts, last);
  CHECK(parts == whole);
  CHECK_THROWS_AS(h.next(h.root(), std::span(all).first(3)), std::invalid_argument);
  CHECK_THROWS_AS(token_hasher(0), std::invalid_argument);
}

namespace {
std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }
}  // namespace

TEST_CASE("an empty extra leaves every chunk hash as it was", "[core][token_hasher]") {
  // The keys of plain token prompts (C++ engines, the mini engine, requests without adapters,
  // images or embeddings) must not move: caches stored before extras existed stay valid.
  for (const auto algorithm : {hash_algorithm::xxh3_128, hash_algorithm::sha256}) {
    const token_hasher h(4, algorithm);
    const auto t = iota_tokens(8, 1);
    const auto plain = h.chunk_hashes(t);
    const std::vector<std::span<const std::byte>> none(2);
    CHECK(h.chunk_hashes(t, none) == plain);
    CHECK(h.next(h.root(), std::span(t).first(4), {}) == plain[0]);
  }
  // The pinned values of the first test, through the extras path.
  const std::vector<std::span<const std::byte>> none(2);
  const auto s = token_hasher(4).chunk_hashes(iota_tokens(9, 1), none);
  CHECK(s[0].to_hex() == "b2747f92442d1de6a116da93a5f46f04");
  CHECK(s[1].to_hex() == "ae68132fb20f392f36a0a116d05eb1db");
}

TEST_CASE("chunk extras match the fixed vectors", "[core][token_hasher]") {
  // Computed independently with Python's xxhash / hashlib over the documented encoding:
  // 16-byte LE prefix || u32 LE tokens || (u64 LE len(extra) || extra, when extra is non-empty).
  const auto t = iota_tokens(8, 1);
  const std::vector<std::span<const std::byte>> first_only{bytes_of("lora:a"), {}};
  const auto x = token_hasher(4).chunk_hashes(t, first_only);
  REQUIRE(x.size() == 2);
  CHECK(x[0].to_hex() == "4f30b5c9335e62ac53e9cb72e9c6865e");
  CHECK(x[1].to_hex() == "bac1c5701a901b6b76224c9c5b2fe029");  // the extra reaches later chunks by the chain
  const std::string zero(1, '\0');
  const std::vector<std::span<const std::byte>> both{bytes_of("lora:a"), bytes_of(zero)};
  const auto y = token_hasher(4).chunk_hashes(t, both);
  CHECK(y[0] == x[0]);
  CHECK(y[1].to_hex() == "95ddd4d7664db37bec84bda2f3cf48bc");  // one NUL byte is an extra, not "none"
  const auto s = token_hasher(4, hash_algorithm::sha256).chunk_hashes(t, first_only);
  CHECK(s[0].to_hex() == "66e061714464b4d2199f1e6772c15ddf");
  CHECK(s[1].to_hex() == "3e857a91d74fb5824f5369f19c0fca35");
}

TEST_CASE("different extras or a different split of tokens and extra never share a hash", "[core][token_hasher]") {
  const token_hasher h(2);
  const std::vector<token_id> t{1, 2};
  const hash128 plain = h.next(h.root(), t);
  const hash128 a = h.next(h.root(), t, bytes_of("a"));
  const hash128 b = h.next(h.root(), t, bytes_of("b"));
  const hash128 ab = h.next(h.root(), t, bytes_of("ab"));
  CHECK(a != plain);
  CHECK(a != b);
  CHECK(ab != a);
  // Without the length prefix, tokens {1, 2} + extra "" and tokens {1, 2} + the extra holding
  // the LE bytes of a third token would be one message with a different split; the fixed
  // token width and the length prefix keep them apart.
  const std::string le3("\x03\0\0\0", 4);
  CHECK(h.next(h.root(), t, bytes_of(le3)) != plain);
  const std::string len_then("\x01\0\0\0\0\0\0\0a", 9);
  CHECK(h.next(h.root(), t, bytes_of(len_then)) != a);  // an extra that looks like a framed one
}

TEST_CASE("extras must name every full chunk or none", "[core][token_hasher]") {
  const token_hasher h(4);
  const auto t = iota_tokens(10);  // 2 full chunks
  const std::vector<std::span<const std::byte>> one{bytes_of("x")};
  const std::vector<std::span<const std::byte>> three(3);
  CHECK_THROWS_AS(h.chunk_hashes(t, one), std::invalid_argument);
  CHECK_THROWS_AS(h.chunk_hashes(t, three), std::invalid_argument);
  // Continuing from a prefix with extras equals hashing the whole sequence with them.
  const std::vector<std::span<const std::byte>> two{bytes_of("x"), bytes_of("y")};
  const auto whole = h.chunk_hashes(t, two);
  std::vector<hash128> parts;
  const hash128 last = h.append_chunk_hashes(std::span(t).first(4), parts, std::nullopt, std::span(two).first(1));
  h.append_chunk_hashes(std::span(t).subspan(4), parts, last, std::span(two).subspan(1));
  CHECK(parts == whole);
}

TEST_CASE("hash algorithms parse from their names", "[core][token_hasher]") {
  CHECK(parse_hash_algorithm("xxh3_128") == hash_algorithm::xxh3_128);
  CHECK(parse_hash_algorithm("sha256") == hash_algorithm::sha256);
  CHECK_FALSE(parse_hash_algorithm("md5").has_value());
  CHECK(to_string(hash_algorithm::sha256) == "sha256");
}

TEST_CASE("model ids separate models, layouts and tenants", "[core][token_hasher]") {
  const model_shape m{24, 2, 64, dtype_kind::bf16, attention_kind::mha};
  // Fixed vectors, computed independently with Python's xxhash (encoding version 2).
  CHECK(make_model_id("Qwen/Qwen2.5-0.5B", m) == 0x3142a63d9d9ead8cULL);
  CHECK(salted_model_id(0x3142a63d9d9ead8cULL, "tenant-a") == 0x03e3f59ac951867bULL);
  model_shape fp8 = m;
  fp8.dtype = dtype_kind::fp8_e4m3;
  CHECK(make_model_id("Qwen/Qwen2.5-0.5B", fp8) != make_model_id("Qwen/Qwen2.5-0.5B", m));
  CHECK(make_model_id("Qwen/Qwen2.5-0.5B", m, kv_layout_kind::nhd, "tenant-a") !=
        make_model_id("Qwen/Qwen2.5-0.5B", m));
  CHECK(make_model_id("a", m, kv_layout_kind::nhd, "bc") != make_model_id("ab", m, kv_layout_kind::nhd, "c"));
}

TEST_CASE("dtype kinds of one element size never share a model id", "[core][token_hasher]") {
  // fp16 and bf16 are both 2 bytes, fp8 e4m3 and e5m2 both 1: a namespace keyed by the size
  // alone would hand one engine the other's KV (sizes and checksums match).
  model_shape a{24, 2, 64, dtype_kind::fp16, attention_kind::mha};
  model_shape b = a;
  b.dtype = dtype_kind::bf16;
  CHECK(a.dtype_bytes() == b.dtype_bytes());
  CHECK(make_model_id("m", a) != make_model_id("m", b));
  a.dtype = dtype_kind::fp8_e4m3;
  b.dtype = dtype_kind::fp8_e5m2;
  CHECK(a.dtype_bytes() == b.dtype_bytes());
  CHECK(make_model_id("m", a) != make_model_id("m", b));
}

TEST_CASE("the layout kind is part of the model id, but an MLA model has only one", "[core][token_hasher]") {
  const model_shape mha{24, 2, 64, dtype_kind::bf16, attention_kind::mha};
  CHECK(make_model_id("m", mha, kv_layout_kind::nhd) != make_model_id("m", mha, kv_layout_kind::hnd));
  const model_shape mla{61, 1, 576, dtype_kind::bf16, attention_kind::mla};
  CHECK(make_model_id("m", mla, kv_layout_kind::nhd) == make_model_id("m", mla, kv_layout_kind::mla));
}

TEST_CASE("request salts separate tenants and the empty salt is the model id itself", "[core][token_hasher]") {
  const std::uint64_t id = make_model_id("m", model_shape{2, 2, 16, dtype_kind::bf16, attention_kind::mha});
  CHECK(salted_model_id(id, "") == id);
  CHECK(salted_model_id(id, "a") != id);
  CHECK(salted_model_id(id, "a") != salted_model_id(id, "b"));
  CHECK(salted_model_id(id, "a") == salted_model_id(id, "a"));
}
