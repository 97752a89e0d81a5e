#pragma once
// Definitions of l1::tier (declarations and documentation: kvtier/l1/tier.hpp).

#include <kvtier/l1/tier.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::l1 {

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
// writes
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes,
                                             const write_options& o, std::span<status> out,
                                             std::span<std::span<std::byte>> buffers) {
  check_span(keys.size(), out.size(), "out");
  if (!buffers.empty()) check_span(keys.size(), buffers.size(), "buffers");
  if (object_bytes == 0 || object_bytes > slots_.slot_bytes())
    throw std::invalid_argument("kvtier::l1::tier::reserve_write: object_bytes " + std::to_string(object_bytes) +
                                " does not fit a slot of " + std::to_string(slots_.slot_bytes()) +
                                " bytes: raise tier_options::slot_bytes to the largest object size");
  tally t;
  std::size_t ok = 0;
  std::size_t oom = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    new_positions_.clear();
    new_index_slots_.clear();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (!buffers.empty()) buffers[i] = {};
      entry* e = nullptr;
      if (o.mode == write_mode::update) {
        const auto it = index_.find(keys[i]);
        if (it != index_.end()) e = it->second;
        if (e != nullptr && expire(*e, now, t)) e = nullptr;
        if (e == nullptr) {
          out[i] = status::not_found;
          continue;
        }
      } else {
        // One hash lookup for a new key: the placeholder (nullptr) is filled below through
        // a pointer to the mapped value, which stays valid while other keys come and go.
        auto [it, inserted] = index_.try_emplace(keys[i], nullptr);
        if (!inserted && it->second == nullptr) {  // a new key earlier in this batch
          out[i] = status::not_writable;
          continue;
        }
        e = it->second;
        if (e != nullptr && expire(*e, now, t)) {  // expiry removed it (and its index node)
          e = nullptr;
          it = index_.try_emplace(keys[i], nullptr).first;
        }
        if (e == nullptr) {
          new_positions_.push_back(i);
          new_index_slots_.push_back(&it->second);
          continue;
        }
      }
      if (o.mode == write_mode::new_only || !writable(*e)) {
        out[i] = status::not_writable;
        continue;
      }
      object_bytes_ = object_bytes_ - e->bytes + object_bytes;
      e->bytes = object_bytes;
      e->temporary = o.temporary;
      lock_write(*e, o.lock, now);
      out[i] = status::success;
      ++ok;
      if (!buffers.empty()) buffers[i] = {slots_.data(e->slot), object_bytes};
    }
    if (!new_positions_.empty()) {
      const std::size_t need = new_positions_.size();
      // All or nothing: room for every new key or for none (nothing evicted for a batch that
      // fails). Otherwise as many as fit, in batch order.
      const std::size_t got = o.all_or_nothing ? (ensure_room(need, now, t) ? need : 0) : room_for(need, now, t);
      new_slots_.clear();
      const bool allocated = slots_.allocate(got, new_slots_);
      (void)allocated;  // ensure_room / room_for guaranteed the room
      for (std::size_t j = 0; j < got; ++j) {
        const std::size_t i = new_positions_[j];
        entry& e = place_new(keys[i], new_slots_[j], object_bytes, o.temporary, o.lock, now);
        *new_index_slots_[j] = &e;
        out[i] = status::success;
        ++ok;
        if (!buffers.empty()) buffers[i] = {slots_.data(e.slot), object_bytes};
      }
      for (std::size_t j = got; j < need; ++j) {
        const std::size_t i = new_positions_[j];
        index_.erase(keys[i]);
        out[i] = status::out_of_memory;
      }
      oom = need - got;
    }
  }
  publish(t);
  if (oom > 0) bus_.publish(bus::l1_allocation_failed{static_cast<std::uint32_t>(oom), o.purpose});
  bus_.publish(
      bus::l1_write_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok), o.purpose});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write(std::span<const chunk_key> keys, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  const std::size_t ok = finish_write_impl(keys, out, false, 0, {}, lock_lifetime::pinned);
  bus_.publish(bus::l1_write_finished{static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_and_reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                                             lock_lifetime read_lock, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  const std::size_t ok = finish_write_impl(keys, out, true, extra_count, {}, read_lock);
  bus_.publish(bus::l1_write_finished_and_read_reserved{static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_and_reserve_read(std::span<const chunk_key> keys,
                                                             std::span<const std::uint32_t> holds,
                                                             lock_lifetime read_lock, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_span(keys.size(), holds.size(), "holds");
  const std::size_t ok = finish_write_impl(keys, out, true, 0, holds, read_lock);
  bus_.publish(bus::l1_write_finished_and_read_reserved{static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_impl(std::span<const chunk_key> keys, std::span<status> out,
                                                 bool reserve_read, std::uint32_t extra_count,
                                                 std::span<const std::uint32_t> holds, lock_lifetime read_lock) {
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr) {
        out[i] = status::not_found;
      } else if (e->removing) {
        // Removed while being written: the write is over, so its memory can go now.
        if (e->write_locked) {
          unlock_write(*e);
          free_removed(*e);
        }
        out[i] = status::not_found;
      } else if (!e->write_locked) {
        out[i] = status::wrong_state;
      } else {
        unlock_write(*e);
        if (!e->in_policy) policy_insert(*e);
        out[i] = status::success;
        ++ok;
        if (reserve_read) {
          const std::uint32_t n = holds.empty() ? 1 + extra_count : holds[i];
          if (n > 0)
            add_readers(*e, read_lock, n, now);
          else
            release_if_done(*e, t);  // nobody reads it: a temporary object goes now
        }
      }
    }
  }
  publish(t);
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::abandon_write(std::span<const chunk_key> keys, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr || (e->removing && !e->write_locked)) {
        out[i] = status::not_found;
      } else if (!e->write_locked) {
        out[i] = status::wrong_state;
      } else {
        unlock_write(*e);
        if (e->removing)
          free_removed(*e);  // already counted when it was removed
        else
          remove_object(*e, bus::removal_reason::abandoned, t);
        out[i] = status::success;
        ++ok;
      }
    }
  }
  publish(t);
  return ok;
}

// ---------------------------------------------------------------------------------------
// reads
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                            lock_lifetime lifetime, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr || e->removing) {
        out[i] = status::not_found;
      } else if (e->write_locked) {
        out[i] = status::not_readable;
      } else {
        add_readers(*e, lifetime, 1 + extra_count, now);
        if (e->in_policy) policy_.on_access(*e);
        out[i] = status::success;
        ++ok;
      }
    }
  }
  publish(t);
  bus_.publish(bus::l1_read_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                           lock_lifetime lifetime, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr) {
        out[i] = status::not_found;
        continue;
      }
      const std::uint32_t held = lifetime == lock_lifetime::expiring ? e->expiring_readers : e->pinned_readers;
      if (held < 1 + extra_count) {
        out[i] = status::wrong_state;
        continue;
      }
      drop_readers(*e, lifetime, 1 + extra_count);
      release_if_done(*e, t);
      out[i] = status::success;
      ++ok;
    }
  }
  publish(t);
  bus_.publish(bus::l1_read_finished{static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::read_views(std::span<const chunk_key> keys, std::span<status> out,
                                          std::span<std::span<const std::byte>> views) {
  check_span(keys.size(), out.size(), "out");
  check_span(keys.size(), views.size(), "views");
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      views[i] = {};
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr) {
        out[i] = status::not_found;
      } else if (e->write_locked) {
        out[i] = status::not_readable;
      } else if (e->readers() == 0) {
        out[i] = status::wrong_state;
      } else {
        views[i] = {slots_.data(e->slot), e->bytes};
        out[i] = status::success;
        ++ok;
      }
    }
  }
  publish(t);
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::touch(std::span<const chunk_key> keys) {
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (const auto& k : keys) {
      entry* e = lookup(k, now, t);
      if (e != nullptr && !e->removing && !e->write_locked && e->in_policy) {
        policy_.on_access(*e);
        ++ok;
      }
    }
  }
  publish(t);
  return ok;
}

