#pragma once
// Definitions of prefetch_controller's request coroutine, its load-or-recompute gate, the L1
// walk, the load tasks and their finalization (declarations and the pipeline's description:
// pipeline/prefetch_controller.hpp).

#include <kvtier/pipeline/prefetch_controller.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
boost::asio::awaitable<void> prefetch_controller<Tier, PlanPolicy, Bus>::run(std::shared_ptr<state> sp) {
  state& s = *sp;
  active_.fetch_add(1, std::memory_order_relaxed);
  live_.insert(&s);
  const std::size_t n = s.req.keys.size();
  // A caller that waits reads the objects once: reserve them temporary. A caller that does
  // not wait (best_effort) leaves them to later requests: keep them.
  s.temporary = s.req.wait_budget.count() > 0;
  if (s.temporary)
    tracker_.spawn(executor_, answer_at_budget(sp));
  else
    answer(s, {}, {});

  const bool admitted = co_await admit();
  if (!admitted || n == 0 || backends_.empty() || (s.gave_up && s.temporary) || stopping()) {
    answer(s, stopping() ? boost::asio::error::operation_aborted : error_code{}, {});
    if (admitted) release_admission();
    finish(s);
    co_return;
  }

  // 1. lookup and pin everywhere at once.
  bus_.publish(bus::l2_prefetch_lookup_submitted{s.req.id, static_cast<std::uint32_t>(n),
                                                 static_cast<std::uint32_t>(backends_.size())});
  std::vector<bitmap> found = co_await lookup_all(sp, s.submitted_at + options_.lookup_timeout);

  // 2. plan, untrimmed; its leading run is the pure L2 prefix.
  prefetch_plan plan = plan_backends(plan_, found, n);
  s.l2_prefix = plan.l2_prefix;
  bus_.publish(bus::l2_prefetch_lookup_completed{s.req.id, static_cast<std::uint32_t>(n),
                                                 static_cast<std::uint32_t>(plan.l2_prefix)});

  // 3. walk L1 and the plan together (unless the answer already went out for a temporary
  //    reservation: nobody would read it), keep in the plan only what this request loads,
  //    unpin the rest.
  take_prefix(sp, plan, found);

  // 4. submit the loads.
  const std::size_t submitted = plan.submitted();
  submit_loads(sp, plan, found);
  release_admission();
  // A caller that waits for the decision has it now.
  if (decides(s) && !s.answered && !s.gave_up && !stopping()) answer(s, {}, decided_answer(s));

  // 5. answer when every task and join ended, unless the budget (or a cancellation) answered
  //    first; a decided caller waits here until its keys landed or it gave up.
  while ((s.tasks_left > 0 || s.joins_left > 0) && !s.gave_up) {
    s.signal.expires_at(boost::asio::steady_timer::time_point::max());
    co_await s.signal.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  }
  answer(s, stopping() ? boost::asio::error::operation_aborted : error_code{}, current_answer(s));
  // 6. late tasks finalize their own keys; wait for them before the completion event.
  while (s.tasks_left > 0) {
    s.signal.expires_at(boost::asio::steady_timer::time_point::max());
    co_await s.signal.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  }
  if (submitted > 0) publish_load_completed(s, submitted);
  finish(s);
}

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
void prefetch_controller<Tier, PlanPolicy, Bus>::take_prefix(const std::shared_ptr<state>& sp, prefetch_plan& plan,
                                                             const std::vector<bitmap>& found) {
  state& s = *sp;
  const std::size_t n = s.req.keys.size();
  s.own = bitmap(n);
  s.served = bitmap(n);
  s.settled = bitmap(n);
  if (!(s.gave_up && s.temporary) && !stopping()) reserve(sp, plan, gate(s, plan));
  restrict_plan(plan, s.own);
  const auto unpins = unpins_for(found, plan);
  for (std::size_t b = 0; b < backends_.size(); ++b) unpin(b, s.req.keys, unpins[b]);
}

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
void prefetch_controller<Tier, PlanPolicy, Bus>::submit_loads(const std::shared_ptr<state>& sp,
                                                              const prefetch_plan& plan,
                                                              const std::vector<bitmap>& found) {
  state& s = *sp;
  const std::size_t n = s.req.keys.size();
  const std::size_t submitted = plan.submitted();
  if (plan.found_any > 0) {
    bitmap any(n);
    for (const auto& f : found)
      if (f.size() == n) any |= f;
    any.subtract(s.own);
    any.subtract(s.served);
    const std::size_t trimmed = any.count();  // found, but neither loaded nor served otherwise
    bus_.publish(bus::l2_prefetch_load_submitted{s.req.id, static_cast<std::uint32_t>(submitted),
                                                 static_cast<std::uint32_t>(plan.tasks()),
                                                 static_cast<std::uint32_t>(trimmed), submitted * s.req.object_bytes});
  }
  s.outcomes.assign(s.reserved, l2::key_outcome::timeout);
  for (std::size_t b = 0; b < plan.per_backend.size(); ++b) {
    if (!plan.per_backend[b].any()) continue;
    ++s.tasks_left;
    tracker_.spawn(executor_, load_task(sp, b, plan.per_backend[b]));
  }
}

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
void prefetch_controller<Tier, PlanPolicy, Bus>::publish_load_completed(const state& s, std::size_t submitted) {
  bus_.publish(bus::l2_prefetch_load_completed{s.req.id, s.loaded, static_cast<std::uint32_t>(submitted) - s.loaded,
                                               s.loaded_bytes, ns(l2::clock::now() - s.submitted_at)});
  for (std::size_t r = 0; r < bus::prefetch_failure_count; ++r)
    if (s.failures[r] > 0)
      bus_.publish(bus::l2_prefetch_failed{s.req.id, static_cast<bus::prefetch_failure>(r), s.failures[r]});
}

