#pragma once
// cuda/copy_engine: moves a batch of chunks between a registered GPU KV cache and pinned L1
// slots on streams of its own, ordered by events: what the cache server runs for a store
// (paged KV -> L1) and a retrieve (L1 -> paged KV), staged (kernel + DMA through a device
// ring, the default) or zero-copy. Standard library and the CUDA runtime only. The modes and
// why staged is the default, skip_tokens, ordering, errors and threads: docs/integration.md,
// "The copy path on the server".

#include <kvtier/cuda/check.cuh>
#include <kvtier/cuda/kv_transfer.cuh>

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <cuda_runtime.h>

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

enum class copy_mode : std::uint8_t {
  staged = 0,     ///< kernel to/from a device staging buffer + DMA to/from the pinned slot
  zero_copy = 1,  ///< kernel reads/writes the pinned slot directly
};

struct copy_engine_options {
  copy_mode mode = copy_mode::staged;
  /// Staging buffers in the ring (staged mode): 2 overlaps one gather with one DMA; 3 keeps
  /// the DMA busy when a kernel is delayed by the engine's work.
  std::uint32_t staging_chunks = 3;
  /// The device of the KV cache; -1: the device current when the engine is created.
  int device = -1;
};

class copy_engine {
 public:
  copy_engine() noexcept = default;

