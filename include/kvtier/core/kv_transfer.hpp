#pragma once
// kv_transfer: the CPU copies between an engine's paged KV cache and contiguous chunk objects:
// gather_chunk(s) (paged KV -> chunk objects, a store), scatter_chunk(s) and
// scatter_chunk_layer (chunk objects -> paged KV, a retrieve). Standard library only. The
// layouts: core/kv_layout.hpp and docs/integration.md, "Layout assumptions"; the two copy
// paths, skip_tokens, the error contract, the speed and the CUDA twins (cuda/kv_transfer.cuh):
// docs/integration.md, "The copy functions".

#include <kvtier/config.hpp>
#include <kvtier/core/detail/streaming_copy.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

/// Why a gather or scatter refused to copy. Values are stable: append, never renumber.
enum class transfer_errc : int {
  invalid_layout = 1,     ///< the paged KV layout or the chunk layout fails its validation
  layout_mismatch,        ///< different models, or chunk_tokens is not a multiple of block_size
  layer_count,            ///< cache.layers.size() != num_layers
  null_pointer,           ///< a layer pointer or an object pointer is null
  block_count,            ///< block_ids.size() != chunk_tokens / block_size
  block_id_out_of_range,  ///< a block id >= num_blocks
  skip_out_of_range,      ///< skip_tokens > chunk_tokens
  layer_out_of_range,     ///< a layer index >= num_layers
};

namespace detail {

class transfer_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "kvtier.transfer"; }
  [[nodiscard]] std::string message(int ev) const override {
    switch (static_cast<transfer_errc>(ev)) {
      case transfer_errc::invalid_layout: return "invalid paged KV or chunk layout";
      case transfer_errc::layout_mismatch:
        return "the chunk layout does not fit the paged KV cache (other model, or chunk_tokens "
               "not a multiple of block_size)";
      case transfer_errc::layer_count: return "the number of layer pointers differs from num_layers";
      case transfer_errc::null_pointer: return "a layer or object pointer is null";
      case transfer_errc::block_count: return "the number of block ids differs from chunk_tokens / block_size";
      case transfer_errc::block_id_out_of_range: return "a block id is not below num_blocks";
      case transfer_errc::skip_out_of_range: return "skip_tokens exceeds chunk_tokens";
      case transfer_errc::layer_out_of_range: return "a layer index is not below num_layers";
    }
    return "unknown kv transfer error";
  }
  /// Every transfer error is a malformed argument.
  [[nodiscard]] std::error_condition default_error_condition(int ev) const noexcept override {
    if (ev >= 1 && ev <= static_cast<int>(transfer_errc::layer_out_of_range))
      return std::make_error_condition(std::errc::invalid_argument);
    return {ev, *this};
  }
};

}  // namespace detail

/// The category of transfer_errc; one instance per program.
[[nodiscard]] inline const std::error_category& transfer_category() noexcept {
  static const detail::transfer_category_impl category;
  return category;
}

[[nodiscard]] inline std::error_code make_error_code(transfer_errc e) noexcept {
  return {static_cast<int>(e), transfer_category()};
}

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

template <>
struct std::is_error_code_enum<kvtier::transfer_errc> : std::true_type {};

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

/// An engine's paged KV cache as the copies see it: the layout plus one base pointer per
/// layer (vLLM keeps one tensor per layer; a kvtier CPU kv region puts them back to back).
/// Gather only reads through the pointers.
struct paged_kv_view {
  paged_kv_layout layout;
  std::span<std::byte* const> layers;  ///< layout.model.num_layers pointers
};

/// How a transfer writes its destination.
enum class transfer_write : std::uint8_t {
  /// Streaming stores when the transfer (one call: all items of a batch) moves at least
  /// transfer_streaming_threshold_bytes and the CPU has AVX-512 or AVX2; memcpy otherwise.
  automatic = 0,
  cached,     ///< always memcpy: the destination is read again soon by this core
  streaming,  ///< streaming stores whenever the CPU has them, whatever the size
};

