// Tests of include/kvtier/cuda/: compiled by nvcc, standard library + CUDA + POSIX only (no
// Catch2: this program also builds in bench/cuda's standalone project on a GPU machine that
// has nothing else).
//
// Without a device it runs the host-side checks (error category, argument validation with
// the same codes as core/kv_transfer.hpp, the launch packing replayed on the host against the
// CPU gather/scatter, the IPC descriptor wire format), prints
// "SKIPPED: no CUDA device (...)" and exits 77 (ctest's SKIP_RETURN_CODE). With a device it
// also checks, byte for byte against the CPU implementation: the kernels (MHA, MLA, odd
// widths, skip-first-n, batches, repeated ids, several launches per batch), the copy engine
// (staged and zero-copy), the parallel pinned registration, and CUDA IPC through a child
// process (fork + exec of this binary with --ipc-child; skipped with a message when the
// runtime refuses IPC).
//
//   kvtier_test_cuda              all checks; exit 0, 1 (a check failed) or 77 (no device)
//   kvtier_test_cuda --require-device   exit 1 instead of 77 when there is no device
//   kvtier_test_cuda --ipc-child <descriptor hex> <event hex>   (internal)

#include <kvtier/cuda/kv_transfer.cuh>

#include <kvtier/cuda/check.cuh>
#include <kvtier/cuda/copy_engine.cuh>
#include <kvtier/cuda/ipc_region.cuh>
#include <kvtier/cuda/pinned.cuh>

#include <kvtier/core/buffer.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace kc = kvtier::cuda;
using kvtier::attention_kind;
using kvtier::chunk_layout;
using kvtier::dtype_kind;
using kvtier::gather_item;
using kvtier::kv_layout_kind;
using kvtier::model_shape;
using kvtier::paged_kv_layout;
using kvtier::scatter_item;
using kvtier::transfer_errc;

namespace {

int checks = 0;
int failures = 0;

void check_impl(bool ok, const char* expr, const char* file, int line, const std::string& context) {
  ++checks;
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "%s:%d: CHECK failed: %s%s%s\n", file, line, expr, context.empty() ? "" : "  -- ",
               context.c_str());
}

#define CHECK(...) check_impl(static_cast<bool>(__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__, {})
#define CHECK_MSG(cond, msg) check_impl(static_cast<bool>(cond), #cond, __FILE__, __LINE__, (msg))

/// Stops the program on a CUDA failure in test plumbing (not in what is under test).
void must(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "FATAL: %s: %s\n", what, kc::make_error_code(e).message().c_str());
  std::exit(1);
}

void section(const char* name) { std::printf("-- %s\n", name); }

/// splitmix64 bytes: distinct everywhere, so a byte from the wrong place shows.
void fill_random(std::span<std::byte> bytes, std::uint64_t seed) {
  for (std::size_t i = 0; i < bytes.size(); i += 8) {
    std::uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(bytes.data() + i, &z, std::min<std::size_t>(8, bytes.size() - i));
  }
}

std::string describe(const paged_kv_layout& l, const chunk_layout& c) {
  return std::string(l.model.attention == attention_kind::mha ? "MHA " : "MLA ") + std::string(name(l.kind())) +
         " layers=" + std::to_string(l.model.num_layers) + " heads=" + std::to_string(l.model.num_kv_heads) +
         " dim=" + std::to_string(l.model.head_dim) + " dtype=" + std::string(name(l.model.dtype)) +
         " block=" + std::to_string(l.block_size) + " chunk=" + std::to_string(c.chunk_tokens) +
         (l.strides.dense() ? std::string() : "; " + l.describe());
}

/// The dimensions of an engine's KV tensor as its memory holds them (outermost first).
enum class dim_role { layer, plane, block, token, head, dim };

/// `l` with the strides of a contiguous tensor whose memory holds `memory`'s dimensions in
/// that order (each with the elements of padding its stride has beyond the dimensions
/// inside it). Without a layer dimension the layers lie apart, the layer extent rounded up
/// to 64 bytes from one another.
paged_kv_layout strided(paged_kv_layout l, const std::vector<std::pair<dim_role, std::uint32_t>>& memory) {
  auto size = [&](dim_role r) -> std::uint64_t {
    switch (r) {
      case dim_role::layer: return l.model.num_layers;
      case dim_role::plane: return l.model.planes();
      case dim_role::block: return l.num_blocks;
      case dim_role::token: return l.block_size;
      case dim_role::head: return l.model.num_kv_heads;
      case dim_role::dim: return l.model.head_dim;
    }
    return 0;
  };
  std::uint64_t st[6] = {};
  std::uint64_t inner = 1;
  bool has_layer = false;
  for (auto it = memory.rbegin(); it != memory.rend(); ++it) {
    st[static_cast<int>(it->first)] = inner + it->second;
    inner = (inner + it->second) * size(it->first);
    has_layer = has_layer || it->first == dim_role::layer;
  }
  const std::uint64_t e = l.model.dtype_bytes();
  l.strides = {has_layer ? st[0] * e : 1, st[1] * e, st[2] * e, st[3] * e, st[4] * e};
  if (!has_layer) l.strides.layer = (l.layer_bytes() + 63) / 64 * 64;
  return l;
}

/// One test case: a layout, a chunk size, a batch of items (block ids + skip).
struct batch_case {
  paged_kv_layout layout;
  chunk_layout chunk;
  std::vector<std::vector<std::uint32_t>> ids;  // per item
  std::vector<std::uint32_t> skips;             // per item
  std::string name;
};

/// Random distinct block ids for `items` chunks (a shuffled free list), random skips drawn
/// from the interesting values (0, 1, block-1, block, block+1, chunk-1, chunk) and others.
batch_case make_case(const paged_kv_layout& layout, std::uint32_t chunk_tokens, std::size_t items, std::uint64_t seed,
                     std::string name, bool repeats = false) {
  batch_case c{layout, {layout.model, chunk_tokens}, {}, {}, std::move(name)};
  std::mt19937_64 rng(seed);
  const std::uint32_t per = chunk_tokens / layout.block_size;
  std::vector<std::uint32_t> free(layout.num_blocks);
  std::iota(free.begin(), free.end(), 0u);
  std::shuffle(free.begin(), free.end(), rng);
  const std::uint32_t bs = layout.block_size;
  const std::vector<std::uint32_t> skip_values = {0, 1, bs - 1, bs, bs + 1, chunk_tokens - 1, chunk_tokens, bs / 2};
  std::size_t next = 0;
  for (std::size_t i = 0; i < items; ++i) {
    std::vector<std::uint32_t> ids;
    for (std::uint32_t j = 0; j < per; ++j) {
      if (repeats && !ids.empty() && rng() % 3 == 0)
        ids.push_back(ids[rng() % ids.size()]);  // a repeat inside the item
      else if (repeats && i > 0 && rng() % 4 == 0)
        ids.push_back(c.ids[rng() % i][rng() % per]);  // a repeat of an earlier item
      else
        ids.push_back(free[next++ % free.size()]);
    }
    c.ids.push_back(std::move(ids));
    std::uint32_t skip = i < skip_values.size() ? skip_values[(i + seed) % skip_values.size()]
                                                : static_cast<std::uint32_t>(rng() % (chunk_tokens + 1));
    c.skips.push_back(std::min(skip, chunk_tokens));
  }
  return c;
}

