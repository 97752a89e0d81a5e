#include <kvtier/config.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <kvtier/core/model_id.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <vector>

using namespace kvtier;

namespace {

constexpr std::byte sentinel{0xee};

/// Fills bytes with a cheap pseudo-random sequence (splitmix64): distinct bytes everywhere,
/// so a byte copied from or to the wrong place shows.
void fill_random(std::span<std::byte> bytes, std::uint64_t seed) {
  for (std::size_t i = 0; i < bytes.size(); i += 8) {
    std::uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(bytes.data() + i, &z, std::min<std::size_t>(8, bytes.size() - i));
  }
}

/// std::vector's allocator for 64-byte aligned storage.
template <class T>
struct aligned64_allocator {
  using value_type = T;
  aligned64_allocator() = default;
  template <class U>
  aligned64_allocator(const aligned64_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete (p, std::align_val_t{64}); }
  friend bool operator==(const aligned64_allocator&, const aligned64_allocator&) = default;
};
using aligned_vector = std::vector<std::byte, aligned64_allocator<std::byte>>;

/// Bytes whose usable part starts `misalign` bytes after a 64-byte boundary (0 gives the
/// aligned destinations the side-by-side streaming path needs, anything else the one-run
/// path), with 64 guard bytes after it.
class offset_bytes {
 public:
  offset_bytes(std::size_t n, std::size_t misalign, std::byte fill = std::byte{0})
      : storage_(n + misalign + 64, fill), misalign_(misalign), size_(n) {}
  [[nodiscard]] std::byte* data() { return storage_.data() + misalign_; }
  [[nodiscard]] std::span<std::byte> span() { return {data(), size_}; }
  /// Every byte, the guard bytes around the usable part included.
  [[nodiscard]] const aligned_vector& all() const { return storage_; }
  [[nodiscard]] aligned_vector& all() { return storage_; }

 private:
  aligned_vector storage_;
  std::size_t misalign_;
  std::size_t size_;
};

/// An engine's paged KV cache in test memory: one allocation per layer (not contiguous,
/// 64-byte aligned or at an odd offset), or all layers in one allocation like a kv region
/// (at the layout's layer stride: back to back when dense).
class test_cache {
 public:
  test_cache(const paged_kv_layout& layout, std::uint64_t seed, bool contiguous, std::size_t misalign = 0)
      : layout_(layout) {
    const std::size_t lb = layout.layer_bytes();
    if (contiguous) {
      storage_.emplace_back(layout.total_bytes(), misalign);
      const std::size_t stride = layout.effective_strides().layer;
      for (std::uint32_t l = 0; l < layout.model.num_layers; ++l) layers_.push_back(storage_[0].data() + l * stride);
    } else {
      for (std::uint32_t l = 0; l < layout.model.num_layers; ++l) {
        storage_.emplace_back(lb, misalign);
        layers_.push_back(storage_.back().data());
      }
      std::reverse(storage_.begin(), storage_.end());  // pointers keep their targets
    }
    fill(seed);
  }

  void fill(std::uint64_t seed) {
    for (auto& s : storage_) fill_random(s.all(), seed++ * 1000003);
  }
  void fill_with(std::byte v) {
    for (auto& s : storage_) std::fill(s.all().begin(), s.all().end(), v);
  }

  [[nodiscard]] paged_kv_view view() const { return {layout_, layers_}; }
  [[nodiscard]] const paged_kv_layout& layout() const { return layout_; }
  [[nodiscard]] std::byte* layer(std::uint32_t l) const { return layers_[l]; }
  /// Every byte of the cache, padding included, for whole-state comparisons.
  [[nodiscard]] std::vector<std::byte> snapshot() const {
    std::vector<std::byte> all;
    for (const auto& s : storage_) all.insert(all.end(), s.all().begin(), s.all().end());
    return all;
  }

 private:
  paged_kv_layout layout_;
  std::vector<offset_bytes> storage_;
  std::vector<std::byte*> layers_;
};

/// Where the row of (plane, block, token, head) starts in a layer's memory, in bytes from the
/// layer's base.
using row_address = std::function<std::size_t(std::uint32_t plane, std::uint32_t block, std::uint32_t token,
                                              std::uint32_t head)>;

/// The layout's own answer (offset_in_layer), for the dense layouts.
row_address layout_address(const paged_kv_layout& L) {
  return [L](std::uint32_t p, std::uint32_t b, std::uint32_t t, std::uint32_t h) {
    return L.offset_in_layer(p, b, t, h);
  };
}

/// The trivially correct gather (Gather) or scatter: byte by byte, one (token, head) row at a
/// time, the object side from object_offset (which knows NHD and HND) and the paged side from
/// `address` (offset_in_layer, or the tensor's own description: strided_tensor).
template <bool Gather, class ObjectByte>
void reference_copy(const test_cache& cache, const std::vector<std::uint32_t>& ids, const chunk_layout& chunk,
                    ObjectByte* object, std::uint32_t skip, const row_address& address) {
  const auto& L = cache.layout();
  const std::size_t row = L.head_row_bytes();
  for (std::uint32_t l = 0; l < L.model.num_layers; ++l)
    for (std::uint32_t p = 0; p < L.model.planes(); ++p)
      for (std::uint32_t i = 0; i < ids.size(); ++i)
        for (std::uint32_t t = 0; t < L.block_size; ++t) {
          const std::uint32_t token = i * L.block_size + t;
          if (token < skip) continue;
          for (std::uint32_t h = 0; h < L.model.num_kv_heads; ++h) {
            ObjectByte* obj = object + L.object_offset(chunk, l, p, token, h);
            std::byte* paged = cache.layer(l) + address(p, ids[i], t, h);
            if constexpr (Gather)
              std::copy(paged, paged + row, obj);
            else
              std::copy(obj, obj + row, paged);
          }
        }
}

enum class id_order { consecutive, reversed, shuffled, repeated };

std::vector<std::uint32_t> make_ids(std::size_t n, std::uint32_t num_blocks, id_order order, std::uint64_t seed) {
  std::vector<std::uint32_t> all(num_blocks);
  std::iota(all.begin(), all.end(), 0u);
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> ids;
  switch (order) {
    case id_order::consecutive: {  // one run starting at a random block
      const std::uint32_t start = static_cast<std::uint32_t>(rng() % (num_blocks - n + 1));
      ids.assign(all.begin() + start, all.begin() + start + static_cast<std::ptrdiff_t>(n));
      break;
    }
    case id_order::reversed:
      ids.assign(all.rbegin(), all.rbegin() + static_cast<std::ptrdiff_t>(n));
      break;
    case id_order::shuffled:  // non-contiguous, with the odd accidental run
      std::shuffle(all.begin(), all.end(), rng);
      ids.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n));
      break;
    case id_order::repeated:  // few distinct blocks, each used several times
      for (std::size_t i = 0; i < n; ++i)
        ids.push_back(static_cast<std::uint32_t>(rng() % std::min<std::uint32_t>(3, num_blocks)));
      break;
  }
  return ids;
}

