#pragma once
// Definitions of tiered_cache's lookup bookkeeping, writes and administration (declarations
// and documentation: cache/tiered_cache.hpp).

#include <kvtier/cache/tiered_cache.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

// --- lookups ------------------------------------------------------------------------------

template <class Traits>
typename tiered_cache<Traits>::lookup_id tiered_cache<Traits>::start_lookup(const lookup_request& r) {
  if (r.group == 0 || r.keys.size() % r.group != 0)
    throw std::invalid_argument("tiered_cache::start_lookup: keys must be whole groups of `group` shards");
  auto l = std::make_shared<lookup>();
  l->keys.assign(r.keys.begin(), r.keys.end());
  l->group = r.group;
  l->chunk_tokens = r.chunk_tokens;
  l->extra = r.extra_count;
  l->request_id = r.request_id;
  const std::size_t n = l->keys.size();
  l->held = bitmap(n);
  l->pending = bitmap(n);
  l->failed = bitmap(n);
  l->gone = bitmap(n);
  l->partial = bitmap(n);
  l->partial_given = bitmap(n);

  // The L1 prefix, held now (pinned, owned by this lookup); nothing after its first miss
  // is touched.
  std::vector<l1::prefix_take> takes(n);
  l1::prefix_options po;
  po.object_bytes = r.object_bytes;
  po.extra_count = r.extra_count;
  po.read_lock = l1::lock_lifetime::pinned;
  po.count_refused_read = true;
  const std::size_t prefix = l1_.reserve_read_prefix(l->keys, po, takes).length;
  l->held.set_range(0, prefix);
  l->l1_prefix = prefix;
  if constexpr (requires(typename Traits::store_policy & sp) { sp.wants_hits(); }) {
    if (store_.policy().wants_hits() && prefix > 0) store_.offer(std::span(l->keys).first(prefix));
  }

  const lookup_id id = next_id_.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard g(mutex_);
    lookups_.emplace(id, l);
  }
  if (prefix == n || backends_.empty() || stopping_.load(std::memory_order_relaxed)) {
    complete(id, *l, {});
    return id;
  }
  pipeline::prefetch_request pr;
  pr.id = r.request_id ? r.request_id : id;
  pr.keys.assign(l->keys.begin() + static_cast<std::ptrdiff_t>(prefix), l->keys.end());
  pr.object_bytes = r.object_bytes;
  pr.extra_count = r.extra_count;
  pr.wait_budget = wait_.wait_budget((n / r.group) * r.chunk_tokens);
  pr.prefill_tokens_per_second = r.prefill_tokens_per_second;
  pr.group = r.group;
  pr.chunk_tokens = r.chunk_tokens;
  if (pr.wait_budget.count() > 0) {  // a caller that waits is answered when decided
    pr.on_key = [this, id, l, prefix](std::size_t i, bool landed) { on_key(id, l, prefix + i, landed); };
    pr.on_verified = [this, l, prefix](std::size_t i, std::size_t bytes) { on_verified(l, prefix + i, bytes); };
  }
  prefetch_.async_prefetch(std::move(pr), [this, id, l](error_code ec, pipeline::prefetch_result res) {
    complete(id, *l, ec ? pipeline::prefetch_result{} : std::move(res));
  });
  return id;
}

template <class Traits>
std::size_t tiered_cache<Traits>::pin_for_copy(std::span<const chunk_key> keys, std::span<l1::status> out,
                                               std::span<std::span<const std::byte>> views, std::size_t object_bytes) {
  const std::size_t n = keys.size();
  if (out.size() != n || views.size() != n)
    throw std::invalid_argument("tiered_cache::pin_for_copy: out and views need one element per key");
  std::vector<l1::prefix_take> takes(n);
  l1::prefix_options po;
  po.object_bytes = object_bytes;
  po.read_lock = l1::lock_lifetime::pinned;
  po.count_refused_read = true;
  const auto r = l1_.reserve_read_prefix(keys, po, takes);
  for (std::size_t i = 0; i < n; ++i) {
    views[i] = {};
    out[i] = i < r.length ? l1::status::success : l1::status::skipped;
  }
  if (r.length < n) {
    switch (r.end) {
      case l1::prefix_end::busy:
        out[r.length] = l1::status::not_readable;
        break;
      case l1::prefix_end::wrong_size:
        out[r.length] = l1::status::wrong_state;
        break;
      default:
        out[r.length] = l1::status::not_found;
        break;
    }
  }
  if (r.length > 0) {
    std::vector<l1::status> vs(r.length);
    l1_.read_views(keys.first(r.length), vs, views.first(r.length));
  }
  bus_.publish(
      bus::cache_read_prefetched{static_cast<std::uint32_t>(r.length), static_cast<std::uint32_t>(n - r.length)});
  return r.length;
}

