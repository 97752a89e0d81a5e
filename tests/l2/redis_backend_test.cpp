// The Redis backend beyond the conformance suite (l2/redis_conformance_test.cpp): the slot
// function against the specification and a real cluster, the wire pieces, the options,
// MOVED and ASK on a real cluster while a slot migrates, corrupt and foreign values written
// behind the backend's back, Redis killed, restarted and frozen mid-run, a fake server that
// stalls mid-reply (the buffer contract), AUTH, TTL, Redis's own eviction, and two tiered
// caches sharing one Redis.
#include <kvtier/l2/redis/redis_backend.hpp>

#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/telemetry/collectors.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <catch2/catch.hpp>

#include "l2/redis_support.hpp"
#include "support/asio.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <vector>

using namespace kvtier;
namespace asio = boost::asio;
using kvtier::test::reply_text;
using kvtier::test::run_sync;
using kvtier::test::run_until;
using kvtier::test::run_until_idle;
using l2::key_outcome;

namespace {

constexpr std::size_t object_bytes = 16 * 1024;

chunk_key key_of(std::uint64_t i, std::uint64_t model = 0xabc) {
  return chunk_key{model, 1, 0, hash128{i * 977 + 3, i}};
}

std::vector<std::byte> bytes_of(const chunk_key& k, std::size_t n = object_bytes) {
  std::vector<std::byte> b(n);
  for (std::size_t j = 0; j < n; ++j) b[j] = static_cast<std::byte>(k.hash.lo * 131 + j * 7 + (j >> 9));
  return b;
}

l2::deadline in(std::chrono::milliseconds ms) { return l2::clock::now() + ms; }
l2::deadline soon() { return in(std::chrono::seconds(30)); }

// One backend on its own io_context, with helpers that run one operation to completion.
struct client {
  asio::io_context io;
  std::unique_ptr<l2::redis_backend> b;

  explicit client(l2::redis_backend_options o, bool wait_healthy = true, telemetry::logger* log = nullptr) {
    b = std::make_unique<l2::redis_backend>(io.get_executor(), std::move(o), log);
    if (wait_healthy) REQUIRE(run_until(io, [&] { return b->health().healthy; }));
  }

  std::tuple<error_code, bitmap> lookup(std::span<const chunk_key> keys, l2::deadline d = soon()) {
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
      co_return co_await b->async_lookup_and_pin(keys, d, asio::as_tuple(asio::use_awaitable));
    }());
  }
  std::tuple<error_code, l2::batch_result> store(std::span<const chunk_key> keys, std::size_t n = object_bytes,
                                                 l2::deadline d = soon()) {
    std::vector<std::vector<std::byte>> data;
    for (const auto& k : keys) data.push_back(bytes_of(k, n));
    std::vector<std::span<const std::byte>> src(data.begin(), data.end());
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_store(keys, src, d, asio::as_tuple(asio::use_awaitable));
    }());
  }
  // Loads into fresh buffers filled with 0xee; `out` keeps them.
  std::tuple<error_code, l2::batch_result> load(std::span<const chunk_key> keys,
                                                std::vector<std::vector<std::byte>>& out, std::size_t n = object_bytes,
                                                l2::deadline d = soon()) {
    out.assign(keys.size(), std::vector<std::byte>(n, std::byte{0xee}));
    std::vector<std::span<std::byte>> dst(out.begin(), out.end());
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_load(keys, dst, d, asio::as_tuple(asio::use_awaitable));
    }());
  }
  std::tuple<error_code, l2::batch_result> remove(std::span<const chunk_key> keys, l2::deadline d = soon()) {
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b->async_remove(keys, d, asio::as_tuple(asio::use_awaitable));
    }());
  }
  std::tuple<error_code, std::vector<l2::listed_object>> list(l2::key_filter f = {}, l2::deadline d = soon()) {
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, std::vector<l2::listed_object>>> {
      co_return co_await b->async_list(f, d, asio::as_tuple(asio::use_awaitable));
    }());
  }
  // Every key loads exactly its own bytes.
  bool loads_right_bytes(std::span<const chunk_key> keys, std::size_t n = object_bytes) {
    std::vector<std::vector<std::byte>> out;
    auto [ec, r] = load(keys, out, n);
    if (ec) return false;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (!r.ok(i) || out[i] != bytes_of(keys[i], n)) return false;
    return true;
  }
};

l2::redis_backend_options standalone_options(const test::redis_server& s) {
  l2::redis_backend_options o;
  o.nodes = {s.endpoint()};
  o.connections_per_node = 2;
  return o;
}

l2::redis_backend_options cluster_options(test::redis_cluster& c) {
  l2::redis_backend_options o;
  o.name = "redis-cluster";
  o.cluster = true;
  o.nodes = {c.node(0).endpoint()};
  o.connections_per_node = 2;
  return o;
}

std::vector<chunk_key> keys(std::uint64_t first, std::size_t n, std::uint64_t model = 0xabc) {
  std::vector<chunk_key> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(key_of(first + i, model));
  return k;
}

}  // namespace

// --- pure pieces ------------------------------------------------------------------------

TEST_CASE("the key slot is CRC16/XMODEM modulo 16384 of the key or its first non-empty hash tag", "[redis][slot]") {
  using l2::detail::redis_key_slot;
  CHECK(l2::detail::redis_crc16("123456789") == 0x31C3);  // the specification's test vector
  CHECK(redis_key_slot("123456789") == 12739);
  CHECK(redis_key_slot("") == 0);
  CHECK(redis_key_slot("foo") == 12182);  // redis-cli CLUSTER KEYSLOT foo
  CHECK(redis_key_slot("{user1000}.following") == redis_key_slot("{user1000}.followers"));
  CHECK(redis_key_slot("{user1000}.following") == redis_key_slot("user1000"));
  CHECK(l2::detail::redis_hash_tag("foo{}{bar}") == "foo{}{bar}");  // empty first tag: whole key
  CHECK(l2::detail::redis_hash_tag("foo{{bar}}zap") == "{bar");
  CHECK(l2::detail::redis_hash_tag("foo{bar}{zap}") == "bar");
  CHECK(l2::detail::redis_hash_tag("foo{bar") == "foo{bar");
}

