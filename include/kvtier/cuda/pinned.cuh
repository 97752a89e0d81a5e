#pragma once
// cuda/pinned: page-locked host memory for the L1 tier and for staging: pinned_buffer (an
// owned cudaHostAlloc) and host_registration (cudaHostRegister of an existing range, the L1
// arena, in pieces on several threads, timed). Standard library and the CUDA runtime only.
// Why pieces, the flags and piece_alignment: docs/integration.md, "Pinned memory sizing".

#include <kvtier/cuda/check.cuh>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

/// An owned page-locked host allocation (cudaHostAlloc, portable | mapped). Move-only.
class pinned_buffer {
 public:
  pinned_buffer() noexcept = default;

  /// Allocates `bytes` pinned bytes; throws std::system_error when CUDA refuses.
  explicit pinned_buffer(std::size_t bytes) {
    std::error_code ec;
    *this = allocate(bytes, ec);
    if (ec) throw std::system_error(ec, "kvtier::cuda::pinned_buffer: cudaHostAlloc of " + std::to_string(bytes) + " bytes");
  }

  /// Allocates `bytes` pinned bytes, or returns an empty buffer and sets ec.
  [[nodiscard]] static pinned_buffer allocate(std::size_t bytes, std::error_code& ec) noexcept {
    ec.clear();
    pinned_buffer b;
    if (bytes == 0) return b;
    void* p = nullptr;
    if (const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return b;
    }
    b.data_ = static_cast<std::byte*>(p);
    b.size_ = bytes;
    return b;
  }