template <class Traits>
void tiered_cache<Traits>::wait(lookup_id id, wait_handler h, bool loaded) {
  std::unique_lock g(mutex_);
  auto it = lookups_.find(id);
  if (it == lookups_.end()) {
    g.unlock();
    deliver(std::move(h), make_error_code(errc::not_found), {});
    return;
  }
  lookup& l = *it->second;
  if (l.done && (!loaded || l.pending.none())) {
    const lookup_status r = loaded ? loaded_status(l) : l.result;
    g.unlock();
    deliver(std::move(h), {}, r);
    return;
  }
  (loaded ? l.loaded_waiters : l.waiters).push_back(std::move(h));
}

// The leading chunks of the decided answer none of whose shards failed (under mutex_).
template <class Traits>
lookup_status tiered_cache<Traits>::loaded_status(const lookup& l) const {
  std::size_t keys = 0;
  while (keys < l.hit_keys && !l.failed.test(keys) && !l.pending.test(keys)) ++keys;
  lookup_status r;
  r.chunks = keys / l.group;
  r.l1_chunks = std::min(l.result.l1_chunks, r.chunks);
  return r;
}

// The prefetch decided (or, for a caller that does not wait, finished): `res.prefix` leading
// keys after the L1 prefix are held for this lookup or, `res.pending`, still loading. Round
// down to whole chunks, give back the rest, publish, wake the waiters.
template <class Traits>
void tiered_cache<Traits>::complete(lookup_id id, lookup& l, const pipeline::prefetch_result& res) {
  const std::size_t n = l.keys.size();
  const std::size_t locked = std::min(n, l.l1_prefix + res.prefix);
  const std::size_t chunks = locked / l.group;
  auto loading = [&](std::size_t i) { return answered_past_l1(l, res.pending, i); };
  const lookup_status r = decided_status(l, res, chunks);
  std::vector<chunk_key> back;
  std::vector<wait_handler> waiters, loaded_waiters;
  std::vector<std::pair<std::size_t, bool>> early;
  std::vector<std::function<void()>> watchers;  // copies that started before the decision
  {
    std::lock_guard g(mutex_);
    l.hit_keys = chunks * l.group;
    for (std::size_t i = l.l1_prefix; i < locked; ++i) {
      if (loading(i)) {
        if (i < l.hit_keys) l.pending.set(i);  // past the last whole chunk: on_key gives it back
        continue;
      }
      // Released while prefetching (release_all gave back the L1 prefix), or a partial
      // chunk (no hit): nobody will read what L2 brought in.
      if (l.abandoned || i >= l.hit_keys)
        back.push_back(l.keys[i]);
      else
        l.held.set(i);
    }
    l.result = r;
    l.done = true;
    l.answered_at = options_.l1.clock();
    waiters.swap(l.waiters);
    early.swap(l.early);
    watchers = l.watchers;
    if (early.empty() && l.pending.none()) loaded_waiters.swap(l.loaded_waiters);
  }
  release_holds(back, l.extra);
  bus_.publish(bus::cache_lookup{l.request_id ? l.request_id : id,
                                 static_cast<std::uint32_t>(n / l.group * l.chunk_tokens),
                                 static_cast<std::uint32_t>(n / l.group), static_cast<std::uint32_t>(r.l1_chunks),
                                 static_cast<std::uint32_t>(r.chunks - r.l1_chunks), l.chunk_tokens});
  for (auto& w : waiters) deliver(std::move(w), {}, r);
  if (!loaded_waiters.empty()) {
    lookup_status lr;
    {
      std::lock_guard g(mutex_);
      lr = loaded_status(l);
    }
    for (auto& w : loaded_waiters) deliver(std::move(w), {}, lr);
  }
  std::shared_ptr<lookup> self = find(id);
  for (auto& [i, landed] : early)
    if (self) on_key(id, self, i, landed);
  for (auto& w : watchers) w();
  forget_if_done(id, l);
}

