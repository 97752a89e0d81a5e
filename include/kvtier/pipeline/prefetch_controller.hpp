#pragma once
// prefetch_controller: the prefetch pipeline, L2 -> L1 (reference/lmcache-mp.md section 6.1).
//
// For each request (keys missing from L1, in prefix order):
//   1. lookup-and-pin in every backend at once;
//   2. plan (the plan policy picks a backend per key) and trim to the contiguous L2 prefix:
//      that prefix is the pure L2 hit count (l2.prefetch.lookup.completed);
//   3. reserve L1 slots for the prefix (new keys, pinned write locks: the kernel writes into
//      them), trim again to the reserved prefix, unpin what will not be loaded;
//   4. submit one load task per backend (l2.prefetch.load.submitted counts the keys actually
//      submitted, and the found keys dropped by trimming separately);
//   5. answer the caller when every task completed or the wait budget passed, whichever is
//      first: loaded keys of the prefix become readable and read-locked for the caller
//      (finish_write_and_reserve_read, atomically, never offered to the store pipeline);
//      the answer is the contiguous prefix that landed; loaded keys after a hole are
//      released; failed keys are abandoned without ever becoming readable;
//   6. a task still running at the answer keeps its slots write-locked until the backend
//      completes (a cancelled or late read never lands in a reused slot); its keys are then
//      abandoned, or, for a non-temporary reservation (the best_effort wait policy), made
//      ready in L1 for later requests. l2.prefetch.load.completed is published once every
//      task completed: loaded = keys that landed and were made readable, failed = submitted
//      minus loaded, with l2.prefetch.failed per reason.
// At most max_in_flight requests run at once (default 8); others wait in FIFO order.
//
// Threading: async_prefetch may be called from any thread; the controller runs on its
// executor, which must not run handlers concurrently (one thread or a strand). The caller's
// handler runs on its associated executor. Cancelling async_prefetch (its cancellation slot)
// answers at once with operation_aborted; the request then finishes in the background.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l1/tier.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/pipeline/plan.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::pipeline {

struct prefetch_options {
  std::size_t max_in_flight = 8;  ///< requests past their lookup at once (LMCache's default)
  std::chrono::nanoseconds lookup_timeout = std::chrono::seconds(5);  ///< deadline of the lookups
  std::chrono::nanoseconds load_timeout = std::chrono::seconds(30);   ///< deadline of each load task
};

struct prefetch_request {
  std::uint64_t id = 0;             ///< for events and logs
  std::vector<chunk_key> keys;      ///< the keys to bring into L1, in prefix order
  std::size_t object_bytes = 0;     ///< size of each object
  std::uint32_t extra_count = 0;    ///< extra read holds per key handed to the caller
  std::chrono::nanoseconds wait_budget{0};  ///< how long the caller waits for the answer
};

struct prefetch_result {
  /// Leading keys now in L1 and read-locked for the caller with 1 + extra_count expiring
  /// holds; the caller releases them with finish_read.
  std::size_t prefix = 0;
  /// Leading keys the L2 backends had (before L1 reservation).
  std::size_t l2_prefix = 0;
};

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
class prefetch_controller {
 public:
  using executor_type = boost::asio::any_io_executor;
  using answer_handler = boost::asio::any_completion_handler<void(error_code, prefetch_result)>;

  prefetch_controller(executor_type executor, Tier& l1, std::vector<l2::any_backend>& backends, Bus& bus,
                      PlanPolicy plan = PlanPolicy{}, prefetch_options options = {})
      : executor_(std::move(executor)),
        l1_(l1),
        backends_(backends),
        bus_(bus),
        plan_(std::move(plan)),
        options_(options) {}

  prefetch_controller(const prefetch_controller&) = delete;
  prefetch_controller& operator=(const prefetch_controller&) = delete;

