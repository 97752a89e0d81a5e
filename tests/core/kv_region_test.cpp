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

TEST_CASE("a region with explicit strides sizes its data by the last row and places layers at the layer stride",
          "[core][kv_region]") {
  // One tensor for all layers, vLLM's cross-layer NHD (blocks, layers, block_size, heads,
  // 2 * head_dim): 4 layers, 2 heads of 64 bf16 (128-byte rows), blocks of 16, 8 blocks.
  paged_kv_layout cross{{4, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 8};
  const std::uint64_t row = 128, token = 2 * 2 * row, layer = 16 * token;
  cross.strides = {layer, row, 4 * layer, token, 2 * row};
  REQUIRE(cross.validation_error() == "");
  CHECK(cross.total_bytes() == 8 * 4 * layer);  // dense in memory: the end of the last row
  CHECK(cross.layer_bytes() == 7 * 4 * layer + layer);
  auto engine = kv_region::create(cross);
  REQUIRE(engine.has_value());
  CHECK(engine->bytes() == kv_region::bytes_for(cross));
  CHECK(kv_region::bytes_for(cross) == cross.total_bytes() + 4096);  // + 8 generations, 4 KiB aligned
  for (std::uint32_t l = 0; l < 4; ++l) CHECK(engine->layers()[l] == engine->data() + l * layer);
  // The last row of the last layer is the region's last data byte; the server sees it.
  std::byte* last = engine->layers()[3] + cross.offset_in_layer(1, 7, 15, 1);
  CHECK(last + row == engine->data() + cross.total_bytes());
  last[row - 1] = std::byte{0x7e};
  auto server = kv_region::open(::dup(engine->fd()), cross);
  REQUIRE(server.has_value());
  CHECK(server->layers()[3][cross.offset_in_layer(1, 7, 15, 1) + row - 1] == std::byte{0x7e});
  // Padded blocks make another size: the server refuses this fd for that layout.
  paged_kv_layout padded = cross;
  padded.strides.block += 4096;
  CHECK(kv_region::open(::dup(engine->fd()), padded).error() == errc::layout_mismatch);
  // Overlapping strides: no region.
  paged_kv_layout overlapping = cross;
  overlapping.strides.token = row;
  CHECK(kv_region::create(overlapping).error() == errc::invalid_argument);
}
