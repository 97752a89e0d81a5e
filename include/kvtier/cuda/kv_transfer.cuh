#pragma once
// cuda/kv_transfer: the GPU gather/scatter between an engine's paged KV cache (device memory)
// and contiguous chunk objects: core/kv_transfer.hpp's functions with a cudaStream_t appended,
// over a paged_kv_view whose table of layer bases lives on the device (layer_table). Compiled
// by nvcc; standard library and the CUDA runtime only. The contract, memory, kernel and
// launches: docs/integration.md, "The copy functions" ("On the GPU").

#include <kvtier/cuda/check.cuh>

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

/// A device-resident array of layer base pointers, as kernels see it. Never dereferenced on
/// the host.
struct layer_table_view {
  std::byte* const* device_data = nullptr;  ///< device memory: `size` pointers, none null
  std::uint32_t size = 0;
  /// The largest power of two <= 16 that divides every layer base address: the launcher
  /// picks its vector width from it.
  std::uint32_t alignment = 16;

  /// What the host-side checks (core/kv_transfer.hpp's detail::validate_cache) ask of the
  /// layer pointers: how many, and whether one is null. The entries were checked when the
  /// table was uploaded (layer_table::upload), so only an absent table is.
  friend std::size_t layer_pointer_count(const layer_table_view& t) noexcept { return t.size; }
  friend bool has_null_layer(const layer_table_view& t) noexcept { return t.device_data == nullptr; }
};

/// The device twin of kvtier::paged_kv_view: the layout plus the device table of layer bases.
struct paged_kv_view {
  paged_kv_layout layout;
  layer_table_view layers;
};

/// The owned device table of layer base pointers, on the device that was current at upload.
/// Move-only; frees the table on destruction.
class layer_table {
 public:
  layer_table() noexcept = default;

  /// Copies `layers` (device pointers, one per layer) into a new device array (a blocking
  /// cudaMemcpy: once per registration). Fails with transfer_errc::layer_count on an empty
  /// span, transfer_errc::null_pointer when a pointer is null, else a cuda_category() code.
  [[nodiscard]] static layer_table upload(std::span<std::byte* const> layers, std::error_code& ec) {
    ec.clear();
    layer_table t;
    if (layers.empty() || layers.size() > UINT32_MAX) {
      ec = transfer_errc::layer_count;
      return t;
    }
    std::uintptr_t bits = 16;
    for (std::byte* p : layers) {
      if (p == nullptr) {
        ec = transfer_errc::null_pointer;
        return t;
      }
      bits |= reinterpret_cast<std::uintptr_t>(p);
    }
    void* d = nullptr;
    if (const cudaError_t e = cudaMalloc(&d, layers.size() * sizeof(std::byte*)); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return t;
    }
    t.data_ = static_cast<std::byte**>(d);
    t.size_ = static_cast<std::uint32_t>(layers.size());
    t.alignment_ = static_cast<std::uint32_t>(bits & (~bits + 1));  // lowest set bit, <= 16
    if (const cudaError_t e = cudaMemcpy(d, layers.data(), layers.size() * sizeof(std::byte*), cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return layer_table{};  // t frees the table
    }
    return t;
  }

  layer_table(layer_table&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), alignment_(o.alignment_) {}
  layer_table& operator=(layer_table&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      alignment_ = o.alignment_;
    }
    return *this;
  }
  layer_table(const layer_table&) = delete;
  layer_table& operator=(const layer_table&) = delete;
  ~layer_table() { release(); }

  [[nodiscard]] layer_table_view view() const noexcept { return {data_, size_, alignment_}; }
  [[nodiscard]] bool empty() const noexcept { return data_ == nullptr; }

 private:
  void release() noexcept {
    if (data_) (void)cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
  }

  std::byte** data_ = nullptr;
  std::uint32_t size_ = 0;
  std::uint32_t alignment_ = 16;
};