// Step 2's load-or-recompute gate: loadable keys must be below the returned index. Only
// when a rate is declared and some planned backend loses time on a key or fails some loads
// (else every prefix gains and nothing is looked up); L1 is looked up per key then. One
// declining request in probe_every loads probe_chunks of the declined chunks as a probe.
template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
std::size_t prefetch_controller<Tier, PlanPolicy, Bus>::gate(state& s, const prefetch_plan& plan) {
  const std::size_t n = s.req.keys.size();
  if (s.req.prefill_tokens_per_second == 0 || s.req.object_bytes == 0 || s.req.chunk_tokens == 0) return n;
  const std::size_t g = s.req.group == 0 ? 1 : s.req.group;
  recompute_rate rate{static_cast<double>(s.req.prefill_tokens_per_second), s.req.chunk_tokens, g, s.req.object_bytes};
  const double compute_key =
      static_cast<double>(s.req.chunk_tokens) / (rate.prefill_tokens_per_second * static_cast<double>(g));
  std::vector<load_estimate> est(backends_.size());
  bool loses = false;
  for (std::size_t b = 0; b < backends_.size(); ++b) {
    est[b] = bandwidth_.estimate(b);
    if (b < plan.per_backend.size() && plan.per_backend[b].any() &&
        (load_gain(est[b], compute_key, s.req.object_bytes) < 0 || est[b].landed_share < 1))
      loses = true;
  }
  if (!loses) return n;
  std::vector<int> src(n, source_none);
  for (std::size_t i = 0; i < n; ++i) {
    if (l1_.contains(s.req.keys[i])) {
      src[i] = source_l1;
      continue;
    }
    for (std::size_t b = 0; b < plan.per_backend.size(); ++b)
      if (plan.per_backend[b].size() > i && plan.per_backend[b].test(i)) src[i] = static_cast<int>(b);
    if (src[i] == source_none) break;
  }
  const prefix_choice c = best_prefix(src, rate, est);
  if (c.keys >= c.available) return c.keys;
  // Declined. The chunk right after the best prefix loses time (else the best prefix would
  // take it), so a probe loads from a backend the gate judges slow: its sample corrects the
  // estimate either way.
  std::size_t offer = c.keys;
  if (options_.probe_every > 0 && ++declining_ % options_.probe_every == 0)
    offer = std::min(c.available, c.keys + options_.probe_chunks * g);
  const std::size_t probe = offer - c.keys;
  bus_.publish(bus::l2_prefetch_declined{s.req.id, bus::decline_reason::slower_than_recompute,
                                         static_cast<std::uint32_t>(c.available - offer),
                                         std::uint64_t{(c.available - offer) / g} * s.req.chunk_tokens,
                                         static_cast<std::uint32_t>(probe), std::uint64_t{probe / g} * s.req.chunk_tokens});
  return offer;
}