template <class Policy, class Bus>
template <class Loadable, class Waitable>
prefix_result tier<Policy, Bus>::reserve_prefix(std::span<const chunk_key> keys, const prefix_options& o,
                                                Loadable&& loadable, Waitable&& waitable, std::span<prefix_take> out,
                                                std::span<std::span<std::byte>> buffers) {
  check_span(keys.size(), out.size(), "out");
  if (!buffers.empty()) check_span(keys.size(), buffers.size(), "buffers");
  check_extra(o.extra_count);
  if (o.object_bytes > slots_.slot_bytes())
    throw std::invalid_argument("kvtier::l1::tier::reserve_prefix: object_bytes " + std::to_string(o.object_bytes) +
                                " does not fit a slot of " + std::to_string(slots_.slot_bytes()) + " bytes");
  const std::uint32_t holds = 1 + o.extra_count;
  prefix_result r;
  std::size_t held = 0;
  tally t;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    new_positions_.clear();
    new_index_slots_.clear();
    prefix_reads_.clear();
    prefix_read_positions_.clear();
    std::size_t i = 0;
    for (; i < keys.size(); ++i) {
      out[i] = prefix_take::none;
      if (!buffers.empty()) buffers[i] = {};
      auto it = index_.find(keys[i]);
      if (it != index_.end() && it->second == nullptr) {  // a new key earlier in this batch
        r.end = prefix_end::busy;
        break;
      }
      entry* e = it == index_.end() ? nullptr : it->second;
      if (e != nullptr && expire(*e, now, t)) e = nullptr;
      if (e != nullptr) {
        if (e->removing) {
          r.end = prefix_end::missing;
          break;
        }
        if (e->write_locked) {
          if (!waitable(i)) {
            r.end = prefix_end::busy;
            break;
          }
          out[i] = prefix_take::wait;
          continue;
        }
        if (o.object_bytes != 0 && e->bytes != o.object_bytes) {
          r.end = prefix_end::wrong_size;
          break;
        }
        out[i] = prefix_take::read;
        if (o.hold_reads) {
          // Held now, so that making room below can never evict it; counted and shown to the
          // policy only if it stays in the prefix.
          add_readers(*e, o.read_lock, holds, now);
          prefix_reads_.push_back(e);
          prefix_read_positions_.push_back(i);
        }
        continue;
      }
      if (!loadable(i)) {
        r.end = prefix_end::missing;
        break;
      }
      if (o.object_bytes == 0)
        throw std::invalid_argument("kvtier::l1::tier::reserve_prefix: a loadable key needs object_bytes > 0");
      auto [slot_it, inserted] = index_.try_emplace(keys[i], nullptr);  // placeholder until allocated
      (void)inserted;
      new_positions_.push_back(i);
      new_index_slots_.push_back(&slot_it->second);
      out[i] = prefix_take::write;
    }
    r.length = i;
    for (std::size_t j = i + 1; j < keys.size(); ++j) {
      out[j] = prefix_take::none;
      if (!buffers.empty()) buffers[j] = {};
    }

    const std::size_t need = new_positions_.size();
    const std::size_t got = need > 0 ? room_for(need, now, t) : 0;
    if (got < need) {
      // Cut the prefix at the first loadable key without a slot; give back what lies past it.
      const std::size_t cut = new_positions_[got];
      r.short_of_room = need - got;
      r.length = cut;
      r.end = prefix_end::no_room;
      for (std::size_t j = got; j < need; ++j) index_.erase(keys[new_positions_[j]]);
      while (!prefix_read_positions_.empty() && prefix_read_positions_.back() >= cut) {
        entry& e = *prefix_reads_.back();
        drop_readers(e, o.read_lock, holds);
        release_if_done(e, t);
        prefix_reads_.pop_back();
        prefix_read_positions_.pop_back();
      }
      for (std::size_t j = cut; j < keys.size(); ++j) out[j] = prefix_take::none;
    }
    new_slots_.clear();
    const bool allocated = slots_.allocate(got, new_slots_);
    (void)allocated;  // room_for guaranteed the room
    for (std::size_t j = 0; j < got; ++j) {
      const std::size_t at = new_positions_[j];
      entry& e = place_new(keys[at], new_slots_[j], o.object_bytes, o.temporary, o.write_lock, now);
      *new_index_slots_[j] = &e;
      if (!buffers.empty()) buffers[at] = {slots_.data(e.slot), o.object_bytes};
    }
    r.writes = got;
    r.reads = r.waits = 0;
    for (std::size_t j = 0; j < r.length; ++j) {
      r.reads += out[j] == prefix_take::read ? 1 : 0;
      r.waits += out[j] == prefix_take::wait ? 1 : 0;
    }
    held = prefix_reads_.size();
    for (entry* e : prefix_reads_)
      if (e->in_policy) policy_.on_access(*e);
  }
  publish(t);
  const bool refused =
      o.count_refused_read && r.end != prefix_end::complete && r.end != prefix_end::no_room && r.length < keys.size();
  if (held > 0 || refused) bus_.publish(bus::l1_read_reserved{static_cast<std::uint32_t>(held), refused ? 1U : 0U});
  if (r.writes > 0 || r.short_of_room > 0)
    bus_.publish(bus::l1_write_reserved{static_cast<std::uint32_t>(r.writes),
                                        static_cast<std::uint32_t>(r.short_of_room), o.purpose});
  if (r.short_of_room > 0)
    bus_.publish(bus::l1_allocation_failed{static_cast<std::uint32_t>(r.short_of_room), o.purpose});
  return r;
}

