#pragma once
// Definitions of l1::tier (declarations and documentation: kvtier/l1/tier.hpp), one file per
// concern:
//   impl/tier.hpp             construction, argument checks, the frame every operation runs
//                             in (mutex, clock, key events published before the mutex is
//                             released, count events after), queries
//   impl/tier_entry.hpp       one entry's lock state: the leaf mutators that keep
//                             evictable_, read_locked_ and write_locked_ exact, and an
//                             entry leaving the tier
//   impl/tier_writes.hpp      reserve_write, finish_write(_and_reserve_read), abandon_write
//   impl/tier_reads.hpp       reserve_read, finish_read, read_views, touch
//   impl/tier_prefix.hpp      reserve_prefix
//   impl/tier_allocation.hpp  room for new objects: eviction, new slots
//   impl/tier_expiry.hpp      TTL expiry of locks
//   impl/tier_removal.hpp     remove, clear

#include <kvtier/l1/tier.hpp>

#include <kvtier/l1/impl/tier_allocation.hpp>
#include <kvtier/l1/impl/tier_entry.hpp>
#include <kvtier/l1/impl/tier_expiry.hpp>
#include <kvtier/l1/impl/tier_prefix.hpp>
#include <kvtier/l1/impl/tier_reads.hpp>
#include <kvtier/l1/impl/tier_removal.hpp>
#include <kvtier/l1/impl/tier_writes.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

inline void tier_options::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("kvtier::l1::tier_options: " + what); };
  if (slot_bytes == 0)
    fail("slot_bytes is 0: set it to the size of the largest object (e.g. chunk_layout::object_bytes())");
  if (slot_count == 0) fail("slot_count is 0: give the tier at least one slot");
  if (slot_count > UINT32_MAX) fail("slot_count " + std::to_string(slot_count) + " exceeds 2^32 - 1: use larger slots");
  if (slot_bytes > SIZE_MAX / 2 / slot_count) fail("slot_bytes * slot_count overflows: lower slot_count or slot_bytes");
  if (write_lock_ttl <= clock_type::duration::zero())
    fail("write_lock_ttl must be positive (LMCache's default: 600 s)");
  if (read_lock_ttl <= clock_type::duration::zero()) fail("read_lock_ttl must be positive (LMCache's default: 300 s)");
  if (!(eviction_watermark > 0.0 && eviction_watermark <= 1.0))
    fail("eviction_watermark " + std::to_string(eviction_watermark) + " must be in (0, 1] (default 0.8)");
  if (!(eviction_target >= 0.0 && eviction_target < eviction_watermark))
    fail("eviction_target " + std::to_string(eviction_target) + " must be in [0, eviction_watermark = " +
         std::to_string(eviction_watermark) + "): lower the target or raise the watermark (defaults 0.7 and 0.8)");
  if (!clock) fail("clock is empty: leave the default (steady_clock::now) or give a time source");
}

template <class Policy, class Bus>
tier<Policy, Bus>::tier(tier_options options, Bus& bus, Policy policy)
    : options_((options.validate(), std::move(options))),
      bus_(bus),
      slots_(options_.slot_bytes, options_.slot_count),
      policy_(std::move(policy)),
      entries_(new entry[options_.slot_count]) {
  const auto count = static_cast<double>(options_.slot_count);
  watermark_slots_ = static_cast<std::size_t>(std::floor(count * options_.eviction_watermark));
  target_slots_ = std::min(watermark_slots_, static_cast<std::size_t>(std::floor(count * options_.eviction_target)));
  for (std::size_t s = 0; s < options_.slot_count; ++s) entries_[s].slot = static_cast<slot_id>(s);
  index_.reserve(options_.slot_count);
  if constexpr (capacity_aware_policy<Policy>) policy_.set_capacity(std::max<std::size_t>(watermark_slots_, 1));
}

// ---------------------------------------------------------------------------------------
// the frame of an operation
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
template <class F>
auto tier<Policy, Bus>::run_locked(F&& f) {
  tally t;
  auto r = [&] {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    t.keys = wants_key_events();
    if (!t.keys) return std::forward<F>(f)(now, t);
    // The key events go into the bus's queue before the mutex is released: two operations
    // on one key (stored by one thread, removed by another) are queued in index order.
    key_log_.clear();
    try {
      auto result = std::forward<F>(f)(now, t);
      publish_keys();
      return result;
    } catch (...) {
      publish_keys();  // what changed before the throw (a predicate of remove_if) changed
      throw;
    }
  }();
  publish(t);
  return r;
}

template <class Policy, class Bus>
template <class PerKey>
std::size_t tier<Policy, Bus>::for_each_key(std::span<const chunk_key> keys, std::span<status> out, PerKey&& per_key) {
  return run_locked([&](lazy_now& now, tally& t) {
    std::size_t ok = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const status s = per_key(lookup(keys[i], now, t), i, now, t);
      if (!out.empty()) out[i] = s;
      ok += s == status::success ? 1 : 0;
    }
    return ok;
  });
}

template <class Policy, class Bus>
typename tier<Policy, Bus>::entry* tier<Policy, Bus>::lookup(const chunk_key& key, lazy_now& now, tally& t) {
  auto it = index_.find(key);
  if (it == index_.end() || it->second == nullptr) return nullptr;
  entry* e = it->second;
  return expire(*e, now, t) ? nullptr : e;
}