/// The size from which transfer_write::automatic writes around the cache. Below it the
/// destination fits in one core's L2 (2 MiB on the dev VM) and may be read back from there:
/// a hot 1 MiB copy ran at 18.8 GB/s with memcpy and 16.5 GB/s streaming; from 4 MiB on,
/// streaming wins even hot (10.3 vs 9.2 GB/s), and cold 3-32 MiB chunks gain 25-45%.
inline constexpr std::size_t transfer_streaming_threshold_bytes = std::size_t{2} << 20;

/// Knobs of one transfer call. The CUDA kernels take the same struct and ignore `write`.
struct transfer_options {
  transfer_write write = transfer_write::automatic;
};

/// One chunk of a batched gather: its block ids in chunk order and the object to fill.
struct gather_item {
  std::span<const std::uint32_t> block_ids;
  std::byte* object = nullptr;      ///< chunk.object_bytes() bytes
  std::uint32_t skip_tokens = 0;  ///< leading tokens neither read nor written
};

/// One chunk of a batched scatter: its block ids in chunk order and the object to copy out.
struct scatter_item {
  std::span<const std::uint32_t> block_ids;
  const std::byte* object = nullptr;  ///< chunk.object_bytes() bytes
  std::uint32_t skip_tokens = 0;    ///< leading tokens neither read nor written
};

namespace detail {

/// The kernel for a transfer of `bytes` bytes.
[[nodiscard]] inline const copy_kernel& select_copy(transfer_write mode, std::size_t bytes) noexcept {
  if (mode == transfer_write::cached || (mode == transfer_write::automatic && bytes < transfer_streaming_threshold_bytes))
    return cached_copy();
  const copy_kernel* s = streaming_copy();
  return s ? *s : cached_copy();
}

/// The layer pointers of a host view, as the checks below ask about them: how many, and
/// whether one is null. cuda::layer_table_view (cuda/kv_transfer.cuh) answers the same two
/// questions for its device table, as hidden friends found by argument-dependent lookup.
[[nodiscard]] inline std::size_t layer_pointer_count(std::span<std::byte* const> layers) noexcept {
  return layers.size();
}
[[nodiscard]] inline bool has_null_layer(std::span<std::byte* const> layers) noexcept {
  return std::find(layers.begin(), layers.end(), nullptr) != layers.end();
}

/// A view of a paged KV cache the checks can read: its layout, and layer pointers they can
/// count and test for null. paged_kv_view (host pointers) and cuda::paged_kv_view (a device
/// table of them, cuda/kv_transfer.cuh): both paths check their arguments with the same code.
template <class View>
concept checkable_kv_view = requires(const View& v) {
  { v.layout } -> std::convertible_to<const paged_kv_layout&>;
  { layer_pointer_count(v.layers) } -> std::convertible_to<std::size_t>;
  { has_null_layer(v.layers) } -> std::convertible_to<bool>;
};

/// The checks common to every item: layouts, the layer pointer table.
template <checkable_kv_view View>
[[nodiscard]] std::error_code validate_cache(const View& cache, const chunk_layout& chunk) noexcept {
  // validation_error() returns an empty std::string (no allocation) on success.
  if (!cache.layout.validation_error().empty() || !chunk.validation_error().empty())
    return transfer_errc::invalid_layout;
  if (!(chunk.model == cache.layout.model) || chunk.chunk_tokens % cache.layout.block_size != 0)
    return transfer_errc::layout_mismatch;
  if (layer_pointer_count(cache.layers) != cache.layout.model.num_layers) return transfer_errc::layer_count;
  if (has_null_layer(cache.layers)) return transfer_errc::null_pointer;
  return {};
}

/// The checks of one item, after validate_cache succeeded.
[[nodiscard]] inline std::error_code validate_item(const paged_kv_layout& layout, const chunk_layout& chunk,
                                                   std::span<const std::uint32_t> block_ids,
                                                   const std::byte* object, std::uint32_t skip_tokens) noexcept {
  if (object == nullptr) return transfer_errc::null_pointer;
  if (block_ids.size() != chunk.chunk_tokens / layout.block_size) return transfer_errc::block_count;
  if (skip_tokens > chunk.chunk_tokens) return transfer_errc::skip_out_of_range;
  for (std::uint32_t id : block_ids)
    if (id >= layout.num_blocks) return transfer_errc::block_id_out_of_range;
  return {};
}

/// The checks of a batch (Item: gather_item or scatter_item), all before anything is copied:
/// validate_cache, then validate_item of each item in order.
template <checkable_kv_view View, class Item>
[[nodiscard]] std::error_code validate_batch(const View& cache, const chunk_layout& chunk,
                                             std::span<const Item> items) noexcept {
  if (auto ec = validate_cache(cache, chunk)) return ec;
  for (const Item& it : items)
    if (auto ec = validate_item(cache.layout, chunk, it.block_ids, it.object, it.skip_tokens)) return ec;
  return {};
}

/// Bytes one item moves.
[[nodiscard]] inline std::size_t item_bytes(const chunk_layout& chunk, std::uint32_t skip_tokens) noexcept {
  return std::size_t{chunk.chunk_tokens - skip_tokens} * chunk.model.token_plane_bytes() * chunk.model.planes() *
         chunk.model.num_layers;
}

/// Hints that `p` will be read soon (into all cache levels).
inline void prefetch_read([[maybe_unused]] const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#endif
}

/// Hints that the page of `p` will be written soon: a prefetch into the outer cache levels
/// only (prefetcht2), for its address translation more than for the line.
inline void prefetch_page([[maybe_unused]] const void* p) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 1);
#endif
}