// Step 3: the walk over L1 and the plan (l1::tier::reserve_prefix); keys from `limit` on
// are not loaded.
template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
void prefetch_controller<Tier, PlanPolicy, Bus>::reserve(const std::shared_ptr<state>& sp, const prefetch_plan& plan,
                                                         std::size_t limit) {
  state& s = *sp;
  const std::size_t n = s.req.keys.size();
  const bitmap loadable = planned_keys(plan, n);
  const bool can_load = s.req.object_bytes > 0;
  std::vector<l1::prefix_take> takes(n);
  s.buffers.assign(n, {});
  l1::prefix_options po;
  po.object_bytes = s.req.object_bytes;
  po.extra_count = s.req.extra_count;
  po.read_lock = l1::lock_lifetime::pinned;   // the caller's holds: it expires them itself
  po.write_lock = l1::lock_lifetime::pinned;  // the kernel writes these slots: they must never expire
  po.temporary = s.temporary;
  po.purpose = bus::allocation_purpose::prefetch;
  po.hold_reads = !s.gave_up;  // a request nobody waits for reads nothing now
  const auto r = l1_.reserve_prefix(
      s.req.keys, po, [&](std::size_t i) { return can_load && i < limit && loadable.test(i); },
      [&](std::size_t i) { return !s.gave_up && i < limit && inflight_.contains(s.req.keys[i]); }, takes, s.buffers);
  s.reserved = r.length;
  s.keys.assign(s.reserved, key_state::released);
  for (std::size_t i = 0; i < s.reserved; ++i) {
    switch (takes[i]) {
      case l1::prefix_take::read:
        s.keys[i] = s.gave_up ? key_state::released : key_state::l1_held;
        s.served.set(i);
        break;
      case l1::prefix_take::write:
        s.keys[i] = key_state::loading;
        s.own.set(i);
        inflight_.try_emplace(s.req.keys[i]);
        break;
      case l1::prefix_take::wait:
        s.keys[i] = key_state::joined;
        s.served.set(i);
        inflight_[s.req.keys[i]].joiners.emplace_back(sp, i);
        ++s.joins_left;
        break;
      case l1::prefix_take::none:
        break;
    }
  }
  if (r.short_of_room > 0)
    bus_.publish(bus::l2_prefetch_failed{s.req.id, bus::prefetch_failure::l1_out_of_memory,
                                         static_cast<std::uint32_t>(r.short_of_room)});
}

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
boost::asio::awaitable<void> prefetch_controller<Tier, PlanPolicy, Bus>::load_task(std::shared_ptr<state> sp,
                                                                                   std::size_t b, bitmap mine) {
  state& s = *sp;
  std::vector<std::size_t> idx;
  std::vector<chunk_key> keys;
  std::vector<std::span<std::byte>> dst;
  for (std::size_t i = 0; i < mine.size(); ++i)
    if (mine.test(i)) {
      idx.push_back(i);
      keys.push_back(s.req.keys[i]);
      dst.push_back(s.buffers[i]);
    }
  const std::uint64_t bytes = keys.size() * s.req.object_bytes;
  inflight_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  const auto t0 = l2::clock::now();
  // Each key that lands (backends that tell) is finalized at once, on our executor.
  auto where = std::make_shared<const std::vector<std::size_t>>(idx);
  l2::load_observer landed = [this, sp, where, whole = s.req.object_bytes](std::size_t j, std::size_t told) {
    if (told >= whole)
      tracker_.post(executor_, [this, sp, where, j] { land(sp, (*where)[j]); });
    else if (sp->req.on_verified)
      tracker_.post(executor_, [this, sp, where, j, told] { verified(sp, (*where)[j], told); });
  };
  auto [ec, result] = co_await backends_[b].async_load(keys, dst, t0 + options_.load_timeout, std::move(landed),
                                                       boost::asio::as_tuple(boost::asio::use_awaitable));
  // The backend no longer writes the buffers: the slots may now be finalized or freed.
  inflight_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  backends_[b].unpin(keys);
  std::uint32_t ok = 0;
  std::vector<std::size_t> rest;
  for (std::size_t j = 0; j < idx.size(); ++j) {
    const auto o = j < result.size() ? result.outcomes[j] : l2::key_outcome::timeout;
    ok += o == l2::key_outcome::ok ? 1 : 0;
    if (s.settled.test(idx[j])) continue;  // landed early (its outcome was ok)
    s.outcomes[idx[j]] = o;
    rest.push_back(idx[j]);
  }
  const auto elapsed = l2::clock::now() - t0;
  // Every task is a sample, one that landed nothing too (it cost its time): a stalled or
  // failing backend lowers the estimate.
  bandwidth_.record(b, bytes, std::uint64_t{ok} * s.req.object_bytes, elapsed);
  bus_.publish(bus::l2_backend_load_completed{static_cast<std::uint8_t>(b), backends_[b].name(),
                                              static_cast<std::uint32_t>(keys.size()), ok, ok * s.req.object_bytes,
                                              ns(elapsed)});
  finalize(sp, rest);
  --s.tasks_left;
  s.signal.cancel();
}