  pinned_buffer(pinned_buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { release(); }

  [[nodiscard]] std::byte* data() noexcept { return data_; }
  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() noexcept { return {data_, size_}; }
  [[nodiscard]] explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  void release() noexcept {
    if (data_) (void)cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// The page size piece boundaries are aligned to: 4 KiB (x86-64). On a kernel with 64 KiB
/// pages (some aarch64 systems, e.g. Grace) pass a piece_alignment that is a multiple of 64 KiB.
inline constexpr std::size_t host_page_bytes = 4096;

/// How host_registration splits and registers a range.
struct registration_options {
  /// Host threads registering pieces at once (0: std::thread::hardware_concurrency()).
  unsigned threads = 0;
  /// Upper bound of one piece. Smaller pieces balance better between threads; each is one
  /// driver registration. 1 GiB by default.
  std::size_t max_piece_bytes = std::size_t{1} << 30;
  /// Piece boundaries fall on multiples of this (from the start of the range): pass the L1
  /// slot size so that no slot spans two registrations. Always also a multiple of the page
  /// size (host_page_bytes). 0 or 1: page boundaries only.
  std::size_t piece_alignment = 0;
  /// The device whose context the registering threads use (the flags make the pages pinned
  /// for every device of the process).
  int device = 0;
  /// Called once after registration with a one-line summary (pieces, threads, seconds, GB/s),
  /// from the calling thread. Empty: no message.
  std::function<void(std::string_view)> log;
};

/// What a registration cost.
struct registration_stats {
  std::size_t bytes = 0;
  std::size_t pieces = 0;
  unsigned threads = 0;
  double seconds = 0;  ///< wall time of the whole parallel registration
};

/// The pinned state of an existing host range, registered piece by piece. Move-only; the
/// destructor unregisters every piece (in parallel, with the threads of the registration).
class host_registration {
 public:
  host_registration() noexcept = default;

  /// Registers `range` with cudaHostRegister (portable | mapped) in pieces, on
  /// `options.threads` threads. On failure every piece already registered is unregistered,
  /// ec holds the first error, and the returned object is empty.
  [[nodiscard]] static host_registration register_range(std::span<std::byte> range, const registration_options& options,
                                                        std::error_code& ec) {
    ec.clear();
    host_registration r;
    if (range.empty()) return r;
    unsigned threads = options.threads ? options.threads : std::max(1u, std::thread::hardware_concurrency());
    r.pieces_ = plan(range, options, threads);
    threads = static_cast<unsigned>(std::min<std::size_t>(threads, r.pieces_.size()));
    r.device_ = options.device;
    r.threads_ = threads;

    const auto start = std::chrono::steady_clock::now();
    std::vector<cudaError_t> errors(r.pieces_.size(), cudaSuccess);
    r.for_each_piece(threads, [&](std::size_t i) {
      errors[i] = cudaHostRegister(r.pieces_[i].data(), r.pieces_[i].size(),
                                   cudaHostRegisterPortable | cudaHostRegisterMapped);
      if (errors[i] != cudaSuccess) (void)cudaGetLastError();
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    const auto bad = std::find_if(errors.begin(), errors.end(), [](cudaError_t e) { return e != cudaSuccess; });
    if (bad != errors.end()) {
      ec = make_error_code(*bad);
      std::vector<std::span<std::byte>> ok;
      for (std::size_t i = 0; i < errors.size(); ++i)
        if (errors[i] == cudaSuccess) ok.push_back(r.pieces_[i]);
      r.pieces_ = std::move(ok);
      r.release();
      return host_registration{};
    }
    r.stats_ = {range.size(), r.pieces_.size(), threads, seconds};
    r.range_ = range;
    if (options.log) {
      const double gib = static_cast<double>(range.size()) / double(std::size_t{1} << 30);
      std::string msg = "kvtier::cuda: pinned " + std::to_string(gib) + " GiB in " + std::to_string(r.pieces_.size()) +
                        " pieces on " + std::to_string(threads) + " threads in " + std::to_string(seconds) + " s (" +
                        std::to_string(seconds > 0 ? gib / seconds : 0.0) + " GiB/s)";
      options.log(msg);
    }
    return r;
  }

  /// How register_range splits `range` for `threads` threads: consecutive pieces of at most
  /// max_piece_bytes, at least one per thread, boundaries on multiples of piece_alignment and
  /// of the page size (a page registered twice fails), the whole range as one piece when it
  /// does not start on a page. No CUDA call.
  [[nodiscard]] static std::vector<std::span<std::byte>> plan(std::span<std::byte> range,
                                                              const registration_options& options, unsigned threads) {
    std::vector<std::span<std::byte>> pieces;
    if (range.empty()) return pieces;
    threads = std::max(1u, threads);
    const bool page_aligned = reinterpret_cast<std::uintptr_t>(range.data()) % host_page_bytes == 0;
    const std::size_t align =
        page_aligned ? std::lcm(options.piece_alignment > 1 ? options.piece_alignment : 1, host_page_bytes) : range.size();
    std::size_t piece = std::max(options.max_piece_bytes, align);
    piece -= piece % align;
    // At least one piece per thread even below max_piece_bytes (a 4 GiB arena on 16 threads:
    // 16 pieces of 256 MiB rather than 4 of 1 GiB).
    const std::size_t per_thread = (range.size() + threads - 1) / threads;
    if (per_thread < piece) piece = std::max(align, (per_thread + align - 1) / align * align);
    for (std::size_t off = 0; off < range.size(); off += piece)
      pieces.push_back(range.subspan(off, std::min(piece, range.size() - off)));
    return pieces;
  }

  /// register_range that throws std::system_error.
  [[nodiscard]] static host_registration register_range(std::span<std::byte> range,
                                                        const registration_options& options = {}) {
    std::error_code ec;
    host_registration r = register_range(range, options, ec);
    if (ec) throw std::system_error(ec, "kvtier::cuda::host_registration: cudaHostRegister");
    return r;
  }

  host_registration(host_registration&& o) noexcept
      : range_(std::exchange(o.range_, {})),
        pieces_(std::move(o.pieces_)),
        stats_(o.stats_),
        device_(o.device_),
        threads_(o.threads_) {
    o.pieces_.clear();
  }
  host_registration& operator=(host_registration&& o) noexcept {
    if (this != &o) {
      release();
      range_ = std::exchange(o.range_, {});
      pieces_ = std::move(o.pieces_);
      o.pieces_.clear();
      stats_ = o.stats_;
      device_ = o.device_;
      threads_ = o.threads_;
    }
    return *this;
  }
  host_registration(const host_registration&) = delete;
  host_registration& operator=(const host_registration&) = delete;
  ~host_registration() { release(); }

  /// Unregisters every piece now (the destructor does it otherwise). Returns the first error.
  std::error_code unregister() noexcept { return release(); }

  [[nodiscard]] std::span<std::byte> range() const noexcept { return range_; }
  [[nodiscard]] std::span<const std::span<std::byte>> pieces() const noexcept { return pieces_; }
  [[nodiscard]] const registration_stats& stats() const noexcept { return stats_; }
  [[nodiscard]] bool empty() const noexcept { return pieces_.empty(); }
  [[nodiscard]] bool contains(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return !range_.empty() && b >= range_.data() && b < range_.data() + range_.size();
  }

  /// The address device code uses for host address p inside the range: p itself where the
  /// device can use host pointers for registered memory (cudaDevAttrCanUseHostPointerFor-
  /// RegisteredMem), else what cudaHostGetDevicePointer answers for p's piece. nullptr
  /// (and ec set) when p is outside the range or CUDA refuses.
  [[nodiscard]] void* device_pointer(void* p, std::error_code& ec) const noexcept {
    ec.clear();
    if (!contains(p)) {
      ec = std::make_error_code(std::errc::invalid_argument);
      return nullptr;
    }
    void* d = nullptr;
    if (const cudaError_t e = cudaHostGetDevicePointer(&d, p, 0); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return nullptr;
    }
    return d;
  }

 private:
  /// Runs f(i) for every piece index on `threads` threads (the caller's thread is one), each
  /// thread on device_. Pieces are taken from a shared counter, so a slow piece does not hold
  /// up the others.
  template <class F>
  void for_each_piece(unsigned threads, F&& f) const noexcept {
    std::atomic<std::size_t> next{0};
    auto work = [&]() noexcept {
      (void)cudaSetDevice(device_);
      for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces_.size();) f(i);
    };
    std::vector<std::thread> pool;
    try {
      pool.reserve(threads);
      for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
    } catch (...) {  // no more threads: the ones started and this one share the pieces
    }
    work();
    for (auto& t : pool) t.join();
  }

  std::error_code release() noexcept {
    std::error_code first;
    if (pieces_.empty()) return first;
    std::mutex m;
    auto unregister_one = [&](std::size_t i) {
      if (const cudaError_t e = cudaHostUnregister(pieces_[i].data()); e != cudaSuccess) {
        (void)cudaGetLastError();
        const std::lock_guard lock(m);
        if (!first) first = make_error_code(e);
      }
    };
    for_each_piece(std::max(1u, threads_), unregister_one);
    pieces_.clear();
    range_ = {};
    stats_ = {};
    return first;
  }

  std::span<std::byte> range_;
  std::vector<std::span<std::byte>> pieces_;
  registration_stats stats_;
  int device_ = 0;
  unsigned threads_ = 1;
};

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