TEST_CASE("the slot function agrees with CLUSTER KEYSLOT of a real cluster", "[redis][slot][cluster]") {
  auto& c = test::shared_cluster();
  l2::redis_backend_options o = cluster_options(c);
  std::vector<std::string> probe = {"a",
                                    "b",
                                    "kvtier",
                                    "{a}b",
                                    "a{b}c",
                                    "{}x",
                                    "x{}",
                                    "{{x}}",
                                    "}{x}",
                                    "\xff\xfe\x01",
                                    "a long key with spaces and : colons"};
  std::mt19937_64 rng(42);
  for (int i = 0; i < 60; ++i) {
    std::string s;
    const auto len = rng() % 40;
    for (std::uint64_t j = 0; j < len; ++j) s += static_cast<char>("ab{}:xyz0123"[rng() % 12]);
    probe.push_back(s);
  }
  // Our own keys, as the backend writes them.
  asio::io_context io;
  l2::redis_backend b(io.get_executor(), o);
  for (std::uint64_t i = 0; i < 30; ++i) probe.push_back(b.key_of(key_of(i, i * 0x9e3779b97f4a7c15ULL)));
  for (const auto& k : probe) {
    INFO(k);
    auto r = c.node(0).command({"CLUSTER", "KEYSLOT", k});
    REQUIRE(r);
    REQUIRE(r->type == REDIS_REPLY_INTEGER);
    CHECK(l2::detail::redis_key_slot(k) == r->integer);
  }
}

TEST_CASE("keys carry the prefix, the model id, the shard and the chunk hash", "[redis]") {
  asio::io_context io;
  l2::redis_backend_options o;
  o.key_prefix = "fleet-a";
  l2::redis_backend b(io.get_executor(), o);
  const chunk_key k{0x0123456789abcdefULL, 8, 3, hash128{0x1111, 0xffff}};
  CHECK(b.key_of(k) == "fleet-a:0123456789abcdef:8:3:000000000000ffff0000000000001111");
  const chunk_key other_layout{0x0123456789abcdeeULL, 8, 3, k.hash};
  CHECK(b.key_of(other_layout) != b.key_of(k));
}

TEST_CASE("a SET framed around the caller's value is byte for byte what hiredis formats", "[redis][wire]") {
  const std::string key = "kvtier:00:1:0:ab";
  const std::string value(1000, 'v');
  for (std::uint32_t ttl : {0u, 86400u}) {
    INFO(ttl);
    const auto f = l2::detail::redis_set_frame(key, value.size(), ttl);
    std::string expected;
    if (ttl == 0)
      l2::detail::redis_format_append(expected, {"SET", key, value, "NX"});
    else
      l2::detail::redis_format_append(expected, {"SET", key, value, "NX", "EX", std::to_string(ttl)});
    CHECK(f.head + value + f.tail == expected);
  }
}

TEST_CASE("redirects, endpoints and INFO fields are parsed, malformed ones refused", "[redis][wire]") {
  using namespace l2::detail;
  auto m = redis_parse_redirect("MOVED 3999 127.0.0.1:6381");
  REQUIRE(m);
  CHECK_FALSE(m->ask);
  CHECK(m->slot == 3999);
  CHECK(m->to == redis_endpoint{"127.0.0.1", 6381});
  auto a = redis_parse_redirect("ASK 12 ::1:7000");
  REQUIRE(a);
  CHECK(a->ask);
  CHECK(a->to == redis_endpoint{"::1", 7000});
  auto empty_host = redis_parse_redirect("MOVED 5 :7001");
  REQUIRE(empty_host);
  CHECK(empty_host->to.host.empty());
  CHECK_FALSE(redis_parse_redirect("MOVED 16384 h:1"));
  CHECK_FALSE(redis_parse_redirect("MOVED x h:1"));
  CHECK_FALSE(redis_parse_redirect("MOVED 1 h:0"));
  CHECK_FALSE(redis_parse_redirect("ERR wrong"));
  CHECK_FALSE(redis_parse_endpoint("nohost"));
  CHECK_FALSE(redis_parse_endpoint("h:99999"));
  const std::string info = "# Memory\r\nused_memory:123456\r\nused_memory_human:1.2M\r\nmaxmemory:0\r\n";
  CHECK(redis_info_field(info, "used_memory") == 123456u);
  CHECK(redis_info_field(info, "maxmemory") == 0u);
  CHECK_FALSE(redis_info_field(info, "used_memory_human"));
  CHECK_FALSE(redis_info_field(info, "absent"));
}

// --- a real standalone Redis ------------------------------------------------------------

TEST_CASE("stores and loads of 3 MiB objects go straight to and from the caller's buffers", "[redis]") {
  auto& s = test::shared_standalone();
  s.command({"FLUSHALL"});
  client c(standalone_options(s));
  const auto k = keys(1, 6);
  constexpr std::size_t big = 3 * 1024 * 1024;
  auto [ec, r] = c.store(k, big);
  REQUIRE_FALSE(ec);
  CHECK(r.count(key_outcome::ok) == 6);
  CHECK(c.loads_right_bytes(k, big));
  // The value is the 72-byte header and the payload.
  auto len = s.command({"STRLEN", c.b->key_of(k[0])});
  REQUIRE(len);
  CHECK(len->integer == static_cast<long long>(big + l2::object_header_bytes));
}

