#pragma once
// kv_transfer: the CPU copies between an engine's paged KV cache and contiguous chunk objects.
// Standard library only (the streaming stores use compiler builtins, no intrinsics header).
//
//   gather_chunk  / gather_chunks    paged KV -> chunk object(s)   (store: engine -> L1)
//   scatter_chunk / scatter_chunks   chunk object(s) -> paged KV   (retrieve: L1 -> engine)
//
// Layouts (core/kv_layout.hpp): the paged cache is one tensor per layer,
//   NHD [2][num_blocks][block_size][kv_heads][head_dim], HND [2][num_blocks][kv_heads]
//   [block_size][head_dim], MLA [num_blocks][block_size][latent],
// so one (layer, plane, block) is a contiguous "block segment" of block_size * token_plane
// bytes in every kind; a chunk object holds the chunk's segments back to back per (layer,
// plane) as the blocks hold them (NHD and MLA: [layer][plane][token][kv_heads * head_dim];
// HND: the same with each block's segment head-major). A chunk of chunk_tokens tokens is
// chunk_tokens / block_size blocks, named by block ids in chunk order. Every (layer, plane)
// of the object is therefore the concatenation of the chunk's block segments of that
// (layer, plane): the copy is num_layers * planes * blocks memcpys of one segment each
// (fewer where consecutive block ids let runs be merged), whatever the layout kind.
//
// skip_tokens: the first skip_tokens tokens of the chunk are neither read nor written, in
// either direction (any value in [0, chunk_tokens], not only block multiples). Scatter uses
// it so that tokens the engine already computed (a prefix hit that ends inside a chunk) are
// never overwritten; gather leaves those bytes of the object untouched. Inside the block
// where the skip ends, NHD and MLA skip one leading run of token rows; HND skips the leading
// rows of each head's run (kv_heads copies of (block_size - t) rows for that block alone).
//
// Errors: every function validates all its arguments before it copies a byte and returns a
// std::error_code: {} on success, else a transfer_errc (category "kvtier.transfer") that
// compares equal to std::errc::invalid_argument. Nothing throws and nothing allocates; a
// batch copies nothing when any of its items is invalid. Memory is not checked: the object
// must hold chunk.object_bytes() bytes, each layer pointer layout.layer_bytes() bytes, and
// the object must not overlap the paged cache. Calls share no state: concurrent gathers may
// read the same blocks; concurrent writes to the same bytes are the caller's data race.
//
// Speed (docs/performance.md, "Gather/scatter"): the copy is memory-bound, so what counts is
// how the memory is touched. Large transfers write with non-temporal (streaming) stores
// where the CPU has AVX-512 or AVX2 (checked once at run time, memcpy elsewhere): the
// destination of a multi-MiB chunk is cold and not read back by this core soon, and
// streaming saves the read-for-ownership of every destination line. A gather prefetches
// the start of the next block segment, whose address the hardware prefetcher cannot guess.
// Measured on the 2-vCPU dev VM with cold source and destination, against one glibc memcpy
// of the same bytes: gather 1.35-1.40x and scatter 1.41-1.46x with 32 KiB block segments
// (8B model shape), gather 1.19-1.25x and scatter 1.25-1.26x with 4 KiB segments (0.5B
// shape). A memcpy per segment reached 0.90-1.00x and 0.79-0.84x.
//
// CUDA (cuda/kv_transfer.cuh): the kernels keep these signatures and only append a
// `cudaStream_t stream` parameter:
//   gather_chunk(cache, block_ids, chunk, object, skip_tokens, options, stream)
//   gather_chunks(cache, chunk, items, options, stream)   (likewise for scatter)
// and map as follows. `cache.layers` then points to a device-resident table of the layer
// base pointers (uploaded once at registration: vLLM's per-layer tensors never move), so the
// kernel reads a layer's base without a host round trip; its null check happens at
// registration, the per-call checks (sizes, block ids, skip) stay on the host and return the
// same codes before anything is enqueued. `block_ids` stay host memory: the launcher packs
// them into the kernel's parameter block (or a pinned staging slot for large batches), so a
// caller never allocates device memory per call. `object` is a device-accessible pointer:
// a pinned L1 slot (zero-copy over PCIe) or device memory. One CTA copies one block segment
// with 16-byte vector accesses (grid = layers * planes * blocks, times items for a batch:
// one launch per batch); skip_tokens becomes the same per-segment byte offset as here.
// The copy is ordered on `stream` instead of being complete on return, and the fence that
// publishes streaming stores here becomes the stream's completion.

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>

