#pragma once
// l1::tier, deletion on request (part of kvtier/l1/impl/tier.hpp): remove, clear and
// remove_if, and the listing for_each_object. A locked object leaves the tier only when
// forced, and its memory waits for its last lock.

#include <kvtier/l1/tier.hpp>

#include <cstddef>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::remove(std::span<const chunk_key> keys, bool force, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  return for_each_key(keys, out, [&](entry* e, std::size_t, lazy_now&, tally& t) {
    if (e == nullptr || e->removing) return status::not_found;
    if (!e->locked()) {
      remove_object(*e, bus::removal_reason::deleted, t);
      return status::success;
    }
    if (!force) return status::locked;
    mark_removing(*e, t);
    return status::success;
  });
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::clear(bool force) {
  return run_locked([&](lazy_now& now, tally& t) {
    std::size_t removed = 0;
    for (std::size_t s = 0; s < options_.slot_count; ++s) {
      entry& e = entries_[s];
      if (!slots_.is_allocated(e.slot) || e.removing) continue;
      if (expire(e, now, t) || e.removing) continue;  // gone, or left with a prefix reader
      if (!e.locked()) {
        remove_object(e, bus::removal_reason::deleted, t);
        ++removed;
      } else if (force) {
        mark_removing(e, t);
        ++removed;
      }
    }
    return removed;
  });
}

template <class Policy, class Bus>
template <class Pred>
removal_summary tier<Policy, Bus>::remove_if(Pred&& pred, bool force) {
  return run_locked([&](lazy_now& now, tally& t) {
    removal_summary r;
    for (std::size_t s = 0; s < options_.slot_count; ++s) {
      entry& e = entries_[s];
      if (!slots_.is_allocated(e.slot) || e.removing) continue;
      if (expire(e, now, t) || e.removing) continue;  // gone, or left with a prefix reader
      if (!pred(static_cast<const chunk_key&>(e.key))) continue;
      const std::size_t bytes = e.bytes;
      if (!e.locked()) {
        remove_object(e, bus::removal_reason::deleted, t);
      } else if (force) {
        mark_removing(e, t);
      } else {
        ++r.locked;
        r.locked_bytes += bytes;
        continue;
      }
      ++r.removed;
      r.removed_bytes += bytes;
    }
    return r;
  });
}

template <class Policy, class Bus>
template <class F>
void tier<Policy, Bus>::for_each_object(F&& f) {
  run_locked([&](lazy_now&, tally&) {
    for (std::size_t s = 0; s < options_.slot_count; ++s) {
      const entry& e = entries_[s];
      if (!slots_.is_allocated(e.slot) || e.removing) continue;
      f(static_cast<const chunk_key&>(e.key), e.bytes, state_of(e));
    }
    return 0;
  });
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