TEST_CASE("a garbage, truncated or foreign value written behind the backend answers corrupt and is deleted",
          "[redis]") {
  auto& s = test::shared_standalone();
  s.command({"FLUSHALL"});
  client c(standalone_options(s));
  const auto k = keys(100, 4);
  REQUIRE_FALSE(std::get<0>(c.store(std::span(k).first(2))));
  // k[2]: garbage. k[3]: a header that promises more payload than there is.
  REQUIRE(s.cli("SET '" + c.b->key_of(k[2]) + "' 'not a kvtier object at all'").exit_code == 0);
  {
    const auto payload = bytes_of(k[3]);
    l2::object_header h{k[3], payload.size(), l2::payload_checksum(payload), 0};
    const auto hdr = l2::encode_header(h);
    std::string v(reinterpret_cast<const char*>(hdr.data()), hdr.size());
    v.append(reinterpret_cast<const char*>(payload.data()), payload.size() - 1);
    REQUIRE(s.command({"SET", c.b->key_of(k[3]), v}));
  }
  // k[1]'s value copied under k[0]'s name: a valid object of another key.
  REQUIRE(s.command({"DEL", c.b->key_of(k[0])}));
  auto copied = s.command({"COPY", c.b->key_of(k[1]), c.b->key_of(k[0])});
  REQUIRE(copied);
  REQUIRE(copied->integer == 1);

  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = c.load(k, out);
  REQUIRE_FALSE(ec);
  CHECK(r.outcomes[0] == key_outcome::corrupt);  // foreign
  CHECK(r.outcomes[1] == key_outcome::ok);
  CHECK(r.outcomes[2] == key_outcome::corrupt);  // garbage
  CHECK(r.outcomes[3] == key_outcome::corrupt);  // truncated
  CHECK(c.b->stats().error(l2::redis_error_kind::corrupt) == 3);
  // Deleted before the load answered: a lookup misses them.
  auto [lec, found] = c.lookup(k);
  REQUIRE_FALSE(lec);
  CHECK(found.to_string() == "0100");
  c.b->unpin(k);
}

TEST_CASE("a listing returns the objects under its own prefix only, glob characters in the prefix taken literally, "
          "with their stored bytes",
          "[redis][list]") {
  auto& s = test::shared_standalone();
  s.command({"FLUSHALL"});
  l2::redis_backend_options o = standalone_options(s);
  o.key_prefix = "fleet[a]*";
  client c(o);
  l2::redis_backend_options other = standalone_options(s);
  other.key_prefix = "fleeta-b";  // what "fleet[a]*" would match as a glob
  client neighbour(other);
  const auto mine = keys(500, 3);
  REQUIRE_FALSE(std::get<0>(c.store(mine)));
  REQUIRE_FALSE(std::get<0>(neighbour.store(keys(600, 2))));
  // Keys under the prefix that are not objects' keys are skipped, not misread.
  const std::vector<std::string> junk_keys = {"fleet[a]*:notakey", "fleet[a]*:0123456789abcdef:1:0:zz",
                                              "fleet[a]*:0123456789abcdef:01:0:" + std::string(32, 'a')};
  for (const auto& junk : junk_keys)
    REQUIRE(s.command({"SET", junk, "x"}));
  auto [ec, listed] = c.list();
  REQUIRE_FALSE(ec);
  std::vector<chunk_key> got;
  for (const auto& x : listed) {
    got.push_back(x.key);
    CHECK(x.bytes == l2::object_header_bytes + object_bytes);
  }
  std::sort(got.begin(), got.end());
  std::vector<chunk_key> want = mine;
  std::sort(want.begin(), want.end());
  CHECK(got == want);
  auto [nec, theirs] = neighbour.list();
  REQUIRE_FALSE(nec);
  CHECK(theirs.size() == 2);
}

TEST_CASE("a TTL is set on every stored object when configured", "[redis]") {
  auto& s = test::shared_standalone();
  s.command({"FLUSHALL"});
  auto o = standalone_options(s);
  o.ttl_seconds = 100;
  client c(o);
  const auto k = keys(200, 2);
  REQUIRE_FALSE(std::get<0>(c.store(k)));
  for (const auto& x : k) {
    auto ttl = s.command({"TTL", c.b->key_of(x)});
    REQUIRE(ttl);
    CHECK(ttl->integer > 0);
    CHECK(ttl->integer <= 100);
  }
  o.ttl_seconds = 0;
  client plain(o);
  const auto k2 = keys(300, 1);
  REQUIRE_FALSE(std::get<0>(plain.store(k2)));
  CHECK(s.command({"TTL", plain.b->key_of(k2[0])})->integer == -1);  // no expiry
}

TEST_CASE("usage reports Redis's memory, maxmemory and key count, and our own writes at once", "[redis]") {
  test::redis_server s;
  s.command({"CONFIG", "SET", "maxmemory", "64mb"});
  auto o = standalone_options(s);
  o.info_interval_ms = std::chrono::milliseconds(50);
  client c(o);
  REQUIRE(run_until(c.io, [&] { return c.b->usage().bytes_capacity == 64u * 1024 * 1024; }));
  CHECK(c.b->usage().bytes_used > 0);
  REQUIRE_FALSE(std::get<0>(c.store(keys(0, 7))));
  CHECK(c.b->usage().objects == 7);
  REQUIRE(run_until(c.io, [&] { return c.b->usage().objects == 7 && c.b->usage().bytes_used > 7 * object_bytes; }));
  REQUIRE_FALSE(std::get<0>(c.remove(keys(0, 2))));
  CHECK(c.b->usage().objects == 5);
}

TEST_CASE("Redis's maxmemory policy evicts, pins or not, and nothing wrong is ever served", "[redis]") {
  test::redis_server s;
  s.command({"CONFIG", "SET", "maxmemory", "3mb"});
  s.command({"CONFIG", "SET", "maxmemory-policy", "allkeys-lru"});
  client c(standalone_options(s));
  const auto k = keys(0, 200);  // 3.2 MB of payload: does not fit
  auto [lec, none] = c.lookup(std::span(k).first(4));
  CHECK(none.to_string() == "0000");
  std::size_t stored = 0;
  for (std::size_t i = 0; i < k.size(); i += 20) {
    auto [ec, r] = c.store(std::span(k).subspan(i, 20));
    for (auto x : r.outcomes) CHECK((x == key_outcome::ok || x == key_outcome::no_space));
    stored += r.count(key_outcome::ok);
  }
  CHECK(stored > 0);
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = c.load(k, out);
  REQUIRE_FALSE(ec);
  std::size_t present = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    INFO(i);
    REQUIRE((r.outcomes[i] == key_outcome::ok || r.outcomes[i] == key_outcome::not_found));
    if (r.ok(i)) {
      ++present;
      CHECK(out[i] == bytes_of(k[i]));
    }
  }
  CHECK(present < k.size());  // Redis evicted
}