// x86-64 with GCC or clang (not nvcc, whose front end does not know the x86 builtins):
// streaming stores with AVX-512 or AVX2, chosen at run time. Elsewhere: memcpy only.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__)
#define KVTIER_DETAIL_X86_STREAMING 1
#else
#define KVTIER_DETAIL_X86_STREAMING 0
#endif

namespace kvtier::inline KVTIER_ABI_TAG {

/// Why a gather or scatter refused to copy. Values are stable: append, never renumber.
enum class transfer_errc : int {
  invalid_layout = 1,     ///< the paged KV layout or the chunk layout fails its validation
  layout_mismatch,        ///< different models, or chunk_tokens is not a multiple of block_size
  layer_count,            ///< cache.layers.size() != num_layers
  null_pointer,           ///< a layer pointer or an object pointer is null
  block_count,            ///< block_ids.size() != chunk_tokens / block_size
  block_id_out_of_range,  ///< a block id >= num_blocks
  skip_out_of_range,      ///< skip_tokens > chunk_tokens
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
    }
    return "unknown kv transfer error";
  }
  /// Every transfer error is a malformed argument.
  [[nodiscard]] std::error_condition default_error_condition(int ev) const noexcept override {
    if (ev >= 1 && ev <= static_cast<int>(transfer_errc::skip_out_of_range))
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

}  // namespace kvtier::inline KVTIER_ABI_TAG

template <>
struct std::is_error_code_enum<kvtier::transfer_errc> : std::true_type {};

namespace kvtier::inline KVTIER_ABI_TAG {

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

/// Copies n bytes with plain stores.
inline void copy_cached(std::byte* dst, const std::byte* src, std::size_t n) noexcept {
  std::memcpy(dst, src, n);
}

#if KVTIER_DETAIL_X86_STREAMING

// GCC spells the streaming store as a builtin; clang has a generic one. The vector types
// are <immintrin.h>'s __m512i / __m256i (may_alias); loads go through memcpy, which both
// compilers turn into one unaligned vector load.
typedef long long v8di __attribute__((vector_size(64), may_alias));
typedef long long v4di __attribute__((vector_size(32), may_alias));

/// Bytes to copy with memcpy before dst reaches an Align boundary.
template <std::size_t Align>
[[nodiscard]] inline std::size_t head_bytes(const std::byte* dst, std::size_t n) noexcept {
  const std::size_t mis = reinterpret_cast<std::uintptr_t>(dst) & (Align - 1);
  const std::size_t head = mis ? Align - mis : 0;
  return head < n ? head : n;
}

/// One 64-byte line: an unaligned load, a streaming store to the 64-byte aligned dst.
__attribute__((target("avx512f"), always_inline)) inline void stream_line_avx512(std::byte* dst,
                                                                                const std::byte* src) noexcept {
  v8di v;
  std::memcpy(&v, src, sizeof v);
#if defined(__clang__)
  __builtin_nontemporal_store(v, reinterpret_cast<v8di*>(dst));
#else
  __builtin_ia32_movntdq512(reinterpret_cast<v8di*>(dst), v);
#endif
}

/// One 64-byte line as two 32-byte halves, stored back to back (the compiler otherwise
/// interleaves the halves of neighbouring lines, which keeps more write-combining buffers
/// partially filled: measured 10-15% slower).
__attribute__((target("avx2"), always_inline)) inline void stream_line_avx2(std::byte* dst,
                                                                           const std::byte* src) noexcept {
  v4di lo, hi;
  std::memcpy(&lo, src, sizeof lo);
  std::memcpy(&hi, src + 32, sizeof hi);
#if defined(__clang__)
  __builtin_nontemporal_store(lo, reinterpret_cast<v4di*>(dst));
  __builtin_nontemporal_store(hi, reinterpret_cast<v4di*>(dst + 32));
#else
  __builtin_ia32_movntdq256(reinterpret_cast<v4di*>(dst), lo);
  __builtin_ia32_movntdq256(reinterpret_cast<v4di*>(dst + 32), hi);
#endif
  __asm__ volatile("" ::: "memory");
}

/// Streaming copy with 64-byte stores, four lines per iteration. Head (up to the first
/// 64-byte boundary of dst) and tail (under one line) go through memcpy. The caller fences.
__attribute__((target("avx512f"))) inline void copy_streaming_avx512(std::byte* dst, const std::byte* src,
                                                                     std::size_t n) noexcept {
  const std::size_t head = head_bytes<64>(dst, n);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 256; dst += 256, src += 256, n -= 256) {
    stream_line_avx512(dst, src);
    stream_line_avx512(dst + 64, src + 64);
    stream_line_avx512(dst + 128, src + 128);
    stream_line_avx512(dst + 192, src + 192);
  }
  for (; n >= 64; dst += 64, src += 64, n -= 64) stream_line_avx512(dst, src);
  std::memcpy(dst, src, n);
}

