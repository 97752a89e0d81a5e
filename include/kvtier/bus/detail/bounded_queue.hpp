#pragma once
// A bounded multi-producer multi-consumer queue (Dmitry Vyukov's array queue): one CAS per
// push and per pop, no allocation after construction. try_push fails instead of blocking
// when the queue is full; the caller counts the drop.

#include <kvtier/config.hpp>

#include <atomic>
#include <bit>
#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {
namespace detail {

template <class T>
class bounded_queue {
 public:
  /// capacity is rounded up to a power of two (at least 2).
  explicit bounded_queue(std::size_t capacity)
      : mask_(std::bit_ceil(capacity < 2 ? std::size_t{2} : capacity) - 1), cells_(new cell[mask_ + 1]) {
    for (std::size_t i = 0; i <= mask_; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }

  bounded_queue(const bounded_queue&) = delete;
  bounded_queue& operator=(const bounded_queue&) = delete;

  ~bounded_queue() {
    while (try_pop()) {
    }
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return mask_ + 1; }

  /// Moves v in and returns true, or returns false (v untouched) when the queue is full.
  bool try_push(T&& v) noexcept(std::is_nothrow_move_constructible_v<T>) { return push(std::move(v)); }

  /// Constructs a T from args in its cell and returns true, or returns false (nothing
  /// constructed) when the queue is full. The construction must not throw (a T that would
  /// leaves its claimed cell unpublished for ever): pass what T's constructor only moves. So a
  /// std::variant T is built in place with its alternative known, never moved (g++ 12 at -O1
  /// warns of a maybe-uninitialized member of another alternative when a variant temporary
  /// is moved in).
  template <class... Args>
  bool try_emplace(Args&&... args) noexcept(std::is_nothrow_constructible_v<T, Args...>) {
    return push(std::forward<Args>(args)...);
  }

  /// Pops the oldest element, or nullopt when empty.
  std::optional<T> try_pop() noexcept(std::is_nothrow_move_constructible_v<T>) {
    std::size_t pos = dequeue_.load(std::memory_order_relaxed);
    for (;;) {
      cell& c = cells_[pos & mask_];
      const std::size_t seq = c.sequence.load(std::memory_order_acquire);
      const auto diff = static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(pos + 1);
      if (diff == 0) {
        if (dequeue_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          T* p = std::launder(reinterpret_cast<T*>(c.storage));
          std::optional<T> out(std::move(*p));
          p->~T();
          c.sequence.store(pos + mask_ + 1, std::memory_order_release);
          return out;
        }
      } else if (diff < 0) {
        return std::nullopt;  // empty
      } else {
        pos = dequeue_.load(std::memory_order_relaxed);
      }
    }
  }

  /// A snapshot, exact only when no push or pop runs concurrently.
  [[nodiscard]] bool empty_approx() const noexcept {
    return enqueue_.load(std::memory_order_acquire) == dequeue_.load(std::memory_order_acquire);
  }

 private:
  // Claims a cell, constructs a T from args in it (must not throw once claimed: callers pass
  // nothrow arguments), publishes it. False when full.
  template <class... Args>
  bool push(Args&&... args) noexcept(std::is_nothrow_constructible_v<T, Args...>) {
    std::size_t pos = enqueue_.load(std::memory_order_relaxed);
    for (;;) {
      cell& c = cells_[pos & mask_];
      const std::size_t seq = c.sequence.load(std::memory_order_acquire);
      const auto diff = static_cast<std::ptrdiff_t>(seq) - static_cast<std::ptrdiff_t>(pos);
      if (diff == 0) {
        if (enqueue_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          ::new (static_cast<void*>(c.storage)) T(std::forward<Args>(args)...);
          c.sequence.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = enqueue_.load(std::memory_order_relaxed);
      }
    }
  }

  struct cell {
    std::atomic<std::size_t> sequence;
    alignas(T) unsigned char storage[sizeof(T)];
  };

  const std::size_t mask_;
  std::unique_ptr<cell[]> cells_;
  alignas(config::cache_line_size) std::atomic<std::size_t> enqueue_{0};
  alignas(config::cache_line_size) std::atomic<std::size_t> dequeue_{0};
};

}  // namespace detail
}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