TEST_CASE("a full Redis with noeviction answers no_space and counts it", "[redis]") {
  test::redis_server s;
  s.command({"CONFIG", "SET", "maxmemory", "2mb"});
  s.command({"CONFIG", "SET", "maxmemory-policy", "noeviction"});
  client c(standalone_options(s));
  std::size_t full = 0;
  for (std::uint64_t i = 0; i < 400 && full == 0; i += 20) {
    auto [ec, r] = c.store(keys(i, 20));
    full += r.count(key_outcome::no_space);
  }
  CHECK(full > 0);
  CHECK(c.b->stats().error(l2::redis_error_kind::oom) == full);
}

TEST_CASE("Redis killed mid-run: lookups miss and stores fail within the deadline, then it comes back", "[redis]") {
  test::redis_server s;
  auto o = standalone_options(s);
  o.reconnect_backoff_max_ms = std::chrono::milliseconds(200);
  o.log_interval_ms = std::chrono::hours(1);
  std::vector<std::string> lines;
  telemetry::logger log(telemetry::log_level::info, "test",
                        [&](telemetry::log_level, std::string_view line) { lines.emplace_back(line); });
  client c(o, true, &log);
  telemetry::registry reg;
  telemetry::collect_redis_backend(reg, *c.b);
  const auto k = keys(0, 8);
  REQUIRE_FALSE(std::get<0>(c.store(k)));

  s.kill();
  {
    auto [ec, found] = c.lookup(k, in(std::chrono::seconds(10)));
    CHECK(ec == errc::backend_unavailable);
    CHECK(found.count() == 0);
    CHECK(c.b->pins(k[0]) == 0);  // a failed lookup pinned nothing
  }
  {
    auto [ec, r] = c.store(keys(100, 4), object_bytes, in(std::chrono::seconds(10)));
    CHECK(ec == errc::backend_unavailable);
    CHECK(r.count(key_outcome::unavailable) == 4);
  }
  {
    std::vector<std::vector<std::byte>> out;
    auto [ec, r] = c.load(k, out, object_bytes, in(std::chrono::seconds(10)));
    CHECK(ec == errc::backend_unavailable);
    CHECK(r.count(key_outcome::unavailable) == k.size());
    for (const auto& b : out) CHECK(b == std::vector<std::byte>(object_bytes, std::byte{0xee}));
  }
  CHECK_FALSE(c.b->health().healthy);
  CHECK_FALSE(c.b->health().reason.empty());
  const auto st = c.b->stats();
  CHECK(st.error(l2::redis_error_kind::disconnect) >= 1);
  CHECK(st.error(l2::redis_error_kind::unavailable) >= 4 + 8 + 8);
  CHECK(reg.value("kvtier_l2_redis_errors_total", {{"backend", "redis"}, {"kind", "unavailable"}}).value_or(0) ==
        static_cast<double>(st.error(l2::redis_error_kind::unavailable)));
  // Three operations failed, each logged its keys: one line per kind per interval.
  auto logged = [&](std::string_view kind) {
    std::size_t n = 0;
    for (const auto& l : lines) n += l.find("': " + std::string(kind) + " x") != std::string::npos ? 1 : 0;
    return n;
  };
  CHECK(logged("unavailable") == 1);
  CHECK(logged("disconnect") == 1);

  s.restart();  // empty: persistence is off
  REQUIRE(run_until(c.io, [&] { return c.b->health().healthy; }));
  CHECK(c.b->stats().reconnects >= 1);
  CHECK(reg.value("kvtier_l2_redis_reconnects_total", {{"backend", "redis"}}).value_or(0) >= 1);
  auto [lec, found] = c.lookup(k);
  REQUIRE_FALSE(lec);
  CHECK(found.count() == 0);  // the old objects are gone, and nothing else is served
  REQUIRE_FALSE(std::get<0>(c.store(k)));
  CHECK(c.loads_right_bytes(k));
}

TEST_CASE("a frozen Redis makes operations time out at their deadline; late replies never land", "[redis]") {
  test::redis_server s;
  client c(standalone_options(s));
  const auto k = keys(0, 4);
  constexpr std::size_t big = 1024 * 1024;
  REQUIRE_FALSE(std::get<0>(c.store(k, big)));

  s.pause();
  auto [lec, found] = c.lookup(k, in(std::chrono::milliseconds(300)));
  CHECK(lec == errc::timeout);
  CHECK(found.count() == 0);
  CHECK(c.b->pins(k[0]) == 0);
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = c.load(k, out, big, in(std::chrono::milliseconds(300)));
  CHECK(ec == errc::timeout);
  CHECK(r.count(key_outcome::timeout) == k.size());
  auto [sec, sr] = c.store(keys(50, 2), object_bytes, in(std::chrono::milliseconds(300)));
  CHECK(sec == errc::timeout);
  CHECK(sr.count(key_outcome::ok) == 0);
  CHECK(c.b->stats().error(l2::redis_error_kind::timeout) >= 4 + 4 + 2);

  s.resume();
  // Whatever replies were pending are read and dropped (or their connection was closed);
  // the buffers of the abandoned load were never written.
  CHECK(c.loads_right_bytes(k, big));
  for (const auto& b : out) CHECK(b == std::vector<std::byte>(big, std::byte{0xee}));
}

