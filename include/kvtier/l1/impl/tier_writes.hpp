#pragma once
// l1::tier, the write side of the state machine (part of kvtier/l1/impl/tier.hpp):
// reserve_write, finish_write, finish_write_and_reserve_read, abandon_write.

#include <kvtier/l1/tier.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes,
                                             const write_options& o, std::span<status> out,
                                             std::span<std::span<std::byte>> buffers) {
  check_span(keys.size(), out.size(), "out");
  if (!buffers.empty()) check_span(keys.size(), buffers.size(), "buffers");
  if (object_bytes == 0)
    throw std::invalid_argument("kvtier::l1::tier::reserve_write: object_bytes is 0: give the object's size");
  check_object_bytes(object_bytes, "reserve_write");
  struct counts {
    std::size_t ok = 0;
    std::size_t oom = 0;
  };
  const counts c = run_locked([&](lazy_now& now, tally& t) {
    counts r;
    new_positions_.clear();
    new_index_slots_.clear();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (!buffers.empty()) buffers[i] = {};
      entry* e = write_target(keys[i], i, o.mode, out, now, t);
      if (e == nullptr) continue;
      if (o.mode == write_mode::new_only || !writable(*e)) {
        out[i] = status::not_writable;
        continue;
      }
      object_bytes_ = object_bytes_ - e->bytes + object_bytes;
      e->bytes = object_bytes;
      e->temporary = o.temporary;
      lock_write(*e, o.lock, now);
      out[i] = status::success;
      ++r.ok;
      if (!buffers.empty()) buffers[i] = {slots_.data(e->slot), object_bytes};
    }
    if (!new_positions_.empty()) {
      const std::size_t need = new_positions_.size();
      // All or nothing: room for every new key or for none (nothing evicted for a batch that
      // fails). Otherwise as many as fit, in batch order.
      const std::size_t got = o.all_or_nothing ? (ensure_room(need, now, t) ? need : 0) : room_for(need, now, t);
      place_new_keys(keys, got, object_bytes, o.temporary, o.lock, buffers, now);
      for (std::size_t j = 0; j < got; ++j) out[new_positions_[j]] = status::success;
      for (std::size_t j = got; j < need; ++j) {
        const std::size_t i = new_positions_[j];
        index_.erase(keys[i]);
        out[i] = status::out_of_memory;
      }
      r.ok += got;
      r.oom = need - got;
    }
    return r;
  });
  if (c.oom > 0) bus_.publish(bus::l1_allocation_failed{static_cast<std::uint32_t>(c.oom), o.purpose});
  bus_.publish(bus::l1_write_reserved{static_cast<std::uint32_t>(c.ok), static_cast<std::uint32_t>(keys.size() - c.ok),
                                      o.purpose});
  return c.ok;
}

template <class Policy, class Bus>
typename tier<Policy, Bus>::entry* tier<Policy, Bus>::write_target(const chunk_key& key, std::size_t i, write_mode mode,
                                                                   std::span<status> out, lazy_now& now, tally& t) {
  entry* e = nullptr;
  if (mode == write_mode::update) {
    const auto it = index_.find(key);
    if (it != index_.end()) e = it->second;
    if (e != nullptr && expire(*e, now, t)) e = nullptr;
    if (e == nullptr) out[i] = status::not_found;
    return e;
  }
  // One hash lookup for a new key: the placeholder (nullptr) is filled below through
  // a pointer to the mapped value, which stays valid while other keys come and go.
  auto [it, inserted] = index_.try_emplace(key, nullptr);
  if (!inserted && it->second == nullptr) {  // a new key earlier in this batch
    out[i] = status::not_writable;
    return nullptr;
  }
  e = it->second;
  if (e != nullptr && expire(*e, now, t)) {  // expiry removed it (and its index node)
    e = nullptr;
    it = index_.try_emplace(key, nullptr).first;
  }
  if (e == nullptr) {
    new_positions_.push_back(i);
    new_index_slots_.push_back(&it->second);
  }
  return e;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write(std::span<const chunk_key> keys, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  std::uint32_t no_holds = 0;
  const std::size_t ok = finish_write_impl(keys, out, false, 0, {}, lock_lifetime::pinned, no_holds);
  bus_.publish(bus::l1_write_finished{static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_and_reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                                             lock_lifetime read_lock, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  std::uint32_t taken = 0;
  const std::size_t ok = finish_write_impl(keys, out, true, extra_count, {}, read_lock, taken);
  bus_.publish(bus::l1_write_finished_and_read_reserved{static_cast<std::uint32_t>(ok), taken});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_and_reserve_read(std::span<const chunk_key> keys,
                                                             std::span<const std::uint32_t> holds,
                                                             lock_lifetime read_lock, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_span(keys.size(), holds.size(), "holds");
  std::uint32_t taken = 0;
  const std::size_t ok = finish_write_impl(keys, out, true, 0, holds, read_lock, taken);
  bus_.publish(bus::l1_write_finished_and_read_reserved{static_cast<std::uint32_t>(ok), taken});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_write_impl(std::span<const chunk_key> keys, std::span<status> out,
                                                 bool reserve_read, std::uint32_t extra_count,
                                                 std::span<const std::uint32_t> holds, lock_lifetime read_lock,
                                                 std::uint32_t& holds_taken) {
  return for_each_key(keys, out, [&](entry* e, std::size_t i, lazy_now& now, tally& t) {
    if (e == nullptr) return status::not_found;
    if (e->removing) {
      // Removed while being written: the write is over, so its memory can go now (or with
      // the last hold of a reader of its verified prefix).
      if (e->write_locked) {
        unlock_write(*e);
        if (e->readers() == 0) free_removed(*e);
      }
      return status::not_found;
    }
    if (!e->write_locked) return status::wrong_state;
    unlock_write(*e);
    if (!e->in_policy) policy_insert(*e);
    announce_stored(*e, t);  // readable now (a rewrite stays announced)
    if (reserve_read) {
      const std::uint32_t n = holds.empty() ? 1 + extra_count : holds[i];
      holds_taken += n;
      if (n > 0)
        add_readers(*e, read_lock, n, now);
      else
        release_if_done(*e, t);  // nobody reads it: a temporary object goes now
    }
    return status::success;
  });
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::abandon_write(std::span<const chunk_key> keys, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  return for_each_key(keys, out, [&](entry* e, std::size_t, lazy_now&, tally& t) {
    if (e == nullptr || (e->removing && !e->write_locked)) return status::not_found;
    if (!e->write_locked) return status::wrong_state;
    drop_unfinished_write(*e, t);
    return status::success;
  });
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
