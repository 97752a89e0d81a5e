// The global operator new/delete of the test binaries that use support/allocation_probe.hpp
// (see there), and the sanitizer malloc hook that stands in for them in sanitizer builds.
#include "support/allocation_probe.hpp"

#include <kvtier/config.hpp>

#include <atomic>
#include <cstdlib>
#include <new>

#if KVTIER_ASAN_BUILD || KVTIER_TSAN_BUILD
#define KVTIER_TEST_SANITIZER_OPERATOR_NEW 1
#else
#define KVTIER_TEST_SANITIZER_OPERATOR_NEW 0
#endif

namespace {

thread_local bool g_counting = false;
thread_local std::size_t g_count = 0;
std::atomic<bool> g_tracking{false};
std::atomic<std::size_t> g_largest{0};

void note_largest(std::size_t n) noexcept {
  if (!g_tracking.load(std::memory_order_relaxed)) return;
  std::size_t seen = g_largest.load(std::memory_order_relaxed);
  while (n > seen && !g_largest.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
}

}  // namespace

#if KVTIER_TEST_SANITIZER_OPERATOR_NEW
// The sanitizer runtimes (ASan, TSan) call this hook on every allocation, operator new's
// included (sanitizer/allocator_interface.h, which Debian's g++ 12 does not install).
extern "C" int __sanitizer_install_malloc_and_free_hooks(void (*malloc_hook)(const volatile void*, std::size_t),
                                                         void (*free_hook)(const volatile void*));

namespace {
void sanitizer_malloc_hook(const volatile void*, std::size_t n) { note_largest(n); }
void sanitizer_free_hook(const volatile void*) {}
}  // namespace
#endif

namespace kvtier::test {

void count_allocations(bool on) noexcept {
  if (on) g_count = 0;
  g_counting = on;
}
std::size_t counted_allocations() noexcept { return g_count; }
bool allocation_counting_available() noexcept { return !config::asan_build && !config::tsan_build; }

void start_tracking_allocations() noexcept {
#if KVTIER_TEST_SANITIZER_OPERATOR_NEW
  static const int installed = __sanitizer_install_malloc_and_free_hooks(sanitizer_malloc_hook, sanitizer_free_hook);
  (void)installed;
#endif
  g_largest.store(0);
  g_tracking.store(true);
}
std::size_t stop_tracking_allocations() noexcept {
  g_tracking.store(false);
  return g_largest.load();
}

}  // namespace kvtier::test

#if !KVTIER_TEST_SANITIZER_OPERATOR_NEW
namespace {
void note_allocation(std::size_t n) noexcept {
  if (g_counting) ++g_count;
  note_largest(n);
}
}  // namespace

// Every non-aligned form is replaced, so each allocation is paired with its own release (the
// aligned forms stay the runtime's, paired among themselves).
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
#endif