TEST_CASE("AUTH with a password from a file or an environment variable, on every connection", "[redis][auth]") {
  test::redis_server s;
  s.command({"ACL", "SETUSER", "kv", "on", ">kv-secret", "~*", "+@all"});
  s.command({"CONFIG", "SET", "requirepass", "s3cret"});
  test::temp_dir dir;
  const auto write = [&](const char* name, const char* text) {
    const auto p = dir.path() / name;
    std::ofstream(p) << text;
    return p.string();
  };
  const auto k = keys(0, 2);

  SECTION("no password: every key answers unavailable (NOAUTH)") {
    client c(standalone_options(s));
    auto [ec, r] = c.store(k);
    CHECK(ec == errc::backend_unavailable);
    CHECK(r.count(key_outcome::unavailable) == 2);
    auto [lec, found] = c.lookup(k);
    CHECK(lec == errc::backend_unavailable);
    CHECK(found.count() == 0);
  }
  SECTION("a wrong password: the connections are refused and counted") {
    auto o = standalone_options(s);
    o.password_file = write("wrong", "nope\n");
    client c(o, false);
    REQUIRE(run_until(c.io, [&] { return c.b->stats().error(l2::redis_error_kind::auth) >= 1; }));
    CHECK_FALSE(c.b->health().healthy);
    CHECK(c.b->health().reason.find("handshake") != std::string::npos);
  }
  SECTION("the password from a file (trailing newline dropped), also after a restart") {
    auto o = standalone_options(s);
    o.password_file = write("right", "s3cret\n");
    client c(o);
    REQUIRE_FALSE(std::get<0>(c.store(k)));
    CHECK(c.loads_right_bytes(k));
    s.restart();  // the requirepass was a CONFIG SET: the new process has none...
    s.command({"CONFIG", "SET", "requirepass", "s3cret"});  // ...until set again
    REQUIRE(run_until(c.io, [&] { return c.b->stats().reconnects >= 1 && c.b->health().healthy; }));
    REQUIRE_FALSE(std::get<0>(c.store(k)));
    CHECK(c.loads_right_bytes(k));
  }
  SECTION("the password from an environment variable, with an ACL user") {
    ::setenv("KVTIER_TEST_REDIS_PASSWORD", "kv-secret", 1);
    auto o = standalone_options(s);
    o.username = "kv";
    o.password_env = "KVTIER_TEST_REDIS_PASSWORD";
    client c(o);
    REQUIRE_FALSE(std::get<0>(c.store(k)));
    CHECK(c.loads_right_bytes(k));
    ::unsetenv("KVTIER_TEST_REDIS_PASSWORD");
    asio::io_context io;
    CHECK_THROWS_AS(l2::redis_backend(io.get_executor(), o), std::invalid_argument);  // the variable is unset
  }
}

// --- a fake server: replies under the test's control --------------------------------------

namespace {

// Speaks just enough RESP: parses each command with hiredis and writes what `answer` returns
// (nothing: no reply yet). Keeps the sockets so a test can send more later.
class fake_redis {
 public:
  explicit fake_redis(asio::io_context& io)
      : acceptor_(io, asio::ip::tcp::endpoint(asio::ip::address_v4::loopback(), 0)) {
    asio::co_spawn(io, accept(), asio::detached);
  }
  [[nodiscard]] std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  /// Options of a backend on this server: one connection, no background refresh to speak of.
  [[nodiscard]] l2::redis_backend_options options() const {
    l2::redis_backend_options o;
    o.nodes = {"127.0.0.1:" + std::to_string(port())};
    o.connections_per_node = 1;
    o.info_interval_ms = std::chrono::hours(1);
    return o;
  }

  std::function<std::string(const std::vector<std::string>&)> answer;
  std::size_t connections = 0;
  std::vector<std::shared_ptr<asio::ip::tcp::socket>> sockets;
  std::size_t peer_closed = 0;

  void send(std::size_t conn, const std::string& bytes) {
    boost::system::error_code ec;
    asio::write(*sockets.at(conn), asio::buffer(bytes), ec);
  }

 private:
  asio::awaitable<void> accept() {
    for (;;) {
      auto [ec, s] = co_await acceptor_.async_accept(asio::as_tuple(asio::use_awaitable));
      if (ec) co_return;
      ++connections;
      auto sp = std::make_shared<asio::ip::tcp::socket>(std::move(s));
      sockets.push_back(sp);
      asio::co_spawn(acceptor_.get_executor(), session(sp), asio::detached);
    }
  }
  asio::awaitable<void> session(std::shared_ptr<asio::ip::tcp::socket> s) {
    l2::detail::redis_reader reader;
    std::vector<char> buf(1 << 20);
    for (;;) {
      auto [ec, n] = co_await s->async_read_some(asio::buffer(buf), asio::as_tuple(asio::use_awaitable));
      if (ec) {
        ++peer_closed;
        co_return;
      }
      if (!reader.feed(buf.data(), n)) co_return;
      l2::detail::redis_reply_ptr cmd;
      while (reader.next(cmd) == l2::detail::redis_reader::status::reply) {
        std::vector<std::string> args;
        for (std::size_t i = 0; i < cmd->elements; ++i) args.emplace_back(cmd->element[i]->str, cmd->element[i]->len);
        std::string out = answer ? answer(args) : std::string();
        if (args[0] == "INFO") {
          const std::string body = "used_memory:1\r\nmaxmemory:0";
          out = "$" + std::to_string(body.size()) + "\r\n" + body + "\r\n";
        }
        if (args[0] == "DBSIZE") out = ":0\r\n";
        if (!out.empty()) co_await asio::async_write(*s, asio::buffer(out), asio::as_tuple(asio::use_awaitable));
      }
    }
  }
  asio::ip::tcp::acceptor acceptor_;
};

std::string object_value(const chunk_key& k, std::size_t n) {
  const auto payload = bytes_of(k, n);
  const auto hdr = l2::encode_header(l2::object_header{k, n, l2::payload_checksum(payload), 0});
  std::string v(reinterpret_cast<const char*>(hdr.data()), hdr.size());
  v.append(reinterpret_cast<const char*>(payload.data()), n);
  return v;
}

}  // namespace

namespace {

/// A backend on a fake server that answers the GET of one 256 KiB object with the first half
/// of its value, then nothing, and a buffer for it.
struct stalled_get {
  asio::io_context io;
  fake_redis fake{io};
  const chunk_key k = key_of(7);
  static constexpr std::size_t n = 256 * 1024;
  const std::string value = object_value(k, n);
  std::vector<std::byte> dst = std::vector<std::byte>(n, std::byte{0xee});
  std::vector<std::span<std::byte>> dsts{dst};
  std::unique_ptr<l2::redis_backend> b;

  stalled_get() {
    const std::string head = "$" + std::to_string(value.size()) + "\r\n";
    fake.answer = [this, head](const std::vector<std::string>& a) -> std::string {
      if (a[0] == "GET") return head + value.substr(0, value.size() / 2);  // then silence
      return {};
    };
    b = std::make_unique<l2::redis_backend>(io.get_executor(), fake.options());
    REQUIRE(run_until(io, [&] { return b->health().healthy; }));
  }