/// The same with 32-byte stores, for CPUs with AVX2 but no AVX-512.
__attribute__((target("avx2"))) inline void copy_streaming_avx2(std::byte* dst, const std::byte* src,
                                                                std::size_t n) noexcept {
  const std::size_t head = head_bytes<64>(dst, n);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 256; dst += 256, src += 256, n -= 256) {
    stream_line_avx2(dst, src);
    stream_line_avx2(dst + 64, src + 64);
    stream_line_avx2(dst + 128, src + 128);
    stream_line_avx2(dst + 192, src + 192);
  }
  for (; n >= 64; dst += 64, src += 64, n -= 64) stream_line_avx2(dst, src);
  std::memcpy(dst, src, n);
}

/// Orders the streaming stores before anything this thread does next (a release that
/// publishes the destination must not overtake them).
inline void store_fence() noexcept { __builtin_ia32_sfence(); }

#else

inline void store_fence() noexcept {}

#endif

using copy_function = void (*)(std::byte*, const std::byte*, std::size_t) noexcept;

/// A copy function and its name, for tests and benchmarks.
struct named_copy {
  const char* name;
  copy_function copy;
};

/// Every copy function this build and CPU can run: "memcpy", then "streaming_avx512" and
/// "streaming_avx2" where the CPU has them (best first). Probed once: a function-local
/// static, so thread-safe, and one guard load per call afterwards.
[[nodiscard]] inline std::span<const named_copy> available_copies() noexcept {
  struct table {
    named_copy entries[3];
    std::size_t size = 0;
  };
  static const table t = [] () noexcept {
    table r{};
    r.entries[r.size++] = {"memcpy", &copy_cached};
#if KVTIER_DETAIL_X86_STREAMING
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) r.entries[r.size++] = {"streaming_avx512", &copy_streaming_avx512};
    if (__builtin_cpu_supports("avx2")) r.entries[r.size++] = {"streaming_avx2", &copy_streaming_avx2};
#endif
    return r;
  }();
  return {t.entries, t.size};
}

/// The best streaming copy this CPU has, or nullptr.
[[nodiscard]] inline copy_function streaming_copy() noexcept {
  const auto copies = available_copies();
  return copies.size() > 1 ? copies[1].copy : nullptr;
}

/// The copy function for a transfer of `bytes` bytes.
[[nodiscard]] inline copy_function select_copy(transfer_write mode, std::size_t bytes) noexcept {
  if (mode == transfer_write::cached || (mode == transfer_write::automatic && bytes < transfer_streaming_threshold_bytes))
    return &copy_cached;
  const copy_function s = streaming_copy();
  return s ? s : &copy_cached;
}