/// Prefetches the first `lines` cache lines of a paged segment (or run) at `at`: a gather's
/// source (prefetch_read), a scatter's destination (prefetch_page).
template <bool Gather>
inline void prefetch_lines(const std::byte* at, std::size_t lines) noexcept {
  for (std::size_t j = 0; j < lines; ++j) {
    if constexpr (Gather)
      prefetch_read(at + 64 * j);
    else
      prefetch_page(at + 64 * j);
  }
}

/// Block segments a streaming transfer copies side by side (copy_kernel::streams). Measured
/// on the dev VM against a streaming copy of the same bytes in 8 contiguous parts side by
/// side (docs/performance.md), 32 KiB / 4 KiB segments: one at a time 0.86 / 0.63-0.76,
/// 4 side by side 0.91-1.01 / 0.76-0.92, 8 side by side 0.93-1.04 / 0.84-0.96; 16 no
/// better than 8.
inline constexpr std::size_t transfer_copy_streams = 8;

/// Cache lines at the start of each source segment of the next group that a gather
/// prefetches before copying the current group: each segment starts in a new page, where
/// the hardware prefetcher first needs a few misses. Worth 0.1-0.2 of the baseline with one
/// segment in flight at 4 KiB; with 8 side by side within the noise (docs/performance.md).
inline constexpr std::size_t gather_prefetch_lines = 2;

/// Cache lines at the start of each destination segment of the next group that a scatter
/// prefetches (prefetch_page): the streaming stores need the page's translation, and a store
/// waits for its page walk where a prefetch does not (docs/performance.md).
inline constexpr std::size_t scatter_prefetch_lines = 0;

/// How copy_chunk copies; the benchmark varies the tuning.
struct copy_plan {
  const copy_kernel* kernel;
  /// Segments side by side through kernel->streams (1..max_copy_streams), where every
  /// destination segment is 64-byte aligned and a multiple of 64 bytes long; 0: one copy
  /// per run of consecutive block ids through kernel->copy (what unaligned layouts get).
  std::size_t streams = transfer_copy_streams;
  /// Lines of each next paged segment (or run) prefetched: a gather's sources
  /// (prefetch_read), a scatter's destinations (prefetch_page).
  std::size_t prefetch_lines = gather_prefetch_lines;
};