  /// The server sends the rest of the value now, when the connection it was meant for is
  /// gone; returns once the backend has reconnected.
  void send_the_rest() {
    REQUIRE(run_until(io, [&] { return fake.peer_closed >= 1; }));
    fake.send(0, value.substr(value.size() / 2) + "\r\n");
    REQUIRE(run_until(io, [&] { return fake.connections >= 2 && b->health().healthy; }));  // reconnected
  }
};

}  // namespace

TEST_CASE(
    "a reply that stalls mid-payload: the load times out, the connection is dropped, the buffer is "
    "never written afterwards",
    "[redis][buffers]") {
  stalled_get s;
  auto [ec, r] = run_sync(s.io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
    co_return co_await s.b->async_load(std::span(&s.k, 1), s.dsts, in(std::chrono::milliseconds(300)),
                                       asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(ec == errc::timeout);
  CHECK(r.outcomes[0] == key_outcome::timeout);
  const auto snapshot = s.dst;
  s.send_the_rest();
  CHECK(s.dst == snapshot);
}

TEST_CASE(
    "a load cancelled mid-payload completes at once with operation_aborted; the buffer is never written "
    "afterwards",
    "[redis][buffers][cancel]") {
  stalled_get s;
  asio::cancellation_signal cancel;
  std::optional<std::tuple<error_code, l2::batch_result>> result;
  s.b->async_load(std::span(&s.k, 1), s.dsts, in(std::chrono::hours(1)),
                  asio::bind_cancellation_slot(
                      cancel.slot(), [&](error_code e, l2::batch_result r) { result.emplace(e, std::move(r)); }));
  // The first half of the payload lands in the buffer; the rest never comes.
  REQUIRE(run_until(s.io, [&] {
    return std::any_of(s.dst.begin(), s.dst.begin() + 4096, [](std::byte x) { return x != std::byte{0xee}; });
  }));
  CHECK_FALSE(result.has_value());
  cancel.emit(asio::cancellation_type::terminal);
  REQUIRE(run_until(s.io, [&] { return result.has_value(); }));  // long before the deadline
  CHECK(std::get<0>(*result) == asio::error::operation_aborted);
  CHECK(std::get<1>(*result).outcomes[0] == key_outcome::timeout);
  std::fill(s.dst.begin(), s.dst.end(), std::byte{0x11});
  s.send_the_rest();
  CHECK(std::all_of(s.dst.begin(), s.dst.end(), [](std::byte x) { return x == std::byte{0x11}; }));
}

TEST_CASE("a reply that comes after the deadline is read and dropped; the connection stays in step",
          "[redis][buffers]") {
  asio::io_context io;
  fake_redis fake(io);
  const chunk_key k = key_of(8);
  constexpr std::size_t n = 64 * 1024;
  const std::string value = object_value(k, n);
  bool hold = true;
  fake.answer = [&](const std::vector<std::string>& a) -> std::string {
    if (a[0] == "GET" && hold) return {};
    if (a[0] == "GET") return "$" + std::to_string(value.size()) + "\r\n" + value + "\r\n";
    if (a[0] == "EXISTS") return ":1\r\n";
    return "-ERR unexpected\r\n";
  };
  l2::redis_backend b(io.get_executor(), fake.options());
  REQUIRE(run_until(io, [&] { return b.health().healthy; }));
  auto load = [&](std::vector<std::byte>& dst, l2::deadline d) {
    std::vector<std::span<std::byte>> dsts = {dst};
    return run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, l2::batch_result>> {
      co_return co_await b.async_load(std::span(&k, 1), dsts, d, asio::as_tuple(asio::use_awaitable));
    }());
  };
  std::vector<std::byte> late(n, std::byte{0xee});
  auto [ec, r] = load(late, in(std::chrono::milliseconds(200)));
  CHECK(ec == errc::timeout);
  // Now the server answers that GET (late), then the next one.
  hold = false;
  fake.send(0, "$" + std::to_string(value.size()) + "\r\n" + value + "\r\n");
  std::vector<std::byte> fresh(n, std::byte{0});
  auto [ec2, r2] = load(fresh, soon());
  REQUIRE_FALSE(ec2);
  CHECK(r2.outcomes[0] == key_outcome::ok);
  CHECK(fresh == bytes_of(k, n));
  CHECK(late == std::vector<std::byte>(n, std::byte{0xee}));  // the late reply went nowhere
  CHECK(fake.connections == 1);                               // and cost no reconnection
}

TEST_CASE("large GETs are not pipelined past max_inflight_bytes_per_connection", "[redis][buffers]") {
  asio::io_context io;
  fake_redis fake(io);
  constexpr std::size_t n = 64 * 1024;
  std::size_t gets = 0;
  fake.answer = [&](const std::vector<std::string>& a) -> std::string {
    if (a[0] == "GET") ++gets;  // answered by the test, one at a time
    return {};
  };
  l2::redis_backend_options o = fake.options();
  o.max_inflight_bytes_per_connection = 100 * 1024;  // room for one object at a time
  l2::redis_backend b(io.get_executor(), o);
  REQUIRE(run_until(io, [&] { return b.health().healthy; }));
  const auto k = keys(0, 3);
  std::vector<std::vector<std::byte>> out(3, std::vector<std::byte>(n));
  std::vector<std::span<std::byte>> dst(out.begin(), out.end());
  std::optional<l2::batch_result> result;
  b.async_load(k, dst, soon(), [&](error_code, l2::batch_result r) { result = std::move(r); });
  for (std::size_t i = 0; i < k.size(); ++i) {
    REQUIRE(run_until(io, [&] { return gets == i + 1; }));
    // Everything the backend does in reaction to the GET it sent has run, and the fake has
    // read whatever was written meanwhile: a wrongly pipelined GET would be counted now.
    run_until_idle(io);
    CHECK(gets == i + 1);
    const std::string v = object_value(k[i], n);
    fake.send(0, "$" + std::to_string(v.size()) + "\r\n" + v + "\r\n");
  }
  REQUIRE(run_until(io, [&] { return result.has_value(); }));
  CHECK(result->count(key_outcome::ok) == 3);
  for (std::size_t i = 0; i < k.size(); ++i) CHECK(out[i] == bytes_of(k[i], n));
}

TEST_CASE("a malformed reply drops the connection and counts a protocol error", "[redis]") {
  asio::io_context io;
  fake_redis fake(io);
  fake.answer = [&](const std::vector<std::string>& a) -> std::string {
    if (a[0] == "EXISTS") return "?what\r\n";
    return {};
  };
  l2::redis_backend b(io.get_executor(), fake.options());
  REQUIRE(run_until(io, [&] { return b.health().healthy; }));
  const chunk_key k = key_of(9);
  auto [ec, found] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, bitmap>> {
    co_return co_await b.async_lookup_and_pin(std::span(&k, 1), soon(), asio::as_tuple(asio::use_awaitable));
  }());
  CHECK(ec == errc::backend_unavailable);
  CHECK(found.count() == 0);
  CHECK(b.stats().error(l2::redis_error_kind::protocol) == 1);
  REQUIRE(run_until(io, [&] { return fake.connections >= 2; }));  // and reconnects
}

