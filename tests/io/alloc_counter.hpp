#pragma once
// Counts calls of the global operator new made by this thread (see alloc_counter.cpp).

#include <cstddef>

namespace kvtier::test {
/// Starts (from zero) or stops counting on this thread.
void count_allocations(bool on) noexcept;
/// operator new calls counted on this thread since counting started.
std::size_t counted_allocations() noexcept;
}  // namespace kvtier::test