// ---------------------------------------------------------------------------------------
// removal, eviction, expiry
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::remove(std::span<const chunk_key> keys, bool force, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  tally t;
  std::size_t ok = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t i = 0; i < keys.size(); ++i) {
      entry* e = lookup(keys[i], now, t);
      if (e == nullptr || e->removing) {
        out[i] = status::not_found;
      } else if (!e->locked()) {
        remove_object(*e, bus::removal_reason::deleted, t);
        out[i] = status::success;
        ++ok;
      } else if (force) {
        mark_removing(*e, t);
        out[i] = status::success;
        ++ok;
      } else {
        out[i] = status::locked;
      }
    }
  }
  publish(t);
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::clear(bool force) {
  tally t;
  std::size_t removed = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    for (std::size_t s = 0; s < options_.slot_count; ++s) {
      entry& e = entries_[s];
      if (!slots_.is_allocated(e.slot) || e.removing) continue;
      if (expire(e, now, t)) continue;
      if (!e.locked()) {
        remove_object(e, bus::removal_reason::deleted, t);
        ++removed;
      } else if (force) {
        mark_removing(e, t);
        ++removed;
      }
    }
  }
  publish(t);
  return removed;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::evict() {
  tally t;
  std::size_t n = 0;
  {
    std::lock_guard g(mutex_);
    const std::size_t used = slots_.used_count();
    if (used > watermark_slots_) n = evict_n(std::min(used - target_slots_, evictable_), t);
  }
  publish(t);
  return n;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::expire_locks() {
  tally t;
  std::size_t n = 0;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    n = expire_all(now, t);
  }
  publish(t);
  return n;
}