// --- a real cluster ---------------------------------------------------------------------

TEST_CASE("keys spread over all three masters and load back", "[redis][cluster]") {
  auto& cl = test::shared_cluster();
  cl.flush();
  client c(cluster_options(cl));
  const auto k = keys(0, 60);
  auto [ec, r] = c.store(k);
  REQUIRE_FALSE(ec);
  CHECK(r.count(key_outcome::ok) == 60);
  long long total = 0;
  for (std::size_t i = 0; i < cl.size(); ++i) {
    const auto n = cl.node(i).command({"DBSIZE"})->integer;
    CHECK(n > 0);
    total += n;
  }
  CHECK(total == 60);
  CHECK(c.loads_right_bytes(k));
  CHECK(c.b->stats().moved == 0);  // routed by the slot map, no redirect needed
  REQUIRE(run_until(c.io, [&] { return c.b->usage().objects == 60; }));
}

TEST_CASE("a slot migrating under the backend: ASK during the migration, MOVED after it", "[redis][cluster]") {
  auto& cl = test::shared_cluster();
  cl.flush();
  REQUIRE(cl.wait_ok());
  auto o = cluster_options(cl);
  o.info_interval_ms = std::chrono::hours(1);  // the map read at start goes stale
  client c(o);

  const chunk_key old_key = key_of(4242);
  const std::uint16_t slot = l2::detail::redis_key_slot(c.b->key_of(old_key));
  chunk_key new_key = old_key;  // another key of the same slot
  for (std::uint64_t i = 0;; ++i) {
    new_key = key_of(1'000'000 + i);
    if (l2::detail::redis_key_slot(c.b->key_of(new_key)) == slot) break;
  }
  REQUIRE_FALSE(std::get<0>(c.store(std::span(&old_key, 1))));
  const int from = cl.owner(slot);
  REQUIRE(from >= 0);
  const int to = (from + 1) % 3;
  auto& src = cl.node(static_cast<std::size_t>(from));
  auto& dst = cl.node(static_cast<std::size_t>(to));
  const std::string s = std::to_string(slot);
  REQUIRE(reply_text(dst.command({"CLUSTER", "SETSLOT", s, "IMPORTING", cl.id(static_cast<std::size_t>(from))})) ==
          "OK");
  REQUIRE(reply_text(src.command({"CLUSTER", "SETSLOT", s, "MIGRATING", cl.id(static_cast<std::size_t>(to))})) == "OK");

  // The new key is not on the source: it answers ASK, the backend asks the target.
  auto [sec, sr] = c.store(std::span(&new_key, 1));
  REQUIRE_FALSE(sec);
  CHECK(sr.outcomes[0] == key_outcome::ok);
  // (A plain EXISTS on the importing node would answer MOVED: count the slot's keys instead.)
  CHECK(dst.command({"CLUSTER", "COUNTKEYSINSLOT", s})->integer == 1);
  CHECK(src.command({"CLUSTER", "COUNTKEYSINSLOT", s})->integer == 1);
  CHECK(c.loads_right_bytes(std::span(&new_key, 1)));
  CHECK(c.loads_right_bytes(std::span(&old_key, 1)));  // still on the source
  CHECK(c.b->stats().ask >= 2);
  CHECK(c.b->stats().moved == 0);

  // Finish the migration; the backend's map still names the source.
  auto m =
      src.command({"MIGRATE", "127.0.0.1", std::to_string(dst.port()), "", "0", "5000", "KEYS", c.b->key_of(old_key)});
  REQUIRE(reply_text(m) == "OK");
  for (std::size_t i :
       {static_cast<std::size_t>(to), static_cast<std::size_t>(from), static_cast<std::size_t>(3 - from - to)})
    REQUIRE(reply_text(cl.node(i).command({"CLUSTER", "SETSLOT", s, "NODE", cl.id(static_cast<std::size_t>(to))})) ==
            "OK");
  REQUIRE(cl.wait_ok());
  CHECK(c.loads_right_bytes(std::span(&old_key, 1)));
  CHECK(c.b->stats().moved >= 1);
  const auto moved = c.b->stats().moved;
  CHECK(c.loads_right_bytes(std::span(&old_key, 1)));  // the map was fixed: no more redirects
  CHECK(c.b->stats().moved == moved);
}

TEST_CASE("a backend that starts with no slot map follows MOVED to every master", "[redis][cluster]") {
  auto& cl = test::shared_cluster();
  cl.flush();
  auto o = cluster_options(cl);
  o.info_interval_ms = std::chrono::hours(1);
  client c(o, false);  // operations start before the map is read
  const auto k = keys(500, 30);
  auto [ec, r] = c.store(k);
  REQUIRE_FALSE(ec);
  CHECK(r.count(key_outcome::ok) == 30);
  CHECK(c.loads_right_bytes(k));
  REQUIRE(run_until(c.io, [&] { return c.b->health().healthy; }));
}

