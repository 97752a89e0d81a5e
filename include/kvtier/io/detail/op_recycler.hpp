#pragma once
// op_recycler: a per-ring cache of freed operation blocks, so that in steady state starting
// an I/O operation takes no malloc. Blocks are sorted into power-of-two size classes (64 B to
// 1 KiB: an op with its handler is 100-400 bytes); each class keeps up to `max_cached`
// blocks, which bounds the memory held to what the deepest burst needed. Larger or
// over-aligned blocks go straight to operator new.
//
// Not thread-safe: one ring allocates and frees on its own thread. (Asio's thread-local
// recycling allocator keeps only 2 blocks per purpose, and a queue 32 deep needs 32.)

#include <kvtier/config.hpp>
#include <kvtier/io/stats.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <new>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

class op_recycler {
 public:
  static constexpr std::size_t min_block = 64;
  static constexpr std::size_t class_count = 5;  // 64, 128, 256, 512, 1024
  static constexpr std::size_t max_cached = 1024;

  explicit op_recycler(io_stats* stats = nullptr) noexcept : stats_(stats) {}
  op_recycler(const op_recycler&) = delete;
  op_recycler& operator=(const op_recycler&) = delete;
  ~op_recycler() {
    for (auto& c : classes_) {
      while (c.head != nullptr) {
        free_block* b = c.head;
        c.head = b->next;
        ::operator delete(b);
      }
    }
  }

  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t align) {
    const std::size_t c = size_class(bytes, align);
    if (c < class_count && classes_[c].head != nullptr) {
      free_block* b = classes_[c].head;
      classes_[c].head = b->next;
      --classes_[c].count;
      return b;
    }
    if (stats_ != nullptr) bump_owned(stats_->op_heap_allocations);
    if (c < class_count) return ::operator new(min_block << c);
    return ::operator new(bytes, std::align_val_t{align});
  }

  void deallocate(void* p, std::size_t bytes, std::size_t align) noexcept {
    const std::size_t c = size_class(bytes, align);
    if (c < class_count) {
      if (classes_[c].count < max_cached) {
        auto* b = static_cast<free_block*>(p);
        b->next = classes_[c].head;
        classes_[c].head = b;
        ++classes_[c].count;
        return;
      }
      ::operator delete(p);
      return;
    }
    ::operator delete(p, std::align_val_t{align});
  }

  /// Blocks cached now (for tests).
  [[nodiscard]] std::size_t cached() const noexcept {
    std::size_t n = 0;
    for (const auto& c : classes_) n += c.count;
    return n;
  }

 private:
  struct free_block {
    free_block* next;
  };
  struct size_class_list {
    free_block* head = nullptr;
    std::size_t count = 0;
  };

  /// The class index, or class_count for blocks the cache does not take.
  static constexpr std::size_t size_class(std::size_t bytes, std::size_t align) noexcept {
    if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) return class_count;
    std::size_t c = 0;
    for (std::size_t s = min_block; s < bytes; s <<= 1) ++c;
    return c;
  }

  std::array<size_class_list, class_count> classes_{};
  io_stats* stats_;
};

/// A standard allocator over an op_recycler: the default allocator of ring operations whose
/// handler has no associated allocator of its own.
template <class T>
class recycling_op_allocator {
 public:
  using value_type = T;

  explicit recycling_op_allocator(op_recycler& r) noexcept : r_(&r) {}
  template <class U>
  recycling_op_allocator(const recycling_op_allocator<U>& o) noexcept : r_(o.recycler()) {}  // NOLINT

  [[nodiscard]] T* allocate(std::size_t n) { return static_cast<T*>(r_->allocate(n * sizeof(T), alignof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { r_->deallocate(p, n * sizeof(T), alignof(T)); }

  [[nodiscard]] op_recycler* recycler() const noexcept { return r_; }

  template <class U>
  friend bool operator==(const recycling_op_allocator& a, const recycling_op_allocator<U>& b) noexcept {
    return a.recycler() == b.recycler();
  }

 private:
  op_recycler* r_;
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