template <class Traits>
lookup_status tiered_cache<Traits>::decided_status(const lookup& l, const pipeline::prefetch_result& res,
                                                   std::size_t chunks) {
  // A hit chunk counts for L1 when none of its shards was loaded from L2 for this lookup.
  lookup_status r{chunks, 0, 0};
  for (std::size_t c = 0; c < chunks; ++c) {
    bool loaded = false, still = false;
    for (std::size_t i = c * l.group; i < (c + 1) * l.group; ++i) {
      loaded = loaded || answered_past_l1(l, res.from_l2, i);
      still = still || answered_past_l1(l, res.pending, i);
    }
    r.l1_chunks += loaded ? 0 : 1;
    r.loading_chunks += still ? 1 : 0;
  }
  return r;
}

// Key i of a decided answer landed (held for this lookup now) or failed.
template <class Traits>
void tiered_cache<Traits>::on_key(lookup_id id, const std::shared_ptr<lookup>& lp, std::size_t i, bool landed) {
  lookup& l = *lp;
  std::vector<chunk_key> back, partial;
  std::vector<std::function<void()>> watchers;
  std::vector<wait_handler> loaded_waiters;
  lookup_status lr;
  {
    std::lock_guard g(mutex_);
    if (!l.done) {  // the decision's handler has not run yet: keep it for complete()
      l.early.emplace_back(i, landed);
      return;
    }
    if (i >= l.keys.size()) return;
    take_partial_back(l, i, partial);  // settled: its whole holds (landed) or nothing (failed)
    if (!l.pending.test(i)) {
      if (landed) back.push_back(l.keys[i]);  // past the hit's last whole chunk
    } else {
      l.pending.reset(i);
      if (!landed) {
        // The hit ends at this chunk: nothing from it on can be copied as a prefix, so its
        // holds go back now (those still loading when they land) and copies stop there.
        for (std::size_t j = i - i % l.group; j < l.hit_keys; ++j) {
          l.failed.set(j);
          if (l.pending.test(j)) l.gone.set(j);
          if (l.held.test(j)) {
            l.held.reset(j);
            back.push_back(l.keys[j]);
          }
        }
      } else if (l.abandoned || l.gone.test(i)) {
        back.push_back(l.keys[i]);
      } else {
        l.held.set(i);
      }
      watchers = l.watchers;
      if (l.pending.none()) {
        loaded_waiters.swap(l.loaded_waiters);
        lr = loaded_status(l);
      }
    }
  }
  release_holds(back, l.extra);
  release_holds(partial, 0);
  for (auto& w : watchers) w();
  for (auto& w : loaded_waiters) deliver(std::move(w), {}, lr);
  forget_if_done(id, l);
}

// Key i of a decided answer, still loading, has its first `bytes` bytes verified in its slot
// (the prefetch calls this before the key can settle, on the prefetch's executor). The first
// time, the lookup takes a hold on the slot being written, so the bytes outlive a failure of
// the rest (l1::tier::reserve_unfinished_read); the copies waiting on the lookup are woken.
template <class Traits>
void tiered_cache<Traits>::on_verified(const std::shared_ptr<lookup>& lp, std::size_t i, std::size_t bytes) {
  lookup& l = *lp;
  const auto wanted = [&] { return l.done && !l.abandoned && i < l.keys.size() && l.pending.test(i) && !l.gone.test(i); };
  bool hold = false;
  {
    std::lock_guard g(mutex_);
    if (!wanted()) return;
    hold = !l.partial.test(i) && !l.partial_given.test(i);
  }
  std::span<const std::byte> view;
  if (hold) {  // the write is in flight and cannot end meanwhile (we run before its finalize)
    l1::status st{};
    if (l1_.reserve_unfinished_read(std::span(&l.keys[i], 1), std::span(&st, 1), std::span(&view, 1)) != 1) return;
  }
  std::vector<std::function<void()>> watchers;
  {
    std::lock_guard g(mutex_);
    if (hold && !wanted()) {
      hold = false;  // released meanwhile: nobody will read it
    } else {
      if (hold) {
        l.partial.set(i);
        if (l.partial_views.empty()) l.partial_views.resize(l.keys.size());
        l.partial_views[i] = view;
      }
      if (l.verified.empty()) l.verified.resize(l.keys.size(), 0);
      l.verified[i] = std::max(l.verified[i], bytes);
      watchers = l.watchers;
      view = {};
    }
  }
  if (!view.empty()) release_holds(std::span(&l.keys[i], 1), 0);
  for (auto& w : watchers) w();
}

