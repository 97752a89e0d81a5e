#pragma once
// Counts calls of the global operator new made by this thread (see alloc_counter.cpp).

#include <cstddef>

namespace kvtier::test {
/// Starts (from zero) or stops counting on this thread.
void count_allocations(bool on) noexcept;
/// operator new calls counted on this thread since counting started.
std::size_t counted_allocations() noexcept;
/// False in sanitizer builds, which keep their own operator new: nothing is counted there.
bool allocation_counting_available() noexcept;
}  // namespace kvtier::test