TEST_CASE("a cluster master killed and restarted: its keys fail, then everything works again",
          "[redis][cluster][long]") {
  test::redis_cluster cl;
  auto o = cluster_options(cl);
  o.reconnect_backoff_max_ms = std::chrono::milliseconds(200);
  o.info_interval_ms = std::chrono::milliseconds(200);
  client c(o);
  const auto k = keys(0, 30);
  REQUIRE_FALSE(std::get<0>(c.store(k)));
  cl.node(1).kill();
  std::vector<std::vector<std::byte>> out;
  auto [ec, r] = c.load(k, out, object_bytes, in(std::chrono::seconds(10)));
  std::size_t failed = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    INFO(i);
    CHECK((r.outcomes[i] == key_outcome::ok || r.outcomes[i] == key_outcome::unavailable));
    if (r.ok(i)) CHECK(out[i] == bytes_of(k[i]));
    failed += r.ok(i) ? 0 : 1;
  }
  CHECK(failed > 0);  // at least the dead master's keys
  REQUIRE(run_until(c.io, [&] { return !c.b->health().healthy; }));
  cl.node(1).restart();  // same port, same nodes.conf: it rejoins
  REQUIRE(cl.wait_ok());
  REQUIRE(run_until(c.io, [&] { return c.b->health().healthy; }));
  const auto k2 = keys(1000, 30);
  auto [sec, sr] = c.store(k2);
  REQUIRE_FALSE(sec);
  CHECK(sr.count(key_outcome::ok) == 30);
  CHECK(c.loads_right_bytes(k2));
}

// --- two caches, one Redis ----------------------------------------------------------------

namespace {

struct cache_traits : cache::default_traits {
  using wait_policy = pipeline::wait_complete;
};

// One "server": its own io_context, Redis backend and tiered_cache.
struct cache_node {
  asio::io_context io;
  bus::null_bus events;
  std::shared_ptr<l2::redis_backend> redis;
  std::unique_ptr<cache::tiered_cache<cache_traits>> cache;

  explicit cache_node(l2::redis_backend_options o) {
    redis = std::make_shared<l2::redis_backend>(io.get_executor(), std::move(o));
    REQUIRE(run_until(io, [&] { return redis->health().healthy; }));
    cache::cache_options co;
    co.l1.slot_bytes = object_bytes;
    co.l1.slot_count = 64;
    co.l1.eviction_watermark = 1.0;
    co.l1.eviction_target = 0.9;
    cache = std::make_unique<cache::tiered_cache<cache_traits>>(io.get_executor(), co, events,
                                                                std::vector<l2::any_backend>{l2::any_backend(redis)});
  }
  void settle() {
    run_sync(io, [&]() -> asio::awaitable<void> { co_await cache->wait_idle(); }());
  }
  void write(std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    std::vector<std::span<std::byte>> buf(keys.size());
    REQUIRE(cache->reserve_write(keys, object_bytes, st, buf) == keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto p = bytes_of(keys[i]);
      std::memcpy(buf[i].data(), p.data(), p.size());
    }
    cache->finish_write(keys, {}, st);
    settle();
  }
  cache::lookup_status lookup(std::span<const chunk_key> keys, cache::tiered_cache<cache_traits>::lookup_id& id) {
    cache::lookup_request r;
    r.keys = keys;
    r.object_bytes = object_bytes;
    r.chunk_tokens = 256;
    id = cache->start_lookup(r);
    auto [ec, st] = run_sync(io, [&]() -> asio::awaitable<std::tuple<error_code, cache::lookup_status>> {
      co_return co_await cache->async_wait_loaded(id, asio::as_tuple(asio::use_awaitable));
    }());
    REQUIRE_FALSE(ec);
    return st;
  }
  bool serves(const chunk_key& k) {
    std::vector<l1::status> st(1);
    std::vector<std::span<const std::byte>> v(1);
    if (cache->pin_for_copy(std::span(&k, 1), st, v) != 1) return false;
    const auto p = bytes_of(k);
    const bool same = v[0].size() == p.size() && std::memcmp(v[0].data(), p.data(), p.size()) == 0;
    cache->unpin_after_copy(std::span(&k, 1));
    return same;
  }
};

}  // namespace

TEST_CASE("two caches share one Redis: written through one, hit with the same bytes through the other",
          "[redis][cache]") {
  const bool use_cluster = GENERATE(false, true);
  INFO((use_cluster ? "cluster" : "standalone"));
  l2::redis_backend_options o;
  if (use_cluster) {
    test::shared_cluster().flush();
    o = cluster_options(test::shared_cluster());
  } else {
    test::shared_standalone().command({"FLUSHALL"});
    o = standalone_options(test::shared_standalone());
  }
  cache_node a(o);
  cache_node b(o);
  const auto k = keys(0, 8);
  a.write(k);  // L1 of A, then the store pipeline puts it in Redis
  cache::tiered_cache<cache_traits>::lookup_id id = 0;
  const auto st = b.lookup(k, id);
  CHECK(st.chunks == 8);
  CHECK(st.l1_chunks == 0);  // all of it came from Redis
  for (const auto& x : k) CHECK(b.serves(x));
  b.cache->release_all(id);
  // A different model namespace (another layout) never meets these objects.
  const auto other = keys(0, 8, 0xdef);
  const auto miss = b.lookup(other, id);
  CHECK(miss.chunks == 0);
  b.cache->release_all(id);
}

TEST_CASE("with Redis down the cache keeps serving from L1 and the writes land in L1", "[redis][cache]") {
  test::redis_server s;
  auto o = standalone_options(s);
  o.reconnect_backoff_max_ms = std::chrono::milliseconds(200);
  cache_node a(o);
  const auto k = keys(0, 4);
  a.write(k);
  s.kill();
  cache::tiered_cache<cache_traits>::lookup_id id = 0;
  const auto hit = a.lookup(k, id);  // L1 prefix: answered without Redis
  CHECK(hit.chunks == 4);
  a.cache->release_all(id);
  const auto k2 = keys(100, 4);
  a.write(k2);  // L1 takes it; the store to Redis fails and is counted
  CHECK(a.redis->stats().error(l2::redis_error_kind::unavailable) >= 4);
  const auto miss = a.lookup(keys(200, 4), id);  // not in L1, Redis down: a miss, promptly
  CHECK(miss.chunks == 0);
  a.cache->release_all(id);
  s.restart();
  REQUIRE(run_until(a.io, [&] { return a.redis->health().healthy; }));
  const auto k3 = keys(300, 4);
  a.write(k3);
  cache_node b(o);
  const auto st = b.lookup(k3, id);
  CHECK(st.chunks == 4);
  for (const auto& x : k3) CHECK(b.serves(x));
  b.cache->release_all(id);
}
