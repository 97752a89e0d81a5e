#pragma once
// l1::tier, room for new objects (part of kvtier/l1/impl/tier.hpp): eviction down to the
// target when an allocation would pass the watermark, a sweep of expired locks when short,
// and the placement of new write-locked objects in the slots found.

#include <kvtier/l1/tier.hpp>

#include <algorithm>
#include <cstddef>
#include <mutex>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::evict() {
  return run_locked([&](lazy_now&, tally& t) -> std::size_t {
    const std::size_t used = slots_.used_count();
    return used > watermark_slots_ ? evict_n(std::min(used - target_slots_, evictable_), t) : 0;
  });
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::evict_n(std::size_t n, tally& t) {
  if (n == 0) return 0;
  victims_.clear();
  policy_.select_victims(
      n, [](const typename Policy::hook& h) { return evictable(static_cast<const entry&>(h)); }, victims_);
  std::size_t evicted = 0;
  for (auto* h : victims_) {
    entry& e = entry_of(*h);
    // A policy must return evictable objects only; one that does not is ignored rather
    // than freed under its holder.
    if (!evictable(e)) continue;
    remove_object(e, bus::removal_reason::evicted, t);
    ++evicted;
  }
  return evicted;
}

template <class Policy, class Bus>
bool tier<Policy, Bus>::ensure_room(std::size_t need, lazy_now& now, tally& t) {
  for (bool swept = false;; swept = true) {
    const std::size_t free = slots_.free_count();
    const std::size_t used = slots_.used_count();
    const std::size_t required = need > free ? need - free : 0;
    // Above the watermark, free down to the target (>= required, as target <= capacity).
    const std::size_t wanted = used + need > watermark_slots_ ? used + need - target_slots_ : 0;
    if (required <= evictable_) {
      if (wanted > 0) evict_n(std::min(wanted, evictable_), t);
      if (slots_.free_count() >= need) return true;
    }
    // Short of room: drop expired locks (a crashed client's) and try once more.
    if (swept || expire_all(now, t) == 0) return false;
  }
}

// As many of `need` new slots as can be had: evicts unlocked objects (down to the target
// when the watermark would be passed), sweeps expired locks once when short. Returns how
// many slots are free for the caller, at most need.
template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::room_for(std::size_t need, lazy_now& now, tally& t) {
  for (bool swept = false;; swept = true) {
    const std::size_t used = slots_.used_count();
    const std::size_t wanted = used + need > watermark_slots_ ? used + need - target_slots_ : 0;
    if (wanted > 0 && evictable_ > 0) evict_n(std::min(wanted, evictable_), t);
    if (slots_.free_count() >= need || swept || expire_all(now, t) == 0) return std::min(need, slots_.free_count());
  }
}

template <class Policy, class Bus>
void tier<Policy, Bus>::place_new_keys(std::span<const chunk_key> keys, std::size_t count, std::size_t bytes,
                                       bool temporary, lock_lifetime lock, std::span<std::span<std::byte>> buffers,
                                       lazy_now& now) {
  new_slots_.clear();
  const bool allocated = slots_.allocate(count, new_slots_);
  (void)allocated;  // ensure_room / room_for guaranteed the room
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t i = new_positions_[j];
    entry& e = entries_[new_slots_[j]];
    e.key = keys[i];
    e.bytes = bytes;
    e.temporary = temporary;
    lock_write(e, lock, now);
    ++objects_;
    object_bytes_ += bytes;
    *new_index_slots_[j] = &e;
    if (!buffers.empty()) buffers[i] = {slots_.data(e.slot), bytes};
  }
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