/// The plan of a gather (Gather) or scatter of `bytes` bytes: memcpy copies one run at a
/// time (a memcpy per segment gains nothing from company), streaming kernels several
/// segments side by side.
template <bool Gather>
[[nodiscard]] inline copy_plan plan_for(transfer_write mode, std::size_t bytes) noexcept {
  const copy_kernel& k = select_copy(mode, bytes);
  return {&k, &k == &cached_copy() ? 0 : transfer_copy_streams,
          Gather ? gather_prefetch_lines : scatter_prefetch_lines};
}

/// The geometry of one chunk's copy, computed once per call.
template <class ObjectByte>
struct chunk_walk {
  std::span<std::byte* const> layers;
  std::span<const std::uint32_t> ids;
  ObjectByte* object;
  std::size_t seg;           ///< bytes of one block segment
  std::size_t plane_stride;  ///< from one plane of a layer's tensor to the next
  std::size_t block_stride;  ///< from one block of a plane to the next
  std::size_t slab;          ///< bytes of one (layer, plane) of the object
  std::uint32_t planes;
  std::size_t start;  ///< the first block copied whole

  /// Calls f(paged, object, bytes) for each run of consecutive block ids from `start` (one
  /// block per run unless the block stride is one segment), in chunk order per (layer,
  /// plane), and prefetch(next paged run) before each run.
  template <class F, class P>
  void for_each_run(F&& f, P&& prefetch) const noexcept {
    const std::size_t n = ids.size();
    ObjectByte* obj_slab = object;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::byte* paged_plane = layers[l];
      for (std::uint32_t p = 0; p < planes; ++p, paged_plane += plane_stride, obj_slab += slab) {
        for (std::size_t i = start; i < n;) {
          std::size_t j = i + 1;
          if (block_stride == seg)
            while (j < n && ids[j] == ids[j - 1] + 1) ++j;
          // The source of the next run: the next block of this plane, else the first block
          // of the next plane (of this layer or the next one).
          if (j < n)
            prefetch(paged_plane + ids[j] * block_stride);
          else if (p + 1 < planes)
            prefetch(paged_plane + plane_stride + ids[start] * block_stride);
          else if (l + 1 < layers.size())
            prefetch(layers[l + 1] + ids[start] * block_stride);
          f(paged_plane + ids[i] * block_stride, obj_slab + i * seg, (j - i) * seg);
          i = j;
        }
      }
    }
  }

  /// Where next_group continues: block i of (layer l, plane p), whose plane starts at
  /// paged_plane in the cache and at obj_slab in the object.
  struct cursor {
    std::size_t l = 0, i = 0;
    std::uint32_t p = 0;
    std::byte* paged_plane = nullptr;
    ObjectByte* obj_slab = nullptr;
  };

  /// Fills paged[] and obj[] with the next up to `width` whole segments from the cursor, in
  /// chunk order across (layer, plane) boundaries; returns how many (0: the chunk is done).
  std::size_t next_group(cursor& c, std::size_t width, std::byte** paged, ObjectByte** obj) const noexcept {
    std::size_t k = 0;
    for (; k < width && c.l < layers.size(); ++k) {
      paged[k] = c.paged_plane + ids[c.i] * block_stride;
      obj[k] = c.obj_slab + c.i * seg;
      if (++c.i < ids.size()) continue;
      c.i = start;
      c.obj_slab += slab;
      c.paged_plane += plane_stride;
      if (++c.p < planes) continue;
      c.p = 0;
      if (++c.l < layers.size()) c.paged_plane = layers[c.l];
    }
    return k;
  }
};