namespace detail {

/// Threads per CTA: 256 threads * 16 bytes = one 4 KiB segment (0.5B model shape) per pass.
inline constexpr unsigned threads_per_block = 256;
/// Loads each thread issues before it stores.
inline constexpr unsigned copy_unroll = 4;
/// Capacity of one launch's parameter block (kept under the classic 4 KiB limit).
inline constexpr std::uint32_t launch_max_pieces = 64;
inline constexpr std::uint32_t launch_max_ids = 576;

/// A run of block positions [begin, end) of one item, copied by one launch.
struct piece_desc {
  std::byte* object = nullptr;      ///< the item's object (written by a gather, read by a scatter)
  std::uint32_t ids_base = 0;       ///< index in launch_params::ids of block position `begin`
  std::uint32_t begin = 0;          ///< first block position (chunk order)
  std::uint32_t end = 0;            ///< one past the last
  std::uint32_t begin_tokens = 0;   ///< tokens of block `begin` left alone (skip_tokens inside it)
};

struct launch_params {
  std::byte* const* layers = nullptr;  ///< device table
  std::uint64_t segment_bytes = 0;     ///< one (layer, plane, block) of the object
  std::uint64_t plane_stride = 0;      ///< from one plane of a layer's tensor to the next
  std::uint64_t block_stride = 0;      ///< from one block of a plane to the next
  std::uint64_t token_stride = 0;      ///< from one token of a block to the next (row path)
  std::uint64_t head_stride = 0;       ///< from one KV head of a token to the next (row path)
  std::uint64_t slab_bytes = 0;        ///< one (layer, plane) of the object
  std::uint64_t run_bytes = 0;         ///< one run of a segment (paged_kv_layout::run_bytes)
  std::uint64_t row_bytes = 0;         ///< one (token, head) row
  std::uint64_t token_bytes = 0;       ///< one token of the object's NHD segment (kv heads rows)
  std::uint32_t segment_runs = 1;      ///< runs per segment: 1 (NHD, MLA), kv heads (HND)
  std::uint32_t block_size = 0;
  std::uint32_t heads = 0;
  std::uint8_t contiguous = 1;         ///< paged_kv_layout::segment_contiguous(): whole segments
  std::uint8_t hnd = 0;                ///< the object's segments are head-major
  std::uint32_t planes = 0;
  std::uint32_t num_layers = 0;
  std::uint32_t max_piece_blocks = 0;  ///< grid extent per (piece, layer, plane)
  std::uint32_t num_pieces = 0;
  piece_desc pieces[launch_max_pieces];
  std::uint32_t ids[launch_max_ids];
};
static_assert(sizeof(launch_params) <= 4096, "the kernel parameter block must stay within 4 KiB");

/// Copies len bytes (a multiple of sizeof(Vec), both addresses Vec-aligned) with the CTA's
/// threads, copy_unroll loads in flight per thread.
template <class Vec>
__device__ __forceinline__ void copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t len) {
  Vec* d = reinterpret_cast<Vec*>(dst);
  const Vec* s = reinterpret_cast<const Vec*>(src);
  const std::uint64_t n = len / sizeof(Vec);
  constexpr std::uint64_t stride = threads_per_block;
  std::uint64_t i = threadIdx.x;
  for (; i + (copy_unroll - 1) * stride < n; i += copy_unroll * stride) {
    Vec v[copy_unroll];
#pragma unroll
    for (unsigned u = 0; u < copy_unroll; ++u) v[u] = s[i + u * stride];
#pragma unroll
    for (unsigned u = 0; u < copy_unroll; ++u) d[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) d[i] = s[i];
}

/// What one CTA copies, or nothing (active == false): `runs` runs of `rows` pieces of len
/// bytes each; piece (r, q) goes from src + r * src_stride + q * src_row_stride to dst + r *
/// dst_stride + q * dst_row_stride. A contiguous segment is one run of one piece (the whole
/// segment, or its tail after a skip) but for the first block of an HND piece whose skip ends
/// inside it: one run per head, each without its first skipped rows. The row path: tokens
/// (NHD, MLA) or heads (HND) as runs, rows inside them as pieces (one piece per run where
/// they are adjacent in the paged cache).
struct segment_copy {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  std::uint64_t len = 0;
  bool active = false;
  std::uint32_t runs = 1;
  std::uint64_t dst_stride = 0;
  std::uint64_t src_stride = 0;
  std::uint32_t rows = 1;
  std::uint64_t dst_row_stride = 0;
  std::uint64_t src_row_stride = 0;

  /// Calls f(dst, src, len) for each piece, runs outer (the tests' replay on the host).
  template <class F>
  void for_each_piece(F&& f) const {
    for (std::uint32_t r = 0; r < runs; ++r)
      for (std::uint32_t q = 0; q < rows; ++q)
        f(dst + r * dst_stride + q * dst_row_stride, src + r * src_stride + q * src_row_stride, len);
  }
};

/// A block segment's shape on both sides, before the direction makes one the source: the
/// bytes its first t0 tokens take (left alone), and segment_copy's runs, rows and strides.
struct segment_shape {
  std::uint64_t paged_skip = 0, obj_skip = 0;
  std::uint32_t runs = 1, rows = 1;
  std::uint64_t len = 0;
  std::uint64_t paged_run = 0, obj_run = 0, paged_row = 0, obj_row = 0;
};

/// A segment contiguous in object order (p.contiguous), copied whole, or its tail after t0
/// skipped tokens.
__host__ __device__ __forceinline__ segment_shape whole_segment_shape(const launch_params& p, std::uint32_t t0) {
  segment_shape s;
  // The bytes of each run left alone: t0 token rows (NHD, MLA) or t0 rows of each head.
  const std::uint64_t offset = t0 * (p.hnd ? p.row_bytes : p.token_bytes);
  s.paged_skip = s.obj_skip = offset;
  // Skipped rows lead every run: with several runs (HND) the CTA copies each run's tail.
  const bool split = offset != 0 && p.segment_runs > 1;
  s.runs = split ? p.segment_runs : 1;
  s.len = split ? p.run_bytes - offset : p.segment_bytes - offset;
  s.paged_run = s.obj_run = p.run_bytes;
  return s;
}

/// The row path of an HND object: heads as runs, tokens t0.. of each as rows.
__host__ __device__ __forceinline__ segment_shape hnd_rows_shape(const launch_params& p, std::uint32_t t0) {
  segment_shape s;
  s.paged_skip = t0 * p.token_stride;
  s.obj_skip = t0 * p.row_bytes;
  s.runs = p.heads;
  s.paged_run = p.head_stride;
  s.obj_run = std::uint64_t{p.block_size} * p.row_bytes;
  const std::uint32_t n = p.block_size - t0;
  const bool adjacent = n == 1 || p.token_stride == p.row_bytes;
  s.rows = adjacent ? 1 : n;
  s.len = adjacent ? n * p.row_bytes : p.row_bytes;
  s.paged_row = p.token_stride;
  s.obj_row = p.row_bytes;
  return s;
}

/// The row path of an NHD or MLA object: tokens t0.. as runs, the heads of each as rows.
__host__ __device__ __forceinline__ segment_shape nhd_rows_shape(const launch_params& p, std::uint32_t t0) {
  segment_shape s;
  s.paged_skip = t0 * p.token_stride;
  s.obj_skip = t0 * p.token_bytes;
  s.runs = p.block_size - t0;
  s.paged_run = p.token_stride;
  s.obj_run = p.token_bytes;
  const bool adjacent = p.heads == 1 || p.head_stride == p.row_bytes;
  s.rows = adjacent ? 1 : p.heads;
  s.len = adjacent ? p.token_bytes : p.row_bytes;
  s.paged_row = p.head_stride;
  s.obj_row = p.row_bytes;
  return s;
}

/// The block segment of CTA `cta`: cta = ((piece * num_layers + layer) * planes + plane) *
/// max_piece_blocks + k, block position begin + k of the piece. Host and device (tests
/// replay a launch on the host with it).
template <bool Gather>
__host__ __device__ __forceinline__ segment_copy locate_segment(const launch_params& p, std::uint32_t cta) {
  const std::uint32_t k = cta % p.max_piece_blocks;
  cta /= p.max_piece_blocks;
  const std::uint32_t plane = cta % p.planes;
  cta /= p.planes;
  const std::uint32_t layer = cta % p.num_layers;
  cta /= p.num_layers;
  const piece_desc& pc = p.pieces[cta];
  const std::uint32_t j = pc.begin + k;
  if (j >= pc.end) return {};
  // begin_tokens: the tokens of the piece's first block left alone (a skip).
  const std::uint32_t t0 = k == 0 ? pc.begin_tokens : 0;
  const std::uint64_t id = p.ids[pc.ids_base + k];
  const segment_shape s = p.contiguous ? whole_segment_shape(p, t0)
                          : p.hnd      ? hnd_rows_shape(p, t0)
                                       : nhd_rows_shape(p, t0);
  std::byte* paged = p.layers[layer] + plane * p.plane_stride + id * p.block_stride + s.paged_skip;
  std::byte* obj =
      pc.object + (std::uint64_t{layer} * p.planes + plane) * p.slab_bytes + j * p.segment_bytes + s.obj_skip;
  segment_copy c;
  c.active = true;
  c.runs = s.runs;
  c.rows = s.rows;
  c.len = s.len;
  if constexpr (Gather) {
    c.dst = obj, c.src = paged;
    c.dst_stride = s.obj_run, c.src_stride = s.paged_run, c.dst_row_stride = s.obj_row, c.src_row_stride = s.paged_row;
  } else {
    c.dst = paged, c.src = obj;
    c.dst_stride = s.paged_run, c.src_stride = s.obj_run, c.dst_row_stride = s.paged_row, c.src_row_stride = s.obj_row;
  }
  return c;
}

/// The row path's copy: the pieces of `s` (each len bytes, a multiple of sizeof(Vec)) as one
/// flat range of vectors shared by the CTA's threads.
template <class Vec>
__device__ __forceinline__ void copy_pieces(const segment_copy& s) {
  const std::uint64_t per = s.len / sizeof(Vec);  // vectors of one piece
  const std::uint64_t n = per * s.rows * s.runs;
  for (std::uint64_t i = threadIdx.x; i < n; i += threads_per_block) {
    const std::uint64_t piece = i / per, v = i - piece * per;
    const std::uint64_t r = piece / s.rows, q = piece - r * s.rows;
    reinterpret_cast<Vec*>(s.dst + r * s.dst_stride + q * s.dst_row_stride)[v] =
        reinterpret_cast<const Vec*>(s.src + r * s.src_stride + q * s.src_row_stride)[v];
  }
}

/// One CTA per block segment (locate_segment). A template, so that every translation unit
/// may instantiate it (no -rdc needed).
template <bool Gather, class Vec>
__global__ void __launch_bounds__(threads_per_block) copy_segments_kernel(const __grid_constant__ launch_params p) {
  const segment_copy s = locate_segment<Gather>(p, blockIdx.x);
  if (!s.active) return;
  if (s.rows == 1 && (s.runs == 1 || s.len >= threads_per_block * sizeof(Vec))) {
    // Whole segments, and runs long enough to keep every thread busy (HND's heads after a
    // skip): the unrolled copy, one run after the other.
    for (std::uint32_t r = 0; r < s.runs; ++r)
      copy_bytes<Vec>(s.dst + r * s.dst_stride, s.src + r * s.src_stride, s.len);
  } else {
    copy_pieces<Vec>(s);
  }
}

/// CTAs of one launch.
[[nodiscard]] inline std::uint64_t grid_size(const launch_params& p) noexcept {
  return std::uint64_t{p.num_pieces} * p.num_layers * p.planes * p.max_piece_blocks;
}

/// The widest access (16, 8, 4, 2 or 1 bytes) that divides every bit pattern OR-ed into bits.
[[nodiscard]] inline unsigned vector_bytes(std::uintptr_t bits) noexcept {
  for (unsigned v : {16u, 8u, 4u, 2u})
    if ((bits & (v - 1)) == 0) return v;
  return 1;
}

/// Launches one parameter block with `vec`-byte accesses on `stream`.
template <bool Gather>
[[nodiscard]] inline cudaError_t launch(const launch_params& p, unsigned vec, cudaStream_t stream) noexcept {
  const std::uint64_t grid = grid_size(p);
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7fffffffu) return cudaErrorInvalidConfiguration;  // unreachable with the capacities above
  const dim3 g(static_cast<unsigned>(grid));
  switch (vec) {
    case 16: copy_segments_kernel<Gather, uint4><<<g, threads_per_block, 0, stream>>>(p); break;
    case 8: copy_segments_kernel<Gather, uint2><<<g, threads_per_block, 0, stream>>>(p); break;
    case 4: copy_segments_kernel<Gather, unsigned><<<g, threads_per_block, 0, stream>>>(p); break;
    case 2: copy_segments_kernel<Gather, unsigned short><<<g, threads_per_block, 0, stream>>>(p); break;
    default: copy_segments_kernel<Gather, unsigned char><<<g, threads_per_block, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

/// A fixed-capacity set of block ids (open addressing), cleared per launch: finds the
/// repeated block ids of a scatter launch without allocating.
class id_set {
 public:
  id_set() noexcept {
    for (auto& s : slots_) s = empty;
  }
  void clear() noexcept {
    for (std::uint32_t i = 0; i < used_count_; ++i) slots_[used_[i]] = empty;
    used_count_ = 0;
  }
  /// Inserts id; false when it was already there. At most launch_max_ids ids between clears.
  bool insert(std::uint32_t id) noexcept {
    std::uint32_t h = (id * 2654435761u) & (capacity - 1);
    while (slots_[h] != empty) {
      if (slots_[h] == id) return false;
      h = (h + 1) & (capacity - 1);
    }
    slots_[h] = id;
    used_[used_count_++] = h;
    return true;
  }

 private:
  static constexpr std::uint32_t capacity = 2048;      // > 2 * launch_max_ids: short probes
  static constexpr std::uint32_t empty = 0xffffffffu;  // never a valid block id
  std::uint32_t slots_[capacity];
  std::uint32_t used_[launch_max_ids];
  std::uint32_t used_count_ = 0;
};

/// What a gather keeps instead of an id_set: nothing.
struct no_id_set {
  void clear() noexcept {}
  bool insert(std::uint32_t) noexcept { return true; }
};

/// Fills the fields of `p` that every parameter block of a batch shares: the layer table and
/// the layout's sizes and strides (not the pieces and ids).
inline void set_batch_shape(launch_params& p, const paged_kv_view& cache, const chunk_layout& chunk) noexcept {
  const paged_kv_layout& layout = cache.layout;
  const kv_strides strides = layout.effective_strides();
  p.layers = cache.layers.device_data;
  p.segment_bytes = layout.segment_bytes();
  p.plane_stride = strides.plane;
  p.block_stride = strides.block;
  p.token_stride = strides.token;
  p.head_stride = strides.head;
  p.slab_bytes = chunk.slab_bytes();
  p.run_bytes = layout.run_bytes();
  p.row_bytes = layout.head_row_bytes();
  p.token_bytes = layout.model.token_plane_bytes();
  p.segment_runs = layout.segment_runs();
  p.block_size = layout.block_size;
  p.heads = layout.model.num_kv_heads;
  p.contiguous = layout.segment_contiguous() ? 1 : 0;
  p.hnd = layout.kind() == kv_layout_kind::hnd ? 1 : 0;
  p.planes = layout.model.planes();
  p.num_layers = layout.model.num_layers;
}

/// The bits every offset the kernel forms for this shape is a multiple of, OR-ed with the
/// layer table's alignment: the launch's vector width is vector_bytes() of these and of the
/// objects of its pieces. `p` holds the batch shape (set_batch_shape).
[[nodiscard]] inline std::uintptr_t shape_alignment_bits(const launch_params& p, const paged_kv_view& cache) noexcept {
  const paged_kv_layout& layout = cache.layout;
  const kv_strides strides = layout.effective_strides();
  // Every offset the kernel forms is a multiple of one of these: whole segments move by
  // token_plane_bytes (NHD, MLA) or head_row_bytes (HND) within a block, and by the plane and
  // block strides between blocks; rows by the token and head strides and whole rows (a
  // dimension of one entry never moves an address). Layer bases and objects bring their own
  // alignment.
  std::uintptr_t base_bits = cache.layers.alignment | p.segment_bytes;
  if (layout.model.planes() > 1) base_bits |= strides.plane;
  if (layout.num_blocks > 1) base_bits |= strides.block;
  if (p.contiguous) {
    base_bits |= layout.kind() == kv_layout_kind::hnd ? layout.head_row_bytes() : layout.model.token_plane_bytes();
  } else {
    base_bits |= layout.head_row_bytes();
    if (layout.block_size > 1) base_bits |= strides.token;
    if (layout.model.num_kv_heads > 1) base_bits |= strides.head;
  }
  return base_bits;
}

/// Packs validated items into parameter blocks and calls launch(params, vector_bytes) for
/// each full one, in order; stops at the first launch that fails. The library passes a
/// launcher that enqueues copy_segments_kernel; tests pass one that replays the launch on the
/// host with locate_segment.
template <bool Gather, class Item, class Launch>
[[nodiscard]] inline std::error_code pack(const paged_kv_view& cache, const chunk_layout& chunk,
                                          std::span<const Item> items, Launch&& launch) noexcept {
  const paged_kv_layout& layout = cache.layout;
  const std::uint32_t nblocks = chunk.chunk_tokens / layout.block_size;
  launch_params p;
  set_batch_shape(p, cache, chunk);
  const std::uintptr_t base_bits = shape_alignment_bits(p, cache);
  std::uintptr_t bits = base_bits;
  std::uint32_t num_ids = 0;
  // Only a scatter needs the set (10 KiB of stack, no allocation).
  std::conditional_t<Gather, no_id_set, id_set> written;

  auto flush = [&]() noexcept -> cudaError_t {
    const cudaError_t e = launch(static_cast<const launch_params&>(p), vector_bytes(bits));
    p.num_pieces = 0;
    p.max_piece_blocks = 0;
    num_ids = 0;
    bits = base_bits;
    written.clear();
    return e;
  };
  auto close = [&](piece_desc& pc) noexcept { p.max_piece_blocks = std::max(p.max_piece_blocks, pc.end - pc.begin); };

  for (const Item& it : items) {
    const std::uint32_t first = it.skip_tokens / layout.block_size;
    if (first >= nblocks) continue;  // the whole chunk is skipped
    const std::uint32_t first_tokens = it.skip_tokens % layout.block_size;
    std::byte* object = const_cast<std::byte*>(static_cast<const std::byte*>(it.object));
    std::uint32_t j = first;
    while (j < nblocks) {
      // Open a piece at block position j (launch the full parameter block first).
      if (p.num_pieces == launch_max_pieces || num_ids == launch_max_ids)
        if (const cudaError_t e = flush(); e != cudaSuccess) return make_error_code(e);
      const std::uint32_t tokens = j == first ? first_tokens : 0;
      piece_desc& pc = p.pieces[p.num_pieces++];
      pc = {object, num_ids, j, j, tokens};
      bits |= reinterpret_cast<std::uintptr_t>(object);
      // A scatter stops before a block this launch already writes.
      while (j < nblocks && num_ids < launch_max_ids && written.insert(it.block_ids[j])) {
        p.ids[num_ids++] = it.block_ids[j];
        pc.end = ++j;
      }
      if (pc.end == pc.begin)
        --p.num_pieces;  // the repeat was its first block: nothing to copy in this launch
      else
        close(pc);
      if (j < nblocks)  // stopped early (full, or a repeat): the rest goes in the next launch
        if (const cudaError_t e = flush(); e != cudaSuccess) return make_error_code(e);
    }
  }
  if (p.num_pieces)
    if (const cudaError_t e = flush(); e != cudaSuccess) return make_error_code(e);
  return {};
}

/// Validates every item (core/kv_transfer.hpp's checks), then pack() with the kernel
/// launcher on `stream`: nothing is enqueued when an item is invalid.
template <bool Gather, class Item>
[[nodiscard]] inline std::error_code enqueue(const paged_kv_view& cache, const chunk_layout& chunk,
                                             std::span<const Item> items, cudaStream_t stream) noexcept {
  if (auto ec = ::kvtier::detail::validate_batch(cache, chunk, items)) return ec;
  return pack<Gather>(cache, chunk, items,
                      [stream](const launch_params& p, unsigned vec) noexcept { return launch<Gather>(p, vec, stream); });
}

}  // namespace detail

/// check_transfer(cache, block_ids, chunk, object, skip_tokens): checks a gather or scatter
/// of one chunk without enqueuing, the codes gather_chunk and scatter_chunk would return.
/// The CPU path's function (core/kv_transfer.hpp), which reads this paged_kv_view too.
using ::kvtier::check_transfer;

/// Enqueues on `stream` the copy of the chunk made of `block_ids` (chunk order) from the
/// paged cache into `object`, but its first skip_tokens tokens (left untouched).
/// options.write is ignored (the GPU has no such choice).
[[nodiscard]] inline std::error_code gather_chunk(const paged_kv_view& cache, std::span<const std::uint32_t> block_ids,
                                                  const chunk_layout& chunk, std::byte* object,
                                                  std::uint32_t skip_tokens = 0, transfer_options options = {},
                                                  cudaStream_t stream = nullptr) noexcept {
  (void)options;
  const gather_item item{block_ids, object, skip_tokens};
  return detail::enqueue<true, gather_item>(cache, chunk, {&item, 1}, stream);
}

/// Enqueues on `stream` the copy of `object` into the blocks `block_ids` (chunk order), but
/// its first skip_tokens tokens, whose bytes in the cache stay as they are. Repeated block
/// ids are allowed; the last occurrence wins.
[[nodiscard]] inline std::error_code scatter_chunk(const paged_kv_view& cache,
                                                   std::span<const std::uint32_t> block_ids,
                                                   const chunk_layout& chunk, const std::byte* object,
                                                   std::uint32_t skip_tokens = 0, transfer_options options = {},
                                                   cudaStream_t stream = nullptr) noexcept {
  (void)options;
  const scatter_item item{block_ids, object, skip_tokens};
  return detail::enqueue<false, scatter_item>(cache, chunk, {&item, 1}, stream);
}

/// gather_chunk for several chunks of the same layout, in one launch (several past 576
/// block ids): all items are validated first, and nothing is enqueued when one is invalid.
[[nodiscard]] inline std::error_code gather_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                   std::span<const gather_item> items, transfer_options options = {},
                                                   cudaStream_t stream = nullptr) noexcept {
  (void)options;
  return detail::enqueue<true, gather_item>(cache, chunk, items, stream);
}

/// scatter_chunk for several chunks of the same layout: all items are validated first, and
/// nothing is enqueued when one is invalid. Where two items name the same block, the later
/// one wins (as on the CPU).
[[nodiscard]] inline std::error_code scatter_chunks(const paged_kv_view& cache, const chunk_layout& chunk,
                                                    std::span<const scatter_item> items, transfer_options options = {},
                                                    cudaStream_t stream = nullptr) noexcept {
  (void)options;
  return detail::enqueue<false, scatter_item>(cache, chunk, items, stream);
}

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