/// A paged cache in host memory, one allocation per layer (CPU reference and host replay).
struct host_cache {
  paged_kv_layout layout;
  std::vector<std::vector<std::byte>> storage;
  std::vector<std::byte*> layers;

  explicit host_cache(const paged_kv_layout& l) : layout(l) {
    for (std::uint32_t i = 0; i < l.model.num_layers; ++i) storage.emplace_back(l.layer_bytes() + 64);
    for (auto& s : storage) layers.push_back(s.data() + 16);  // 16-aligned in the vector
  }
  void fill(std::uint64_t seed) {
    for (auto& s : storage) fill_random(s, seed++);
  }
  [[nodiscard]] kvtier::paged_kv_view view() const { return {layout, layers}; }
  [[nodiscard]] std::vector<std::byte> bytes() const {
    std::vector<std::byte> all;
    for (std::byte* p : layers) all.insert(all.end(), p, p + layout.layer_bytes());
    return all;
  }
};

std::vector<gather_item> gather_items(const batch_case& c, std::byte* objects) {
  std::vector<gather_item> v;
  for (std::size_t i = 0; i < c.ids.size(); ++i)
    v.push_back({c.ids[i], objects + i * c.chunk.object_bytes(), c.skips[i]});
  return v;
}

std::vector<scatter_item> scatter_items(const batch_case& c, const std::byte* objects) {
  std::vector<scatter_item> v;
  for (std::size_t i = 0; i < c.ids.size(); ++i)
    v.push_back({c.ids[i], objects + i * c.chunk.object_bytes(), c.skips[i]});
  return v;
}

// ---------------------------------------------------------------------------------------
// Host-side checks (no device needed).
// ---------------------------------------------------------------------------------------

void test_error_category() {
  section("cuda error category");
  const std::error_code ec = kc::make_error_code(cudaErrorInsufficientDriver);
  CHECK(ec.category() == kc::cuda_category());
  CHECK(std::string(ec.category().name()) == "kvtier.cuda");
  CHECK_MSG(ec.message().find("cudaErrorInsufficientDriver (35)") != std::string::npos, ec.message());
  CHECK(ec == std::errc::no_such_device);
  CHECK(kc::make_error_code(cudaErrorMemoryAllocation) == std::errc::not_enough_memory);
  CHECK(kc::make_error_code(cudaErrorInvalidValue) == std::errc::invalid_argument);
  CHECK(!kc::make_error_code(cudaSuccess));
  kc::device_probe p;
  p.error = kc::make_error_code(cudaErrorNoDevice);
  CHECK(p.no_device() && !p.usable());
  p.error = kc::make_error_code(cudaErrorInsufficientDriver);
  CHECK(p.no_device());
  p.error = kc::make_error_code(cudaErrorUnknown);
  CHECK(!p.no_device() && !p.usable());
  p = {};
  CHECK(p.no_device());  // a count of 0
  CHECK(kc::ipc_refused(kc::make_error_code(cudaErrorMapBufferObjectFailed)));
  CHECK(!kc::ipc_refused(kc::make_error_code(cudaErrorInvalidValue)));
  CHECK(!kc::ipc_refused(kc::region_errc::bad_descriptor));
}

/// The GPU functions return the CPU's codes for every malformed argument, before touching
/// anything. The device table pointer is a fake (never dereferenced: validation fails first).
void test_validation_matches_cpu(bool have_device) {
  section("validation codes match core/kv_transfer.hpp");
  const paged_kv_layout layout{{2, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 10};
  const chunk_layout chunk{layout.model, 8};
  host_cache hc(layout);
  std::vector<std::byte> object(chunk.object_bytes());
  std::byte* const fake_table_entry[2] = {};
  const kc::paged_kv_view gv{layout, {fake_table_entry, 2, 16}};
  const std::vector<std::uint32_t> ok_ids = {1, 2};

  struct bad_case {
    const char* name;
    paged_kv_layout layout;
    chunk_layout chunk;
    std::vector<std::uint32_t> ids;
    bool null_object;
    std::uint32_t skip;
    std::size_t layer_count;
    transfer_errc want;
  };
  paged_kv_layout bad_layout = layout;
  bad_layout.num_blocks = 0;
  chunk_layout other_model = chunk;
  other_model.model.head_dim = 16;
  chunk_layout odd_chunk = chunk;
  odd_chunk.chunk_tokens = 6;
  const std::vector<bad_case> cases = {
      {"invalid layout", bad_layout, chunk, ok_ids, false, 0, 2, transfer_errc::invalid_layout},
      {"other model", layout, other_model, ok_ids, false, 0, 2, transfer_errc::layout_mismatch},
      {"chunk not a block multiple", layout, odd_chunk, ok_ids, false, 0, 2, transfer_errc::layout_mismatch},
      {"layer count", layout, chunk, ok_ids, false, 0, 1, transfer_errc::layer_count},
      {"null object", layout, chunk, ok_ids, true, 0, 2, transfer_errc::null_pointer},
      {"block count", layout, chunk, {1, 2, 3}, false, 0, 2, transfer_errc::block_count},
      {"block id out of range", layout, chunk, {1, 10}, false, 0, 2, transfer_errc::block_id_out_of_range},
      {"skip out of range", layout, chunk, ok_ids, false, 9, 2, transfer_errc::skip_out_of_range},
  };
  for (const bad_case& c : cases) {
    const kvtier::paged_kv_view cpu{c.layout, std::span<std::byte* const>(hc.layers).first(c.layer_count)};
    const kc::paged_kv_view gpu{c.layout, {fake_table_entry, static_cast<std::uint32_t>(c.layer_count), 16}};
    std::byte* obj = c.null_object ? nullptr : object.data();
    const std::error_code want = c.want;
    const std::error_code cpu_g = kvtier::gather_chunk(cpu, c.ids, c.chunk, obj, c.skip);
    const std::error_code gpu_g = kc::gather_chunk(gpu, c.ids, c.chunk, obj, c.skip);
    const std::error_code gpu_s = kc::scatter_chunk(gpu, c.ids, c.chunk, obj, c.skip);
    const gather_item gi[2] = {{ok_ids, object.data(), 0}, {c.ids, obj, c.skip}};
    const std::error_code gpu_b = kc::gather_chunks(gpu, c.chunk, gi);
    CHECK_MSG(cpu_g == want, c.name);
    CHECK_MSG(gpu_g == want && gpu_s == want && gpu_b == want, std::string(c.name) + ": " + gpu_g.message());
    CHECK_MSG(kc::check_transfer(gpu, c.ids, c.chunk, obj, c.skip) == want, c.name);
    CHECK(gpu_g == std::errc::invalid_argument);
  }
  // A null device table is the null_pointer of the layer pointers.
  const kc::paged_kv_view no_table{layout, {nullptr, 2, 16}};
  CHECK(kc::gather_chunk(no_table, ok_ids, chunk, object.data()) == transfer_errc::null_pointer);
  // Valid arguments without a driver: the launch fails with a CUDA code, nothing crashes.
  if (!have_device) {
    const std::error_code ec = kc::gather_chunk(gv, ok_ids, chunk, object.data());
    CHECK_MSG(ec && ec.category() == kc::cuda_category(), ec.message());
    std::error_code tec;
    const kc::layer_table t = kc::layer_table::upload(hc.layers, tec);
    CHECK(tec && t.empty());
  }
  std::error_code ec;
  std::byte* const null_layers[2] = {hc.layers[0], nullptr};
  (void)kc::layer_table::upload(null_layers, ec);
  CHECK(ec == transfer_errc::null_pointer);
  (void)kc::layer_table::upload({}, ec);
  CHECK(ec == transfer_errc::layer_count);
}

/// Replays every launch of pack() on the host (locate_segment per CTA, memcpy) and checks the
/// result against the CPU gather/scatter byte for byte; also checks that no two CTAs of one
/// launch write overlapping bytes (the race the scatter splitting avoids) and that each
/// copy is aligned to the chosen vector width.
struct replay {
  int launches = 0;
  bool overlap = false;
  bool misaligned = false;

  template <bool Gather>
  cudaError_t operator()(const kc::detail::launch_params& p, unsigned vec) {
    ++launches;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> writes;
    const std::uint64_t grid = kc::detail::grid_size(p);
    for (std::uint64_t cta = 0; cta < grid; ++cta) {
      const kc::detail::segment_copy s = kc::detail::locate_segment<Gather>(p, static_cast<std::uint32_t>(cta));
      if (!s.active) continue;
      s.for_each_piece([&](std::byte* dst, const std::byte* src, std::uint64_t len) {
        if ((reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) | len) % vec)
          misaligned = true;
        std::memcpy(dst, src, len);
        writes.emplace_back(reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(dst) + len);
      });
    }
    std::sort(writes.begin(), writes.end());
    for (std::size_t i = 1; i < writes.size(); ++i)
      if (writes[i].first < writes[i - 1].second) overlap = true;
    return cudaSuccess;
  }
};