/// The dimensions of an engine's KV tensor, as its memory holds them.
enum class dim_role { layer, plane, block, token, head, dim };

/// One dimension of a tensor in memory order (outermost first): its role and the elements
/// of padding its stride has beyond the dimensions inside it (a gap after each entry).
struct memory_dim {
  dim_role role;
  std::uint32_t pad = 0;
};

/// A tensor as vLLM allocates it: the dimensions in memory order, contiguous but for the
/// padding. Computes, independently of kvtier, each row's address and the kv_strides that
/// describe it. Without a layer dimension it is one layer's tensor (the layers then lie
/// layer_bytes() rounded up to 64 bytes apart, in a region).
struct strided_tensor {
  std::vector<memory_dim> dims;

  /// Elements between consecutive entries of each role (0: not a dimension of the tensor).
  [[nodiscard]] std::array<std::uint64_t, 6> element_strides(const paged_kv_layout& L) const {
    std::array<std::uint64_t, 6> st{};
    std::uint64_t inner = 1;
    for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
      st[static_cast<std::size_t>(it->role)] = inner + it->pad;
      inner = (inner + it->pad) * size(L, it->role);
    }
    return st;
  }
  [[nodiscard]] static std::uint64_t size(const paged_kv_layout& L, dim_role r) {
    switch (r) {
      case dim_role::layer: return L.model.num_layers;
      case dim_role::plane: return L.model.planes();
      case dim_role::block: return L.num_blocks;
      case dim_role::token: return L.block_size;
      case dim_role::head: return L.model.num_kv_heads;
      case dim_role::dim: return L.model.head_dim;
    }
    return 0;
  }
  [[nodiscard]] bool has(dim_role r) const {
    return std::any_of(dims.begin(), dims.end(), [r](const memory_dim& d) { return d.role == r; });
  }
  /// The strides in bytes that kvtier is told.
  [[nodiscard]] kv_strides strides(const paged_kv_layout& L) const {
    const auto st = element_strides(L);
    const std::uint64_t e = L.model.dtype_bytes();
    kv_strides s{st[0] * e, st[1] * e, st[2] * e, st[3] * e, st[4] * e};
    if (!has(dim_role::layer)) {  // one tensor per layer: a region puts them 64-aligned apart
      paged_kv_layout one = L;
      one.strides = s;
      one.strides.layer = 1;  // any non-zero value: layer_bytes() ignores it
      s.layer = (one.layer_bytes() + 63) / 64 * 64;
    }
    return s;
  }
  [[nodiscard]] row_address address(const paged_kv_layout& L) const {
    const auto st = element_strides(L);
    const std::uint64_t e = L.model.dtype_bytes();
    return [st, e](std::uint32_t p, std::uint32_t b, std::uint32_t t, std::uint32_t h) {
      return static_cast<std::size_t>((p * st[1] + b * st[2] + t * st[3] + h * st[4]) * e);
    };
  }
};

struct transfer_case {
  std::string name;
  model_shape model;
  std::uint32_t block_size;
  std::uint32_t blocks_per_chunk;
  std::uint32_t num_blocks;
  kv_layout_kind order = kv_layout_kind::nhd;
  /// Empty: the dense layout of `order`; else the engine's tensor, told as kv_strides.
  std::vector<memory_dim> memory{};

  [[nodiscard]] paged_kv_layout layout() const {
    paged_kv_layout L{model, block_size, num_blocks, order};
    if (!memory.empty()) L.strides = strided_tensor{memory}.strides(L);
    return L;
  }
  /// Where each row is, from the tensor's description (not from kvtier) when there is one.
  [[nodiscard]] row_address address() const {
    const paged_kv_layout L = layout();
    return memory.empty() ? layout_address(L) : strided_tensor{memory}.address(L);
  }
  /// Whether the layers must share one allocation (one tensor for all layers).
  [[nodiscard]] bool cross_layer() const { return strided_tensor{memory}.has(dim_role::layer); }
};

using R = dim_role;

