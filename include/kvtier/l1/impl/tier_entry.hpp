#pragma once
// l1::tier, one entry's lock state (part of kvtier/l1/impl/tier.hpp): the leaf mutators, each
// keeping the counts of evictable, read-locked and write-locked entries exact and none
// calling another, and the steps by which an entry leaves the tier (removed now, or marked
// removing and freed at its last unlock).

#include <kvtier/l1/tier.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
object_state tier<Policy, Bus>::state_of(const entry& e) noexcept {
  if (e.removing) return object_state::removing;
  if (e.write_locked) return object_state::write_locked;
  return e.readers() > 0 ? object_state::read_locked : object_state::ready;
}

// ---------------------------------------------------------------------------------------
// leaf mutators (each keeps evictable_, read_locked_ and write_locked_ exact)
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
template <class F>
void tier<Policy, Bus>::adjust(entry& e, F&& f) {
  const bool evictable_before = evictable(e);
  const bool read_before = e.readers() > 0;
  const bool write_before = e.write_locked;
  std::forward<F>(f)();
  const auto recount = [](std::size_t& n, bool before, bool after) {
    if (before && !after)
      --n;
    else if (!before && after)
      ++n;
  };
  recount(evictable_, evictable_before, evictable(e));
  recount(read_locked_, read_before, e.readers() > 0);
  recount(write_locked_, write_before, e.write_locked);
}

template <class Policy, class Bus>
void tier<Policy, Bus>::lock_write(entry& e, lock_lifetime lifetime, lazy_now& now) {
  adjust(e, [&] {
    e.write_locked = true;
    e.write_pinned = lifetime == lock_lifetime::pinned;
    if (!e.write_pinned) {
      e.write_deadline = now() + options_.write_lock_ttl;
      earliest_deadline_ = std::min(earliest_deadline_, e.write_deadline);
    }
  });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::unlock_write(entry& e) {
  adjust(e, [&] {
    e.write_locked = false;
    e.write_pinned = false;
  });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::add_readers(entry& e, lock_lifetime lifetime, std::uint32_t n, lazy_now& now) {
  adjust(e, [&] {
    if (lifetime == lock_lifetime::pinned) {
      e.pinned_readers += n;
    } else {
      e.expiring_readers += n;
      e.read_deadline = now() + options_.read_lock_ttl;
      earliest_deadline_ = std::min(earliest_deadline_, e.read_deadline);
    }
  });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::drop_readers(entry& e, lock_lifetime lifetime, std::uint32_t n) {
  adjust(e, [&] { (lifetime == lock_lifetime::pinned ? e.pinned_readers : e.expiring_readers) -= n; });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::policy_insert(entry& e) {
  adjust(e, [&] {
    policy_.on_insert(e, e.key);
    e.in_policy = true;
  });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::policy_leave(entry& e) {
  adjust(e, [&] {
    if (e.in_policy) policy_.on_remove(e);
    e.in_policy = false;
  });
}

template <class Policy, class Bus>
void tier<Policy, Bus>::free_slot(entry& e) {
  adjust(e, [&] {
    slots_.release(e.slot);
    const slot_id s = e.slot;
    e.key = {};
    e.bytes = 0;
    e.slot = s;
    e.expiring_readers = e.pinned_readers = 0;
    e.write_locked = e.write_pinned = e.temporary = e.in_policy = e.removing = e.announced = false;
  });
}

// ---------------------------------------------------------------------------------------
// leaving the tier
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
bool tier<Policy, Bus>::release_if_done(entry& e, tally& t) {
  if (e.locked()) return false;
  if (e.removing) {
    free_removed(e);
    return true;
  }
  if (e.temporary) {
    remove_object(e, bus::removal_reason::temporary, t);
    return true;
  }
  return false;
}

template <class Policy, class Bus>
bool tier<Policy, Bus>::drop_unfinished_write(entry& e, tally& t) {
  unlock_write(e);
  if (e.readers() > 0) {  // a reader of its verified prefix still copies: freed at its last hold
    if (!e.removing) mark_removing(e, t, bus::removal_reason::abandoned);
    return false;
  }
  if (e.removing)
    free_removed(e);  // already counted when it was removed
  else
    remove_object(e, bus::removal_reason::abandoned, t);
  return true;
}

// Counts the removal for l1_keys_evicted and, when the object was announced, logs its key
// event: it leaves the listing now (removed at once, or marked removing).
template <class Policy, class Bus>
void tier<Policy, Bus>::count_removal(entry& e, bus::removal_reason reason, tally& t) {
  const auto r = static_cast<std::size_t>(reason);
  ++t.removed_keys[r];
  t.removed_bytes[r] += e.bytes;
  if (!e.announced) return;  // never readable (a write abandoned or expired): never announced
  e.announced = false;
  if (!t.keys) return;
  bus::key_removal why = bus::key_removal::deleted;  // deleted, and a rewrite abandoned (its old object)
  if (reason == bus::removal_reason::evicted)
    why = bus::key_removal::evicted;
  else if (reason == bus::removal_reason::temporary)
    why = bus::key_removal::expired;
  key_log_.push_back({e.key, static_cast<std::uint8_t>(1 + static_cast<std::uint8_t>(why))});
}

template <class Policy, class Bus>
void tier<Policy, Bus>::remove_object(entry& e, bus::removal_reason reason, tally& t) {
  count_removal(e, reason, t);
  policy_leave(e);
  index_.erase(e.key);
  --objects_;
  object_bytes_ -= e.bytes;
  free_slot(e);
}

template <class Policy, class Bus>
void tier<Policy, Bus>::mark_removing(entry& e, tally& t, bus::removal_reason reason) {
  count_removal(e, reason, t);
  policy_leave(e);
  e.removing = true;
  --objects_;
  object_bytes_ -= e.bytes;
  ++removing_;
}

template <class Policy, class Bus>
void tier<Policy, Bus>::free_removed(entry& e) {
  index_.erase(e.key);
  --removing_;
  free_slot(e);
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