/// copy(paged, obj, n) moving n bytes in the direction of the transfer through `k`: paged ->
/// object for a gather (Gather), object -> paged for a scatter.
template <bool Gather, class ObjectByte>
[[nodiscard]] inline auto directed_copy(const copy_kernel& k) noexcept {
  return [&k](std::byte* paged, ObjectByte* obj, std::size_t n) noexcept {
    if constexpr (Gather)
      k.copy(obj, paged, n);
    else
      k.copy(paged, obj, n);
  };
}

/// Copies one validated chunk whose block segments are not contiguous in object order
/// (paged_kv_layout::segment_contiguous() is false): per (layer, plane, block of the chunk),
/// the rows in object order, one copy per run of rows adjacent on both sides. The object
/// side of a segment is `outer` runs of `inner` rows (NHD, MLA: tokens of heads; HND: heads
/// of tokens); a run is one copy where the paged stride of its inner dimension is one row,
/// else one copy per row. A skip that ends inside a block drops that block's leading token
/// rows (NHD, MLA: the first outer runs; HND: the first rows of each head's run).
///
/// Where the planes lie inside a block (K|V packed per token, vLLM's CPU layout: plane
/// stride below block stride) a block's planes are copied one after the other, so the
/// block's memory comes from DRAM once (the second plane finds it in cache), and the first
/// lines of the next block are prefetched (random blocks: each starts with a miss the
/// hardware prefetcher cannot foresee). Measured on the dev VM against a streaming copy of
/// the same bytes (bench/gather_bench.cpp --explore=packed, 5 repeats, a machine shared
/// with other jobs): vLLM's CPU layout gathers at 0.7-1.0x and scatters at 0.8-1.4x (a
/// head's rows are one copy); K|V packed per (token, head) copies one row at a time:
/// 0.8-0.9x (gather) and 1.1x (scatter) with 256-byte rows (8B shape), but 0.3x and 0.6x
/// with 128-byte rows (0.5B shape; plane by plane over all blocks, before this reordering,
/// the gather ran at 0.2x). That layout is what vLLM's GPU backends allocate; on a GPU the
/// CUDA kernels copy it (cuda/kv_transfer.cuh). For
/// every (layer, plane, row), blocks are copied in chunk order: a scatter's later occurrence
/// of a block wins, as in copy_chunk.
template <bool Gather, class ObjectByte>
inline void copy_chunk_rows(const paged_kv_view& cache, std::span<const std::uint32_t> ids, const chunk_layout& chunk,
                            ObjectByte* object, std::uint32_t skip_tokens, const copy_plan& plan) noexcept {
  const paged_kv_layout& layout = cache.layout;
  const kv_strides s = layout.effective_strides();
  const std::size_t nblocks = ids.size();
  const std::size_t first = skip_tokens / layout.block_size;
  if (first >= nblocks) return;
  const std::uint32_t first_tokens = skip_tokens % layout.block_size;  // skipped in block `first`
  const std::size_t row = layout.head_row_bytes();
  const std::size_t seg = layout.segment_bytes();
  const std::size_t slab = chunk.slab_bytes();
  const std::uint32_t planes = layout.model.planes();
  const bool hnd = layout.kind() == kv_layout_kind::hnd;
  const std::uint32_t tokens = layout.block_size;
  const std::uint32_t heads = layout.model.num_kv_heads;
  const std::uint32_t inner = hnd ? tokens : heads;
  const std::size_t outer_paged = hnd ? s.head : s.token;
  const std::size_t inner_paged = hnd ? s.token : s.head;
  const std::size_t outer_obj = std::size_t{inner} * row;
  const bool inner_run = inner == 1 || inner_paged == row;  // a run's rows are adjacent both sides
  const bool planes_inside_blocks = planes > 1 && s.plane < s.block;
  const copy_kernel& k = *plan.kernel;
  const auto copy = directed_copy<Gather, ObjectByte>(k);
  // `count` rows from `paged` / `obj`, inner_paged / row apart.
  auto rows = [&](std::byte* paged, ObjectByte* obj, std::uint32_t count) noexcept {
    if (inner_run) {
      copy(paged, obj, count * row);
      return;
    }
    for (std::uint32_t r = 0; r < count; ++r) copy(paged + r * inner_paged, obj + r * row, row);
  };
  // Block i of the chunk, plane p, of the layer at `layer` (its object slab at `obj_slab`).
  auto block = [&](std::byte* layer, std::uint32_t p, ObjectByte* obj_slab, std::size_t i) noexcept {
    std::byte* paged = layer + p * s.plane + ids[i] * s.block;
    ObjectByte* obj = obj_slab + i * seg;
    const std::uint32_t t0 = i == first ? first_tokens : 0;
    if (hnd) {  // each head: tokens t0.. of its run
      for (std::uint32_t h = 0; h < heads; ++h)
        rows(paged + h * outer_paged + t0 * inner_paged, obj + h * outer_obj + t0 * row, tokens - t0);
    } else {  // each token from t0: its heads
      for (std::uint32_t t = t0; t < tokens; ++t) rows(paged + t * outer_paged, obj + t * outer_obj, heads);
    }
  };
  const std::size_t lines = plan.prefetch_lines;
  auto prefetch = [lines](const std::byte* at) noexcept { prefetch_lines<Gather>(at, lines); };
  ObjectByte* obj_layer = object;
  for (std::byte* layer : cache.layers) {
    if (planes_inside_blocks) {
      for (std::size_t i = first; i < nblocks; ++i) {
        if (i + 1 < nblocks) prefetch(layer + ids[i + 1] * s.block);
        for (std::uint32_t p = 0; p < planes; ++p) block(layer, p, obj_layer + p * slab, i);
      }
    } else {
      for (std::uint32_t p = 0; p < planes; ++p)
        for (std::size_t i = first; i < nblocks; ++i) {
          if (i + 1 < nblocks) prefetch(layer + p * s.plane + ids[i + 1] * s.block);
          block(layer, p, obj_layer + p * slab, i);
        }
    }
    obj_layer += planes * slab;
  }
}