  /// An engine for `cache` (a view whose table lives on options.device) and chunks of
  /// `chunk`. ec: a transfer_errc when the view or layouts are invalid, std::errc::
  /// not_supported for zero_copy on a device that cannot use host pointers, else a
  /// cuda_category() code (stream, event or staging allocation failed).
  [[nodiscard]] static copy_engine create(const paged_kv_view& cache, const chunk_layout& chunk,
                                          const copy_engine_options& options, std::error_code& ec) {
    ec.clear();
    copy_engine c;
    if ((ec = ::kvtier::detail::validate_cache(cache, chunk))) return c;
    c.cache_ = cache;
    c.chunk_ = chunk;
    c.mode_ = options.mode;
    c.device_ = options.device;
    auto fail = [&](cudaError_t e) {
      ec = detail::cuda_fail(e);
      return copy_engine{};  // c's destructor frees what was made
    };
    if (c.device_ < 0)
      if (const cudaError_t e = cudaGetDevice(&c.device_); e != cudaSuccess) return fail(e);
    if (const cudaError_t e = cudaSetDevice(c.device_); e != cudaSuccess) return fail(e);
    if (c.mode_ == copy_mode::zero_copy) {
      int host_ptr_ok = 0;
      if (const cudaError_t e = cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, c.device_);
          e != cudaSuccess)
        return fail(e);
      if (!host_ptr_ok) {
        ec = std::make_error_code(std::errc::not_supported);
        return copy_engine{};
      }
    }
    if (const cudaError_t e = cudaStreamCreateWithFlags(&c.kernel_stream_, cudaStreamNonBlocking); e != cudaSuccess)
      return fail(e);
    if (c.mode_ == copy_mode::staged) {
      if (const cudaError_t e = cudaStreamCreateWithFlags(&c.copy_stream_, cudaStreamNonBlocking); e != cudaSuccess)
        return fail(e);
      const std::uint32_t n = options.staging_chunks ? options.staging_chunks : 1;
      void* s = nullptr;
      if (const cudaError_t e = cudaMalloc(&s, std::size_t{n} * chunk.object_bytes()); e != cudaSuccess) return fail(e);
      c.staging_ = static_cast<std::byte*>(s);
      c.ring_.resize(n);
      for (ring_entry& r : c.ring_) {
        if (const cudaError_t e = cudaEventCreateWithFlags(&r.filled, cudaEventDisableTiming); e != cudaSuccess)
          return fail(e);
        if (const cudaError_t e = cudaEventCreateWithFlags(&r.free, cudaEventDisableTiming); e != cudaSuccess)
          return fail(e);
      }
    }
    return c;
  }

  /// create() that throws std::system_error.
  [[nodiscard]] static copy_engine create(const paged_kv_view& cache, const chunk_layout& chunk,
                                          const copy_engine_options& options = {}) {
    std::error_code ec;
    copy_engine c = create(cache, chunk, options, ec);
    if (ec) throw std::system_error(ec, "kvtier::cuda::copy_engine");
    return c;
  }

  copy_engine(copy_engine&& o) noexcept { swap(o); }
  copy_engine& operator=(copy_engine&& o) noexcept {
    if (this != &o) {
      copy_engine tmp(std::move(o));
      swap(tmp);
    }
    return *this;
  }
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;
  ~copy_engine() { release(); }

  /// Store: copies every item's chunk from the paged cache into its pinned object (L1
  /// slot), after `after`, recording `done` at the end. Validates every item first (the
  /// transfer_errc of core/kv_transfer.hpp); nothing is enqueued when one is invalid.
  [[nodiscard]] std::error_code store(std::span<const gather_item> items, cudaEvent_t after = nullptr,
                                      cudaEvent_t done = nullptr) noexcept {
    return transfer(items, after, done);
  }

  /// Retrieve: copies every item's pinned object into its blocks of the paged cache (but the
  /// first skip_tokens tokens), items in order (a later item wins on a repeated block), after
  /// `after`, recording `done` at the end. Validates every item first.
  [[nodiscard]] std::error_code retrieve(std::span<const scatter_item> items, cudaEvent_t after = nullptr,
                                         cudaEvent_t done = nullptr) noexcept {
    return transfer(items, after, done);
  }

  /// Blocks until everything enqueued so far has completed.
  [[nodiscard]] std::error_code synchronize() noexcept {
    if (kernel_stream_)
      if (const cudaError_t e = cudaStreamSynchronize(kernel_stream_); e != cudaSuccess) return detail::cuda_fail(e);
    if (copy_stream_)
      if (const cudaError_t e = cudaStreamSynchronize(copy_stream_); e != cudaSuccess) return detail::cuda_fail(e);
    return {};
  }

  [[nodiscard]] copy_mode mode() const noexcept { return mode_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const chunk_layout& chunk() const noexcept { return chunk_; }
  [[nodiscard]] cudaStream_t kernel_stream() const noexcept { return kernel_stream_; }
  /// The DMA stream (staged mode; nullptr in zero_copy mode).
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return copy_stream_; }
  /// Device bytes held for staging.
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return ring_.size() * chunk_.object_bytes(); }
  [[nodiscard]] bool empty() const noexcept { return kernel_stream_ == nullptr; }

 private:
  struct ring_entry {
    cudaEvent_t filled = nullptr;  ///< the buffer holds the chunk (gathered, or landed by DMA)
    cudaEvent_t free = nullptr;    ///< the buffer's content has left (DMA'd out, or scattered)
  };

  /// store (Item = gather_item) or retrieve (scatter_item). `after` holds up the kernel
  /// stream. Staged, each chunk passes through a ring buffer in two stages, the second
  /// waiting for the first: a store fills it with the gather kernel (kernel stream) and
  /// empties it by DMA into the L1 slot (copy stream); a retrieve fills it by DMA from the
  /// slot (copy stream, not held up by `after`: the paged cache is not touched yet) and
  /// empties it with the scatter kernel (kernel stream). The stream of the second stage is
  /// fed by everything before it, so its end is the batch's end: `done` is recorded there.
  template <class Item>
  [[nodiscard]] std::error_code transfer(std::span<const Item> items, cudaEvent_t after, cudaEvent_t done) noexcept {
    constexpr bool is_store = std::is_same_v<Item, gather_item>;
    if (auto ec = validate(items)) return ec;
    if (const cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return detail::cuda_fail(e);
    if (after)
      if (const cudaError_t e = cudaStreamWaitEvent(kernel_stream_, after, 0); e != cudaSuccess)
        return detail::cuda_fail(e);
    if (mode_ == copy_mode::zero_copy) {
      if constexpr (is_store) {
        if (auto ec = gather_chunks(cache_, chunk_, items, {}, kernel_stream_)) return ec;
      } else {
        if (auto ec = scatter_chunks(cache_, chunk_, items, {}, kernel_stream_)) return ec;
      }
      return record(done, kernel_stream_);
    }
    const cudaStream_t fill_stream = is_store ? kernel_stream_ : copy_stream_;
    const cudaStream_t empty_stream = is_store ? copy_stream_ : kernel_stream_;
    for (const Item& it : items) {
      if (it.skip_tokens >= chunk_.chunk_tokens) continue;
      ring_entry& r = ring_[next_];
      std::byte* staging = staging_ + next_ * chunk_.object_bytes();
      next_ = (next_ + 1) % ring_.size();
      // The buffer's previous content has left (its DMA or scatter is done).
      if (const cudaError_t e = cudaStreamWaitEvent(fill_stream, r.free, 0); e != cudaSuccess)
        return detail::cuda_fail(e);
      if (auto ec = fill_staging(it, staging)) return ec;
      if (const cudaError_t e = cudaEventRecord(r.filled, fill_stream); e != cudaSuccess) return detail::cuda_fail(e);
      if (const cudaError_t e = cudaStreamWaitEvent(empty_stream, r.filled, 0); e != cudaSuccess)
        return detail::cuda_fail(e);
      if (auto ec = empty_staging(it, staging)) return ec;
      if (const cudaError_t e = cudaEventRecord(r.free, empty_stream); e != cudaSuccess) return detail::cuda_fail(e);
    }
    return record(done, empty_stream);
  }

  /// The first stage of a staged store: the gather kernel, paged blocks -> staging.
  [[nodiscard]] std::error_code fill_staging(const gather_item& it, std::byte* staging) noexcept {
    return gather_chunk(cache_, it.block_ids, chunk_, staging, it.skip_tokens, {}, kernel_stream_);
  }
  /// The second stage of a staged store: the DMA staging -> L1 slot.
  [[nodiscard]] std::error_code empty_staging(const gather_item& it, const std::byte* staging) noexcept {
    if (const cudaError_t e = dma(it.object, staging, it.skip_tokens, cudaMemcpyDeviceToHost); e != cudaSuccess)
      return detail::cuda_fail(e);
    return {};
  }
  /// The first stage of a staged retrieve: the DMA L1 slot -> staging.
  [[nodiscard]] std::error_code fill_staging(const scatter_item& it, std::byte* staging) noexcept {
    if (const cudaError_t e = dma(staging, it.object, it.skip_tokens, cudaMemcpyHostToDevice); e != cudaSuccess)
      return detail::cuda_fail(e);
    return {};
  }
  /// The second stage of a staged retrieve: the scatter kernel, staging -> paged blocks.
  [[nodiscard]] std::error_code empty_staging(const scatter_item& it, const std::byte* staging) noexcept {
    return scatter_chunk(cache_, it.block_ids, chunk_, staging, it.skip_tokens, {}, kernel_stream_);
  }

  template <class Item>
  [[nodiscard]] std::error_code validate(std::span<const Item> items) const noexcept {
    if (kernel_stream_ == nullptr) return std::make_error_code(std::errc::invalid_argument);  // an empty (moved-from) engine
    for (const Item& it : items)
      if (auto ec = check_transfer(cache_, it.block_ids, chunk_, it.object, it.skip_tokens)) return ec;
    return {};
  }

  [[nodiscard]] static std::error_code record(cudaEvent_t done, cudaStream_t s) noexcept {
    if (done)
      if (const cudaError_t e = cudaEventRecord(done, s); e != cudaSuccess) return detail::cuda_fail(e);
    return {};
  }

  /// The DMA of one object's bytes that are not skipped, on the copy stream: one contiguous
  /// copy, or one 2D copy over the (layer, plane) slabs when tokens are skipped (an HND skip
  /// inside a block: docs/integration.md, "The copy path on the server", skip_tokens).
  template <class Dst, class Src>
  [[nodiscard]] cudaError_t dma(Dst* dst, Src* src, std::uint32_t skip_tokens, cudaMemcpyKind kind) noexcept {
    if (skip_tokens == 0) return cudaMemcpyAsync(dst, src, chunk_.object_bytes(), kind, copy_stream_);
    const paged_kv_layout& layout = cache_.layout;
    const std::size_t slab = chunk_.slab_bytes();
    const std::size_t seg = layout.segment_bytes();
    const std::size_t rows = std::size_t{chunk_.model.planes()} * chunk_.model.num_layers;
    const std::size_t first = skip_tokens / layout.block_size;  // the block the skip ends in
    const std::uint32_t t0 = skip_tokens % layout.block_size;   // its skipped tokens
    auto* d = reinterpret_cast<std::byte*>(dst);
    auto* s = reinterpret_cast<std::byte*>(const_cast<std::remove_const_t<Src>*>(src));
    auto slabs_from = [&](std::size_t off) noexcept {
      return off >= slab ? cudaSuccess
                         : cudaMemcpy2DAsync(d + off, slab, s + off, slab, slab - off, rows, kind, copy_stream_);
    };
    if (layout.segment_runs() == 1 || t0 == 0) return slabs_from(first * seg + layout.run_offset(t0));
    if (kind == cudaMemcpyHostToDevice) return slabs_from(first * seg);  // staging: extra rows never read
    // A store: block `first`'s head runs without their first t0 rows, in every slab.
    const std::size_t run = layout.run_bytes(), row = layout.head_row_bytes();
    cudaMemcpy3DParms p{};
    p.srcPtr = make_cudaPitchedPtr(s, run, run, slab / run);
    p.dstPtr = make_cudaPitchedPtr(d, run, run, slab / run);
    p.srcPos = p.dstPos = make_cudaPos(t0 * row, first * layout.segment_runs(), 0);
    p.extent = make_cudaExtent((layout.block_size - t0) * row, layout.segment_runs(), rows);
    p.kind = kind;
    if (const cudaError_t e = cudaMemcpy3DAsync(&p, copy_stream_); e != cudaSuccess) return e;
    return slabs_from((first + 1) * seg);
  }

  void swap(copy_engine& o) noexcept {
    std::swap(cache_, o.cache_);
    std::swap(chunk_, o.chunk_);
    std::swap(mode_, o.mode_);
    std::swap(device_, o.device_);
    std::swap(kernel_stream_, o.kernel_stream_);
    std::swap(copy_stream_, o.copy_stream_);
    std::swap(staging_, o.staging_);
    std::swap(ring_, o.ring_);
    std::swap(next_, o.next_);
  }

  void release() noexcept {
    if (kernel_stream_ == nullptr && copy_stream_ == nullptr && staging_ == nullptr && ring_.empty()) return;
    (void)cudaSetDevice(device_);
    (void)synchronize();  // the staging buffer must not be freed under a running copy
    for (ring_entry& r : ring_) {
      if (r.filled) (void)cudaEventDestroy(r.filled);
      if (r.free) (void)cudaEventDestroy(r.free);
    }
    ring_.clear();
    if (staging_) (void)cudaFree(staging_);
    if (copy_stream_) (void)cudaStreamDestroy(copy_stream_);
    if (kernel_stream_) (void)cudaStreamDestroy(kernel_stream_);
    staging_ = nullptr;
    copy_stream_ = kernel_stream_ = nullptr;
  }

  paged_kv_view cache_{};
  chunk_layout chunk_{};
  copy_mode mode_ = copy_mode::staged;
  int device_ = 0;
  cudaStream_t kernel_stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
  std::byte* staging_ = nullptr;
  std::vector<ring_entry> ring_;
  std::size_t next_ = 0;  ///< the ring entry the next chunk uses
};

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
