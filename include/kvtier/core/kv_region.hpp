#pragma once
// kv_region: an engine's paged KV cache in shared memory (a sealed memfd), plus one
// generation counter per block for fencing. The engine creates it and registers its fd with
// the server (SCM_RIGHTS); the server maps the same memory and copies between it and L1 with
// core/kv_transfer.hpp. Unlike the rest of core/ it needs POSIX. docs/integration.md,
// "Registering the region", holds its memory layout, the seals and the fencing protocol.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>
#include <kvtier/error.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

class kv_region {
 public:
  static constexpr unsigned required_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

  kv_region() = default;
  kv_region(kv_region&& o) noexcept { swap(o); }
  kv_region& operator=(kv_region&& o) noexcept {
    if (this != &o) {
      kv_region tmp(std::move(o));
      swap(tmp);
    }
    return *this;
  }
  kv_region(const kv_region&) = delete;
  kv_region& operator=(const kv_region&) = delete;
  ~kv_region() { close(); }

  /// Bytes of the memory of a region for `layout`: its data (total_bytes(), the end of the
  /// last row, 4 KiB aligned), then the generations.
  [[nodiscard]] static std::size_t bytes_for(const paged_kv_layout& layout) noexcept {
    return align_up(layout.total_bytes()) + align_up(std::size_t{layout.num_blocks} * sizeof(std::uint64_t));
  }

  /// Engine side: a new sealed memfd region, zero-filled (pages come on first touch).
  [[nodiscard]] static result<kv_region> create(const paged_kv_layout& layout, const char* name = "kvtier-kv") {
    if (!layout.validation_error().empty()) return make_error_code(errc::invalid_argument);
    const int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return error_code(errno, boost::system::system_category());
    const std::size_t bytes = bytes_for(layout);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 || ::fcntl(fd, F_ADD_SEALS, required_seals) != 0) {
      const int e = errno;
      ::close(fd);
      return error_code(e, boost::system::system_category());
    }
    return map(fd, layout, bytes);
  }

  /// Server side: maps an fd received from a client and, with `prefault_now`, prefaults it
  /// (prefault()), so the first copies into or out of it take no page faults (the server
  /// prefaults in the background instead where the kernel can: populate()). Takes ownership
  /// of fd (closed on failure too). Refuses (errc::layout_mismatch) an fd whose size is not
  /// bytes_for(layout) or that lacks the seals that keep the client from resizing it.
  [[nodiscard]] static result<kv_region> open(int fd, const paged_kv_layout& layout, bool prefault_now = true) {
    if (!layout.validation_error().empty()) {
      ::close(fd);
      return make_error_code(errc::invalid_argument);
    }
    struct stat st {};
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (::fstat(fd, &st) != 0 || seals < 0 || (static_cast<unsigned>(seals) & required_seals) != required_seals ||
        static_cast<std::size_t>(st.st_size) != bytes_for(layout)) {
      ::close(fd);
      return make_error_code(errc::layout_mismatch);
    }
    auto r = map(fd, layout, bytes_for(layout));
    if (r && prefault_now) prefault(r->base_, r->bytes_);
    return r;
  }

  /// Faults every page of [base, base + bytes) in now without changing a byte: one
  /// madvise(MADV_POPULATE_WRITE) (Linux 5.14), else a read of every page. A region's pages
  /// come on first touch (the memfd is sparse), so without this the first retrieves and
  /// stores into a fresh region pay a page fault per 4 KiB (~0.25 ms per MiB). Returns
  /// whether the kernel populated it (false: the read loop did).
  static bool prefault(std::byte* base, std::size_t bytes) noexcept {
    if (base == nullptr || bytes == 0) return true;
    if (populate(base, bytes) == 0) return true;
    const long page = ::sysconf(_SC_PAGESIZE);
    const std::size_t step = page > 0 ? static_cast<std::size_t>(page) : 4096;
    const volatile std::byte* p = base;
    for (std::size_t off = 0; off < bytes; off += step) (void)p[off];
    return false;
  }

  /// madvise(MADV_POPULATE_WRITE) over [base, base + bytes): the kernel faults the pages in
  /// without changing a byte. 0, or the errno: EINVAL where the kernel lacks it (before
  /// Linux 5.14), ENOMEM where the range is not mapped (any more). Never touches memory
  /// itself, so it is safe on a range another thread may unmap meanwhile (it fails, or
  /// populates whatever is mapped there then, changing no byte).
  static int populate(std::byte* base, std::size_t bytes) noexcept {
    constexpr int populate_write = 23;  // MADV_POPULATE_WRITE, absent from older headers
    return ::madvise(base, bytes, populate_write) == 0 ? 0 : errno;
  }

  /// Whether this kernel has MADV_POPULATE_WRITE (probed once, on a page of its own).
  [[nodiscard]] static bool populate_supported() noexcept {
    static const bool supported = [] {
      const long page = ::sysconf(_SC_PAGESIZE);
      const std::size_t n = page > 0 ? static_cast<std::size_t>(page) : 4096;
      void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return false;
      const bool ok = populate(static_cast<std::byte*>(p), n) == 0;
      ::munmap(p, n);
      return ok;
    }();
    return supported;
  }

  /// Start of the mapping (tests: residency checks).
  [[nodiscard]] std::byte* data() const noexcept { return base_; }

  [[nodiscard]] bool valid() const noexcept { return base_ != nullptr; }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] const paged_kv_layout& layout() const noexcept { return layout_; }

  /// Base pointer of each layer's tensor.
  [[nodiscard]] std::span<std::byte* const> layers() const noexcept { return layers_; }
  /// The region as kv_transfer sees it.
  [[nodiscard]] paged_kv_view view() const noexcept { return paged_kv_view{layout_, layers_}; }

  /// Engine: announce that `block` is about to hold new content (before writing it).
  void begin_reuse(std::uint32_t block) noexcept { generations_[block].fetch_add(1, std::memory_order_acq_rel); }

  /// The generation of `block`. An acq_rel read-modify-write, so every read of the block's
  /// bytes before it stays before it (the server's post-copy check).
  [[nodiscard]] std::uint64_t generation(std::uint32_t block) const noexcept {
    return generations_[block].fetch_add(0, std::memory_order_acq_rel);
  }

  /// Unmaps and closes (the other side keeps its own mapping).
  void close() noexcept {
    if (base_) ::munmap(base_, bytes_);
    if (fd_ >= 0) ::close(fd_);
    base_ = nullptr;
    fd_ = -1;
    bytes_ = 0;
    layers_.clear();
    generations_ = nullptr;
  }

 private:
  static result<kv_region> map(int fd, const paged_kv_layout& layout, std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return error_code(e, boost::system::system_category());
    }
    kv_region r;
    r.fd_ = fd;
    r.base_ = static_cast<std::byte*>(p);
    r.bytes_ = bytes;
    r.layout_ = layout;
    const std::uint64_t layer_stride = layout.effective_strides().layer;
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l) r.layers_.push_back(r.base_ + l * layer_stride);
    static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "generations live in shared memory");
    r.generations_ = reinterpret_cast<std::atomic<std::uint64_t>*>(r.base_ + align_up(layout.total_bytes()));
    return r;
  }

  void swap(kv_region& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(layout_, o.layout_);
    std::swap(layers_, o.layers_);
    std::swap(generations_, o.generations_);
  }

  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  paged_kv_layout layout_{};
  std::vector<std::byte*> layers_;
  std::atomic<std::uint64_t>* generations_ = nullptr;
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