/// Copies one validated chunk. Gather: paged -> object; else object -> paged. ObjectByte is
/// std::byte for a gather (the object is written), const std::byte for a scatter. Layouts
/// whose block segments are not contiguous in object order go to copy_chunk_rows.
///
/// First, where the skip ends inside a block, that block's part after the skip in every
/// (layer, plane) (NHD and MLA: one run of token rows; HND: one run per head), one copy
/// each. Then the blocks after it, whole: with a streaming plan, `streams` segments at a
/// time side by side, the first lines of the next group's paged segments prefetched; else
/// (or when a destination segment is not 64-byte aligned) one copy per run of consecutive
/// block ids, the next run's first lines prefetched. A scatter that names a block twice
/// leaves the later occurrence's bytes either way: copies follow chunk order, and segments
/// side by side store each 256 bytes in chunk order.
template <bool Gather, class ObjectByte>
inline void copy_chunk(const paged_kv_view& cache, std::span<const std::uint32_t> ids, const chunk_layout& chunk,
                       ObjectByte* object, std::uint32_t skip_tokens, const copy_plan& plan) noexcept {
  const paged_kv_layout& layout = cache.layout;
  if (!layout.segment_contiguous()) {
    copy_chunk_rows<Gather>(cache, ids, chunk, object, skip_tokens, plan);
    return;
  }
  const std::size_t nblocks = ids.size();
  const std::size_t first = skip_tokens / layout.block_size;  // first block with bytes to copy
  if (first >= nblocks) return;                               // the whole chunk is skipped
  // Bytes of each run of the first block left alone (a skip that ends inside that block).
  const std::size_t offset = layout.run_offset(skip_tokens % layout.block_size);
  const kv_strides strides = layout.effective_strides();
  const chunk_walk<ObjectByte> w{cache.layers,
                                 ids,
                                 object,
                                 layout.segment_bytes(),
                                 strides.plane,
                                 strides.block,
                                 chunk.slab_bytes(),
                                 layout.model.planes(),
                                 offset != 0 ? first + 1 : first};
  const copy_kernel& k = *plan.kernel;
  const auto copy = directed_copy<Gather, ObjectByte>(k);

  if (offset != 0) {
    const std::size_t run = layout.run_bytes();
    ObjectByte* obj_slab = object + first * w.seg + offset;
    for (std::byte* layer : cache.layers)
      for (std::uint32_t p = 0; p < w.planes; ++p, obj_slab += w.slab) {
        std::byte* paged = layer + p * w.plane_stride + ids[first] * w.block_stride + offset;
        for (std::uint32_t r = 0; r < layout.segment_runs(); ++r)
          copy(paged + r * run, obj_slab + r * run, run - offset);
      }
    if (w.start == nblocks) return;
  }

  // The prefetch of the first lines of a paged segment: never more lines than it has.
  const std::size_t lines = std::min(plan.prefetch_lines, (w.seg + 63) / 64);
  auto prefetch = [lines](const std::byte* at) noexcept { prefetch_lines<Gather>(at, lines); };
  bool aligned = w.seg % 64 == 0;
  if constexpr (Gather) {
    aligned = aligned && reinterpret_cast<std::uintptr_t>(object) % 64 == 0;
  } else {
    aligned = aligned && w.block_stride % 64 == 0 && w.plane_stride % 64 == 0;
    for (std::byte* layer : cache.layers) aligned = aligned && reinterpret_cast<std::uintptr_t>(layer) % 64 == 0;
  }
  if (plan.streams == 0 || !aligned) {
    w.for_each_run(copy, prefetch);
    return;
  }

  const std::size_t width = std::min(plan.streams, max_copy_streams);
  typename chunk_walk<ObjectByte>::cursor c{0, w.start, 0, cache.layers[0], object};
  std::byte* paged[2][max_copy_streams];
  ObjectByte* obj[2][max_copy_streams];
  std::size_t count = w.next_group(c, width, paged[0], obj[0]);
  for (std::size_t g = 0; count != 0; g ^= 1) {
    const std::size_t next = w.next_group(c, width, paged[g ^ 1], obj[g ^ 1]);
    for (std::size_t s = 0; s < next; ++s) prefetch(paged[g ^ 1][s]);
    if constexpr (Gather)
      k.streams(obj[g], paged[g], count, w.seg);
    else
      k.streams(paged[g], obj[g], count, w.seg);
    count = next;
  }
}