void check_replay(const batch_case& c, std::size_t object_misalign = 0) {
  const std::string what = c.name + " (" + describe(c.layout, c.chunk) + ")";
  host_cache ref(c.layout), rep(c.layout);
  ref.fill(11);
  rep.fill(11);
  const std::size_t ob = c.chunk.object_bytes(), n = c.ids.size();
  std::vector<std::byte> ref_obj(n * ob + 64), rep_obj(n * ob + 64);
  fill_random(ref_obj, 5);
  rep_obj = ref_obj;
  // The "device" table of the replay is host memory.
  const kc::paged_kv_view gv{c.layout, {rep.layers.data(), static_cast<std::uint32_t>(rep.layers.size()), 16}};
  {  // gather
    const auto ref_items = gather_items(c, ref_obj.data() + object_misalign);
    const auto rep_items = gather_items(c, rep_obj.data() + object_misalign);
    CHECK_MSG(!kvtier::gather_chunks(ref.view(), c.chunk, ref_items), what);
    replay r;
    const std::error_code ec = kc::detail::pack<true, gather_item>(
        gv, c.chunk, rep_items,
        [&](const kc::detail::launch_params& p, unsigned v) { return r.operator()<true>(p, v); });
    CHECK_MSG(!ec, what);
    CHECK_MSG(ref_obj == rep_obj, "gather replay differs from the CPU: " + what);
    CHECK_MSG(!r.overlap && !r.misaligned, what);
  }
  {  // scatter
    fill_random(ref_obj, 7);
    rep_obj = ref_obj;
    const auto ref_items = scatter_items(c, ref_obj.data() + object_misalign);
    const auto rep_items = scatter_items(c, rep_obj.data() + object_misalign);
    CHECK_MSG(!kvtier::scatter_chunks(ref.view(), c.chunk, ref_items), what);
    replay r;
    const std::error_code ec = kc::detail::pack<false, scatter_item>(
        gv, c.chunk, rep_items,
        [&](const kc::detail::launch_params& p, unsigned v) { return r.operator()<false>(p, v); });
    CHECK_MSG(!ec, what);
    CHECK_MSG(ref.bytes() == rep.bytes(), "scatter replay differs from the CPU: " + what);
    CHECK_MSG(!r.overlap, "two CTAs of one scatter launch write the same bytes: " + what);
    CHECK_MSG(!r.misaligned, what);
  }
}