// --- writes -------------------------------------------------------------------------------

template <class Traits>
std::size_t tiered_cache<Traits>::reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes,
                                                std::span<l1::status> out, std::span<std::span<std::byte>> buffers) {
  const std::size_t n = keys.size();
  if (out.size() != n || buffers.size() != n)
    throw std::invalid_argument("tiered_cache::reserve_write: out and buffers need one element per key");
  l1::write_options o;
  o.mode = l1::write_mode::new_only;
  o.lock = l1::lock_lifetime::pinned;
  o.purpose = bus::allocation_purpose::store;
  o.all_or_nothing = false;
  if (!any_staged()) {
    l1_.reserve_write(keys, object_bytes, o, out, buffers);
  } else {
    // A key being written through staging is not written twice: only the others go to L1.
    std::vector<chunk_key> rest;
    std::vector<std::size_t> where;
    {
      std::lock_guard g(mutex_);
      for (std::size_t i = 0; i < n; ++i) {
        buffers[i] = {};
        if (staged_.contains(keys[i])) {
          out[i] = l1::status::not_writable;
        } else {
          rest.push_back(keys[i]);
          where.push_back(i);
        }
      }
    }
    std::vector<l1::status> st(rest.size());
    std::vector<std::span<std::byte>> buf(rest.size());
    if (!rest.empty()) l1_.reserve_write(rest, object_bytes, o, st, buf);
    for (std::size_t j = 0; j < rest.size(); ++j) {
      out[where[j]] = st[j];
      buffers[where[j]] = buf[j];
    }
  }
  stage_out_of_memory(keys, object_bytes, out, buffers);
  std::size_t ok = 0;
  for (std::size_t i = 0; i < n; ++i) ok += out[i] == l1::status::success ? 1 : 0;
  bus_.publish(bus::cache_write_reserved{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(n - ok)});
  return ok;
}

// What L1 had no room for goes through staging.
template <class Traits>
void tiered_cache<Traits>::stage_out_of_memory(std::span<const chunk_key> keys, std::size_t object_bytes,
                                               std::span<l1::status> out, std::span<std::span<std::byte>> buffers) {
  const std::uint64_t bytes = align_up(object_bytes);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (out[i] != l1::status::out_of_memory || object_bytes == 0) continue;
    if (!store_.try_reserve_staging(bytes)) continue;
    staged_object so;
    try {
      so.buffer = aligned_buffer(object_bytes);
    } catch (const std::bad_alloc&) {
      store_.release_staging(bytes);
      continue;
    }
    so.reserved = bytes;
    so.object_bytes = object_bytes;
    std::lock_guard g(mutex_);
    auto [it, inserted] = staged_.try_emplace(keys[i], std::move(so));
    if (!inserted) {  // the same key twice in the batch
      store_.release_staging(bytes);
      out[i] = l1::status::not_writable;
      continue;
    }
    buffers[i] = {it->second.buffer.data(), object_bytes};
    out[i] = l1::status::success;
    staged_count_.store(staged_.size(), std::memory_order_relaxed);
  }
}

