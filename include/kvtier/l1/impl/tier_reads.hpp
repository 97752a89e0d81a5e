#pragma once
// l1::tier, the read side of the state machine (part of kvtier/l1/impl/tier.hpp):
// reserve_read, finish_read, read_views, touch.

#include <kvtier/l1/tier.hpp>

#include <cstddef>
#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                            lock_lifetime lifetime, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  const std::size_t ok = for_each_key(keys, out, [&](entry* e, std::size_t, lazy_now& now, tally&) {
    if (e == nullptr || e->removing) return status::not_found;
    if (e->write_locked) return status::not_readable;
    add_readers(*e, lifetime, 1 + extra_count, now);
    if (e->in_policy) policy_.on_access(*e);
    return status::success;
  });
  bus_.publish(bus::l1_read_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok),
                                     static_cast<std::uint32_t>(ok * (1 + extra_count))});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::finish_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                           lock_lifetime lifetime, std::span<status> out) {
  check_span(keys.size(), out.size(), "out");
  check_extra(extra_count);
  const std::size_t ok = for_each_key(keys, out, [&](entry* e, std::size_t, lazy_now&, tally& t) {
    if (e == nullptr) return status::not_found;
    const std::uint32_t held = lifetime == lock_lifetime::expiring ? e->expiring_readers : e->pinned_readers;
    if (held < 1 + extra_count) return status::wrong_state;
    drop_readers(*e, lifetime, 1 + extra_count);
    release_if_done(*e, t);
    return status::success;
  });
  bus_.publish(bus::l1_read_finished{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(ok * (1 + extra_count))});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::read_views(std::span<const chunk_key> keys, std::span<status> out,
                                          std::span<std::span<const std::byte>> views) {
  check_span(keys.size(), out.size(), "out");
  check_span(keys.size(), views.size(), "views");
  return for_each_key(keys, out, [&](entry* e, std::size_t i, lazy_now&, tally&) {
    views[i] = {};
    if (e == nullptr) return status::not_found;
    if (e->write_locked) return status::not_readable;
    if (e->readers() == 0) return status::wrong_state;
    views[i] = {slots_.data(e->slot), e->bytes};
    return status::success;
  });
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::reserve_unfinished_read(std::span<const chunk_key> keys, std::span<status> out,
                                                       std::span<std::span<const std::byte>> views) {
  check_span(keys.size(), out.size(), "out");
  check_span(keys.size(), views.size(), "views");
  const std::size_t ok = for_each_key(keys, out, [&](entry* e, std::size_t i, lazy_now& now, tally&) {
    views[i] = {};
    if (e == nullptr || e->removing) return status::not_found;
    if (!e->write_locked) return status::wrong_state;
    add_readers(*e, lock_lifetime::pinned, 1, now);
    views[i] = {slots_.data(e->slot), e->bytes};
    return status::success;
  });
  bus_.publish(bus::l1_read_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(keys.size() - ok),
                                     static_cast<std::uint32_t>(ok)});
  return ok;
}

template <class Policy, class Bus>
std::size_t tier<Policy, Bus>::touch(std::span<const chunk_key> keys) {
  return for_each_key(keys, {}, [&](entry* e, std::size_t, lazy_now&, tally&) {
    if (e == nullptr || e->removing || e->write_locked || !e->in_policy) return status::not_found;
    policy_.on_access(*e);
    return status::success;
  });
}

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
