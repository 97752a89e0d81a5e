#pragma once
// prefetch_controller: the prefetch pipeline, L2 -> L1 (reference/lmcache-mp.md section 6.1).
//
// For each request (keys a lookup did not find at the head of L1, in prefix order):
//   1. lookup-and-pin in every backend at once;
//   2. plan (the plan policy picks a backend per key); the contiguous prefix of keys some
//      backend has is the pure L2 hit count (l2.prefetch.lookup.completed);
//   3. take the longest prefix L1 and L2 can serve together, in one step under the tier's
//      mutex (l1::tier::reserve_prefix), walking the keys in order: a key L1 holds is
//      read-locked for the caller (a prefix split between L2 and L1 is served whole); a key
//      another request of this controller is loading is joined (this request waits for
//      that load and is handed the object with its own holds: two lookups of one document
//      share the load); a key only L2 has gets a new L1 slot (pinned write lock: the kernel
//      writes into it), as many as fit after eviction: the prefix ends at the first key
//      without a slot (l2.prefetch.failed{l1_out_of_memory} counts the keys that lacked
//      one), at a key neither tier has, or at a key being written by someone else;
//      what will not be loaded is unpinned;
//   4. submit one load task per backend (l2.prefetch.load.submitted counts the keys actually
//      submitted, and separately the found keys neither submitted nor served from L1 or a
//      shared load);
//   5. each key that lands is made readable at once, atomically with the read holds of
//      every request still waiting for it (this one and its joiners; finish_write_and_
//      reserve_read, never offered to the store pipeline); a failed key is abandoned
//      without ever becoming readable and fails its joiners too;
//   6. answer the caller when its loads and joins ended or the wait budget passed,
//      whichever is first: the answer is the contiguous prefix the caller holds; holds past
//      it are given back. A load still running at the answer keeps its slots write-locked
//      until the backend completes (a cancelled or late read never lands in a reused slot);
//      it is then handed to its joiners, or abandoned, or, for a non-temporary reservation
//      (the best_effort wait policy), made ready in L1 for later requests.
//      l2.prefetch.load.completed is published once every task completed: loaded = keys
//      that landed and were made readable, failed = submitted minus loaded, with
//      l2.prefetch.failed per reason.
// At most max_in_flight requests run at once (default 8); others wait in FIFO order.
//
// Holds handed to the caller are pinned (never expired by L1): the caller owns them and
// gives them back with finish_read(..., 1 + extra_count, pinned) (tiered_cache does, per
// lookup, and expires its own lookups).
//
// Stop: stop() answers every request with operation_aborted (giving back what it held),
// cancels the timers and the queue of requests waiting for admission, and reserves nothing
// more; the backend operations in flight are left to complete by their deadlines
// (lookup_timeout, load_timeout: not every backend survives the cancellation of an
// operation, and a load must end before its slots may be freed), after which every
// coroutine ends. The work is counted in the work_tracker given at construction, which the
// owner waits on before destroying the controller.
//
// Threading: async_prefetch and stop may be called from any thread; the controller runs on
// its executor, which must not run handlers concurrently (one thread or a strand). The
// caller's handler runs on its associated executor. Cancelling async_prefetch (its
// cancellation slot) answers at once with operation_aborted; the request then finishes in
// the background.

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
#include <kvtier/pipeline/work_tracker.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/dispatch.hpp>
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
#include <unordered_map>
#include <unordered_set>
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
  std::size_t object_bytes = 0;     ///< size of each object (0: nothing is loaded)
  std::uint32_t extra_count = 0;    ///< extra read holds per key handed to the caller
  std::chrono::nanoseconds wait_budget{0};  ///< how long the caller waits for the answer
};

struct prefetch_result {
  /// Leading keys now in L1 and read-locked for the caller with 1 + extra_count pinned
  /// holds each; the caller releases them with finish_read(..., pinned).
  std::size_t prefix = 0;
  /// Leading keys the L2 backends had (before L1 reservation).
  std::size_t l2_prefix = 0;
  /// Bit i (i < prefix): key i was loaded from L2 for this answer (by this request or a
  /// load it shared); clear: it was read from L1. Empty when prefix is 0.
  bitmap from_l2;
};

template <class Tier, prefetch_plan_policy PlanPolicy, bus::event_bus Bus>
class prefetch_controller {
 public:
  using executor_type = boost::asio::any_io_executor;
  using answer_handler = boost::asio::any_completion_handler<void(error_code, prefetch_result)>;