/// Validates every item, then copies them all (gather: Item = gather_item, else scatter).
template <bool Gather, class Item>
[[nodiscard]] inline std::error_code transfer_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                     std::span<const Item> items, transfer_options options) noexcept {
  if (auto ec = validate_batch(cache, chunk, items)) return ec;
  std::size_t bytes = 0;
  for (const Item& it : items) bytes += item_bytes(chunk, it.skip_tokens);
  const copy_plan plan = plan_for<Gather>(options.write, bytes);
  for (const Item& it : items) copy_chunk<Gather>(cache, it.block_ids, chunk, it.object, it.skip_tokens, plan);
  store_fence();
  return {};
}

}  // namespace detail

/// Checks a gather or scatter of one chunk without copying: the codes gather_chunk and
/// scatter_chunk would return. A server can call it when a request arrives. View:
/// paged_kv_view, or cuda::paged_kv_view (cuda/kv_transfer.cuh names this function
/// cuda::check_transfer): the GPU path checks on the host with this same code.
template <detail::checkable_kv_view View>
[[nodiscard]] std::error_code check_transfer(const View& cache, std::span<const std::uint32_t> block_ids,
                                             const chunk_layout& chunk, const std::byte* object,
                                             std::uint32_t skip_tokens = 0) noexcept {
  if (auto ec = detail::validate_cache(cache, chunk)) return ec;
  return detail::validate_item(cache.layout, chunk, block_ids, object, skip_tokens);
}