  /// Starts a prefetch; completes with void(error_code, prefetch_result) once it finished
  /// or its wait budget passed.
  template <class Token>
  auto async_prefetch(prefetch_request request, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, prefetch_result)>(
        [this](auto handler, prefetch_request req) {
          auto st = std::make_shared<state>(executor_);
          st->req = std::move(req);
          st->submitted_at = l2::clock::now();
          st->answer_at = st->submitted_at + st->req.wait_budget;
          auto slot = boost::asio::get_associated_cancellation_slot(handler);
          if (slot.is_connected()) {
            slot.assign([this, weak = std::weak_ptr<state>(st)](boost::asio::cancellation_type) {
              boost::asio::post(executor_, [this, weak] {
                if (auto s = weak.lock()) {
                  answer(*s, boost::asio::error::operation_aborted, {});
                  s->signal.cancel();
                }
              });
            });
          }
          st->handler = answer_handler(std::move(handler));
          boost::asio::co_spawn(executor_, run(st), boost::asio::detached);
        },
        token, std::move(request));
  }

  /// Requests between submission and their last task's completion.
  [[nodiscard]] std::size_t active() const noexcept { return active_.load(std::memory_order_relaxed); }
  /// Requests past admission (lookup, plan, load), at most max_in_flight.
  [[nodiscard]] std::size_t in_flight() const noexcept { return in_flight_.load(std::memory_order_relaxed); }
  /// Bytes of the loads submitted and not yet completed (for the in-flight gauge).
  [[nodiscard]] std::uint64_t inflight_load_bytes() const noexcept {
    return inflight_bytes_.load(std::memory_order_relaxed);
  }

  /// Completes once no request is active (every load task completed): tests, shutdown.
  boost::asio::awaitable<void> wait_idle() {
    while (active_.load(std::memory_order_relaxed) != 0) {
      boost::asio::steady_timer t(executor_, boost::asio::steady_timer::time_point::max());
      idle_waiters_.push_back(&t);
      co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
      std::erase(idle_waiters_, &t);
    }
  }

 private:
  // Per-key progress of a request.
  enum class key_state : std::uint8_t { waiting, landed, failed, finalized };

  struct state {
    explicit state(const executor_type& ex)
        : signal(ex, boost::asio::steady_timer::time_point::max()),
          budget_timer(ex, boost::asio::steady_timer::time_point::max()) {}
    prefetch_request req;
    l2::clock::time_point submitted_at{};
    l2::clock::time_point answer_at{};
    std::optional<answer_handler> handler;
    bool answered = false;
    bool finished = false;
    bool temporary = true;
    std::size_t l2_prefix = 0;
    std::size_t reserved = 0;           ///< keys [0, reserved) are write-locked for loading
    std::vector<std::span<std::byte>> buffers;
    std::vector<key_state> keys;
    std::vector<l2::key_outcome> outcomes;
    std::size_t tasks_left = 0;
    std::uint32_t loaded = 0;
    std::uint64_t loaded_bytes = 0;
    std::array<std::uint32_t, bus::prefetch_failure_count> failures{};
    boost::asio::steady_timer signal;        ///< cancelled when a task completes or the answer goes out
    boost::asio::steady_timer budget_timer;  ///< fires at answer_at
  };

  void answer(state& s, error_code ec, prefetch_result r) {
    if (s.answered) return;
    s.answered = true;
    if (!s.handler) return;
    auto h = std::move(*s.handler);
    s.handler.reset();
    auto ex = boost::asio::get_associated_executor(h, executor_);
    boost::asio::dispatch(ex, [h = std::move(h), ec, r]() mutable { std::move(h)(ec, r); });
  }

  boost::asio::awaitable<void> admit() {
    while (in_flight_.load(std::memory_order_relaxed) >= options_.max_in_flight) {
      boost::asio::steady_timer t(executor_, boost::asio::steady_timer::time_point::max());
      queue_.push_back(&t);
      co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    in_flight_.fetch_add(1, std::memory_order_relaxed);
  }

  void release_admission() {
    in_flight_.fetch_sub(1, std::memory_order_relaxed);
    if (!queue_.empty()) {
      queue_.front()->cancel();
      queue_.pop_front();
    }
  }

  static std::uint64_t ns(l2::clock::duration d) {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  }

  static bus::prefetch_failure reason_of(l2::key_outcome o) {
    switch (o) {
      case l2::key_outcome::corrupt: return bus::prefetch_failure::corrupt_object;
      case l2::key_outcome::timeout: return bus::prefetch_failure::timeout;
      case l2::key_outcome::unavailable: return bus::prefetch_failure::backend_unavailable;
      default: return bus::prefetch_failure::io_error;
    }
  }

  boost::asio::awaitable<void> run(std::shared_ptr<state> sp) {
    state& s = *sp;
    active_.fetch_add(1, std::memory_order_relaxed);
    const std::size_t n = s.req.keys.size();
    // A caller that waits reads the objects once: reserve them temporary. A caller that does
    // not wait (best_effort) leaves them to later requests: keep them.
    s.temporary = s.req.wait_budget.count() > 0;
    if (s.temporary) boost::asio::co_spawn(executor_, answer_at_budget(sp), boost::asio::detached);
    else answer(s, {}, {});

    co_await admit();
    if (n == 0 || backends_.empty() || (s.answered && s.temporary)) {  // nothing to do, or nobody to do it for
      answer(s, {}, {});
      release_admission();
      finish(s);
      co_return;
    }

    // 1. lookup and pin everywhere at once.
    bus_.publish(bus::l2_prefetch_lookup_submitted{s.req.id, static_cast<std::uint32_t>(n),
                                                   static_cast<std::uint32_t>(backends_.size())});
    std::vector<bitmap> found = co_await lookup_all(s.req.keys, s.submitted_at + options_.lookup_timeout);

    // 2. plan and trim to the pure L2 prefix.
    prefetch_plan plan = make_plan(plan_, found, n);
    s.l2_prefix = plan.l2_prefix;
    bus_.publish(bus::l2_prefetch_lookup_completed{s.req.id, static_cast<std::uint32_t>(n),
                                                   static_cast<std::uint32_t>(plan.l2_prefix)});

    // 3. reserve L1 for the prefix (unless the answer already went out for a temporary
    //    reservation: nobody would read it), trim to the reserved prefix, unpin the rest.
    if (plan.l2_prefix > 0 && !(s.answered && s.temporary)) reserve(s, plan);
    trim_plan(plan, s.reserved);
    const auto unpins = unpins_for(found, plan);
    for (std::size_t b = 0; b < backends_.size(); ++b) unpin(b, s.req.keys, unpins[b]);

    // 4. submit the loads.
    const std::size_t submitted = plan.submitted();
    if (plan.found_any > 0) {
      bus_.publish(bus::l2_prefetch_load_submitted{
          s.req.id, static_cast<std::uint32_t>(submitted), static_cast<std::uint32_t>(plan.tasks()),
          static_cast<std::uint32_t>(count_trimmed(plan)), submitted * s.req.object_bytes});
    }
    s.keys.assign(s.reserved, key_state::waiting);
    s.outcomes.assign(s.reserved, l2::key_outcome::timeout);
    for (std::size_t b = 0; b < plan.per_backend.size(); ++b) {
      if (!plan.per_backend[b].any()) continue;
      ++s.tasks_left;
      boost::asio::co_spawn(executor_, load_task(sp, b, plan.per_backend[b]), boost::asio::detached);
    }
    release_admission();

    // 5. answer when every task completed, unless the budget (or a cancellation) answered first.
    while (s.tasks_left > 0 && !s.answered) {
      s.signal.expires_at(boost::asio::steady_timer::time_point::max());
      co_await s.signal.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    if (!s.answered) {
      answer(s, {}, finalize_answer(s));
    } else {
      // Tasks that completed before an early answer (cancellation) still hold their slots.
      std::vector<std::size_t> done;
      for (std::size_t i = 0; i < s.keys.size(); ++i)
        if (s.keys[i] == key_state::landed || s.keys[i] == key_state::failed) done.push_back(i);
      finalize_late(s, done);
    }
    // 6. late tasks finalize their own keys; wait for them before the completion event.
    while (s.tasks_left > 0) {
      s.signal.expires_at(boost::asio::steady_timer::time_point::max());
      co_await s.signal.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    if (submitted > 0) {
      bus_.publish(bus::l2_prefetch_load_completed{s.req.id, s.loaded, static_cast<std::uint32_t>(submitted) - s.loaded,
                                                   s.loaded_bytes, ns(l2::clock::now() - s.submitted_at)});
      for (std::size_t r = 0; r < bus::prefetch_failure_count; ++r)
        if (s.failures[r] > 0)
          bus_.publish(bus::l2_prefetch_failed{s.req.id, static_cast<bus::prefetch_failure>(r), s.failures[r]});
    }
    finish(s);
  }

  // Answers with what has landed when the wait budget passes first.
  boost::asio::awaitable<void> answer_at_budget(std::shared_ptr<state> sp) {
    state& s = *sp;
    s.budget_timer.expires_at(s.answer_at);
    auto [ec] = co_await s.budget_timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    if (ec || s.answered || s.finished) co_return;
    answer(s, {}, finalize_answer(s));
    s.signal.cancel();
  }

  void finish(state& s) {
    s.finished = true;
    s.budget_timer.cancel();
    if (active_.fetch_sub(1, std::memory_order_relaxed) == 1)
      for (auto* t : idle_waiters_) t->cancel();
  }

  boost::asio::awaitable<std::vector<bitmap>> lookup_all(std::span<const chunk_key> keys, l2::deadline d) {
    struct gather {
      std::vector<bitmap> found;
      std::size_t remaining;
      boost::asio::steady_timer done;
    };
    auto g = std::make_shared<gather>(
        gather{std::vector<bitmap>(backends_.size(), bitmap(keys.size())), backends_.size(),
               boost::asio::steady_timer(executor_, boost::asio::steady_timer::time_point::max())});
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      boost::asio::co_spawn(
          executor_,
          [this, g, b, keys, d]() -> boost::asio::awaitable<void> {
            auto [ec, bits] = co_await backends_[b].async_lookup_and_pin(
                keys, d, boost::asio::as_tuple(boost::asio::use_awaitable));
            // A failed lookup found and pinned nothing; a short bitmap counts as misses.
            if (!ec && bits.size() == keys.size()) g->found[b] = std::move(bits);
            if (--g->remaining == 0) g->done.cancel();
          },
          boost::asio::detached);
    }
    while (g->remaining > 0) co_await g->done.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    co_return std::move(g->found);
  }

  void unpin(std::size_t b, std::span<const chunk_key> keys, const bitmap& which) {
    std::vector<chunk_key> u;
    for (std::size_t i = 0; i < which.size() && i < keys.size(); ++i)
      if (which.test(i)) u.push_back(keys[i]);
    if (!u.empty()) backends_[b].unpin(u);
  }

  void reserve(state& s, const prefetch_plan& plan) {
    const std::size_t m = plan.l2_prefix;
    std::vector<l1::status> st(m);
    s.buffers.assign(m, {});
    l1::write_options wo;
    wo.mode = l1::write_mode::new_only;
    wo.lock = l1::lock_lifetime::pinned;  // the kernel writes these slots: they must never expire
    wo.temporary = s.temporary;
    wo.purpose = bus::allocation_purpose::prefetch;
    l1_.reserve_write(std::span(s.req.keys).first(m), s.req.object_bytes, wo, st, s.buffers);
    std::size_t prefix = 0;
    while (prefix < m && st[prefix] == l1::status::success) ++prefix;
    // Reserved after the hole: never loaded, never readable.
    std::vector<chunk_key> drop;
    bool oom = false;
    for (std::size_t i = prefix; i < m; ++i) {
      if (st[i] == l1::status::success) drop.push_back(s.req.keys[i]);
      if (st[i] == l1::status::out_of_memory) oom = true;
    }
    if (!drop.empty()) {
      std::vector<l1::status> ds(drop.size());
      l1_.abandon_write(drop, ds);
    }
    if (oom)
      bus_.publish(bus::l2_prefetch_failed{s.req.id, bus::prefetch_failure::l1_out_of_memory,
                                           static_cast<std::uint32_t>(m - prefix)});
    s.reserved = prefix;
    s.buffers.resize(prefix);
  }

  boost::asio::awaitable<void> load_task(std::shared_ptr<state> sp, std::size_t b, bitmap mine) {
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
    auto [ec, result] = co_await backends_[b].async_load(keys, dst, t0 + options_.load_timeout,
                                                         boost::asio::as_tuple(boost::asio::use_awaitable));
    // The backend no longer writes the buffers: the slots may now be finalized or freed.
    inflight_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    backends_[b].unpin(keys);
    std::uint32_t ok = 0;
    for (std::size_t j = 0; j < idx.size(); ++j) {
      const auto o = j < result.size() ? result.outcomes[j] : l2::key_outcome::timeout;
      s.outcomes[idx[j]] = o;
      s.keys[idx[j]] = o == l2::key_outcome::ok ? key_state::landed : key_state::failed;
      ok += o == l2::key_outcome::ok ? 1 : 0;
    }
    bus_.publish(bus::l2_backend_load_completed{static_cast<std::uint8_t>(b), backends_[b].name(),
                                                static_cast<std::uint32_t>(keys.size()), ok, ok * s.req.object_bytes,
                                                ns(l2::clock::now() - t0)});
    if (s.answered) finalize_late(s, idx);
    --s.tasks_left;
    s.signal.cancel();
  }

  // Finalizes the keys whose task completed; the answer is the contiguous landed prefix.
  prefetch_result finalize_answer(state& s) {
    prefetch_result r;
    r.l2_prefix = s.l2_prefix;
    while (r.prefix < s.reserved && s.keys[r.prefix] == key_state::landed) ++r.prefix;
    std::vector<chunk_key> ready, after_hole, failed;
    for (std::size_t i = 0; i < s.reserved; ++i) {
      if (s.keys[i] == key_state::landed) (i < r.prefix ? ready : after_hole).push_back(s.req.keys[i]);
      else if (s.keys[i] == key_state::failed) failed.push_back(s.req.keys[i]);
      if (s.keys[i] != key_state::waiting) account(s, i);
    }
    if (!ready.empty()) {
      std::vector<l1::status> st(ready.size());
      l1_.finish_write_and_reserve_read(ready, s.req.extra_count, l1::lock_lifetime::expiring, st);
    }
    make_ready_unlocked(after_hole);
    abandon(failed);
    return r;
  }

  // A task that completed after the answer: nobody waits for its keys.
  void finalize_late(state& s, std::span<const std::size_t> idx) {
    std::vector<chunk_key> keep, drop;
    for (auto i : idx) {
      if (s.keys[i] == key_state::landed && !s.temporary) keep.push_back(s.req.keys[i]);
      else {
        if (s.keys[i] == key_state::landed) s.outcomes[i] = l2::key_outcome::timeout;  // too late to serve
        s.keys[i] = key_state::failed;
        drop.push_back(s.req.keys[i]);
      }
      account(s, i);
    }
    make_ready_unlocked(keep);
    abandon(drop);
  }

  void account(state& s, std::size_t i) {
    if (s.keys[i] == key_state::finalized) return;
    if (s.keys[i] == key_state::landed) {
      ++s.loaded;
      s.loaded_bytes += s.req.object_bytes;
    } else {
      ++s.failures[static_cast<std::size_t>(reason_of(s.outcomes[i]))];
    }
    s.keys[i] = key_state::finalized;
  }

  // Readable without a reader: a temporary object is freed at once, a kept one stays ready.
  // Never offered to the store pipeline (the object is already in L2).
  void make_ready_unlocked(std::span<const chunk_key> keys) {
    if (keys.empty()) return;
    std::vector<l1::status> st(keys.size());
    l1_.finish_write_and_reserve_read(keys, 0, l1::lock_lifetime::pinned, st);
    l1_.finish_read(keys, 0, l1::lock_lifetime::pinned, st);
  }

  void abandon(std::span<const chunk_key> keys) {
    if (keys.empty()) return;
    std::vector<l1::status> st(keys.size());
    l1_.abandon_write(keys, st);
  }

  executor_type executor_;
  Tier& l1_;
  std::vector<l2::any_backend>& backends_;
  Bus& bus_;
  PlanPolicy plan_;
  prefetch_options options_;
  std::atomic<std::size_t> active_{0};
  std::atomic<std::size_t> in_flight_{0};
  std::atomic<std::uint64_t> inflight_bytes_{0};
  std::deque<boost::asio::steady_timer*> queue_;
  std::vector<boost::asio::steady_timer*> idle_waiters_;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::pipeline