// ---------------------------------------------------------------------------------------
// queries
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
object_state tier<Policy, Bus>::state_of(const entry& e) noexcept {
  if (e.removing) return object_state::removing;
  if (e.write_locked) return object_state::write_locked;
  return e.readers() > 0 ? object_state::read_locked : object_state::ready;
}

template <class Policy, class Bus>
object_state tier<Policy, Bus>::state(const chunk_key& key) {
  tally t;
  object_state s = object_state::absent;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    if (entry* e = lookup(key, now, t)) s = state_of(*e);
  }
  publish(t);
  return s;
}

template <class Policy, class Bus>
std::optional<object_info> tier<Policy, Bus>::info(const chunk_key& key) {
  tally t;
  std::optional<object_info> r;
  {
    std::lock_guard g(mutex_);
    lazy_now now{options_.clock};
    if (entry* e = lookup(key, now, t))
      r = object_info{.state = state_of(*e),
                      .bytes = e->bytes,
                      .temporary = e->temporary,
                      .write_pinned = e->write_locked && e->write_pinned,
                      .expiring_readers = e->expiring_readers,
                      .pinned_readers = e->pinned_readers};
  }
  publish(t);
  return r;
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
  return u;
}

// ---------------------------------------------------------------------------------------
// private: checks
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

