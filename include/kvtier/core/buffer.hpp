#pragma once
// aligned_buffer: an owned, 4 KiB-aligned byte buffer whose size is a multiple of 4 KiB, the
// alignment O_DIRECT and io_uring fixed buffers need (or aligned more: an arena on a huge-page
// boundary). Standard library only.

#include <kvtier/config.hpp>

#include <cstddef>
#include <cstring>
#include <new>
#include <span>
#include <stdexcept>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

/// Alignment of every buffer, slot and on-disk object: the page size, which is what O_DIRECT
/// wants for buffers, offsets and lengths on ext4 and tmpfs (EINVAL otherwise).
inline constexpr std::size_t buffer_alignment = 4096;

/// x86-64's transparent huge page. An arena at least this large is allocated on its boundary
/// (slot_allocator), so that huge pages cover it from its first byte: a 4 KiB-aligned one
/// leaves up to 2 MiB at its start in 4 KiB pages, the first slot handed out among them.
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// Rounds n up to a multiple of buffer_alignment.
[[nodiscard]] constexpr std::size_t align_up(std::size_t n) noexcept {
  return (n + buffer_alignment - 1) & ~(buffer_alignment - 1);
}

class aligned_buffer {
 public:
  aligned_buffer() noexcept = default;

  /// Allocates align_up(bytes) bytes on an `alignment` boundary (a power of two, at least
  /// buffer_alignment; std::invalid_argument otherwise); the memory is not initialised (the
  /// kernel gives zero pages on first touch, and a multi-GiB L1 must not be touched at
  /// start-up).
  explicit aligned_buffer(std::size_t bytes, std::size_t alignment = buffer_alignment)
      : size_(align_up(bytes)), alignment_(checked_alignment(alignment)),
        data_(size_ ? static_cast<std::byte*>(::operator new(size_, std::align_val_t{alignment_})) : nullptr) {}

  aligned_buffer(aligned_buffer&& o) noexcept
      : size_(std::exchange(o.size_, 0)),
        alignment_(std::exchange(o.alignment_, buffer_alignment)),
        data_(std::exchange(o.data_, nullptr)) {}
  aligned_buffer& operator=(aligned_buffer&& o) noexcept {
    if (this != &o) {
      release();
      size_ = std::exchange(o.size_, 0);
      alignment_ = std::exchange(o.alignment_, buffer_alignment);
      data_ = std::exchange(o.data_, nullptr);
    }
    return *this;
  }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  ~aligned_buffer() { release(); }

  [[nodiscard]] std::byte* data() noexcept { return data_; }
  [[nodiscard]] const std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::span<std::byte> span() noexcept { return {data_, size_}; }
  [[nodiscard]] std::span<const std::byte> span() const noexcept { return {data_, size_}; }

  void fill(std::byte value) noexcept {
    if (data_) std::memset(data_, static_cast<int>(value), size_);
  }

 private:
  static std::size_t checked_alignment(std::size_t a) {
    if (a < buffer_alignment || (a & (a - 1)) != 0)
      throw std::invalid_argument("kvtier::aligned_buffer: the alignment must be a power of two of at least 4 KiB");
    return a;
  }
  void release() noexcept {
    if (data_) ::operator delete(data_, std::align_val_t{alignment_});
    data_ = nullptr;
    size_ = 0;
  }

  std::size_t size_ = 0;
  std::size_t alignment_ = buffer_alignment;
  std::byte* data_ = nullptr;
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