/// The checks common to every item: layouts, the layer pointer table.
[[nodiscard]] inline std::error_code validate_cache(const paged_kv_view& cache, const chunk_layout& chunk) noexcept {
  // validation_error() returns an empty std::string (no allocation) on success.
  if (!cache.layout.validation_error().empty() || !chunk.validation_error().empty())
    return transfer_errc::invalid_layout;
  if (!(chunk.model == cache.layout.model) || chunk.chunk_tokens % cache.layout.block_size != 0)
    return transfer_errc::layout_mismatch;
  if (cache.layers.size() != cache.layout.model.num_layers) return transfer_errc::layer_count;
  for (std::byte* p : cache.layers)
    if (p == nullptr) return transfer_errc::null_pointer;
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

/// Cache lines of the next block segment a gather prefetches before copying the current one:
/// the segments are scattered over the cache, and the hardware prefetcher needs a few misses
/// in each new page before it runs ahead. Measured with 4 KiB segments: none 1.0x memcpy,
/// 4-16 lines 1.25-1.35x, the whole segment (64 lines) 0.9x (docs/performance.md).
inline constexpr std::size_t gather_prefetch_lines = 8;

/// Copies one validated chunk. Gather: paged -> object; else object -> paged. ObjectByte is
/// std::byte for a gather (the object is written), const std::byte for a scatter. All index
/// math is hoisted out of the loops; runs of consecutive block ids are copied as one call (a
/// fresh engine hands out consecutive blocks); a gather prefetches the next run's start.
template <bool Gather, class ObjectByte>
inline void copy_chunk(const paged_kv_view& cache, std::span<const std::uint32_t> ids, const chunk_layout& chunk,
                       ObjectByte* object, std::uint32_t skip_tokens, copy_function copy,
                       std::size_t prefetch_lines = gather_prefetch_lines) noexcept {
  const paged_kv_layout& layout = cache.layout;
  const std::size_t nblocks = ids.size();
  const std::size_t seg = layout.segment_bytes();
  const std::size_t plane_stride = seg * layout.num_blocks;  // one plane of one layer's tensor
  const std::size_t slab = chunk.slab_bytes();                // one (layer, plane) of the object
  const std::uint32_t planes = layout.model.planes();
  const std::size_t first = skip_tokens / layout.block_size;  // first block with bytes to copy
  // Bytes of each run of the first block left alone (a skip that ends inside that block).
  const std::size_t first_offset = layout.run_offset(skip_tokens % layout.block_size);
  // HND splits such a first block into one run per head, copied on their own.
  const std::uint32_t runs = layout.segment_runs();
  const std::size_t run = layout.run_bytes();
  const bool split_first = first_offset != 0 && runs > 1;
  if (first >= nblocks) return;  // the whole chunk is skipped

  // Never more lines than one segment has.
  const std::size_t lines = prefetch_lines < (seg + 63) / 64 ? prefetch_lines : (seg + 63) / 64;
  const std::size_t num_layers = cache.layers.size();

  ObjectByte* obj_slab = object;
  for (std::size_t l = 0; l < num_layers; ++l) {
    std::byte* paged_plane = cache.layers[l];
    for (std::uint32_t p = 0; p < planes; ++p, paged_plane += plane_stride, obj_slab += slab) {
      std::size_t i = first;
      std::size_t offset = first_offset;
      if (split_first) {
        std::byte* paged = paged_plane + ids[first] * seg + first_offset;
        ObjectByte* obj = obj_slab + first * seg + first_offset;
        for (std::uint32_t r = 0; r < runs; ++r, paged += run, obj += run) {
          if constexpr (Gather)
            copy(obj, paged, run - first_offset);
          else
            copy(paged, obj, run - first_offset);
        }
        ++i;
        offset = 0;
      }
      while (i < nblocks) {
        std::size_t j = i + 1;
        while (j < nblocks && ids[j] == ids[j - 1] + 1) ++j;
        if constexpr (Gather) {
          // The source of the next run: the next block of this plane, else the first block
          // of the next plane (of this layer or the next one).
          const std::byte* next = nullptr;
          if (j < nblocks)
            next = paged_plane + ids[j] * seg;
          else if (p + 1 < planes)
            next = paged_plane + plane_stride + ids[first] * seg + first_offset;
          else if (l + 1 < num_layers)
            next = cache.layers[l + 1] + ids[first] * seg + first_offset;
          if (next != nullptr)
            for (std::size_t k = 0; k < lines; ++k) prefetch_read(next + 64 * k);
        }
        std::byte* paged = paged_plane + ids[i] * seg + offset;
        ObjectByte* obj = obj_slab + i * seg + offset;
        const std::size_t len = (j - i) * seg - offset;
        if constexpr (Gather)
          copy(obj, paged, len);
        else
          copy(paged, obj, len);
        i = j;
        offset = 0;
      }
    }
  }
}

}  // namespace detail