template <class Policy, class Bus>
void tier<Policy, Bus>::publish(const tally& t) {
  if constexpr (Bus::template handles_event<bus::l1_keys_evicted>) {
    for (std::size_t r = 0; r < bus::removal_reason_count; ++r)
      if (t.removed_keys[r] > 0)
        bus_.publish(bus::l1_keys_evicted{t.removed_keys[r], t.removed_bytes[r], static_cast<bus::removal_reason>(r)});
  }
  if constexpr (Bus::template handles_event<bus::l1_lock_expired>) {
    for (std::size_t k = 0; k < bus::lock_kind_count; ++k)
      if (t.expired[k] > 0) {
        const auto kind = static_cast<bus::lock_kind>(k);
        bus_.publish(bus::l1_lock_expired{t.expired[k], kind, kind == bus::lock_kind::read ? t.expired_read_holds : 0});
      }
  }
}

template <class Policy, class Bus>
bool tier<Policy, Bus>::wants_key_events() const noexcept {
  if constexpr (Bus::template handles_event<bus::tier_keys_stored> ||
                Bus::template handles_event<bus::tier_keys_removed>)
    return bus::wants_kind<bus::tier_keys_stored>(bus_) || bus::wants_kind<bus::tier_keys_removed>(bus_);
  else
    return false;
}

template <class Policy, class Bus>
void tier<Policy, Bus>::announce_stored(entry& e, tally& t) {
  if (e.announced) return;  // a rewrite: still the same key held
  e.announced = true;
  if (t.keys) key_log_.push_back({e.key, 0});
}

template <class Policy, class Bus>
void tier<Policy, Bus>::publish_keys() {
  if constexpr (Bus::template handles_event<bus::tier_keys_stored> ||
                Bus::template handles_event<bus::tier_keys_removed>) {
    const bool stored = bus::wants_kind<bus::tier_keys_stored>(bus_);
    const bool removed = bus::wants_kind<bus::tier_keys_removed>(bus_);
    // Runs of one change: one event per run, in log order.
    for (std::size_t i = 0; i < key_log_.size();) {
      const std::uint8_t change = key_log_[i].change;
      std::size_t end = i;
      while (end < key_log_.size() && key_log_[end].change == change) ++end;
      if (change == 0 ? stored : removed) {
        std::vector<chunk_key> keys;
        keys.reserve(end - i);
        for (std::size_t j = i; j < end; ++j) keys.push_back(key_log_[j].key);
        if (change == 0)
          bus_.publish(bus::tier_keys_stored{bus::l1_tier, std::move(keys)});
        else
          bus_.publish(
              bus::tier_keys_removed{bus::l1_tier, static_cast<bus::key_removal>(change - 1), std::move(keys)});
      }
      i = end;
    }
  }
  key_log_.clear();
}

// ---------------------------------------------------------------------------------------
// argument checks
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
void tier<Policy, Bus>::check_span(std::size_t keys, std::size_t other, const char* what) {
  if (keys != other)
    throw std::invalid_argument(std::string("kvtier::l1::tier: the '") + what + "' span has " + std::to_string(other) +
                                " elements for " + std::to_string(keys) + " keys: give one per key");
}

template <class Policy, class Bus>
void tier<Policy, Bus>::check_extra(std::uint32_t extra_count) {
  if (extra_count > max_extra_count)
    throw std::invalid_argument("kvtier::l1::tier: extra_count " + std::to_string(extra_count) + " exceeds " +
                                std::to_string(max_extra_count));
}

template <class Policy, class Bus>
void tier<Policy, Bus>::check_object_bytes(std::size_t object_bytes, const char* operation) const {
  if (object_bytes > slots_.slot_bytes())
    throw std::invalid_argument(std::string("kvtier::l1::tier::") + operation + ": object_bytes " +
                                std::to_string(object_bytes) + " does not fit a slot of " +
                                std::to_string(slots_.slot_bytes()) +
                                " bytes: raise tier_options::slot_bytes to the largest object size");
}

// ---------------------------------------------------------------------------------------
// queries
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
object_state tier<Policy, Bus>::state(const chunk_key& key) {
  return run_locked([&](lazy_now& now, tally& t) {
    const entry* e = lookup(key, now, t);
    return e != nullptr ? state_of(*e) : object_state::absent;
  });
}

template <class Policy, class Bus>
std::optional<object_info> tier<Policy, Bus>::info(const chunk_key& key) {
  return run_locked([&](lazy_now& now, tally& t) -> std::optional<object_info> {
    const entry* e = lookup(key, now, t);
    if (e == nullptr) return std::nullopt;
    return object_info{.state = state_of(*e),
                       .bytes = e->bytes,
                       .temporary = e->temporary,
                       .write_pinned = e->write_locked && e->write_pinned,
                       .expiring_readers = e->expiring_readers,
                       .pinned_readers = e->pinned_readers};
  });
}

template <class Policy, class Bus>
usage_info tier<Policy, Bus>::usage() const {
  std::lock_guard g(mutex_);
  usage_info u;
  u.slots_used = slots_.used_count();
  u.bytes_used = slots_.bytes_used();
  u.bytes_capacity = slots_.bytes_capacity();
  u.objects = objects_;
  u.removing = removing_;
  u.object_bytes = object_bytes_;
  u.evictable = evictable_;
  u.read_locked = read_locked_;
  u.write_locked = write_locked_;
  return u;
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
