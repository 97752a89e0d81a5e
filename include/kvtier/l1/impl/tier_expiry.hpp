#pragma once
// l1::tier, TTL expiry of locks (part of kvtier/l1/impl/tier.hpp): an expired write lock drops
// its unfinished object, expired read holds all go at once. Expiry runs lazily (on the key an
// operation touches, and as a sweep when an allocation runs short) and from expire_locks().

#include <kvtier/l1/tier.hpp>

#include <algorithm>
#include <cstddef>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::expire_locks() {
  return run_locked([&](lazy_now& now, tally& t) { return expire_all(now, t); });
}

template <class Policy, class Bus>
bool tier<Policy, Bus>::expire(entry& e, lazy_now& now, tally& t) {
  if (!e.has_expiring_lock()) return false;
  if (e.write_locked && !e.write_pinned && now() >= e.write_deadline) {
    // The writer went silent: its data never completed, so the object goes (an update
    // that expires loses the old object too, its memory was being overwritten).
    ++t.expired[static_cast<std::size_t>(bus::lock_kind::write)];
    return drop_unfinished_write(e, t);  // false: a prefix reader keeps it (removing)
  }
  if (e.expiring_readers > 0 && now() >= e.read_deadline) {
    ++t.expired[static_cast<std::size_t>(bus::lock_kind::read)];
    t.expired_read_holds += e.expiring_readers;
    drop_readers(e, lock_lifetime::expiring, e.expiring_readers);
    return release_if_done(e, t);
  }
  return false;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::expire_all(lazy_now& now, tally& t) {
  if (earliest_deadline_ == time_point::max() || now() < earliest_deadline_) return 0;
  const auto before = t.expired;
  time_point earliest = time_point::max();
  for (std::size_t s = 0; s < options_.slot_count; ++s) {
    entry& e = entries_[s];
    if (!slots_.is_allocated(e.slot) || expire(e, now, t)) continue;
    if (e.write_locked && !e.write_pinned) earliest = std::min(earliest, e.write_deadline);
    if (e.expiring_readers > 0) earliest = std::min(earliest, e.read_deadline);
  }
  earliest_deadline_ = earliest;
  std::size_t n = 0;
  for (std::size_t k = 0; k < bus::lock_kind_count; ++k) n += t.expired[k] - before[k];
  return n;
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