  /// `tracker` counts every coroutine and handler the controller starts; it must outlive
  /// the controller, whose owner waits on it (after stop()) before destroying it.
  prefetch_controller(executor_type executor, Tier& l1, std::vector<l2::any_backend>& backends, Bus& bus,
                      work_tracker& tracker, PlanPolicy plan = PlanPolicy{}, prefetch_options options = {})
      : executor_(std::move(executor)),
        l1_(l1),
        backends_(backends),
        bus_(bus),
        tracker_(tracker),
        plan_(std::move(plan)),
        options_(options) {}

  prefetch_controller(const prefetch_controller&) = delete;
  prefetch_controller& operator=(const prefetch_controller&) = delete;

  /// Starts a prefetch; completes with void(error_code, prefetch_result) once it finished
  /// or its wait budget passed (operation_aborted, nothing held, once stop() was called).
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
            st->slot = slot;
            slot.assign([this, weak = std::weak_ptr<state>(st)](boost::asio::cancellation_type) {
              tracker_.post(executor_, [this, weak] {
                if (auto s = weak.lock()) {
                  answer(*s, boost::asio::error::operation_aborted, {});
                  s->signal.cancel();
                }
              });
            });
          }
          st->handler = answer_handler(std::move(handler));
          tracker_.spawn(executor_, run(st));
        },
        token, std::move(request));
  }

  /// Stops: answers every request with operation_aborted and starts nothing more (see the
  /// header comment). Any thread; idempotent. Later requests are answered at once.
  void stop() {
    if (stopping_.exchange(true)) return;
    tracker_.post(executor_, [this] { stop_now(); });
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
  // Per-key progress of a request, for keys [0, reserved).
  enum class key_state : std::uint8_t {
    l1_held,   ///< read from L1 at the reservation: held for the caller
    loading,   ///< its own load is in flight (write-locked)
    joined,    ///< another request's load is in flight: waiting for it
    held,      ///< landed (own or shared) and held for the caller
    failed,    ///< its load failed, or was too late to serve
    released,  ///< made readable but not held for the caller (late, or past the answer)
  };

  struct state;
  // A key loaded by one request that others joined: who waits for it.
  struct shared_load {
    std::vector<std::pair<std::shared_ptr<state>, std::size_t>> joiners;  ///< (request, key index)
  };

  struct state {
    explicit state(const executor_type& ex)
        : signal(ex, boost::asio::steady_timer::time_point::max()),
          budget_timer(ex, boost::asio::steady_timer::time_point::max()) {}
    prefetch_request req;
    l2::clock::time_point submitted_at{};
    l2::clock::time_point answer_at{};
    std::optional<answer_handler> handler;
    boost::asio::cancellation_slot slot;  ///< the caller's, cleared at the answer
    bool answered = false;
    bool finished = false;
    bool temporary = true;
    std::size_t l2_prefix = 0;
    std::size_t reserved = 0;  ///< keys [0, reserved) were taken by the L1 walk
    std::vector<std::span<std::byte>> buffers;
    std::vector<key_state> keys;
    bitmap own;     ///< keys this request loads itself (submitted)
    bitmap served;  ///< keys the walk took from L1 or from another request's load
    std::vector<l2::key_outcome> outcomes;
    std::size_t tasks_left = 0;
    std::size_t joins_left = 0;
    std::uint32_t loaded = 0;
    std::uint64_t loaded_bytes = 0;
    std::array<std::uint32_t, bus::prefetch_failure_count> failures{};
    boost::asio::steady_timer signal;        ///< cancelled when a task or join completes, or the answer goes out
    boost::asio::steady_timer budget_timer;  ///< fires at answer_at
  };

  [[nodiscard]] std::uint32_t holds_of(const state& s) const noexcept { return 1 + s.req.extra_count; }

  // The caller's answer. An error answer, or keys past `r.prefix`, give the caller's holds back.
  void answer(state& s, error_code ec, prefetch_result r) {
    if (s.answered) return;
    s.answered = true;
    if (ec) r = {};
    release_past(s, r.prefix);
    if (s.slot.is_connected()) s.slot.clear();
    if (!s.handler) return;
    auto h = std::move(*s.handler);
    s.handler.reset();
    auto ex = boost::asio::get_associated_executor(h, executor_);
    // Counted until the handler ran (it may run later, on another executor).
    tracker_.begin();
    boost::asio::dispatch(ex, [this, h = std::move(h), ec, r = std::move(r)]() mutable {
      std::move(h)(ec, std::move(r));
      tracker_.end();
    });
  }

  // Gives back the caller's holds on keys [from, reserved).
  void release_past(state& s, std::size_t from) {
    std::vector<chunk_key> back;
    for (std::size_t i = from; i < s.keys.size(); ++i)
      if (s.keys[i] == key_state::l1_held || s.keys[i] == key_state::held) {
        back.push_back(s.req.keys[i]);
        s.keys[i] = key_state::released;
      }
    if (back.empty()) return;
    std::vector<l1::status> st(back.size());
    l1_.finish_read(back, s.req.extra_count, l1::lock_lifetime::pinned, st);
  }

  // The answer now: the contiguous prefix the caller holds.
  prefetch_result current_answer(const state& s) const {
    prefetch_result r;
    r.l2_prefix = s.l2_prefix;
    while (r.prefix < s.keys.size() && (s.keys[r.prefix] == key_state::l1_held || s.keys[r.prefix] == key_state::held))
      ++r.prefix;
    if (r.prefix > 0) {
      r.from_l2 = bitmap(r.prefix);
      for (std::size_t i = 0; i < r.prefix; ++i)
        if (s.keys[i] == key_state::held) r.from_l2.set(i);
    }
    return r;
  }

  // Admission in FIFO order; false when the controller stopped meanwhile.
  boost::asio::awaitable<bool> admit() {
    while (in_flight_.load(std::memory_order_relaxed) >= options_.max_in_flight) {
      if (stopping_.load(std::memory_order_relaxed)) co_return false;
      boost::asio::steady_timer t(executor_, boost::asio::steady_timer::time_point::max());
      queue_.push_back(&t);
      co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
      std::erase(queue_, &t);
    }
    if (stopping_.load(std::memory_order_relaxed)) co_return false;
    in_flight_.fetch_add(1, std::memory_order_relaxed);
    co_return true;
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

  [[nodiscard]] bool stopping() const noexcept { return stopping_.load(std::memory_order_relaxed); }

  // On the executor: everything in flight is answered and cancelled.
  void stop_now() {
    for (auto* t : queue_) t->cancel();
    queue_.clear();
    const std::vector<state*> live(live_.begin(), live_.end());
    for (state* s : live) {
      answer(*s, boost::asio::error::operation_aborted, {});
      s->budget_timer.cancel();
      s->signal.cancel();
    }
  }

  boost::asio::awaitable<void> run(std::shared_ptr<state> sp) {
    state& s = *sp;
    active_.fetch_add(1, std::memory_order_relaxed);
    live_.insert(&s);
    const std::size_t n = s.req.keys.size();
    // A caller that waits reads the objects once: reserve them temporary. A caller that does
    // not wait (best_effort) leaves them to later requests: keep them.
    s.temporary = s.req.wait_budget.count() > 0;
    if (s.temporary)
      tracker_.spawn(executor_, answer_at_budget(sp));
    else answer(s, {}, {});

    const bool admitted = co_await admit();
    if (!admitted || n == 0 || backends_.empty() || (s.answered && s.temporary) || stopping()) {
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
    s.own = bitmap(n);
    s.served = bitmap(n);
    if (!(s.answered && s.temporary) && !stopping()) reserve(sp, plan);
    restrict_plan(plan, s.own);
    const auto unpins = unpins_for(found, plan);
    for (std::size_t b = 0; b < backends_.size(); ++b) unpin(b, s.req.keys, unpins[b]);

    // 4. submit the loads.
    const std::size_t submitted = plan.submitted();
    if (plan.found_any > 0) {
      bitmap any(n);
      for (const auto& f : found)
        if (f.size() == n) any |= f;
      any.subtract(s.own);
      any.subtract(s.served);
      const std::size_t trimmed = any.count();  // found, but neither loaded nor served otherwise
      bus_.publish(bus::l2_prefetch_load_submitted{
          s.req.id, static_cast<std::uint32_t>(submitted), static_cast<std::uint32_t>(plan.tasks()),
          static_cast<std::uint32_t>(trimmed), submitted * s.req.object_bytes});
    }
    s.outcomes.assign(s.reserved, l2::key_outcome::timeout);
    for (std::size_t b = 0; b < plan.per_backend.size(); ++b) {
      if (!plan.per_backend[b].any()) continue;
      ++s.tasks_left;
      tracker_.spawn(executor_, load_task(sp, b, plan.per_backend[b]));
    }
    release_admission();

    // 5. answer when every task and join ended, unless the budget (or a cancellation) answered first.
    while ((s.tasks_left > 0 || s.joins_left > 0) && !s.answered) {
      s.signal.expires_at(boost::asio::steady_timer::time_point::max());
      co_await s.signal.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    answer(s, stopping() ? boost::asio::error::operation_aborted : error_code{}, current_answer(s));
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

  // Answers with what is held when the wait budget passes first.
  boost::asio::awaitable<void> answer_at_budget(std::shared_ptr<state> sp) {
    state& s = *sp;
    s.budget_timer.expires_at(s.answer_at);
    auto [ec] = co_await s.budget_timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    if (ec || s.answered || s.finished) co_return;
    answer(s, {}, current_answer(s));
    s.signal.cancel();
  }

  void finish(state& s) {
    s.finished = true;
    s.budget_timer.cancel();
    live_.erase(&s);
    if (active_.fetch_sub(1, std::memory_order_relaxed) == 1)
      for (auto* t : idle_waiters_) t->cancel();
  }

  boost::asio::awaitable<std::vector<bitmap>> lookup_all(std::shared_ptr<state> sp, l2::deadline d) {
    struct gather {
      std::vector<bitmap> found;
      std::size_t remaining;
      boost::asio::steady_timer done;
    };
    std::span<const chunk_key> keys = sp->req.keys;
    auto g = std::make_shared<gather>(
        gather{std::vector<bitmap>(backends_.size(), bitmap(keys.size())), backends_.size(),
               boost::asio::steady_timer(executor_, boost::asio::steady_timer::time_point::max())});
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      // co_spawn keeps the lambda (its captures) alive until the coroutine ends.
      tracker_.spawn(executor_, [this, g, b, keys, d, sp]() -> boost::asio::awaitable<void> {
        auto [ec, bits] =
            co_await backends_[b].async_lookup_and_pin(keys, d, boost::asio::as_tuple(boost::asio::use_awaitable));
        // A failed lookup found and pinned nothing; a short bitmap counts as misses.
        if (!ec && bits.size() == keys.size()) g->found[b] = std::move(bits);
        if (--g->remaining == 0) g->done.cancel();
      });
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

  // Step 3: the walk over L1 and the plan (l1::tier::reserve_prefix).
  void reserve(const std::shared_ptr<state>& sp, const prefetch_plan& plan) {
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
    po.hold_reads = !s.answered;  // a request nobody waits for reads nothing now
    const auto r = l1_.reserve_prefix(
        s.req.keys, po, [&](std::size_t i) { return can_load && loadable.test(i); },
        [&](std::size_t i) { return !s.answered && inflight_.contains(s.req.keys[i]); }, takes, s.buffers);
    s.reserved = r.length;
    s.keys.assign(s.reserved, key_state::released);
    for (std::size_t i = 0; i < s.reserved; ++i) {
      switch (takes[i]) {
        case l1::prefix_take::read:
          s.keys[i] = s.answered ? key_state::released : key_state::l1_held;
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
      ok += o == l2::key_outcome::ok ? 1 : 0;
    }
    bus_.publish(bus::l2_backend_load_completed{static_cast<std::uint8_t>(b), backends_[b].name(),
                                                static_cast<std::uint32_t>(keys.size()), ok, ok * s.req.object_bytes,
                                                ns(l2::clock::now() - t0)});
    finalize(sp, idx);
    --s.tasks_left;
    s.signal.cancel();
  }

  // Step 5: the keys of a completed task are made readable with the holds of every request
  // still waiting for them, or abandoned; their joiners learn the outcome.
  void finalize(const std::shared_ptr<state>& sp, std::span<const std::size_t> idx) {
    state& s = *sp;
    const bool live = !stopping();
    std::vector<chunk_key> ready, drop;
    std::vector<std::uint32_t> holds;
    std::vector<state*> woken;
    for (const std::size_t i : idx) {
      const chunk_key& k = s.req.keys[i];
      std::vector<std::pair<std::shared_ptr<state>, std::size_t>> joiners;
      if (auto it = inflight_.find(k); it != inflight_.end()) {
        joiners = std::move(it->second.joiners);
        inflight_.erase(it);
      }
      const bool landed = s.outcomes[i] == l2::key_outcome::ok;
      const bool self_waits = live && !s.answered && s.keys[i] == key_state::loading;
      std::uint32_t n = landed && self_waits ? holds_of(s) : 0;
      for (auto& [j, at] : joiners) {
        if (j->answered || !live || j->keys[at] != key_state::joined) continue;
        if (landed) {
          n += holds_of(*j);
          j->keys[at] = key_state::held;
        } else {
          j->keys[at] = key_state::failed;
        }
        --j->joins_left;
        woken.push_back(j.get());
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
    for (state* j : woken) j->signal.cancel();
  }

  executor_type executor_;
  Tier& l1_;
  std::vector<l2::any_backend>& backends_;
  Bus& bus_;
  work_tracker& tracker_;
  PlanPolicy plan_;
  prefetch_options options_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::size_t> active_{0};
  std::atomic<std::size_t> in_flight_{0};
  std::atomic<std::uint64_t> inflight_bytes_{0};
  std::deque<boost::asio::steady_timer*> queue_;
  std::vector<boost::asio::steady_timer*> idle_waiters_;
  std::unordered_set<state*> live_;                                      ///< requests running (for stop)
  std::unordered_map<chunk_key, shared_load, chunk_key_hash> inflight_;  ///< keys our loads write
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::pipeline
