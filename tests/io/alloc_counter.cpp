// A counting global operator new for the test binary, to check "no heap allocation per op".
// It counts only on a thread that turned counting on, so other tests and threads are
// unaffected. Not in sanitizer builds (see below). In a file of its own: g++ flags a replaced operator delete that frees memory
// it sees allocated by operator new in the same translation unit.
#include "alloc_counter.hpp"

#include <kvtier/config.hpp>

#include <cstdlib>
#include <new>

namespace {
thread_local bool g_counting = false;
thread_local std::size_t g_count = 0;
}  // namespace

namespace kvtier::test {
void count_allocations(bool on) noexcept {
  if (on) g_count = 0;
  g_counting = on;
}
std::size_t counted_allocations() noexcept { return g_count; }
bool allocation_counting_available() noexcept { return !config::asan_build && !config::tsan_build; }
}  // namespace kvtier::test

// Sanitizers bring their own operator new (and check new/delete pairs): no replacement there.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)

void* operator new(std::size_t n) {
  if (g_counting) ++g_count;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif
