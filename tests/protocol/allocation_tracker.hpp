#pragma once
// Test support: the largest single heap allocation a piece of code makes (the protocol
// tests show that a lying length never makes the decoder allocate what a body does not
// hold). The global operator new/delete replacements live in allocation_tracker.cpp, their
// own translation unit, so no call site sees both malloc and the new-expression.

#include <cstddef>

namespace kvtier::test {

void start_tracking_allocations() noexcept;
/// Stops tracking; returns the largest single allocation since the start.
std::size_t stop_tracking_allocations() noexcept;

/// The largest single allocation made by f().
template <class F>
std::size_t largest_allocation(F&& f) {
  start_tracking_allocations();
  f();
  return stop_tracking_allocations();
}

}  // namespace kvtier::test
