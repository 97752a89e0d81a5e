#pragma once
// l1::tier, reserve_prefix (part of kvtier/l1/impl/tier.hpp): the longest prefix of a batch
// read-locked, waited for or write-locked in new slots, in one step under the mutex.

#include <kvtier/l1/tier.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
template <class Loadable, class Waitable>
prefix_result tier<Policy, Bus>::reserve_prefix(std::span<const chunk_key> keys, const prefix_options& o,
                                                Loadable&& loadable, Waitable&& waitable, std::span<prefix_take> out,
                                                std::span<std::span<std::byte>> buffers) {
  check_span(keys.size(), out.size(), "out");
  if (!buffers.empty()) check_span(keys.size(), buffers.size(), "buffers");
  check_extra(o.extra_count);
  check_object_bytes(o.object_bytes, "reserve_prefix");
  const std::uint32_t holds = 1 + o.extra_count;
  std::size_t held = 0;
  bool loadable_without_size = false;
  const prefix_result taken = run_locked([&](lazy_now& now, tally& t) {
    prefix_result r;
    if (!walk_prefix(keys, o, holds, loadable, waitable, out, buffers, now, t, r)) {
      loadable_without_size = true;  // misuse: thrown below, once the tier is as it was
      return r;
    }
    const std::size_t got = room_for_prefix(keys, o, holds, out, now, t, r);
    place_new_keys(keys, got, o.object_bytes, o.temporary, o.write_lock, buffers, now);
    r.writes = got;
    r.reads = r.waits = 0;
    for (std::size_t j = 0; j < r.length; ++j) {
      r.reads += out[j] == prefix_take::read ? 1 : 0;
      r.waits += out[j] == prefix_take::wait ? 1 : 0;
    }
    held = prefix_reads_.size();
    for (entry* e : prefix_reads_)
      if (e->in_policy) policy_.on_access(*e);
    return r;
  });
  if (loadable_without_size)
    throw std::invalid_argument("kvtier::l1::tier::reserve_prefix: a loadable key needs object_bytes > 0");
  const bool refused = o.count_refused_read && taken.end != prefix_end::complete && taken.end != prefix_end::no_room &&
                       taken.length < keys.size();
  if (held > 0 || refused)
    bus_.publish(bus::l1_read_reserved{static_cast<std::uint32_t>(held), refused ? 1U : 0U,
                                       static_cast<std::uint32_t>(held * holds)});
  if (taken.writes > 0 || taken.short_of_room > 0)
    bus_.publish(bus::l1_write_reserved{static_cast<std::uint32_t>(taken.writes),
                                        static_cast<std::uint32_t>(taken.short_of_room), o.purpose});
  if (taken.short_of_room > 0)
    bus_.publish(bus::l1_allocation_failed{static_cast<std::uint32_t>(taken.short_of_room), o.purpose});
  return taken;
}

template <class Policy, class Bus>
template <class Loadable, class Waitable>
bool tier<Policy, Bus>::walk_prefix(std::span<const chunk_key> keys, const prefix_options& o, std::uint32_t holds,
                                    Loadable& loadable, Waitable& waitable, std::span<prefix_take> out,
                                    std::span<std::span<std::byte>> buffers, lazy_now& now, tally& t,
                                    prefix_result& r) {
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
      if (const auto end = take_present(*e, i, o, holds, waitable, out, now)) {
        r.end = *end;
        break;
      }
      continue;
    }
    if (!loadable(i)) {
      r.end = prefix_end::missing;
      break;
    }
    if (o.object_bytes == 0) {
      give_back_prefix_reads(0, o.read_lock, holds, t);
      return false;
    }
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
  return true;
}

template <class Policy, class Bus>
template <class Waitable>
std::optional<prefix_end> tier<Policy, Bus>::take_present(entry& e, std::size_t i, const prefix_options& o,
                                                          std::uint32_t holds, Waitable& waitable,
                                                          std::span<prefix_take> out, lazy_now& now) {
  if (e.removing) return prefix_end::missing;
  if (e.write_locked) {
    if (!waitable(i)) return prefix_end::busy;
    out[i] = prefix_take::wait;
    return std::nullopt;
  }
  if (o.object_bytes != 0 && e.bytes != o.object_bytes) return prefix_end::wrong_size;
  out[i] = prefix_take::read;
  if (o.hold_reads) {
    // Held now, so that making room below can never evict it; counted and shown to the
    // policy only if it stays in the prefix.
    add_readers(e, o.read_lock, holds, now);
    prefix_reads_.push_back(&e);
    prefix_read_positions_.push_back(i);
  }
  return std::nullopt;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::room_for_prefix(std::span<const chunk_key> keys, const prefix_options& o,
                                               std::uint32_t holds, std::span<prefix_take> out, lazy_now& now, tally& t,
                                               prefix_result& r) {
  const std::size_t need = new_positions_.size();
  std::size_t got = need > 0 ? room_for(need, now, t) : 0;
  if (got >= need) return got;
  // Short of room (room_for evicted every unlocked object it could). The walk's own reads
  // are worth less than the prefix's front: find the longest prefix whose new keys fit in
  // the free slots plus what giving back the reads after it frees or makes evictable
  // (a 48-chunk document, 24 slots holding its chunks 24..47: the prefix is 0..23, never
  // nothing). Shorter prefixes need fewer slots and give back more, so the first length
  // that fits, walking down from the walk's end, is the longest; it is at least the first
  // new key without a slot (the old cut).
  std::size_t length = r.length;
  std::size_t news = need;  // new keys before `length`
  while (news > slots_.free_count() + evictable_) {
    --length;
    if (new_positions_[news - 1] == length) --news;
    give_back_prefix_reads(length, o.read_lock, holds, t);
  }
  if (news > got) got = room_for(news, now, t);  // evicts the reads given back (or less, if the policy refuses)
  // The prefix ends at `length`, or earlier at the first new key still without a slot.
  const std::size_t cut = got < news ? new_positions_[got] : length;
  r.short_of_room = need - got;
  r.length = cut;
  r.end = prefix_end::no_room;
  for (std::size_t j = got; j < need; ++j) index_.erase(keys[new_positions_[j]]);
  give_back_prefix_reads(cut, o.read_lock, holds, t);
  for (std::size_t j = cut; j < keys.size(); ++j) out[j] = prefix_take::none;
  return got;
}

template <class Policy, class Bus>
void tier<Policy, Bus>::give_back_prefix_reads(std::size_t cut, lock_lifetime read_lock, std::uint32_t holds,
                                               tally& t) {
  while (!prefix_read_positions_.empty() && prefix_read_positions_.back() >= cut) {
    entry& e = *prefix_reads_.back();
    drop_readers(e, read_lock, holds);
    release_if_done(e, t);
    prefix_reads_.pop_back();
    prefix_read_positions_.pop_back();
  }
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