template <class Traits>
std::size_t tiered_cache<Traits>::finish_write(std::span<const chunk_key> keys, const pipeline::write_context& ctx,
                                               std::span<l1::status> out) {
  const std::size_t n = keys.size();
  if (out.size() != n) throw std::invalid_argument("tiered_cache::finish_write: out needs one element per key");
  std::size_t ok = 0;
  std::vector<chunk_key> admitted;
  if (!any_staged()) {
    ok = l1_.finish_write(keys, out);
    for (std::size_t i = 0; i < n; ++i)
      if (out[i] == l1::status::success && admission_.admit(keys[i], ctx)) admitted.push_back(keys[i]);
  } else {
    std::vector<std::pair<std::size_t, staged_object>> mine;  // (index in keys, its staging)
    std::vector<chunk_key> rest;
    std::vector<std::size_t> where;
    {
      std::lock_guard g(mutex_);
      for (std::size_t i = 0; i < n; ++i) {
        auto node = staged_.extract(keys[i]);
        if (node.empty()) {
          rest.push_back(keys[i]);
          where.push_back(i);
        } else {
          mine.emplace_back(i, std::move(node.mapped()));
        }
      }
      staged_count_.store(staged_.size(), std::memory_order_relaxed);
    }
    pipeline::staged_keys staged;
    std::uint64_t refused = 0;
    for (auto& [i, so] : mine) {
      out[i] = l1::status::success;
      ++ok;
      if (!admission_.admit(keys[i], ctx)) {  // not for L2: its memory just goes
        refused += so.reserved;
        continue;
      }
      if (!staged.keys.empty() && staged.object_bytes != so.object_bytes)
        store_.offer_staged(std::exchange(staged, {}));  // one object size per batch
      staged.object_bytes = so.object_bytes;
      staged.reserved_bytes += so.reserved;
      staged.keys.push_back(keys[i]);
      staged.buffers.push_back(std::move(so.buffer));
    }
    if (refused > 0) store_.release_staging(refused);
    std::vector<l1::status> st(rest.size());
    if (!rest.empty()) ok += l1_.finish_write(rest, st);
    for (std::size_t j = 0; j < rest.size(); ++j) {
      out[where[j]] = st[j];
      if (st[j] == l1::status::success && admission_.admit(rest[j], ctx)) admitted.push_back(rest[j]);
    }
    store_.offer_staged(std::move(staged));
  }
  bus_.publish(bus::cache_write_finished{static_cast<std::uint32_t>(ok), static_cast<std::uint32_t>(n - ok)});
  store_.offer(admitted);
  return ok;
}

template <class Traits>
std::size_t tiered_cache<Traits>::abandon_write(std::span<const chunk_key> keys) {
  std::size_t n = 0;
  std::vector<chunk_key> rest;
  if (any_staged()) {
    std::uint64_t freed = 0;
    {
      std::lock_guard g(mutex_);
      for (const auto& k : keys) {
        auto node = staged_.extract(k);
        if (node.empty()) {
          rest.push_back(k);
          continue;
        }
        freed += node.mapped().reserved;
        ++n;
      }
      staged_count_.store(staged_.size(), std::memory_order_relaxed);
    }
    store_.release_staging(freed);
  } else {
    rest.assign(keys.begin(), keys.end());
  }
  std::vector<l1::status> st(rest.size());
  if (!rest.empty()) n += l1_.abandon_write(rest, st);
  bus_.publish(bus::cache_write_finished{0, static_cast<std::uint32_t>(n)});
  return n;
}

template <class Traits>
void tiered_cache<Traits>::wait_for_work() {
  namespace asio = boost::asio;
  using io_executor = asio::io_context::executor_type;
  asio::io_context* ctx = nullptr;
  bool here = false;
  if (const auto* e = executor_.template target<io_executor>()) {
    ctx = &e->context();
    here = e->running_in_this_thread();
  } else if (const auto* s = executor_.template target<asio::strand<io_executor>>()) {
    ctx = &s->get_inner_executor().context();
    here = s->running_in_this_thread() || s->get_inner_executor().running_in_this_thread();
  }
  if (here) {
    // Its coroutines need this thread to finish, and the L1 memory they may be writing
    // must not be freed before: nothing safe is left.
    std::fputs(
        "kvtier: tiered_cache destroyed by a handler of its own executor while its pipelines work: co_await "
        "async_stop() before destroying it\n",
        stderr);
    std::terminate();
  }
  if (ctx != nullptr && ctx->stopped()) {
    // Nobody runs the executor: run it here until the cache's work is done, then leave it
    // stopped as it was.
    ctx->restart();
    while (!tracker_.idle()) ctx->run_one_for(std::chrono::milliseconds(100));
    ctx->stop();
    return;
  }
  tracker_.wait_idle();  // another thread runs the executor
}

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
