// Model namespaces on one server (issue 13, item 2; issue 15, the scheduler registration):
// engines of one model name in different dtype kinds or layout kinds never hit each other's
// chunks, request salts separate tenants (the same salt shares), and a scheduler registers
// without a KV region, looks up the workers' chunks and is refused retrieve and store.
#include <kvtier/server/server.hpp>

#include <catch2/catch.hpp>

#include "server/in_process_server.hpp"
#include "server/server_fixtures.hpp"

using namespace kvtier;
using namespace kvtier::test;

namespace {

model_shape small_model_in(dtype_kind d) {
  model_shape m = small_model();
  m.dtype = d;
  return m;
}

/// A scheduler's registration: no region, no fd, the workers' per-rank shape.
p::register_kv_request scheduler_registration(model_shape m, std::uint16_t world_size = 1,
                                              std::string model = "test/model", std::string salt = {}) {
  p::register_kv_request r;
  r.instance_id = static_cast<std::uint64_t>(::getpid());
  r.rank = 0;
  r.world_size = world_size;
  r.model_name = std::move(model);
  r.model = m;
  r.chunk_tokens = test_chunk_tokens;
  r.region = p::region_kind::none;
  r.cache_salt = std::move(salt);
  return r;
}

}  // namespace

TEST_CASE("fp16 and bf16 engines of one model name on one server never hit each other's chunks", "[server]") {
  running_server s;
  raw_client fp16(s.path());
  raw_client bf16(s.path());
  engine_region r16(small_model_in(dtype_kind::fp16));
  engine_region rbf(small_model_in(dtype_kind::bf16));
  const auto reg16 = fp16.register_region(r16);
  const auto regbf = bf16.register_region(rbf);
  // Both dtypes take 2 bytes: the sizes (and so the objects' checksums) would match.
  CHECK(r16.layout.model.dtype_bytes() == rbf.layout.model.dtype_bytes());
  CHECK(reg16.model_id != regbf.model_id);

  const auto hashes = chunk_hashes(11, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  r16.fill_blocks(blocks, 16);
  REQUIRE(fp16.ok(store_req(r16, hashes, blocks)).stored == 2);
  // The same tokens from the bf16 engine: a miss, and its own store is not "already present".
  CHECK(lookup_done(bf16, regbf.model_id, hashes).hit_chunks == 0);
  rbf.fill_blocks(blocks, 99);
  const auto st = bf16.ok(store_req(rbf, hashes, blocks));
  CHECK(st.stored == 2);
  CHECK(st.already_present == 0);
  // Each gets its own bytes back.
  CHECK(lookup_done(fp16, reg16.model_id, hashes, 1, "req-16").hit_chunks == 2);
  const auto dst = block_range(20, 2 * blocks_per_chunk);
  REQUIRE(fp16.ok(retrieve_req(hashes, dst, 0, 0, "req-16")).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(r16.same_token(dst[i], blocks[i], t));
  CHECK(lookup_done(bf16, regbf.model_id, hashes, 1, "req-bf").hit_chunks == 2);
  REQUIRE(bf16.ok(retrieve_req(hashes, dst, 0, 0, "req-bf")).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(rbf.same_token(dst[i], blocks[i], t));
}

TEST_CASE("two cache salts never share a chunk; the same salt does", "[server]") {
  running_server s;
  raw_client a(s.path());
  raw_client b(s.path());
  engine_region ra;
  engine_region rb;
  const auto rega = a.register_region(ra);
  const auto regb = b.register_region(rb);
  CHECK(rega.model_id == regb.model_id);  // one model, one dtype, one layout

  const auto hashes = chunk_hashes(21, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  ra.fill_blocks(blocks, 5);
  REQUIRE(a.ok(store_req(ra, hashes, blocks, 0, "store-a", "tenant-a")).stored == 2);
  // Another salt, and no salt: misses.
  CHECK(lookup_done(b, regb.model_id, hashes, 1, "q-b", "tenant-b").hit_chunks == 0);
  CHECK(lookup_done(b, regb.model_id, hashes, 1, "q-none").hit_chunks == 0);
  // A retrieve under another salt copies nothing.
  const auto dst = block_range(30, 2 * blocks_per_chunk);
  CHECK(b.ok(retrieve_req(hashes, dst, 0, 0, "q-b", "tenant-b")).retrieved_chunks == 0);
  // The same salt, from the other connection: hits, and the bytes are tenant a's.
  CHECK(lookup_done(b, regb.model_id, hashes, 1, "q-a", "tenant-a").hit_chunks == 2);
  REQUIRE(b.ok(retrieve_req(hashes, dst, 0, 0, "q-a", "tenant-a")).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i)
    for (std::uint32_t t = 0; t < test_block_size; ++t) CHECK(rb.same_token(dst[i], blocks[i], t, &ra));
}

TEST_CASE("a registration's cache salt separates its whole namespace", "[server]") {
  running_server s;
  raw_client a(s.path());
  raw_client b(s.path());
  engine_region ra;
  engine_region rb;
  auto reqa = ra.registration();
  reqa.cache_salt = "deployment-a";
  const auto rega = a.expect(reqa, ra.region.fd());
  const auto regb = b.register_region(rb);
  CHECK(rega.model_id != regb.model_id);
  const auto hashes = chunk_hashes(31, 1);
  const auto blocks = block_range(0, blocks_per_chunk);
  ra.fill_blocks(blocks, 3);
  REQUIRE(a.ok(store_req(ra, hashes, blocks)).stored == 1);
  CHECK(lookup_done(b, regb.model_id, hashes).hit_chunks == 0);
  CHECK(lookup_done(a, rega.model_id, hashes, 1, "again").hit_chunks == 1);
}

TEST_CASE("NHD, HND and MLA registrations are accepted; cuda_ipc is refused with what to do", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  // HND: the CPU transfer copies head-major blocks (region_registry::supports_hnd).
  STATIC_REQUIRE(server::region_registry::supports_hnd);
  engine_region rh(small_model(), test_block_size, 64, kv_layout_kind::hnd);
  raw_client h(s.path());
  CHECK(h.register_region(rh).model_id == make_model_id("test/model", small_model(), kv_layout_kind::hnd));
  auto cuda = r.registration();
  cuda.region = p::region_kind::cuda_ipc;
  cuda.region_descriptor = std::string(64, 'x');
  const auto e2 = c.refused(cuda);
  CHECK(e2.code == static_cast<std::uint32_t>(errc::unsupported));
  CHECK_THAT(e2.message, Catch::Contains("CUDA"));
  auto mla_on_mha = r.registration();
  mla_on_mha.layout_kind = kv_layout_kind::mla;
  CHECK(c.refused(mla_on_mha, r.region.fd()).code == static_cast<std::uint32_t>(errc::invalid_argument));
  // The connection still registers a valid region afterwards.
  CHECK(c.register_region(r).model_id == make_model_id("test/model", small_model()));
}

TEST_CASE("a scheduler registers without a region, looks up the workers' chunks and may not copy", "[server]") {
  running_server s;
  raw_client worker(s.path());
  raw_client sched(s.path());
  engine_region r;
  const auto wreg = worker.register_region(r);
  const auto sreg = sched.expect(scheduler_registration(small_model()));
  CHECK(sreg.model_id == wreg.model_id);
  CHECK(sreg.client_id != wreg.client_id);

  const auto hashes = chunk_hashes(41, 3);
  const auto blocks = block_range(0, 3 * blocks_per_chunk);
  r.fill_blocks(blocks, 77);
  REQUIRE(worker.ok(store_req(r, hashes, blocks)).stored == 3);
  const auto q = lookup_done(sched, sreg.model_id, hashes, 1, "sched-1");
  CHECK(q.hit_chunks == 3);
  sched.ok(p::free_lookup_locks_request{"sched-1"});
  sched.ok(p::end_request_request{"sched-1"});

  const auto e1 = sched.refused(retrieve_req(hashes, blocks));
  CHECK(e1.code == static_cast<std::uint32_t>(errc::no_kv_region));
  CHECK_THAT(e1.message, Catch::Contains("scheduler"));
  const auto e2 = sched.refused(store_req(r, hashes, blocks));
  CHECK(e2.code == static_cast<std::uint32_t>(errc::no_kv_region));
  const nlohmann::json st = sched.status();
  bool seen = false;
  for (const auto& cl : st["clients"])
    if (cl["client_id"] == sreg.client_id) {
      seen = true;
      CHECK(cl["region_kind"] == "none");
      CHECK(cl["registered"] == true);
    }
  CHECK(seen);
}

TEST_CASE("a scheduler registration with an fd or block counts is refused", "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r;
  CHECK(c.refused(scheduler_registration(small_model()), r.region.fd()).code ==
        static_cast<std::uint32_t>(errc::invalid_argument));
  auto with_blocks = scheduler_registration(small_model());
  with_blocks.num_blocks = 8;
  CHECK(c.refused(with_blocks).code == static_cast<std::uint32_t>(errc::invalid_argument));
  auto bad_shape = scheduler_registration(model_shape{});
  CHECK(c.refused(bad_shape).code == static_cast<std::uint32_t>(errc::invalid_argument));
  CHECK(c.expect(scheduler_registration(small_model())).model_id == make_model_id("test/model", small_model()));
}

namespace {
/// Block a of `ra` holds the same bytes as block b of `rb` (whole segments: any layout kind).
bool same_block(const engine_region& ra, std::uint32_t a, const engine_region& rb, std::uint32_t b) {
  for (std::uint32_t l = 0; l < ra.layout.model.num_layers; ++l)
    for (std::uint32_t pl = 0; pl < ra.layout.model.planes(); ++pl)
      if (std::memcmp(ra.region.layers()[l] + ra.layout.offset_in_layer(pl, a),
                      rb.region.layers()[l] + rb.layout.offset_in_layer(pl, b), ra.layout.segment_bytes()) != 0)
        return false;
  return true;
}
}  // namespace

TEST_CASE("NHD and HND engines of one model never share chunks, and an HND engine gets its blocks back", "[server]") {
  running_server s;
  raw_client nc(s.path());
  raw_client hc(s.path());
  engine_region rn;
  engine_region rh(small_model(), test_block_size, 64, kv_layout_kind::hnd);
  const auto regn = nc.register_region(rn);
  const auto regh = hc.register_region(rh);
  CHECK(regn.model_id != regh.model_id);

  const auto hashes = chunk_hashes(51, 2);
  const auto blocks = block_range(0, 2 * blocks_per_chunk);
  rh.fill_blocks(blocks, 23);
  REQUIRE(hc.ok(store_req(rh, hashes, blocks)).stored == 2);
  // The NHD engine misses the HND engine's chunks.
  CHECK(lookup_done(nc, regn.model_id, hashes).hit_chunks == 0);
  // The HND engine hits them, and a retrieve that starts inside a block (skip 3 tokens)
  // restores every block byte for byte but the skipped rows of the first block.
  CHECK(lookup_done(hc, regh.model_id, hashes, 1, "req-h").hit_chunks == 2);
  const auto dst = block_range(30, 2 * blocks_per_chunk);
  for (std::uint32_t b : dst) rh.zero_block(b, 0xaa);
  REQUIRE(hc.ok(retrieve_req(hashes, dst, 3, 0, "req-h")).retrieved_chunks == 2);
  for (std::size_t i = 1; i < dst.size(); ++i) CHECK(same_block(rh, dst[i], rh, blocks[i]));
  const auto& L = rh.layout;
  for (std::uint32_t l = 0; l < L.model.num_layers; ++l)
    for (std::uint32_t pl = 0; pl < L.model.planes(); ++pl)
      for (std::uint32_t head = 0; head < L.model.num_kv_heads; ++head)
        for (std::uint32_t t = 0; t < L.block_size; ++t) {
          const std::byte* got = rh.region.layers()[l] + L.offset_in_layer(pl, dst[0], t, head);
          const std::byte* want = rh.region.layers()[l] + L.offset_in_layer(pl, blocks[0], t, head);
          if (t < 3)
            CHECK(std::all_of(got, got + L.head_row_bytes(), [](std::byte x) { return x == std::byte{0xaa}; }));
          else
            CHECK(std::memcmp(got, want, L.head_row_bytes()) == 0);
        }
}

namespace {
/// The CPU-packed layout of vLLM's CPU backend for small_model(): memory (blocks, heads, 2,
/// block_size, head_dim), head-major; 64 blocks.
paged_kv_layout cpu_packed_layout() {
  paged_kv_layout l{small_model(), test_block_size, 64, kv_layout_kind::hnd};
  const std::uint64_t row = l.head_row_bytes();
  const std::uint64_t heads = l.model.num_kv_heads;
  l.strides = {0, test_block_size * row, heads * 2 * test_block_size * row, row, 2 * test_block_size * row};
  l.strides.layer = l.layer_bytes();
  return l;
}

/// K|V packed per (token, head), NHD (FlashAttention's (blocks, block_size, heads, 2 * head_dim)).
paged_kv_layout gpu_packed_layout() {
  paged_kv_layout l{small_model(), test_block_size, 64, kv_layout_kind::nhd};
  const std::uint64_t row = l.head_row_bytes();
  const std::uint64_t heads = l.model.num_kv_heads;
  l.strides = {0, row, test_block_size * heads * 2 * row, heads * 2 * row, 2 * row};
  l.strides.layer = l.layer_bytes();
  return l;
}

/// Fills every row of block b of `r` with a pattern of (seed, layer, plane, token, head).
void fill_rows(const engine_region& r, std::uint32_t b, std::uint32_t seed) {
  const auto& L = r.layout;
  for (std::uint32_t l = 0; l < L.model.num_layers; ++l)
    for (std::uint32_t pl = 0; pl < L.model.planes(); ++pl)
      for (std::uint32_t t = 0; t < L.block_size; ++t)
        for (std::uint32_t h = 0; h < L.model.num_kv_heads; ++h) {
          std::byte* row = r.region.layers()[l] + L.offset_in_layer(pl, b, t, h);
          for (std::size_t i = 0; i < L.head_row_bytes(); ++i)
            row[i] = static_cast<std::byte>((seed * 131 + l * 31 + pl * 17 + t * 7 + h * 3 + i) & 0xff);
        }
}

/// Every row of block a of `ra` equals the same row of block b of `rb` (any strides).
bool same_rows(const engine_region& ra, std::uint32_t a, const engine_region& rb, std::uint32_t b) {
  const auto& L = ra.layout;
  for (std::uint32_t l = 0; l < L.model.num_layers; ++l)
    for (std::uint32_t pl = 0; pl < L.model.planes(); ++pl)
      for (std::uint32_t t = 0; t < L.block_size; ++t)
        for (std::uint32_t h = 0; h < L.model.num_kv_heads; ++h)
          if (std::memcmp(ra.region.layers()[l] + L.offset_in_layer(pl, a, t, h),
                          rb.region.layers()[l] + rb.layout.offset_in_layer(pl, b, t, h), L.head_row_bytes()) != 0)
            return false;
  return true;
}
}  // namespace

TEST_CASE("regions with the engine's own strides share chunks with dense regions of their order, and only those",
          "[server]") {
  running_server s;
  raw_client packed_c(s.path()), dense_c(s.path()), cpu_c(s.path()), hnd_c(s.path());
  engine_region packed(gpu_packed_layout());
  engine_region dense;  // NHD
  engine_region cpu(cpu_packed_layout());
  engine_region hnd(small_model(), test_block_size, 64, kv_layout_kind::hnd);
  CHECK(packed.region.bytes() == kv_region::bytes_for(packed.layout));
  const auto reg_packed = packed_c.register_region(packed);
  const auto reg_dense = dense_c.register_region(dense);
  const auto reg_cpu = cpu_c.register_region(cpu);
  const auto reg_hnd = hnd_c.register_region(hnd);
  // The model id folds in the order, not the strides.
  CHECK(reg_packed.model_id == reg_dense.model_id);
  CHECK(reg_cpu.model_id == reg_hnd.model_id);
  CHECK(reg_packed.model_id != reg_cpu.model_id);

  // Stored from the packed engine, retrieved by the dense one (skip 3: a partial block).
  const auto hashes = chunk_hashes(61, 2);
  const auto blocks = block_range(5, 2 * blocks_per_chunk);
  for (std::size_t i = 0; i < blocks.size(); ++i) fill_rows(packed, blocks[i], 40 + static_cast<std::uint32_t>(i));
  REQUIRE(packed_c.ok(store_req(packed, hashes, blocks)).stored == 2);
  CHECK(lookup_done(dense_c, reg_dense.model_id, hashes).hit_chunks == 2);
  const auto dst = block_range(30, 2 * blocks_per_chunk);
  REQUIRE(dense_c.ok(retrieve_req(hashes, dst)).retrieved_chunks == 2);
  for (std::size_t i = 0; i < dst.size(); ++i) CHECK(same_rows(dense, dst[i], packed, blocks[i]));
  // The HND engines miss them; the CPU-packed engine's own chunks reach the dense HND one.
  CHECK(lookup_done(cpu_c, reg_cpu.model_id, hashes, 1, "cpu-miss").hit_chunks == 0);
  const auto hashes2 = chunk_hashes(62, 1);
  const auto cblocks = block_range(40, blocks_per_chunk);
  for (std::size_t i = 0; i < cblocks.size(); ++i) fill_rows(cpu, cblocks[i], 90 + static_cast<std::uint32_t>(i));
  REQUIRE(cpu_c.ok(store_req(cpu, hashes2, cblocks, 0, "cpu-store")).stored == 1);
  CHECK(lookup_done(hnd_c, reg_hnd.model_id, hashes2, 1, "h").hit_chunks == 1);
  const auto hdst = block_range(2, blocks_per_chunk);
  REQUIRE(hnd_c.ok(retrieve_req(hashes2, hdst, 0, 0, "h")).retrieved_chunks == 1);
  for (std::size_t i = 0; i < hdst.size(); ++i) CHECK(same_rows(hnd, hdst[i], cpu, cblocks[i]));
}

TEST_CASE("a registration whose strides overlap rows, leave the bounds, overflow or disagree with its order is "
          "refused with a message naming the shape and the strides",
          "[server]") {
  running_server s;
  raw_client c(s.path());
  engine_region r(gpu_packed_layout());
  struct bad {
    const char* what;
    kv_strides strides;
    kv_layout_kind order;
    const char* says;
  };
  const kv_strides ok = r.layout.strides;
  kv_strides overlap = ok;
  overlap.token = ok.head;  // two tokens' rows on top of each other
  kv_strides beyond = ok;
  beyond.block = std::uint64_t{1} << 46;  // 63 blocks of 2^46: beyond 1 PiB
  kv_strides wraps = ok;
  wraps.head = ~std::uint64_t{0} / 2 + 2;  // 2^63 + 1: three heads' span would wrap around 64 bits
  kv_strides layers_overlap = ok;
  layers_overlap.layer = r.layout.layer_bytes() / 2;
  const std::vector<bad> cases{
      {"overlapping rows", overlap, kv_layout_kind::nhd, "overlap"},
      {"beyond 1 PiB", beyond, kv_layout_kind::nhd, "1 PiB"},
      {"a stride that would wrap", wraps, kv_layout_kind::nhd, "1 PiB"},
      {"overlapping layers", layers_overlap, kv_layout_kind::nhd, "layer stride"},
      {"order disagreeing", ok, kv_layout_kind::hnd, "order HND disagrees"},
  };
  for (const bad& b : cases) {
    INFO(b.what);
    auto req = r.registration();
    req.strides = b.strides;
    req.layout_kind = b.order;
    const auto e = c.refused(req, r.region.fd());
    CHECK(e.code == static_cast<std::uint32_t>(errc::invalid_argument));
    CHECK_THAT(e.message, Catch::Contains(b.says) && Catch::Contains("strides (bytes)") &&
                              Catch::Contains("kv_heads 2") && Catch::Contains("block_size 4"));
  }
  // A scheduler sends no strides.
  auto sched = scheduler_registration(small_model());
  sched.strides = ok;
  CHECK_THAT(c.refused(sched).message, Catch::Contains("strides 0"));
  // The connection still registers its region with the right strides.
  CHECK(c.register_region(r).model_id == make_model_id("test/model", small_model()));
}
