// Replaces the global operator new/delete of the protocol test binary to record the
// largest single allocation while tracking is on (see allocation_tracker.hpp).
#include "protocol/allocation_tracker.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> g_track{false};
std::atomic<std::size_t> g_largest{0};

void note_allocation(std::size_t n) noexcept {
  if (!g_track.load(std::memory_order_relaxed)) return;
  std::size_t seen = g_largest.load(std::memory_order_relaxed);
  while (n > seen && !g_largest.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
}
}  // namespace

namespace kvtier::test {
void start_tracking_allocations() noexcept {
  g_largest.store(0);
  g_track.store(true);
}
std::size_t stop_tracking_allocations() noexcept {
  g_track.store(false);
  return g_largest.load();
}
}  // namespace kvtier::test

// Every non-aligned form is replaced, so each allocation is paired with its own release
// (the aligned forms stay the runtime's, paired among themselves).
void* operator new(std::size_t n) {
  note_allocation(n);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  note_allocation(n);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return ::operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