/// The shapes every device check also runs.
std::vector<batch_case> shapes() {
  std::vector<batch_case> v;
  // MHA, bf16, 16-byte accesses; 0.5B-like.
  v.push_back(make_case({{3, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 64}, 64, 9, 1, "mha bf16"));
  // MLA (DeepSeek latent 512 + 64 rope), bf16.
  v.push_back(make_case({{2, 1, 576, dtype_kind::bf16, attention_kind::mla}, 16, 40}, 32, 5, 2, "mla bf16"));
  // fp32, 8-byte token planes: 8-byte accesses.
  v.push_back(make_case({{2, 1, 2, dtype_kind::fp32, attention_kind::mha}, 8, 50}, 24, 6, 3, "mha fp32 narrow"));
  // fp8 with an odd width: 1-byte accesses.
  v.push_back(make_case({{2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 4, 60}, 12, 7, 4, "mha fp8 odd width"));
  // One block per token: 256 ids per chunk, 5 chunks = 1280 ids: three launches.
  v.push_back(
      make_case({{2, 1, 8, dtype_kind::bf16, attention_kind::mha}, 1, 2000}, 256, 5, 5, "several launches per batch"));
  // Repeated block ids inside and across items (scatter: the last occurrence wins).
  v.push_back(make_case({{2, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 12}, 16, 6, 6, "repeated ids", true));
  v.push_back(make_case({{2, 1, 16, dtype_kind::bf16, attention_kind::mla}, 2, 6}, 8, 8, 7, "repeated ids mla", true));
  // 70 small chunks: more pieces than one parameter block holds.
  v.push_back(
      make_case({{1, 1, 8, dtype_kind::bf16, attention_kind::mha}, 16, 200}, 32, 70, 8, "more items than one launch"));
  // HND (head-major blocks): a skip inside a block leaves the leading rows of every head.
  v.push_back(make_case({{3, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 64, kv_layout_kind::hnd}, 64, 9, 11,
                        "hnd bf16"));
  v.push_back(make_case({{2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 4, 60, kv_layout_kind::hnd}, 12, 7, 12,
                        "hnd fp8 odd width"));
  v.push_back(make_case({{2, 4, 2, dtype_kind::fp32, attention_kind::mha}, 8, 30, kv_layout_kind::hnd}, 16, 6, 13,
                        "hnd repeated ids", true));
  // Explicit strides: the layouts vLLM's backends allocate. R = memory order, outer first.
  using R = dim_role;
  const model_shape bf16_8x128{2, 8, 128, dtype_kind::bf16, attention_kind::mha};
  // K|V packed in the last dim, NHD (FlashAttention's (B, N, H, 2D)): 256-byte rows.
  v.push_back(make_case(strided({bf16_8x128, 16, 24, kv_layout_kind::nhd},
                                {{R::block, 0}, {R::token, 0}, {R::head, 0}, {R::plane, 0}, {R::dim, 0}}),
                        32, 5, 14, "gpu packed nhd"));
  v.push_back(make_case(strided({{2, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 24, kv_layout_kind::hnd},
                                {{R::block, 0}, {R::head, 0}, {R::token, 0}, {R::plane, 0}, {R::dim, 0}}),
                        32, 5, 15, "gpu packed hnd"));
  // vLLM's CPU backend (B, H, 2, N, D): a head's rows adjacent.
  v.push_back(make_case(strided({{2, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 24, kv_layout_kind::hnd},
                                {{R::block, 0}, {R::head, 0}, {R::plane, 0}, {R::token, 0}, {R::dim, 0}}),
                        32, 5, 16, "cpu packed"));
  // FlashInfer's blocks-first (B, 2, N, H, D): whole segments, block stride of two.
  v.push_back(make_case(strided({{2, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 24, kv_layout_kind::nhd},
                                {{R::block, 0}, {R::plane, 0}, {R::token, 0}, {R::head, 0}, {R::dim, 0}}),
                        32, 5, 17, "blocks-first nhd"));
  // fp8 packed with an odd width: 1-byte accesses through the row path.
  v.push_back(make_case(strided({{2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 4, 60, kv_layout_kind::nhd},
                                {{R::block, 0}, {R::token, 0}, {R::head, 0}, {R::plane, 0}, {R::dim, 0}}),
                        12, 7, 18, "fp8 gpu packed odd width", true));
  // One tensor for all layers, (B, L, N, H, 2D) and (B, H, L, N, 2D).
  v.push_back(make_case(
      strided({{3, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 24, kv_layout_kind::nhd},
              {{R::block, 0}, {R::layer, 0}, {R::token, 0}, {R::head, 0}, {R::plane, 0}, {R::dim, 0}}),
      32, 5, 19, "cross-layer nhd"));
  v.push_back(make_case(
      strided({{3, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 24, kv_layout_kind::hnd},
              {{R::block, 0}, {R::head, 0}, {R::layer, 0}, {R::token, 0}, {R::plane, 0}, {R::dim, 0}}),
      32, 5, 20, "cross-layer hnd"));
  // MLA with padded pages; NHD with padded tokens (rows path, runs of heads).
  v.push_back(make_case(strided({{2, 1, 576, dtype_kind::bf16, attention_kind::mla}, 16, 40, kv_layout_kind::nhd},
                                {{R::block, 64}, {R::token, 0}, {R::dim, 0}}),
                        32, 5, 21, "mla padded blocks"));
  v.push_back(make_case(strided({{2, 4, 8, dtype_kind::fp16, attention_kind::mha}, 8, 30, kv_layout_kind::nhd},
                                {{R::plane, 0}, {R::block, 0}, {R::token, 3}, {R::head, 0}, {R::dim, 0}}),
                        16, 6, 22, "nhd padded tokens", true));
  return v;
}

void test_host_replay() {
  section("launch packing replayed on the host == CPU gather/scatter");
  for (const batch_case& c : shapes()) check_replay(c);
  // An object at an address only 4-aligned: the launch drops to 4-byte accesses.
  check_replay(make_case({{2, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 30}, 32, 3, 9, "object 4-aligned"), 4);
  // The whole batch skipped: no launch at all.
  batch_case all_skipped =
      make_case({{1, 1, 8, dtype_kind::bf16, attention_kind::mha}, 4, 10}, 8, 2, 10, "all skipped");
  all_skipped.skips = {8, 8};
  std::vector<std::byte> objects(2 * all_skipped.chunk.object_bytes());
  host_cache hc(all_skipped.layout);
  const kc::paged_kv_view gv{all_skipped.layout, {hc.layers.data(), 1, 16}};
  replay r;
  const auto items = gather_items(all_skipped, objects.data());
  CHECK(!kc::detail::pack<true, gather_item>(
      gv, all_skipped.chunk, items,
      [&](const kc::detail::launch_params& p, unsigned v) { return r.operator()<true>(p, v); }));
  CHECK(r.launches == 0);
}

void test_descriptor_wire_format() {
  section("region descriptor wire format");
  kc::region_descriptor d;
  d.layout = {{3, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 100};
  for (int i = 0; i < 16; ++i) d.device[i] = static_cast<std::uint8_t>(i * 7 + 1);
  kc::ipc_allocation a0, a1;
  a0.handle.fill(0xab);
  a0.bytes = 2 * d.layout.layer_bytes() + 4096;
  a1.handle.fill(0xcd);
  a1.bytes = d.layout.layer_bytes();
  d.allocations = {a0, a1};
  d.layers = {{0, 0, 0}, {0, 0, d.layout.layer_bytes() + 4096}, {1, 0, 0}};
  CHECK(!d.validate());
  const std::vector<std::byte> bytes = d.serialize();
  CHECK(bytes.size() == 104 + 2 * 72 + 3 * 16);
  CHECK(bytes.size() <= kc::region_descriptor::max_bytes);
  kc::region_descriptor back;
  CHECK(!kc::region_descriptor::parse(bytes, back));
  CHECK(back.layout == d.layout && back.device == d.device && back.allocations.size() == 2 && back.layers.size() == 3);
  CHECK(back.layers[1].offset == d.layout.layer_bytes() + 4096 && back.allocations[1].handle[5] == 0xcd);
  CHECK(back.serialize() == bytes);

  auto parse_code = [](std::vector<std::byte> b) {
    kc::region_descriptor out;
    return kc::region_descriptor::parse(b, out);
  };
  CHECK(parse_code({}) == kc::region_errc::bad_descriptor);
  CHECK(parse_code(std::vector<std::byte>(bytes.begin(), bytes.end() - 1)) == kc::region_errc::bad_descriptor);
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte{0});
  CHECK(parse_code(longer) == kc::region_errc::bad_descriptor);
  std::vector<std::byte> bad = bytes;
  bad[0] = std::byte{0};
  CHECK(parse_code(bad) == kc::region_errc::bad_descriptor);
  bad = bytes;
  bad[4] = std::byte{kc::region_descriptor_version + 1};  // another version
  CHECK(parse_code(bad) == kc::region_errc::unsupported_version);
  CHECK(parse_code(bad) == std::errc::protocol_not_supported);

  // A layout with explicit strides (K|V packed per token) travels whole; its layers are
  // sized by their last row, and strides that overlap rows make the layout invalid.
  kc::region_descriptor packed = d;
  packed.layout = strided(d.layout, {{dim_role::block, 0}, {dim_role::token, 0}, {dim_role::head, 0},
                                     {dim_role::plane, 0}, {dim_role::dim, 0}});
  CHECK(!packed.validate());
  kc::region_descriptor packed_back;
  CHECK(!kc::region_descriptor::parse(packed.serialize(), packed_back));
  CHECK(packed_back.layout == packed.layout && packed_back.layout.strides.plane == 128 * 2);
  packed.layout.strides.token = packed.layout.strides.head;
  CHECK(packed.validate() == transfer_errc::invalid_layout);
  CHECK(parse_code(packed.serialize()) == transfer_errc::invalid_layout);

  kc::region_descriptor e = d;
  e.layers[2].allocation = 2;
  CHECK(e.validate() == kc::region_errc::bad_descriptor);
  CHECK(parse_code(e.serialize()) == kc::region_errc::bad_descriptor);
  e = d;
  e.layers[1].offset += 1;  // runs one byte past allocation 0
  CHECK(e.validate() == kc::region_errc::outside_allocation);
  CHECK(parse_code(e.serialize()) == kc::region_errc::outside_allocation);
  e = d;
  e.layers[0].offset = ~std::uint64_t{0};  // no wrap-around
  CHECK(e.validate() == kc::region_errc::outside_allocation);
  e = d;
  e.layers.pop_back();
  CHECK(e.validate() == kc::region_errc::bad_descriptor);
  e = d;
  e.layout.block_size = 0;
  CHECK(e.validate() == transfer_errc::invalid_layout);
  e = d;
  e.allocations.clear();
  CHECK(e.validate() == kc::region_errc::bad_descriptor);
}

void test_registration_plan() {
  section("host_registration::plan: pieces for parallel cudaHostRegister");
  kvtier::aligned_buffer arena(std::size_t{63} << 20);
  const std::size_t slot = std::size_t{3} << 20;
  kc::registration_options ro;
  ro.piece_alignment = slot;
  ro.max_piece_bytes = std::size_t{16} << 20;
  auto covers = [&](const std::vector<std::span<std::byte>>& pieces, std::span<std::byte> range, std::size_t align) {
    std::byte* at = range.data();
    for (const auto& piece : pieces) {
      if (piece.data() != at || piece.empty()) return false;
      if ((piece.data() - range.data()) % align != 0) return false;
      at += piece.size();
    }
    return at == range.data() + range.size();
  };
  // 16 MiB cap, 3 MiB slots: pieces of 15 MiB (5 slots), the last one 3 MiB.
  auto p = kc::host_registration::plan(arena.span(), ro, 4);
  CHECK(p.size() == 5 && p[0].size() == 15 * (std::size_t{1} << 20) && p[4].size() == slot);
  CHECK(covers(p, arena.span(), slot));
  // 16 threads: at least one piece each where the range allows it (21 slots -> 11 pieces of 2).
  p = kc::host_registration::plan(arena.span(), ro, 16);
  CHECK(p.size() >= 11 && covers(p, arena.span(), slot));
  // No slot size: page boundaries only.
  ro.piece_alignment = 0;
  p = kc::host_registration::plan(arena.span().first(10 * 4096), ro, 3);
  CHECK(p.size() == 3 && covers(p, arena.span().first(10 * 4096), 4096));
  // A slot size that is not a page multiple: boundaries on multiples of both.
  ro.piece_alignment = 6000;
  p = kc::host_registration::plan(arena.span(), ro, 8);
  CHECK(covers(p, arena.span(), std::lcm(std::size_t{6000}, std::size_t{4096})));
  // A range that does not start on a page: one piece.
  p = kc::host_registration::plan(arena.span().subspan(100), ro, 8);
  CHECK(p.size() == 1 && p[0].size() == arena.size() - 100);
  CHECK(kc::host_registration::plan({}, ro, 8).empty());
  // Without a driver, registering fails with the runtime's error and leaves nothing behind.
  if (!kc::probe_devices().usable()) {
    std::error_code ec;
    const kc::host_registration r = kc::host_registration::register_range(arena.span(), {}, ec);
    CHECK(ec && ec.category() == kc::cuda_category() && r.empty());
  }
}

// ---------------------------------------------------------------------------------------
// Device checks.
// ---------------------------------------------------------------------------------------

/// Device memory, freed on destruction.
struct device_buffer {
  std::byte* p = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t bytes) : n(bytes) {
    void* v = nullptr;
    must(cudaMalloc(&v, bytes), "cudaMalloc");
    p = static_cast<std::byte*>(v);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p); }
};

/// A paged cache on the device (layers at uneven distances in one allocation) with its
/// host mirror (the CPU reference).
struct device_cache {
  host_cache host;
  device_buffer mem;
  std::vector<std::byte*> layers;
  kc::layer_table table;

  explicit device_cache(const paged_kv_layout& l) : host(l), mem(l.model.num_layers * (l.layer_bytes() + 512) + 512) {
    for (std::uint32_t i = 0; i < l.model.num_layers; ++i) layers.push_back(mem.p + 256 + i * (l.layer_bytes() + 512));
    std::error_code ec;
    table = kc::layer_table::upload(layers, ec);
    if (ec) {
      std::fprintf(stderr, "FATAL: layer_table::upload: %s\n", ec.message().c_str());
      std::exit(1);
    }
  }
  void fill(std::uint64_t seed) {
    host.fill(seed);
    for (std::uint32_t i = 0; i < layers.size(); ++i)
      must(cudaMemcpy(layers[i], host.layers[i], host.layout.layer_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  [[nodiscard]] std::vector<std::byte> device_bytes() const {
    std::vector<std::byte> all(host.layout.layer_bytes() * layers.size());
    for (std::size_t i = 0; i < layers.size(); ++i)
      must(cudaMemcpy(all.data() + i * host.layout.layer_bytes(), layers[i], host.layout.layer_bytes(),
                      cudaMemcpyDeviceToHost),
           "download");
    return all;
  }
  [[nodiscard]] kc::paged_kv_view view() const { return {host.layout, table.view()}; }
};

enum class object_memory { device, pinned };

/// The kernels against the CPU, byte for byte: objects in device memory or pinned host
/// memory (zero-copy), one item at a time or as a batch.
void check_kernels(const batch_case& c, object_memory where, bool batched, std::size_t misalign = 0) {
  const std::string what = c.name + (where == object_memory::device ? " [device objects" : " [pinned objects") +
                           (batched ? ", batch]" : ", per item]") + " (" + describe(c.layout, c.chunk) + ")";
  device_cache dc(c.layout);
  dc.fill(21);
  const std::size_t ob = c.chunk.object_bytes(), n = c.ids.size(), total = n * ob + 64;
  std::vector<std::byte> ref_obj(total), got(total);
  device_buffer dev_obj(where == object_memory::device ? total : 16);
  kc::pinned_buffer pin(where == object_memory::pinned ? total : 16);
  std::byte* obj = where == object_memory::device ? dev_obj.p : pin.data();
  auto put = [&](const std::vector<std::byte>& h) {
    must(cudaMemcpy(obj, h.data(), total, cudaMemcpyDefault), "object upload");
  };
  auto get = [&]() { must(cudaMemcpy(got.data(), obj, total, cudaMemcpyDefault), "object download"); };
  cudaStream_t s = nullptr;
  must(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

  // Gather.
  fill_random(ref_obj, 31);
  put(ref_obj);
  CHECK_MSG(!kvtier::gather_chunks(dc.host.view(), c.chunk, gather_items(c, ref_obj.data() + misalign)), what);
  if (batched) {
    const std::error_code ec = kc::gather_chunks(dc.view(), c.chunk, gather_items(c, obj + misalign), {}, s);
    CHECK_MSG(!ec, what + ": " + ec.message());
  } else {
    for (const gather_item& it : gather_items(c, obj + misalign)) {
      const std::error_code ec = kc::gather_chunk(dc.view(), it.block_ids, c.chunk, it.object, it.skip_tokens, {}, s);
      CHECK_MSG(!ec, what + ": " + ec.message());
    }
  }
  must(cudaStreamSynchronize(s), "gather sync");
  get();
  CHECK_MSG(got == ref_obj, "GPU gather differs from the CPU: " + what);

  // Scatter.
  fill_random(ref_obj, 41);
  put(ref_obj);
  CHECK_MSG(!kvtier::scatter_chunks(dc.host.view(), c.chunk, scatter_items(c, ref_obj.data() + misalign)), what);
  if (batched) {
    const std::error_code ec = kc::scatter_chunks(dc.view(), c.chunk, scatter_items(c, obj + misalign), {}, s);
    CHECK_MSG(!ec, what + ": " + ec.message());
  } else {
    for (const scatter_item& it : scatter_items(c, obj + misalign)) {
      const std::error_code ec = kc::scatter_chunk(dc.view(), it.block_ids, c.chunk, it.object, it.skip_tokens, {}, s);
      CHECK_MSG(!ec, what + ": " + ec.message());
    }
  }
  must(cudaStreamSynchronize(s), "scatter sync");
  CHECK_MSG(dc.device_bytes() == dc.host.bytes(), "GPU scatter differs from the CPU: " + what);
  must(cudaStreamDestroy(s), "stream destroy");
}

void test_kernels() {
  section("kernels == CPU gather/scatter, byte for byte");
  for (const batch_case& c : shapes()) {
    check_kernels(c, object_memory::device, true);
    check_kernels(c, object_memory::device, false);
    check_kernels(c, object_memory::pinned, true);
  }
  check_kernels(make_case({{2, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 30}, 32, 3, 9, "object 4-aligned"),
                object_memory::device, true, 4);
}

/// The copy engine in both modes against the CPU: objects are slots of a registered arena.
void check_copy_engine(const batch_case& c, kc::copy_mode mode, std::uint32_t ring) {
  const std::string what = c.name + (mode == kc::copy_mode::staged ? " [staged, ring " + std::to_string(ring) + "]"
                                                                   : std::string(" [zero-copy]"));
  device_cache dc(c.layout);
  dc.fill(51);
  const std::size_t ob = kvtier::align_up(c.chunk.object_bytes()), n = c.ids.size();
  kvtier::aligned_buffer arena(ob * n);
  kc::registration_options ro;
  ro.threads = 3;
  ro.piece_alignment = ob;
  std::error_code ec;
  kc::host_registration reg = kc::host_registration::register_range(arena.span(), ro, ec);
  CHECK_MSG(!ec, ec.message());
  if (ec) return;
  std::vector<std::byte> ref(ob * n);
  auto engine_result = kc::copy_engine::create(dc.view(), c.chunk, {mode, ring, -1}, ec);
  if (mode == kc::copy_mode::zero_copy && ec == std::errc::not_supported) {
    std::printf("   (zero-copy not supported on this device: skipped)\n");
    return;
  }
  CHECK_MSG(!ec, what + ": " + ec.message());
  if (ec) return;
  kc::copy_engine engine = std::move(engine_result);
  CHECK(engine.mode() == mode);
  cudaEvent_t done = nullptr;
  must(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");

  // Store, items laid into slots in reverse order.
  fill_random(arena.span(), 61);
  std::memcpy(ref.data(), arena.data(), ref.size());
  std::vector<gather_item> gi, gi_ref;
  for (std::size_t i = 0; i < n; ++i) {
    gi.push_back({c.ids[i], arena.data() + (n - 1 - i) * ob, c.skips[i]});
    gi_ref.push_back({c.ids[i], ref.data() + (n - 1 - i) * ob, c.skips[i]});
  }
  CHECK(!kvtier::gather_chunks(dc.host.view(), c.chunk, gi_ref));
  ec = engine.store(gi, nullptr, done);
  CHECK_MSG(!ec, what + ": " + ec.message());
  must(cudaEventSynchronize(done), "store done");
  CHECK_MSG(std::memcmp(arena.data(), ref.data(), ref.size()) == 0, "copy_engine store differs from the CPU: " + what);

  // Retrieve, twice in a row (the ring is reused across calls).
  for (int round = 0; round < 2; ++round) {
    fill_random(arena.span(), 71 + round);
    std::memcpy(ref.data(), arena.data(), ref.size());
    std::vector<scatter_item> si, si_ref;
    for (std::size_t i = 0; i < n; ++i) {
      si.push_back({c.ids[i], arena.data() + i * ob, c.skips[i]});
      si_ref.push_back({c.ids[i], ref.data() + i * ob, c.skips[i]});
    }
    CHECK(!kvtier::scatter_chunks(dc.host.view(), c.chunk, si_ref));
    ec = engine.retrieve(si, nullptr, done);
    CHECK_MSG(!ec, what + ": " + ec.message());
    must(cudaEventSynchronize(done), "retrieve done");
    CHECK_MSG(dc.device_bytes() == dc.host.bytes(), "copy_engine retrieve differs from the CPU: " + what);
  }
  // An invalid item: nothing is enqueued, the code is the CPU's.
  std::vector<std::uint32_t> bad_ids = c.ids[0];
  bad_ids[0] = c.layout.num_blocks;
  const gather_item bad[2] = {gi[0], {bad_ids, arena.data(), 0}};
  CHECK(engine.store(bad) == transfer_errc::block_id_out_of_range);
  CHECK(!engine.synchronize());
  must(cudaEventDestroy(done), "event destroy");
  CHECK(!reg.unregister());
}

void test_copy_engine() {
  section("copy_engine (staged and zero-copy) == CPU gather/scatter");
  const auto all = shapes();
  // 8: HND (a skip inside a block leads each head's run: the DMA is not one slab prefix);
  // 11, 13: strided (K|V packed per token, vLLM's CPU layout).
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{5}, std::size_t{8}, std::size_t{11},
                        std::size_t{13}}) {
    check_copy_engine(all[i], kc::copy_mode::staged, 2);
    check_copy_engine(all[i], kc::copy_mode::zero_copy, 0);
  }
  check_copy_engine(all[0], kc::copy_mode::staged, 1);
}

void test_pinned() {
  section("pinned memory: cudaHostAlloc and parallel cudaHostRegister");
  std::error_code ec;
  kc::pinned_buffer b = kc::pinned_buffer::allocate(1 << 20, ec);
  CHECK(!ec && b && b.size() == (1u << 20));
  cudaPointerAttributes attr{};
  CHECK(cudaPointerGetAttributes(&attr, b.data()) == cudaSuccess && attr.type == cudaMemoryTypeHost);

  const std::size_t slot = 3 << 20;  // 3 MiB slots: pieces fall on slot boundaries
  kvtier::aligned_buffer arena(slot * 21);
  std::string logged;
  kc::registration_options ro;
  ro.threads = 4;
  ro.piece_alignment = slot;
  ro.max_piece_bytes = 16 << 20;
  ro.log = [&](std::string_view m) { logged = m; };
  kc::host_registration reg = kc::host_registration::register_range(arena.span(), ro, ec);
  CHECK_MSG(!ec, ec.message());
  CHECK(!reg.empty() && reg.stats().bytes == arena.size() && reg.stats().threads == 4);
  CHECK(reg.pieces().size() == reg.stats().pieces && reg.pieces().size() >= 4);
  std::size_t covered = 0;
  for (const auto& piece : reg.pieces()) {
    CHECK((piece.data() - arena.data()) % slot == 0);
    covered += piece.size();
  }
  CHECK(covered == arena.size());
  CHECK_MSG(logged.find("pieces on 4 threads") != std::string::npos, logged);
  std::printf("   %s\n", logged.c_str());
  for (std::size_t off : {std::size_t{0}, slot * 7 + 5, arena.size() - 1}) {
    attr = {};
    CHECK(cudaPointerGetAttributes(&attr, arena.data() + off) == cudaSuccess && attr.type == cudaMemoryTypeHost);
    void* dp = reg.device_pointer(arena.data() + off, ec);
    CHECK(!ec && dp != nullptr);
  }
  (void)reg.device_pointer(b.data(), ec);
  CHECK(ec == std::errc::invalid_argument);
  // A DMA into a registered slot, then back.
  device_buffer d(slot);
  fill_random(std::span(arena.data() + slot * 5, slot), 3);
  must(cudaMemcpy(d.p, arena.data() + slot * 5, slot, cudaMemcpyHostToDevice), "h2d");
  must(cudaMemcpy(arena.data() + slot * 9, d.p, slot, cudaMemcpyDeviceToHost), "d2h");
  CHECK(std::memcmp(arena.data() + slot * 5, arena.data() + slot * 9, slot) == 0);
  CHECK(!reg.unregister());
  CHECK(reg.empty());
  attr = {};
  (void)cudaPointerGetAttributes(&attr, arena.data());
  (void)cudaGetLastError();
  CHECK(attr.type != cudaMemoryTypeHost);  // unregistered again
}

// ---------------------------------------------------------------------------------------
// CUDA IPC through a child process.
// ---------------------------------------------------------------------------------------

std::string to_hex(std::span<const std::byte> b) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::byte x : b) {
    s += digits[std::to_integer<unsigned>(x) >> 4];
    s += digits[std::to_integer<unsigned>(x) & 15];
  }
  return s;
}

std::vector<std::byte> from_hex(std::string_view s) {
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::vector<std::byte> b;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) b.push_back(static_cast<std::byte>(v(s[i]) * 16 + v(s[i + 1])));
  return b;
}

/// The bytes the parent writes into layer l (and the child checks), and the ones the child
/// writes back.
std::byte pattern(std::uint32_t l, std::size_t i, unsigned salt) {
  return static_cast<std::byte>((l * 131 + i * 7 + (i >> 9) * 13 + salt) & 0xff);
}

const paged_kv_layout ipc_layout{{3, 2, 64, dtype_kind::bf16, attention_kind::mha}, 16, 12};
const chunk_layout ipc_chunk{ipc_layout.model, 32};
const std::vector<std::uint32_t> ipc_read_ids = {7, 2};
const std::vector<std::uint32_t> ipc_write_ids = {5, 9};

/// The child: opens the parent's region and event, gathers blocks {7, 2} and compares with
/// the pattern, scatters a new pattern into blocks {5, 9}. Exit 0, 1 (mismatch) or 77.
int ipc_child(const char* descriptor_hex, const char* event_hex) {
  const std::vector<std::byte> bytes = from_hex(descriptor_hex);
  std::error_code ec;
  kc::opened_kv_region region = kc::opened_kv_region::open(bytes, ec);
  if (ec && kc::ipc_refused(ec)) {
    std::printf("SKIPPED: the CUDA runtime refuses IPC here (%s)\n", ec.message().c_str());
    return 77;
  }
  CHECK_MSG(!ec, "opened_kv_region::open: " + ec.message());
  if (ec) return 1;
  CHECK(region.layout() == ipc_layout);
  kc::ipc_event_handle eh{};
  const std::vector<std::byte> ev_bytes = from_hex(event_hex);
  std::memcpy(eh.data(), ev_bytes.data(), std::min(eh.size(), ev_bytes.size()));
  kc::ipc_event ev = kc::ipc_event::open(eh, region.device(), ec);
  if (ec && kc::ipc_refused(ec)) {
    std::printf("SKIPPED: the CUDA runtime refuses IPC events here (%s)\n", ec.message().c_str());
    return 77;
  }
  CHECK_MSG(!ec, "ipc_event::open: " + ec.message());
  if (ec) return 1;
  cudaStream_t s = nullptr;
  must(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  must(cudaStreamWaitEvent(s, ev.get(), 0), "wait for the parent's fill");

  device_buffer obj(ipc_chunk.object_bytes());
  CHECK(!kc::gather_chunk(region.view(), ipc_read_ids, ipc_chunk, obj.p, 0, {}, s));
  std::vector<std::byte> got(ipc_chunk.object_bytes());
  must(cudaMemcpyAsync(got.data(), obj.p, got.size(), cudaMemcpyDeviceToHost, s), "d2h");
  must(cudaStreamSynchronize(s), "sync");
  bool same = true;
  const std::size_t seg = ipc_layout.segment_bytes();
  for (std::uint32_t l = 0; l < ipc_layout.model.num_layers; ++l)
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::size_t j = 0; j < ipc_read_ids.size(); ++j)
        for (std::size_t b = 0; b < seg; ++b)
          same = same && got[ipc_chunk.offset(l, p) + j * seg + b] ==
                             pattern(l, ipc_layout.offset_in_layer(p, ipc_read_ids[j]) + b, 0);
  CHECK_MSG(same, "the child read other bytes than the parent wrote");

  std::vector<std::byte> mine(ipc_chunk.object_bytes());
  for (std::uint32_t l = 0; l < ipc_layout.model.num_layers; ++l)
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::size_t j = 0; j < ipc_write_ids.size(); ++j)
        for (std::size_t b = 0; b < seg; ++b)
          mine[ipc_chunk.offset(l, p) + j * seg + b] =
              pattern(l, ipc_layout.offset_in_layer(p, ipc_write_ids[j]) + b, 99);
  must(cudaMemcpyAsync(obj.p, mine.data(), mine.size(), cudaMemcpyHostToDevice, s), "h2d");
  CHECK(!kc::scatter_chunk(region.view(), ipc_write_ids, ipc_chunk, obj.p, 0, {}, s));
  must(cudaStreamSynchronize(s), "sync");
  must(cudaStreamDestroy(s), "stream destroy");
  CHECK(!region.close());
  return failures ? 1 : 0;
}

void test_ipc() {
  section("CUDA IPC: kv_region (engine) -> child process opened_kv_region (server)");
  // allocate(): one allocation, layers back to back.
  std::error_code ec;
  {
    kc::kv_region r = kc::kv_region::allocate(ipc_layout, 0, ec);
    CHECK_MSG(!ec, ec.message());
    if (!ec) {
      CHECK(r.descriptor().allocations.size() == 1 && r.layers().size() == 3 && r.data() == r.layers()[0]);
      CHECK(r.descriptor().layers[2].offset == 2 * ipc_layout.layer_bytes());
      kc::device_uuid u{};
      CHECK(!kc::get_device_uuid(0, u) && u == r.descriptor().device);
      int found = -1;
      CHECK(!kc::find_device(u, found) && found == 0);
    }
  }
  kc::device_uuid nobody{};
  nobody.fill(0xee);
  int found = -1;
  CHECK(kc::find_device(nobody, found) == kc::region_errc::device_not_found);

  // adopt(): the engine's own tensors, two layers inside one allocation, one alone.
  // 4 MiB: a multiple of the driver's 2 MiB granularity, so the allocation's size as the
  // driver reports it is exactly this and "runs past the end" below is unambiguous.
  const std::size_t lb = ipc_layout.layer_bytes();
  const std::size_t shared_bytes = std::size_t{4} << 20;
  device_buffer shared(shared_bytes), alone(lb);
  std::byte* const layers[3] = {shared.p + 4096, alone.p, shared.p + 4096 + lb + 1024};
  kc::kv_region region = kc::kv_region::adopt(ipc_layout, layers, 0, ec);
  if (ec == std::errc::not_supported) {
    std::printf("SKIPPED (IPC): the driver offers no cuMemGetAddressRange entry point\n");
    return;
  }
  CHECK_MSG(!ec, "kv_region::adopt: " + ec.message());
  if (ec) {
    if (kc::ipc_refused(ec)) std::printf("SKIPPED (IPC): %s\n", ec.message().c_str());
    return;
  }
  const kc::region_descriptor& d = region.descriptor();
  CHECK(d.allocations.size() == 2);
  CHECK(d.layers[0].allocation == d.layers[2].allocation && d.layers[0].allocation != d.layers[1].allocation);
  CHECK(d.layers[0].offset == 4096 && d.layers[2].offset == 4096 + lb + 1024 && d.layers[1].offset == 0);
  std::byte* const outside[3] = {shared.p + shared_bytes - lb / 2, alone.p, shared.p};  // layer 0 runs past the end
  kc::kv_region too_far = kc::kv_region::adopt(ipc_layout, outside, 0, ec);
  CHECK(ec == kc::region_errc::outside_allocation && too_far.empty());

  // Fill the layers with the pattern on a stream and record the interprocess event after it.
  kc::ipc_event ev = kc::ipc_event::create(0, ec);
  CHECK_MSG(!ec, ec.message());
  if (ec) return;
  cudaStream_t s = nullptr;
  must(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::vector<std::vector<std::byte>> host(3, std::vector<std::byte>(lb));
  for (std::uint32_t l = 0; l < 3; ++l) {
    for (std::size_t i = 0; i < lb; ++i) host[l][i] = pattern(l, i, 0);
    must(cudaMemcpyAsync(layers[l], host[l].data(), lb, cudaMemcpyHostToDevice, s), "fill");
  }
  must(cudaEventRecord(ev.get(), s), "record");
  must(cudaStreamSynchronize(s), "sync");  // pageable source: make sure before the child reads
  must(cudaStreamDestroy(s), "stream destroy");

  const std::string desc_hex = to_hex(d.serialize());
  const std::string ev_hex = to_hex(std::as_bytes(std::span(ev.handle())));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const char* argv[] = {"kvtier_test_cuda", "--ipc-child", desc_hex.c_str(), ev_hex.c_str(), nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    std::_Exit(126);
  }
  CHECK(pid > 0);
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (code == 77) {
    std::printf("SKIPPED (IPC): the child could not open the region (message above)\n");
    return;
  }
  CHECK_MSG(code == 0, "the IPC child exited with " + std::to_string(code));
  // The child's writes are visible here: blocks 5 and 9 hold its pattern, the rest ours.
  for (std::uint32_t l = 0; l < 3; ++l) {
    std::vector<std::byte> now(lb);
    must(cudaMemcpy(now.data(), layers[l], lb, cudaMemcpyDeviceToHost), "read back");
    bool ok = true;
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::uint32_t b = 0; b < ipc_layout.num_blocks; ++b) {
        const bool written = b == ipc_write_ids[0] || b == ipc_write_ids[1];
        for (std::size_t i = 0; i < ipc_layout.segment_bytes(); ++i) {
          const std::size_t at = ipc_layout.offset_in_layer(p, b) + i;
          ok = ok && now[at] == pattern(l, at, written ? 99 : 0);
        }
      }
    CHECK_MSG(ok, "layer " + std::to_string(l) + " after the child's scatter");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool require_device = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--ipc-child" && i + 2 < argc) return ipc_child(argv[i + 1], argv[i + 2]);
    if (a == "--require-device") require_device = true;
  }
  const kc::device_probe probe = kc::probe_devices();

  test_error_category();
  test_validation_matches_cpu(probe.usable());
  test_host_replay();
  test_descriptor_wire_format();
  test_registration_plan();

  if (!probe.usable()) {
    std::printf("%d host-side checks, %d failed\n", checks, failures);
    if (failures) return 1;
    const std::string why = probe.error ? probe.error.message() : std::string("0 devices");
    if (probe.no_device() && !require_device) {
      std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount: %s); the device checks did not run\n", why.c_str());
      return 77;
    }
    std::printf("FAILED: no usable CUDA device (cudaGetDeviceCount: %s)\n", why.c_str());
    return 1;
  }
  must(cudaSetDevice(0), "cudaSetDevice(0)");
  cudaDeviceProp prop{};
  must(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device 0 of %d: %s (sm_%d%d)\n", probe.count, prop.name, prop.major, prop.minor);

  test_kernels();
  test_copy_engine();
  test_pinned();
  test_ipc();

  std::printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