// ---------------------------------------------------------------------------------------
// private: leaf mutators (each keeps evictable_ exact)
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
template <class F>
void tier<Policy, Bus>::adjust(entry& e, F&& f) {
  const bool before = evictable(e);
  std::forward<F>(f)();
  const bool after = evictable(e);
  if (before && !after)
    --evictable_;
  else if (!before && after)
    ++evictable_;
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
    e.write_locked = e.write_pinned = e.temporary = e.in_policy = e.removing = false;
  });
}

// ---------------------------------------------------------------------------------------
// private: composite steps
// ---------------------------------------------------------------------------------------
template <class Policy, class Bus>
typename tier<Policy, Bus>::entry* tier<Policy, Bus>::lookup(const chunk_key& key, lazy_now& now, tally& t) {
  auto it = index_.find(key);
  if (it == index_.end() || it->second == nullptr) return nullptr;
  entry* e = it->second;
  return expire(*e, now, t) ? nullptr : e;
}

template <class Policy, class Bus>
bool tier<Policy, Bus>::expire(entry& e, lazy_now& now, tally& t) {
  if (!e.has_expiring_lock()) return false;
  if (e.write_locked && !e.write_pinned && now() >= e.write_deadline) {
    // The writer went silent: its data never completed, so the object goes (an update
    // that expires loses the old object too, its memory was being overwritten).
    ++t.expired[static_cast<std::size_t>(bus::lock_kind::write)];
    unlock_write(e);
    if (e.removing)
      free_removed(e);
    else
      remove_object(e, bus::removal_reason::abandoned, t);
    return true;
  }
  if (e.expiring_readers > 0 && now() >= e.read_deadline) {
    ++t.expired[static_cast<std::size_t>(bus::lock_kind::read)];
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
void tier<Policy, Bus>::remove_object(entry& e, bus::removal_reason reason, tally& t) {
  const auto r = static_cast<std::size_t>(reason);
  ++t.removed_keys[r];
  t.removed_bytes[r] += e.bytes;
  policy_leave(e);
  index_.erase(e.key);
  --objects_;
  object_bytes_ -= e.bytes;
  free_slot(e);
}

template <class Policy, class Bus>
void tier<Policy, Bus>::mark_removing(entry& e, tally& t) {
  const auto r = static_cast<std::size_t>(bus::removal_reason::deleted);
  ++t.removed_keys[r];
  t.removed_bytes[r] += e.bytes;
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
typename tier<Policy, Bus>::entry& tier<Policy, Bus>::place_new(const chunk_key& key, slot_id slot, std::size_t bytes,
                                                                bool temporary, lock_lifetime lock, lazy_now& now) {
  entry& e = entries_[slot];
  e.key = key;
  e.bytes = bytes;
  e.temporary = temporary;
  lock_write(e, lock, now);
  ++objects_;
  object_bytes_ += bytes;
  return e;
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
void tier<Policy, Bus>::publish(const tally& t) {
  if constexpr (Bus::template handles_event<bus::l1_keys_evicted>) {
    for (std::size_t r = 0; r < bus::removal_reason_count; ++r)
      if (t.removed_keys[r] > 0)
        bus_.publish(bus::l1_keys_evicted{t.removed_keys[r], t.removed_bytes[r], static_cast<bus::removal_reason>(r)});
  }
  if constexpr (Bus::template handles_event<bus::l1_lock_expired>) {
    for (std::size_t k = 0; k < bus::lock_kind_count; ++k)
      if (t.expired[k] > 0) bus_.publish(bus::l1_lock_expired{t.expired[k], static_cast<bus::lock_kind>(k)});
  }
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::l1