/// Checks a gather or scatter of one chunk without copying: the codes gather_chunk and
/// scatter_chunk would return. A server can call it when a request arrives.
[[nodiscard]] inline std::error_code check_transfer(const paged_kv_view& cache,
                                                    std::span<const std::uint32_t> block_ids,
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
  if (auto ec = check_transfer(cache, block_ids, chunk, object, skip_tokens)) return ec;
  detail::copy_chunk<true>(cache, block_ids, chunk, object, skip_tokens,
                           detail::select_copy(options.write, detail::item_bytes(chunk, skip_tokens)));
  detail::store_fence();
  return {};
}

/// Copies `object` into the blocks `block_ids` (chunk order) of the paged cache, but its
/// first skip_tokens tokens, whose bytes in the cache stay as they are. Repeated block ids
/// are allowed; the last occurrence wins. Complete on return.
[[nodiscard]] inline std::error_code scatter_chunk(const paged_kv_view& cache,
                                                   std::span<const std::uint32_t> block_ids,
                                                   const chunk_layout& chunk, const std::byte* object,
                                                   std::uint32_t skip_tokens = 0,
                                                   transfer_options options = {}) noexcept {
  if (auto ec = check_transfer(cache, block_ids, chunk, object, skip_tokens)) return ec;
  detail::copy_chunk<false>(cache, block_ids, chunk, object, skip_tokens,
                            detail::select_copy(options.write, detail::item_bytes(chunk, skip_tokens)));
  detail::store_fence();
  return {};
}

/// gather_chunk for several chunks of the same layout (one retrieve or store request): all
/// items are validated first, and none is copied when one is invalid.
[[nodiscard]] inline std::error_code gather_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                   std::span<const gather_item> items,
                                                   transfer_options options = {}) noexcept {
  if (auto ec = detail::validate_cache(cache, chunk)) return ec;
  std::size_t bytes = 0;
  for (const gather_item& it : items) {
    if (auto ec = detail::validate_item(cache.layout, chunk, it.block_ids, it.object, it.skip_tokens)) return ec;
    bytes += detail::item_bytes(chunk, it.skip_tokens);
  }
  const detail::copy_function copy = detail::select_copy(options.write, bytes);
  for (const gather_item& it : items)
    detail::copy_chunk<true>(cache, it.block_ids, chunk, it.object, it.skip_tokens, copy);
  detail::store_fence();
  return {};
}

/// scatter_chunk for several chunks of the same layout: all items are validated first, and
/// none is copied when one is invalid. Items are copied in order (a later item wins where two
/// name the same block).
[[nodiscard]] inline std::error_code scatter_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                    std::span<const scatter_item> items,
                                                    transfer_options options = {}) noexcept {
  if (auto ec = detail::validate_cache(cache, chunk)) return ec;
  std::size_t bytes = 0;
  for (const scatter_item& it : items) {
    if (auto ec = detail::validate_item(cache.layout, chunk, it.block_ids, it.object, it.skip_tokens)) return ec;
    bytes += detail::item_bytes(chunk, it.skip_tokens);
  }
  const detail::copy_function copy = detail::select_copy(options.write, bytes);
  for (const scatter_item& it : items)
    detail::copy_chunk<false>(cache, it.block_ids, chunk, it.object, it.skip_tokens, copy);
  detail::store_fence();
  return {};
}

}  // namespace kvtier::inline KVTIER_ABI_TAG

#undef KVTIER_DETAIL_X86_STREAMING