std::vector<transfer_case> transfer_cases() {
  return {
      {"MHA, block size 1, one block", {3, 2, 4, dtype_kind::bf16, attention_kind::mha}, 1, 1, 5},
      {"MHA, block size 1, many blocks", {3, 2, 4, dtype_kind::bf16, attention_kind::mha}, 1, 37, 50},
      // Segments of one and of five 64-byte lines: copied side by side, but not in 256-byte steps.
      {"MHA, 64-byte segments", {3, 2, 16, dtype_kind::bf16, attention_kind::mha}, 1, 37, 50},
      {"MHA, 320-byte segments", {2, 2, 16, dtype_kind::bf16, attention_kind::mha}, 5, 7, 12},
      {"MHA, block size 16, one block", {4, 2, 8, dtype_kind::bf16, attention_kind::mha}, 16, 1, 4},
      {"MHA, block size 16, many blocks", {4, 2, 8, dtype_kind::bf16, attention_kind::mha}, 16, 16, 40},
      {"MHA, block size 64, fp32", {2, 1, 16, dtype_kind::fp32, attention_kind::mha}, 64, 3, 9},
      {"MHA, odd token bytes (fp8, 3 x 5)", {2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 16, 5, 11},
      {"MLA, block size 1", {2, 1, 10, dtype_kind::fp8_e4m3, attention_kind::mla}, 1, 9, 12},
      {"MLA, block size 16", {3, 1, 72, dtype_kind::bf16, attention_kind::mla}, 16, 4, 10},
      {"MLA, block size 64, one block", {2, 1, 36, dtype_kind::bf16, attention_kind::mla}, 64, 1, 3},
      // The 8B model's 32 KiB segments (2 layers only, to stay quick).
      {"MHA, 8B-like segments", {2, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 4, 6},
      // HND (vLLM's CPU backend, FlashInfer): head-major blocks.
      {"HND, block size 1", {3, 2, 4, dtype_kind::bf16, attention_kind::mha}, 1, 37, 50, kv_layout_kind::hnd},
      {"HND, one block", {4, 2, 8, dtype_kind::bf16, attention_kind::mha}, 16, 1, 4, kv_layout_kind::hnd},
      {"HND, many blocks", {4, 4, 8, dtype_kind::fp32, attention_kind::mha}, 16, 16, 40, kv_layout_kind::hnd},
      {"HND, one KV head", {2, 1, 16, dtype_kind::fp16, attention_kind::mha}, 8, 4, 9, kv_layout_kind::hnd},
      {"HND, fp8, 3 x 5", {2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 16, 5, 11, kv_layout_kind::hnd},
      {"HND, 8B-like segments", {2, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 4, 6, kv_layout_kind::hnd},
      // Explicit strides: the layouts vLLM's backends allocate (docs/integration.md, "vLLM").
      // The dense NHD tensor told as strides: the segment path, as without strides.
      {"strides: dense NHD", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9, kv_layout_kind::nhd,
       {{R::plane}, {R::block}, {R::token}, {R::head}, {R::dim}}},
      // FlashInfer's blocks-first (num_blocks, 2, N, H, D) and its HND twin: whole
      // segments, a block stride of two segments.
      {"strides: blocks-first NHD (FlashInfer)", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::nhd, {{R::block}, {R::plane}, {R::token}, {R::head}, {R::dim}}},
      {"strides: blocks-first HND (FlashInfer)", {3, 2, 8, dtype_kind::fp16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::hnd, {{R::block}, {R::plane}, {R::head}, {R::token}, {R::dim}}},
      // K|V packed in the last dim, NHD stride order: memory (num_blocks, N, H, 2 * D).
      {"strides: GPU packed NHD (B, N, H, 2D)", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::nhd, {{R::block}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      {"strides: GPU packed NHD, 8B-like", {2, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 2, 5,
       kv_layout_kind::nhd, {{R::block}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      // The same in HND stride order: memory (num_blocks, H, N, 2 * D).
      {"strides: GPU packed HND (B, H, N, 2D)", {2, 3, 8, dtype_kind::bf16, attention_kind::mha}, 4, 3, 8,
       kv_layout_kind::hnd, {{R::block}, {R::head}, {R::token}, {R::plane}, {R::dim}}},
      // vLLM's CPU backend: shape (B, H, N, 2D), memory (B, H, 2, N, D).
      {"strides: CPU packed (B, H, 2, N, D)", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::hnd, {{R::block}, {R::head}, {R::plane}, {R::token}, {R::dim}}},
      {"strides: CPU packed, one KV head", {2, 1, 16, dtype_kind::fp32, attention_kind::mha}, 8, 2, 6,
       kv_layout_kind::hnd, {{R::block}, {R::head}, {R::plane}, {R::token}, {R::dim}}},
      // fp8 (1-byte elements, odd widths), packed.
      {"strides: fp8 GPU packed NHD, 3 x 5", {2, 3, 5, dtype_kind::fp8_e4m3, attention_kind::mha}, 4, 3, 8,
       kv_layout_kind::nhd, {{R::block}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      {"strides: fp8 CPU packed, 3 x 5", {2, 3, 5, dtype_kind::fp8_e5m2, attention_kind::mha}, 4, 3, 8,
       kv_layout_kind::hnd, {{R::block}, {R::head}, {R::plane}, {R::token}, {R::dim}}},
      // MLA with padded blocks (vLLM's as_strided page padding): whole segments.
      {"strides: MLA, padded blocks", {3, 1, 24, dtype_kind::bf16, attention_kind::mla}, 4, 4, 9,
       kv_layout_kind::nhd, {{R::block, 40}, {R::token}, {R::dim}}},
      // Gaps inside blocks: padded tokens (NHD: rows of a token adjacent), padded heads (HND:
      // rows of a head adjacent), block size 1.
      {"strides: NHD, padded tokens", {2, 3, 4, dtype_kind::fp16, attention_kind::mha}, 4, 3, 8, kv_layout_kind::nhd,
       {{R::plane}, {R::block}, {R::token, 5}, {R::head}, {R::dim}}},
      {"strides: HND, padded heads", {2, 3, 4, dtype_kind::fp16, attention_kind::mha}, 4, 3, 8, kv_layout_kind::hnd,
       {{R::plane}, {R::block}, {R::head, 3}, {R::token}, {R::dim}}},
      {"strides: GPU packed NHD, block size 1", {2, 2, 8, dtype_kind::bf16, attention_kind::mha}, 1, 9, 20,
       kv_layout_kind::nhd, {{R::block}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      // One tensor for all layers (register_cross_layers_kv_cache): FlashAttention's NHD
      // (num_blocks, L, N, H, 2D) and HND (num_blocks, H, L, N, 2D).
      {"strides: cross-layer NHD (B, L, N, H, 2D)", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::nhd, {{R::block}, {R::layer}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      {"strides: cross-layer HND (B, H, L, N, 2D)", {3, 2, 8, dtype_kind::bf16, attention_kind::mha}, 4, 4, 9,
       kv_layout_kind::hnd, {{R::block}, {R::head}, {R::layer}, {R::token}, {R::plane}, {R::dim}}},
      {"strides: cross-layer MLA (B, L, N, D)", {3, 1, 24, dtype_kind::bf16, attention_kind::mla}, 4, 4, 9,
       kv_layout_kind::nhd, {{R::block}, {R::layer}, {R::token}, {R::dim}}},
  };
}

/// Skip values worth testing for a chunk: none, one token, mid-block, a block multiple,
/// one short of everything, everything.
std::vector<std::uint32_t> skips_for(std::uint32_t chunk_tokens, std::uint32_t block_size) {
  std::vector<std::uint32_t> s{0, 1, block_size / 2 + 1, block_size, chunk_tokens - 1, chunk_tokens};
  std::erase_if(s, [&](std::uint32_t v) { return v > chunk_tokens; });
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  return s;
}

const char* mode_name(transfer_write m) {
  switch (m) {
    case transfer_write::automatic:
      return "automatic";
    case transfer_write::cached:
      return "cached";
    case transfer_write::streaming:
      return "streaming";
  }
  return "?";
}

/// A gather and a scatter of one chunk of `tc`, through `gather` and `scatter` (called as
/// (view, ids, chunk, object, skip)), compared byte for byte with reference_copy: the whole
/// object and every byte of the cache, the guard bytes around them included.
template <class Gather, class Scatter>
void check_against_reference(const transfer_case& tc, id_order order, std::uint32_t skip, std::uint64_t seed,
                             bool contiguous, std::size_t misalign, Gather&& gather, Scatter&& scatter) {
  const paged_kv_layout layout = tc.layout();
  const chunk_layout chunk{tc.model, tc.block_size * tc.blocks_per_chunk};
  REQUIRE(layout.validation_error() == "");
  REQUIRE(layout.compatibility_error(chunk).empty());
  const auto ids = make_ids(tc.blocks_per_chunk, tc.num_blocks, order, seed);
  contiguous = contiguous || tc.cross_layer();
  const row_address address = tc.address();
  test_cache cache(layout, seed, contiguous, misalign);

  // Gather: the skipped prefix of the object keeps its sentinel.
  offset_bytes obj(chunk.object_bytes(), misalign, sentinel);
  offset_bytes expected(chunk.object_bytes(), misalign, sentinel);
  REQUIRE(gather(cache.view(), ids, chunk, obj.data(), skip) == std::error_code{});
  reference_copy<true>(cache, ids, chunk, expected.data(), skip, address);
  REQUIRE(obj.all() == expected.all());

  // Scatter into a cache filled with a sentinel (tokens that are skipped stay so), and into
  // a copy with the reference.
  test_cache dst(layout, 0, !contiguous || tc.cross_layer(), misalign);
  test_cache ref(layout, 0, !contiguous || tc.cross_layer(), misalign);
  dst.fill_with(sentinel);
  ref.fill_with(sentinel);
  // A distinct object, so repeated ids are not trivially the same bytes.
  offset_bytes src(chunk.object_bytes(), misalign);
  fill_random(src.span(), seed * 7);
  REQUIRE(scatter(dst.view(), ids, chunk, src.data(), skip) == std::error_code{});
  reference_copy<false>(ref, ids, chunk, static_cast<const std::byte*>(src.data()), skip, address);
  REQUIRE(dst.snapshot() == ref.snapshot());
}

const std::vector<id_order> all_orders{id_order::consecutive, id_order::reversed, id_order::shuffled,
                                       id_order::repeated};

// The three sweeps below check every combination in the main build. The sanitizer builds
// (-O0 and instrumented: these sweeps took 200 s there, the longest test of the ASan stage)
// check every 4th (the seed runs on across shapes, so every shape and write mode is met and
// the orders and skips rotate); the full sweep runs in the main suite.
constexpr std::uint64_t sweep_stride = (kvtier::config::asan_build || kvtier::config::tsan_build) ? 4 : 1;
bool in_sweep(std::uint64_t seed) { return seed % sweep_stride == 0; }

}  // namespace

TEST_CASE("gather and scatter match a byte-by-byte reference for every shape, id order, skip and write mode",
          "[core][kv_transfer]") {
  std::uint64_t seed = 1;
  for (const auto& tc : transfer_cases())
    for (id_order order : all_orders)
      for (std::uint32_t skip : skips_for(tc.block_size * tc.blocks_per_chunk, tc.block_size))
        for (transfer_write mode : {transfer_write::automatic, transfer_write::cached, transfer_write::streaming}) {
          ++seed;
          if (!in_sweep(seed)) continue;
          const bool contiguous = seed % 2 == 0;
          // 64-byte aligned layer and object bases (streaming: segments side by side), or not.
          const std::size_t misalign = seed % 3 == 0 ? 3 : 0;
          INFO(tc.name << ", order " << static_cast<int>(order) << ", skip " << skip << ", mode " << mode_name(mode)
                       << (contiguous ? ", contiguous layers" : ", separate layers") << ", misalign " << misalign);
          check_against_reference(
              tc, order, skip, seed, contiguous, misalign,
              [mode](const paged_kv_view& v, const auto& ids, const chunk_layout& c, std::byte* o, std::uint32_t k) {
                return gather_chunk(v, ids, c, o, k, {mode});
              },
              [mode](const paged_kv_view& v, const auto& ids, const chunk_layout& c, const std::byte* o,
                     std::uint32_t k) { return scatter_chunk(v, ids, c, o, k, {mode}); });
        }
}

TEST_CASE("every copy kernel, segments side by side or one run at a time, matches the reference",
          "[core][kv_transfer]") {
  // detail::copy_chunk with each plan the benchmark can pick: every kernel this CPU runs,
  // 0 (one copy per run) to max_copy_streams segments side by side (3 and 5 leave a last
  // group that is not full and groups that span two (layer, plane)s), with and without
  // prefetching; aligned bases (side by side) and unaligned ones (one run at a time). The
  // large 8B-like segments only with the plans the library uses, to stay quick.
  std::uint64_t seed = 1000;
  for (const auto& kernel : detail::available_copies())
    for (std::size_t streams : {0u, 1u, 3u, 4u, 5u, 8u})
      for (const auto& tc : transfer_cases())
        for (id_order order : {id_order::shuffled, id_order::repeated})
          if (streams == 0 || streams == detail::transfer_copy_streams || tc.model.head_dim < 128)
            for (std::uint32_t skip : {0u, tc.block_size / 2 + 1}) {
              ++seed;
              if (!in_sweep(seed)) continue;
              const detail::copy_plan plan{&kernel, streams, seed % 2 ? 0u : 8u};
              const std::size_t misalign = seed % 5 == 0 ? 7 : 0;
              INFO(kernel.name << ", streams " << streams << ", prefetch " << plan.prefetch_lines << ", " << tc.name
                               << ", order " << static_cast<int>(order) << ", skip " << skip << ", misalign "
                               << misalign);
              check_against_reference(
                  tc, order, skip, seed, seed % 3 == 0, misalign,
                  [&plan](const paged_kv_view& v, const auto& ids, const chunk_layout& c, std::byte* o,
                          std::uint32_t k) {
                    detail::copy_chunk<true>(v, ids, c, o, k, plan);
                    detail::store_fence();
                    return std::error_code{};
                  },
                  [&plan](const paged_kv_view& v, const auto& ids, const chunk_layout& c, const std::byte* o,
                          std::uint32_t k) {
                    detail::copy_chunk<false>(v, ids, c, o, k, plan);
                    detail::store_fence();
                    return std::error_code{};
                  });
            }
}

TEST_CASE("a scatter layer by layer writes exactly what the whole-object scatter writes, one layer at a time",
          "[core][kv_transfer]") {
  std::uint64_t seed = 5000;
  for (const auto& tc : transfer_cases())
    for (id_order order : all_orders)
      for (std::uint32_t skip : skips_for(tc.block_size * tc.blocks_per_chunk, tc.block_size))
        for (transfer_write mode : {transfer_write::automatic, transfer_write::cached, transfer_write::streaming}) {
          ++seed;
          if (!in_sweep(seed)) continue;
          const bool contiguous = seed % 2 == 0;
          const std::size_t misalign = seed % 3 == 0 ? 5 : 0;
          INFO(tc.name << ", order " << static_cast<int>(order) << ", skip " << skip << ", mode " << mode_name(mode)
                       << ", misalign " << misalign);
          const paged_kv_layout layout = tc.layout();
          const chunk_layout chunk{tc.model, tc.block_size * tc.blocks_per_chunk};
          const auto ids = make_ids(tc.blocks_per_chunk, tc.num_blocks, order, seed);
          offset_bytes src(chunk.object_bytes(), misalign);
          fill_random(src.span(), seed * 13);
          test_cache whole(layout, 0, contiguous || tc.cross_layer(), misalign);
          test_cache layered(layout, 0, contiguous || tc.cross_layer(), misalign);
          whole.fill_with(sentinel);
          layered.fill_with(sentinel);
          REQUIRE_FALSE(scatter_chunk(whole.view(), ids, chunk, src.data(), skip, {mode}));
          // The last layer first: each call writes its own layer only, in any order. A
          // layer's bytes are its rows (the layers of one cross-layer tensor interleave).
          const std::uint32_t layers = tc.model.num_layers;
          const row_address address = tc.address();
          auto layer_rows = [&](const test_cache& c, std::uint32_t o) {
            std::vector<std::byte> v;
            for (std::uint32_t p = 0; p < tc.model.planes(); ++p)
              for (std::uint32_t b = 0; b < tc.num_blocks; ++b)
                for (std::uint32_t t = 0; t < tc.block_size; ++t)
                  for (std::uint32_t h = 0; h < tc.model.num_kv_heads; ++h) {
                    const std::byte* at = c.layer(o) + address(p, b, t, h);
                    v.insert(v.end(), at, at + layout.head_row_bytes());
                  }
            return v;
          };
          for (std::uint32_t k = 0; k < layers; ++k) {
            const std::uint32_t l = layers - 1 - k;
            std::vector<std::vector<std::byte>> before;
            for (std::uint32_t o = 0; o < layers; ++o) before.push_back(layer_rows(layered, o));
            REQUIRE_FALSE(scatter_chunk_layer(layered.view(), ids, chunk, src.data(), l, skip, {mode}));
            for (std::uint32_t o = 0; o < layers; ++o)
              if (o != l) REQUIRE(layer_rows(layered, o) == before[o]);
            // Layer l now holds what the whole-object scatter put there.
            REQUIRE(layer_rows(layered, l) == layer_rows(whole, l));
          }
          REQUIRE(layered.snapshot() == whole.snapshot());
        }
}

TEST_CASE("a layer scatter refuses a layer past the model's and every argument a scatter refuses",
          "[core][kv_transfer]") {
  const model_shape m{3, 2, 8, dtype_kind::bf16, attention_kind::mha};
  const paged_kv_layout layout{m, 4, 8};
  const chunk_layout chunk{m, 8};
  test_cache cache(layout, 9, true);
  const auto before = cache.snapshot();
  const std::vector<std::byte> object(chunk.object_bytes(), sentinel);
  const std::vector<std::uint32_t> ids{1, 2};
  CHECK(scatter_chunk_layer(cache.view(), ids, chunk, object.data(), 3) == transfer_errc::layer_out_of_range);
  const std::vector<std::uint32_t> bad{1, 8};
  CHECK(scatter_chunk_layer(cache.view(), bad, chunk, object.data(), 0) == transfer_errc::block_id_out_of_range);
  CHECK(scatter_chunk_layer(cache.view(), ids, chunk, object.data(), 0, 9) == transfer_errc::skip_out_of_range);
  CHECK(scatter_chunk_layer(cache.view(), ids, chunk, nullptr, 0) == transfer_errc::null_pointer);
  CHECK(cache.snapshot() == before);
  CHECK_FALSE(scatter_chunk_layer(cache.view(), ids, chunk, object.data(), 2));
  CHECK(cache.snapshot() != before);
}

TEST_CASE("a gather then a scatter into other blocks reproduces the chunk's KV byte for byte", "[core][kv_transfer]") {
  for (attention_kind kind : {attention_kind::mha, attention_kind::mla}) {
    const model_shape m = kind == attention_kind::mha
                              ? model_shape{5, 8, 64, dtype_kind::bf16, kind}    // 1 KiB per token-plane
                              : model_shape{8, 1, 576, dtype_kind::bf16, kind};  // DeepSeek's latent
    const paged_kv_layout layout{m, 16, 64};
    const chunk_layout chunk{m, 256};
    // 2.5 MiB (MHA) and 2.25 MiB (MLA) objects: above the threshold, so automatic mode
    // takes the streaming path where the CPU has one.
    REQUIRE(chunk.object_bytes() >= transfer_streaming_threshold_bytes);
    test_cache engine_a(layout, 11, true);
    test_cache engine_b(layout, 12, false);
    const auto ids_a = make_ids(16, 64, id_order::shuffled, 5);
    const auto ids_b = make_ids(16, 64, id_order::consecutive, 6);
    std::vector<std::byte> object(chunk.object_bytes());
    REQUIRE_FALSE(gather_chunk(engine_a.view(), ids_a, chunk, object.data()));
    REQUIRE_FALSE(scatter_chunk(engine_b.view(), ids_b, chunk, object.data()));
    const std::size_t seg = layout.segment_bytes();
    for (std::uint32_t l = 0; l < m.num_layers; ++l)
      for (std::uint32_t p = 0; p < m.planes(); ++p)
        for (std::size_t i = 0; i < 16; ++i)
          REQUIRE(std::memcmp(engine_a.layer(l) + layout.offset_in_layer(p, ids_a[i]),
                              engine_b.layer(l) + layout.offset_in_layer(p, ids_b[i]), seg) == 0);
  }
}

TEST_CASE("a scatter with skip_tokens leaves the engine's tokens before the skip untouched", "[core][kv_transfer]") {
  const model_shape m{2, 2, 8, dtype_kind::bf16, attention_kind::mha};
  const paged_kv_layout layout{m, 16, 8};
  const chunk_layout chunk{m, 64};
  test_cache cache(layout, 3, false);
  test_cache original(layout, 3, false);  // same seed: the same bytes
  const std::vector<std::uint32_t> ids{6, 1, 4, 3};
  const std::vector<std::byte> object(chunk.object_bytes(), sentinel);
  const std::uint32_t skip = 21;  // from token 5 of the second block (id 1) on
  REQUIRE_FALSE(scatter_chunk(cache.view(), ids, chunk, object.data(), skip));
  const std::size_t tpb = m.token_plane_bytes();
  std::size_t kept = 0, written = 0;
  for (std::uint32_t l = 0; l < m.num_layers; ++l)
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::uint32_t token = 0; token < 64; ++token) {
        const std::size_t off = layout.offset_in_layer(p, ids[token / 16], token % 16);
        const std::byte* at = cache.layer(l) + off;
        if (token < skip) {
          REQUIRE(std::memcmp(at, original.layer(l) + off, tpb) == 0);
          ++kept;
        } else {
          REQUIRE(std::all_of(at, at + tpb, [](std::byte b) { return b == sentinel; }));
          ++written;
        }
      }
  CHECK(kept == 2u * 2 * 21);
  CHECK(written == 2u * 2 * 43);
  // Blocks outside the chunk are untouched as well.
  for (std::uint32_t l = 0; l < m.num_layers; ++l)
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::uint32_t id : {0u, 2u, 5u, 7u})
        CHECK(std::memcmp(cache.layer(l) + layout.offset_in_layer(p, id),
                          original.layer(l) + layout.offset_in_layer(p, id), layout.segment_bytes()) == 0);
}

TEST_CASE("batched gather and scatter equal one call per chunk", "[core][kv_transfer]") {
  const model_shape m{3, 2, 16, dtype_kind::bf16, attention_kind::mha};
  const paged_kv_layout layout{m, 16, 48};
  const chunk_layout chunk{m, 64};
  test_cache cache(layout, 21, false);
  const std::vector<std::vector<std::uint32_t>> ids{make_ids(4, 48, id_order::shuffled, 1),
                                                    make_ids(4, 48, id_order::consecutive, 2),
                                                    make_ids(4, 48, id_order::reversed, 3)};
  const std::vector<std::uint32_t> skips{0, 17, 64};
  for (transfer_write mode : {transfer_write::automatic, transfer_write::cached, transfer_write::streaming}) {
    std::vector<std::vector<std::byte>> batched(3, std::vector<std::byte>(chunk.object_bytes(), sentinel));
    std::vector<std::vector<std::byte>> single = batched;
    std::vector<gather_item> items;
    for (std::size_t k = 0; k < 3; ++k) {
      items.push_back({ids[k], batched[k].data(), skips[k]});
      REQUIRE_FALSE(gather_chunk(cache.view(), ids[k], chunk, single[k].data(), skips[k], {mode}));
    }
    REQUIRE_FALSE(gather_chunks(cache.view(), chunk, items, {mode}));
    CHECK(batched == single);

    // Scatter the gathered objects into fresh caches, batched and one by one; later items
    // win where blocks repeat across items (ids[0] and ids[2] may share blocks).
    test_cache a(layout, 0, true), b(layout, 0, false);
    a.fill_with(sentinel);
    b.fill_with(sentinel);
    std::vector<scatter_item> sitems;
    for (std::size_t k = 0; k < 3; ++k) {
      sitems.push_back({ids[k], batched[k].data(), skips[k]});
      REQUIRE_FALSE(scatter_chunk(b.view(), ids[k], chunk, batched[k].data(), skips[k], {mode}));
    }
    REQUIRE_FALSE(scatter_chunks(a.view(), chunk, sitems, {mode}));
    const std::size_t lb = layout.layer_bytes();
    for (std::uint32_t l = 0; l < m.num_layers; ++l) REQUIRE(std::memcmp(a.layer(l), b.layer(l), lb) == 0);
  }
}

TEST_CASE("an empty batch succeeds and copies nothing", "[core][kv_transfer]") {
  const model_shape m{2, 1, 8, dtype_kind::bf16, attention_kind::mla};
  const paged_kv_layout layout{m, 16, 4};
  const chunk_layout chunk{m, 32};
  test_cache cache(layout, 1, true);
  const auto before = cache.snapshot();
  CHECK_FALSE(gather_chunks(cache.view(), chunk, std::span<const gather_item>{}));
  CHECK_FALSE(scatter_chunks(cache.view(), chunk, std::span<const scatter_item>{}));
  CHECK(cache.snapshot() == before);
}

TEST_CASE("every invalid argument is refused with its own code before anything is copied", "[core][kv_transfer]") {
  const model_shape m{2, 2, 8, dtype_kind::bf16, attention_kind::mha};
  const paged_kv_layout layout{m, 16, 8};
  const chunk_layout chunk{m, 32};
  test_cache cache(layout, 9, false);
  const auto cache_before = cache.snapshot();
  std::vector<std::byte> object(chunk.object_bytes(), sentinel);
  const auto object_before = object;
  const std::vector<std::uint32_t> good_ids{3, 5};

  struct bad_case {
    std::string what;
    transfer_errc expected;
    paged_kv_layout layout;
    chunk_layout chunk;
    std::vector<std::byte*> layers;
    std::vector<std::uint32_t> ids;
    bool null_object = false;
    std::uint32_t skip = 0;
  };
  const std::vector<std::byte*> good_layers(cache.view().layers.begin(), cache.view().layers.end());
  model_shape other = m;
  other.head_dim = 16;
  model_shape bad_model = m;
  bad_model.dtype = static_cast<dtype_kind>(200);
  const std::vector<bad_case> cases{
      {"num_blocks 0", transfer_errc::invalid_layout, {m, 16, 0}, chunk, good_layers, good_ids},
      {"block_size 0", transfer_errc::invalid_layout, {m, 0, 8}, chunk, good_layers, good_ids},
      {"chunk_tokens 0", transfer_errc::invalid_layout, layout, {m, 0}, good_layers, good_ids},
      {"dtype of 3 bytes", transfer_errc::invalid_layout, layout, {bad_model, 32}, good_layers, good_ids},
      {"other model", transfer_errc::layout_mismatch, layout, {other, 32}, good_layers, good_ids},
      {"chunk not a block multiple", transfer_errc::layout_mismatch, layout, {m, 40}, good_layers, {3, 5, 6}},
      {"one layer pointer short", transfer_errc::layer_count, layout, chunk, {good_layers[0]}, good_ids},
      {"one layer pointer too many",
       transfer_errc::layer_count,
       layout,
       chunk,
       {good_layers[0], good_layers[1], good_layers[1]},
       good_ids},
      {"null layer pointer", transfer_errc::null_pointer, layout, chunk, {good_layers[0], nullptr}, good_ids},
      {"null object", transfer_errc::null_pointer, layout, chunk, good_layers, good_ids, true},
      {"too few block ids", transfer_errc::block_count, layout, chunk, good_layers, {3}},
      {"too many block ids", transfer_errc::block_count, layout, chunk, good_layers, {3, 5, 6}},
      {"no block ids", transfer_errc::block_count, layout, chunk, good_layers, {}},
      {"block id == num_blocks", transfer_errc::block_id_out_of_range, layout, chunk, good_layers, {3, 8}},
      {"huge block id", transfer_errc::block_id_out_of_range, layout, chunk, good_layers, {0xffffffffu, 1}},
      {"skip beyond the chunk", transfer_errc::skip_out_of_range, layout, chunk, good_layers, good_ids, false, 33},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const paged_kv_view view{c.layout, c.layers};
    std::byte* obj = c.null_object ? nullptr : object.data();
    const std::error_code checked = check_transfer(view, c.ids, c.chunk, obj, c.skip);
    const std::error_code gathered = gather_chunk(view, c.ids, c.chunk, obj, c.skip);
    const std::error_code scattered = scatter_chunk(view, c.ids, c.chunk, obj, c.skip);
    const gather_item gi{c.ids, obj, c.skip};
    const scatter_item si{c.ids, obj, c.skip};
    const std::error_code gathered_batch = gather_chunks(view, c.chunk, std::span(&gi, 1));
    const std::error_code scattered_batch = scatter_chunks(view, c.chunk, std::span(&si, 1));
    for (const std::error_code& ec : {checked, gathered, scattered, gathered_batch, scattered_batch}) {
      CHECK(ec == c.expected);
      CHECK(ec == std::errc::invalid_argument);
      CHECK(ec.category() == transfer_category());
      CHECK(std::string(ec.category().name()) == "kvtier.transfer");
      CHECK_FALSE(ec.message().empty());
      CHECK(ec.message() != transfer_category().message(0));
    }
  }
  CHECK(cache.snapshot() == cache_before);
  CHECK(object == object_before);
}

TEST_CASE("a batch with one invalid item copies none of its items", "[core][kv_transfer]") {
  const model_shape m{2, 1, 8, dtype_kind::bf16, attention_kind::mla};
  const paged_kv_layout layout{m, 16, 8};
  const chunk_layout chunk{m, 32};
  test_cache cache(layout, 4, true);
  const auto cache_before = cache.snapshot();
  std::vector<std::byte> a(chunk.object_bytes(), sentinel), b(chunk.object_bytes(), sentinel);
  const std::vector<std::uint32_t> good{1, 2}, bad{1, 9};
  const std::vector<gather_item> gitems{{good, a.data(), 0}, {bad, b.data(), 0}};
  CHECK(gather_chunks(cache.view(), chunk, gitems) == transfer_errc::block_id_out_of_range);
  CHECK(std::all_of(a.begin(), a.end(), [](std::byte x) { return x == sentinel; }));
  const std::vector<scatter_item> sitems{{good, a.data(), 0}, {good, b.data(), 40}};
  CHECK(scatter_chunks(cache.view(), chunk, sitems) == transfer_errc::skip_out_of_range);
  CHECK(cache.snapshot() == cache_before);
}

TEST_CASE("transfer errors describe themselves and map to invalid_argument only", "[core][kv_transfer]") {
  for (int v = 1; v <= static_cast<int>(transfer_errc::layer_out_of_range); ++v) {
    const std::error_code ec = static_cast<transfer_errc>(v);
    CHECK(ec);
    CHECK(ec == std::errc::invalid_argument);
    CHECK(ec.message().find("unknown") == std::string::npos);
  }
  const std::error_code unknown{99, transfer_category()};
  CHECK(unknown != std::errc::invalid_argument);
  CHECK(unknown.message() == "unknown kv transfer error");
}

TEST_CASE("every copy function this CPU runs copies exactly n bytes at any alignment", "[core][kv_transfer]") {
  const auto copies = detail::available_copies();
  REQUIRE(copies.size() >= 1);
  CHECK(std::string(copies[0].name) == "memcpy");
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (std::size_t n : {511u, 512u, 513u, 4095u, 4096u, 4097u, 70001u}) sizes.push_back(n);
  std::mt19937_64 rng(77);
  std::vector<std::byte> src(70001 + 128), dst, expected;
  for (auto& b : src) b = static_cast<std::byte>(rng());
  for (const auto& c : copies) {
    INFO(c.name);
    std::size_t mismatches = 0;
    for (std::size_t n : sizes)
      for (std::size_t so : {0u, 1u, 31u, 32u})
        for (std::size_t d : {0u, 1u, 7u, 33u, 63u, 64u}) {
          dst.assign(n + 192, sentinel);  // 64 guard bytes before, 64 - d + 64 after
          expected = dst;
          std::memcpy(expected.data() + 64 + d, src.data() + so, n);
          c.copy(dst.data() + 64 + d, src.data() + so, n);
          detail::store_fence();
          if (dst != expected && mismatches++ == 0)
            FAIL_CHECK("n " << n << ", source offset " << so << ", destination offset " << d);
        }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("every kernel copies up to max_copy_streams runs side by side, a later run winning where two overlap",
          "[core][kv_transfer]") {
  std::mt19937_64 rng(78);
  for (const auto& k : detail::available_copies()) {
    INFO(k.name);
    for (std::size_t count = 1; count <= detail::max_copy_streams; ++count)
      for (std::size_t len : {0u, 64u, 128u, 192u, 256u, 320u, 704u, 4096u}) {
        INFO("count " << count << ", len " << len);
        // Runs 64-byte aligned in one destination, a 64-byte gap between them; sources at
        // odd offsets. With three or more runs, the last one writes over the first.
        const std::size_t pitch = len + 64;
        offset_bytes dst(count * pitch, 0, sentinel);
        offset_bytes src(count * pitch + 1, 0);
        fill_random(src.span(), count * 1000 + len);
        std::byte* d[detail::max_copy_streams];
        const std::byte* s[detail::max_copy_streams];
        for (std::size_t r = 0; r < count; ++r) d[r] = dst.data() + r * pitch, s[r] = src.data() + r * pitch + 1;
        if (count >= 3) d[count - 1] = d[0];
        aligned_vector expected = dst.all();
        for (std::size_t r = 0; r < count; ++r) std::memcpy(expected.data() + (d[r] - dst.data()), s[r], len);
        k.streams(d, s, count, len);
        detail::store_fence();
        CHECK(dst.all() == expected);
      }
  }
}

TEST_CASE("engines of one order gather byte-identical objects whatever their strides; NHD and HND differ",
          "[core][kv_transfer]") {
  // The same logical KV (a byte per (layer, plane, block, token, head, byte of the row)) in
  // tensors strided as vLLM's backends allocate them: every NHD engine gathers the same
  // object, every HND engine another one, and the order is in the model id, so an NHD and an
  // HND engine never exchange chunks while two NHD engines do.
  const model_shape m{2, 3, 8, dtype_kind::bf16, attention_kind::mha};
  const std::uint32_t bs = 4, blocks = 10, per_chunk = 4;
  const chunk_layout chunk{m, bs * per_chunk};
  struct engine {
    const char* name;
    kv_layout_kind order;
    std::vector<memory_dim> memory;
  };
  const std::vector<engine> engines{
      {"dense NHD", kv_layout_kind::nhd, {}},
      {"GPU packed NHD", kv_layout_kind::nhd, {{R::block}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      {"blocks-first NHD", kv_layout_kind::nhd, {{R::block}, {R::plane}, {R::token}, {R::head}, {R::dim}}},
      {"cross-layer NHD", kv_layout_kind::nhd, {{R::block}, {R::layer}, {R::token}, {R::head}, {R::plane}, {R::dim}}},
      {"dense HND", kv_layout_kind::hnd, {}},
      {"CPU packed HND", kv_layout_kind::hnd, {{R::block}, {R::head}, {R::plane}, {R::token}, {R::dim}}},
      {"GPU packed HND", kv_layout_kind::hnd, {{R::block}, {R::head}, {R::token}, {R::plane}, {R::dim}}},
  };
  auto value = [](std::uint32_t l, std::uint32_t p, std::uint32_t b, std::uint32_t t, std::uint32_t h,
                  std::size_t i) { return static_cast<std::byte>((l * 71 + p * 37 + b * 29 + t * 13 + h * 7 + i) * 151); };
  const std::vector<std::uint32_t> ids{7, 2, 3, 9};  // the chunk's blocks, the same in every engine
  std::vector<std::vector<std::byte>> objects;
  for (const engine& e : engines) {
    INFO(e.name);
    const transfer_case tc{e.name, m, bs, per_chunk, blocks, e.order, e.memory};
    const paged_kv_layout L = tc.layout();
    REQUIRE(L.validation_error() == "");
    test_cache cache(L, 1, true);
    const row_address address = tc.address();
    const std::size_t row = L.head_row_bytes();
    for (std::uint32_t l = 0; l < m.num_layers; ++l)
      for (std::uint32_t p = 0; p < 2; ++p)
        for (std::uint32_t b = 0; b < blocks; ++b)
          for (std::uint32_t t = 0; t < bs; ++t)
            for (std::uint32_t h = 0; h < m.num_kv_heads; ++h)
              for (std::size_t i = 0; i < row; ++i) cache.layer(l)[address(p, b, t, h) + i] = value(l, p, b, t, h, i);
    std::vector<std::byte> object(chunk.object_bytes());
    REQUIRE_FALSE(gather_chunk(cache.view(), ids, chunk, object.data()));
    objects.push_back(std::move(object));

    // The object scattered into other blocks of a fresh engine of this layout puts every
    // row where the engine's tensor has it.
    test_cache back(L, 2, true);
    const std::vector<std::uint32_t> dst{0, 5, 1, 8};
    REQUIRE_FALSE(scatter_chunk(back.view(), dst, chunk, objects.back().data()));
    for (std::uint32_t l = 0; l < m.num_layers; ++l)
      for (std::uint32_t p = 0; p < 2; ++p)
        for (std::uint32_t k = 0; k < per_chunk; ++k)
          for (std::uint32_t t = 0; t < bs; ++t)
            for (std::uint32_t h = 0; h < m.num_kv_heads; ++h)
              for (std::size_t i = 0; i < row; ++i)
                REQUIRE(back.layer(l)[address(p, dst[k], t, h) + i] == value(l, p, ids[k], t, h, i));
  }
  for (std::size_t i = 1; i < 4; ++i) CHECK(objects[i] == objects[0]);  // NHD: one object
  for (std::size_t i = 5; i < 7; ++i) CHECK(objects[i] == objects[4]);  // HND: another
  CHECK(objects[4] != objects[0]);
  CHECK(make_model_id("m", m, kv_layout_kind::nhd) != make_model_id("m", m, kv_layout_kind::hnd));
}

TEST_CASE("a layout with strides the rows overlap in is refused before anything is copied", "[core][kv_transfer]") {
  const model_shape m{2, 2, 8, dtype_kind::bf16, attention_kind::mha};
  paged_kv_layout layout{m, 4, 8};
  test_cache cache(layout, 3, true);
  const auto before = cache.snapshot();
  layout.strides = layout.dense_strides();
  layout.strides.token = 16;  // the rows of two tokens overlap (a row is 16 bytes, 2 heads)
  const paged_kv_view view{layout, cache.view().layers};
  const chunk_layout chunk{m, 8};
  std::vector<std::byte> object(chunk.object_bytes(), sentinel);
  const std::vector<std::uint32_t> ids{1, 2};
  CHECK(gather_chunk(view, ids, chunk, object.data()) == transfer_errc::invalid_layout);
  CHECK(scatter_chunk(view, ids, chunk, object.data()) == transfer_errc::invalid_layout);
  CHECK(scatter_chunk_layer(view, ids, chunk, object.data(), 1) == transfer_errc::invalid_layout);
  CHECK(cache.snapshot() == before);
  CHECK(std::all_of(object.begin(), object.end(), [](std::byte b) { return b == sentinel; }));
}
