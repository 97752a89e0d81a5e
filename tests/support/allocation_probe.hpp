#pragma once
// Test support: what a piece of code allocates on the heap, seen through the global operator
// new. Two questions:
//   - how many operator new calls this thread made (count_allocations, counted_allocations):
//     "no heap allocation per operation" (tests/io);
//   - the largest single allocation while tracking (largest_allocation): a lying length never
//     makes a decoder allocate what a body does not hold (tests/protocol).
// The probe (allocation_probe.cpp, linked into the test binaries that use it) replaces every
// non-aligned form of operator new and delete, in a translation unit of its own: g++ flags a
// replaced operator delete that frees memory it sees allocated by operator new in the same
// unit. Sanitizer builds keep the sanitizer's operator new (it checks new/delete pairs):
// there nothing is counted (allocation_counting_available() is false), and the largest
// allocation is read from the sanitizer's malloc hook instead.

#include <cstddef>

namespace kvtier::test {

/// Starts (from zero) or stops counting operator new calls on this thread; other threads and
/// tests are unaffected.
void count_allocations(bool on) noexcept;
/// operator new calls counted on this thread since counting started.
std::size_t counted_allocations() noexcept;
/// False in sanitizer builds, which keep their own operator new: nothing is counted there.
bool allocation_counting_available() noexcept;

/// Starts tracking the largest single allocation (any thread), from zero.
void start_tracking_allocations() noexcept;
/// Stops tracking; returns the largest single allocation since the start.
std::size_t stop_tracking_allocations() noexcept;

/// The largest single allocation made by f() (and by any other thread meanwhile).
template <class F>
std::size_t largest_allocation(F&& f) {
  start_tracking_allocations();
  f();
  return stop_tracking_allocations();
}

}  // namespace kvtier::test
