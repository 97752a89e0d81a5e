#include <kvtier/core/kv_region.hpp>

#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

using namespace kvtier;

namespace {
const paged_kv_layout small{{4, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 8};
}

TEST_CASE("a region created by the engine is seen byte for byte by the server", "[core][kv_region]") {
  auto engine = kv_region::create(small);
  REQUIRE(engine.has_value());
  CHECK(engine->bytes() == kv_region::bytes_for(small));
  REQUIRE(engine->layers().size() == 4);
  std::memset(engine->layers()[3], 0x5a, small.layer_bytes());
  auto server = kv_region::open(::dup(engine->fd()), small);
  REQUIRE(server.has_value());
  CHECK(server->layers()[3][small.layer_bytes() - 1] == std::byte{0x5a});
  server->layers()[0][0] = std::byte{0x11};  // shared both ways
  CHECK(engine->layers()[0][0] == std::byte{0x11});
}

TEST_CASE("the server's mapping of a region is prefaulted when it opens it", "[core][kv_region]") {
  const auto& layout = small;
  auto engine_side = kv_region::create(layout);
  REQUIRE(engine_side.has_value());
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t pages = (engine_side->bytes() + page - 1) / page;
  auto resident = [&](const kv_region& r) {
    std::vector<unsigned char> v(pages);
    REQUIRE(::mincore(r.data(), r.bytes(), v.data()) == 0);
    std::size_t n = 0;
    for (auto b : v) n += b & 1;
    return n;
  };
  CHECK(resident(*engine_side) < pages);  // a fresh memfd: pages come on first touch
  auto server_side = kv_region::open(::dup(engine_side->fd()), layout);
  REQUIRE(server_side.has_value());
  CHECK(resident(*server_side) == pages);
  CHECK(resident(*engine_side) == pages);  // the same shared pages
  for (std::size_t i = 0; i < engine_side->bytes(); i += page) CHECK(engine_side->data()[i] == std::byte{0});
}

TEST_CASE("generations move when the engine reuses a block, and the server sees it", "[core][kv_region]") {
  auto engine = kv_region::create(small);
  REQUIRE(engine.has_value());
  auto server = kv_region::open(::dup(engine->fd()), small);
  REQUIRE(server.has_value());
  const auto g = server->generation(5);
  engine->begin_reuse(5);
  CHECK(server->generation(5) == g + 1);
  CHECK(server->generation(4) == 0);
}

TEST_CASE("the server refuses a region of the wrong size or without seals", "[core][kv_region]") {
  auto engine = kv_region::create(small);
  REQUIRE(engine.has_value());
  paged_kv_layout other = small;
  other.num_blocks = 9;
  auto wrong = kv_region::open(::dup(engine->fd()), other);
  REQUIRE_FALSE(wrong.has_value());
  CHECK(wrong.error() == errc::layout_mismatch);

  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  REQUIRE(unsealed >= 0);
  REQUIRE(::ftruncate(unsealed, static_cast<off_t>(kv_region::bytes_for(small))) == 0);
  auto r = kv_region::open(unsealed, small);  // takes ownership, closes on failure
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error() == errc::layout_mismatch);
  // The seals hold: the engine itself cannot shrink its region any more.
  CHECK(::ftruncate(engine->fd(), 4096) != 0);
}