/// Copies the chunk made of `block_ids` (chunk order) from the paged cache into `object`,
/// but its first skip_tokens tokens. Complete on return (streaming stores are fenced).
[[nodiscard]] inline std::error_code gather_chunk(const paged_kv_view& cache, std::span<const std::uint32_t> block_ids,
                                                  const chunk_layout& chunk, std::byte* object,
                                                  std::uint32_t skip_tokens = 0, transfer_options options = {}) noexcept {
  const gather_item item{block_ids, object, skip_tokens};
  return detail::transfer_chunks<true>(cache, chunk, std::span(&item, 1), options);
}

/// Copies `object` into the blocks `block_ids` (chunk order) of the paged cache, but its
/// first skip_tokens tokens, whose bytes in the cache stay as they are. Repeated block ids
/// are allowed; the last occurrence wins. Complete on return.
[[nodiscard]] inline std::error_code scatter_chunk(const paged_kv_view& cache,
                                                   std::span<const std::uint32_t> block_ids,
                                                   const chunk_layout& chunk, const std::byte* object,
                                                   std::uint32_t skip_tokens = 0,
                                                   transfer_options options = {}) noexcept {
  const scatter_item item{block_ids, object, skip_tokens};
  return detail::transfer_chunks<false>(cache, chunk, std::span(&item, 1), options);
}

/// Copies layer `layer` of `object` (its (layer, plane) slabs: one contiguous slice of a
/// layer-major object) into that layer of the blocks `block_ids`, but its first skip_tokens
/// tokens: the bytes scatter_chunk writes into that layer, and nothing else. A layer-wise
/// retrieve calls it for layer 0 of every chunk, then layer 1, ..., so the engine can use
/// the first layers while the rest is copied. The kernels are scatter_chunk's, run on a
/// one-layer view; `options.write` chooses them by this layer's bytes (pass `streaming` to
/// choose by the whole transfer's). Complete on return.
[[nodiscard]] inline std::error_code scatter_chunk_layer(const paged_kv_view& cache,
                                                         std::span<const std::uint32_t> block_ids,
                                                         const chunk_layout& chunk, const std::byte* object,
                                                         std::uint32_t layer, std::uint32_t skip_tokens = 0,
                                                         transfer_options options = {}) noexcept {
  if (auto ec = check_transfer(cache, block_ids, chunk, object, skip_tokens)) return ec;
  if (layer >= cache.layout.model.num_layers) return transfer_errc::layer_out_of_range;
  paged_kv_layout one = cache.layout;
  one.model.num_layers = 1;
  chunk_layout one_chunk = chunk;
  one_chunk.model.num_layers = 1;
  const paged_kv_view view{one, cache.layers.subspan(layer, 1)};
  const detail::copy_plan plan = detail::plan_for<false>(options.write, detail::item_bytes(one_chunk, skip_tokens));
  detail::copy_chunk<false>(view, block_ids, one_chunk, object + chunk.offset(layer, 0), skip_tokens, plan);
  detail::store_fence();
  return {};
}

/// gather_chunk for several chunks of the same layout (one retrieve or store request): all
/// items are validated first, and none is copied when one is invalid.
[[nodiscard]] inline std::error_code gather_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                   std::span<const gather_item> items,
                                                   transfer_options options = {}) noexcept {
  return detail::transfer_chunks<true>(cache, chunk, items, options);
}

/// scatter_chunk for several chunks of the same layout: all items are validated first, and
/// none is copied when one is invalid. Items are copied in order (a later item wins where two
/// name the same block).
[[nodiscard]] inline std::error_code scatter_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                    std::span<const scatter_item> items,
                                                    transfer_options options = {}) noexcept {
  return detail::transfer_chunks<false>(cache, chunk, items, options);
}

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