// Step 5: the keys of a completed task are made readable with the holds of every request
// still waiting for them, or abandoned; their joiners learn the outcome.
template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
void prefetch_controller<Tier, PlanPolicy, Bus>::finalize(const std::shared_ptr<state>& sp,
                                                          std::span<const std::size_t> idx) {
  state& s = *sp;
  const bool live = !stopping();
  std::vector<chunk_key> ready, drop;
  std::vector<std::uint32_t> holds;
  std::vector<state*> woken;
  std::vector<std::tuple<state*, std::size_t, bool>> told;  ///< on_key calls, after L1 changed
  for (const std::size_t i : idx) {
    s.settled.set(i);
    const chunk_key& k = s.req.keys[i];
    std::vector<std::pair<std::shared_ptr<state>, std::size_t>> joiners;
    if (auto it = inflight_.find(k); it != inflight_.end()) {
      joiners = std::move(it->second.joiners);
      inflight_.erase(it);
    }
    const bool landed = s.outcomes[i] == l2::key_outcome::ok;
    const bool self_waits = live && !s.gave_up && s.keys[i] == key_state::loading;
    std::uint32_t n = landed && self_waits ? holds_of(s) : 0;
    if (self_waits && decides(s)) told.emplace_back(&s, i, landed);
    for (auto& [j, at] : joiners) {
      if (j->gave_up || !live || j->keys[at] != key_state::joined) continue;
      if (landed) {
        n += holds_of(*j);
        j->keys[at] = key_state::held;
      } else {
        j->keys[at] = key_state::failed;
      }
      --j->joins_left;
      woken.push_back(j.get());
      if (decides(*j)) told.emplace_back(j.get(), at, landed);
    }
    if (landed && (n > 0 || !s.temporary)) {
      // Readable now: held by whoever waits for it, or kept unlocked for later requests.
      ready.push_back(k);
      holds.push_back(n);
      s.keys[i] = self_waits ? key_state::held : key_state::released;
      ++s.loaded;
      s.loaded_bytes += s.req.object_bytes;
    } else {
      // Failed, or landed too late for anyone: never readable.
      if (landed) s.outcomes[i] = l2::key_outcome::timeout;
      ++s.failures[static_cast<std::size_t>(reason_of(s.outcomes[i]))];
      s.keys[i] = key_state::failed;
      drop.push_back(k);
    }
  }
  if (!ready.empty()) {
    std::vector<l1::status> st(ready.size());
    l1_.finish_write_and_reserve_read(ready, holds, l1::lock_lifetime::pinned, st);
  }
  if (!drop.empty()) {
    std::vector<l1::status> st(drop.size());
    l1_.abandon_write(drop, st);
  }
  for (auto& [t, at, ok] : told) t->req.on_key(at, ok);
  for (state* j : woken) j->signal.cancel();
}

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
