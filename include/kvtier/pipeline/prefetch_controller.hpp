#pragma once
// prefetch_controller: the prefetch pipeline, L2 -> L1. Per request: lookup and pin in every
// backend at once, plan, take the longest prefix L1 and L2 can serve together
// (l1::tier::reserve_prefix), load, make each key readable as it lands, answer the caller. At
// most max_in_flight requests run at once. docs/pipelines.md, "Prefetch pipeline", holds the
// steps and the events each publishes, the load-or-recompute gate, stop and threads.

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
#include <kvtier/pipeline/load_or_recompute.hpp>
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
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

struct prefetch_options {
  std::size_t max_in_flight = 8;  ///< requests past their lookup at once (LMCache's default)
  std::chrono::nanoseconds lookup_timeout = std::chrono::seconds(5);  ///< deadline of the lookups
  std::chrono::nanoseconds load_timeout = std::chrono::seconds(30);   ///< deadline of each load task
  /// The load-or-recompute gate's probes (docs/pipelines.md, "Load or recompute"): one
  /// request in `probe_every` whose L2 chunks the gate declines still loads `probe_chunks`
  /// of them (the first declined ones), so the backend's estimate keeps learning while the
  /// gate declines. 0 (either): never probe; a gate judged slow once then stays shut.
  std::size_t probe_every = 8;
  std::size_t probe_chunks = 1;
};

struct prefetch_request {
  std::uint64_t id = 0;             ///< for events and logs
  std::vector<chunk_key> keys;      ///< the keys to bring into L1, in prefix order
  std::size_t object_bytes = 0;     ///< size of each object (0: nothing is loaded)
  std::uint32_t extra_count = 0;    ///< extra read holds per key handed to the caller
  std::chrono::nanoseconds wait_budget{0};  ///< how long the caller waits for the answer
  /// Set: answer when decided and tell each key still loading with on_key(index, landed)
  /// (docs/pipelines.md, step 6). Runs on the controller's executor; must not call into it.
  std::function<void(std::size_t, bool)> on_key;
  /// Set (with on_key): told on_verified(index, bytes) when a key this request loads itself,
  /// still loading, has its first `bytes` bytes verified and final in its L1 slot (the
  /// backend told: l2::load_observer), before it lands. The slot is still write-locked; the
  /// call runs on the controller's executor before the key can be finalized, so a reader may
  /// take l1::tier::reserve_unfinished_read on it from inside the call and read those bytes.
  /// Must not call into the controller.
  std::function<void(std::size_t, std::size_t)> on_verified;
  /// The load-or-recompute gate (0: off, offer everything): the engine's prefill rate, and
  /// what a chunk is (keys per chunk, its tokens).
  std::uint64_t prefill_tokens_per_second = 0;
  std::size_t group = 1;
  std::uint32_t chunk_tokens = 0;
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
  /// A decided answer (on_key given): bit i (i < prefix) is a key still loading, which on_key
  /// will report; the others are held now. Empty otherwise.
  bitmap pending;
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
        options_(options),
        bandwidth_(backends.size()) {}

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
                  if (s->answered)
                    give_up(*s);
                  else
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

  /// Stops: answers every request with operation_aborted and starts nothing more
  /// (docs/pipelines.md, "Stop"). Any thread; idempotent. Later requests are answered at once.
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

  /// Each backend's achieved load bandwidth (bytes landed per second of loading, 0 before
  /// its first load) and what the gate estimates from it.
  [[nodiscard]] const bandwidth_meter& bandwidth() const noexcept { return bandwidth_; }

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
    bool gave_up = false;  ///< the caller takes no more holds (answered in full, budget, stop)
    bool finished = false;
    bool temporary = true;
    std::size_t l2_prefix = 0;
    std::size_t reserved = 0;  ///< keys [0, reserved) were taken by the L1 walk
    std::vector<std::span<std::byte>> buffers;
    std::vector<key_state> keys;
    bitmap own;     ///< keys this request loads itself (submitted)
    bitmap served;  ///< keys the walk took from L1 or from another request's load
    bitmap settled;  ///< own keys finalized (landed early, or at their task's completion)
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
  [[nodiscard]] static bool decides(const state& s) noexcept { return static_cast<bool>(s.req.on_key); }

  // The caller's answer. An error answer, or keys past `r.prefix`, give the caller's holds back.
  // Only a decided answer (decides(s), r.pending set) leaves the caller waiting for keys.
  void answer(state& s, error_code ec, prefetch_result r) {
    if (s.answered) return;
    s.answered = true;
    if (ec) r = {};
    if (r.pending.none()) s.gave_up = true;
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

  // A decided caller stops waiting (budget, stop, cancellation): every key still loading or
  // joined for it fails (on_key(i, false)); what it holds stays its own.
  void give_up(state& s) {
    if (s.gave_up) return;
    s.gave_up = true;
    if (!decides(s)) return;
    for (std::size_t i = 0; i < s.keys.size(); ++i) {
      if (s.keys[i] == key_state::joined) {
        s.keys[i] = key_state::failed;
        --s.joins_left;
      } else if (s.keys[i] != key_state::loading) {
        continue;
      }
      s.req.on_key(i, false);
    }
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

  // The decided answer: everything the walk took, held or still loading.
  prefetch_result decided_answer(const state& s) const {
    prefetch_result r;
    r.l2_prefix = s.l2_prefix;
    r.prefix = s.reserved;
    r.from_l2 = bitmap(r.prefix);
    r.pending = bitmap(r.prefix);
    for (std::size_t i = 0; i < r.prefix; ++i) {
      if (s.keys[i] != key_state::l1_held) r.from_l2.set(i);
      if (s.keys[i] == key_state::loading || s.keys[i] == key_state::joined) r.pending.set(i);
    }
    return r;
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
      if (s->answered)
        give_up(*s);
      else
        answer(*s, boost::asio::error::operation_aborted, {});
      s->budget_timer.cancel();
      s->signal.cancel();
    }
  }

  boost::asio::awaitable<void> run(std::shared_ptr<state> sp);

  // Answers with what is held when the wait budget passes first.
  boost::asio::awaitable<void> answer_at_budget(std::shared_ptr<state> sp) {
    state& s = *sp;
    s.budget_timer.expires_at(s.answer_at);
    auto [ec] = co_await s.budget_timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    if (ec || s.gave_up || s.finished) co_return;
    if (s.answered)
      give_up(s);
    else
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

  // Step 2's load-or-recompute gate: loadable keys must be below the returned index (see
  // impl/prefetch_controller.hpp); one declining request in probe_every probes.
  std::size_t gate(state& s, const prefetch_plan& plan);

  // Step 3: the walk over L1 and the plan (l1::tier::reserve_prefix); keys from `limit` on
  // are not loaded.
  void reserve(const std::shared_ptr<state>& sp, const prefetch_plan& plan, std::size_t limit);

  // Step 3: walks L1 and the plan together (unless the answer already went out for a
  // temporary reservation), keeps in the plan only what this request loads, unpins the rest.
  void take_prefix(const std::shared_ptr<state>& sp, prefetch_plan& plan, const std::vector<bitmap>& found);
  // Step 4: publishes what the loads take (and what was found but is neither loaded nor
  // served), then spawns one load task per backend that has keys to load.
  void submit_loads(const std::shared_ptr<state>& sp, const prefetch_plan& plan, const std::vector<bitmap>& found);
  boost::asio::awaitable<void> load_task(std::shared_ptr<state> sp, std::size_t b, bitmap mine);
  // Step 6: the completion events of a request that submitted loads.
  void publish_load_completed(const state& s, std::size_t submitted);

  // A prefix of a key of a load in flight was verified (the backend told): pass it on while
  // the key is still write-locked for this request (not finalized: settled is clear).
  void verified(const std::shared_ptr<state>& sp, std::size_t i, std::size_t bytes) {
    state& s = *sp;
    if (i >= s.settled.size() || s.settled.test(i) || s.keys[i] != key_state::loading) return;
    if (stopping() || s.gave_up || !decides(s) || !s.req.on_verified) return;
    s.req.on_verified(i, bytes);
  }

  // One key of a load in flight landed (the backend told): finalize it now.
  void land(const std::shared_ptr<state>& sp, std::size_t i) {
    state& s = *sp;
    if (i >= s.settled.size() || s.settled.test(i)) return;  // its task completed first
    s.outcomes[i] = l2::key_outcome::ok;
    const std::size_t one[] = {i};
    finalize(sp, one);
  }

  // Step 5: the keys of a completed task are made readable with the holds of every request
  // still waiting for them, or abandoned; their joiners learn the outcome.
  void finalize(const std::shared_ptr<state>& sp, std::span<const std::size_t> idx);

  executor_type executor_;
  Tier& l1_;
  std::vector<l2::any_backend>& backends_;
  Bus& bus_;
  work_tracker& tracker_;
  PlanPolicy plan_;
  prefetch_options options_;
  bandwidth_meter bandwidth_;
  std::size_t declining_ = 0;  ///< requests whose L2 chunks the gate declined (on the executor): probe pacing
  std::atomic<bool> stopping_{false};
  std::atomic<std::size_t> active_{0};
  std::atomic<std::size_t> in_flight_{0};
  std::atomic<std::uint64_t> inflight_bytes_{0};
  std::deque<boost::asio::steady_timer*> queue_;
  std::vector<boost::asio::steady_timer*> idle_waiters_;
  std::unordered_set<state*> live_;                                      ///< requests running (for stop)
  std::unordered_map<chunk_key, shared_load, chunk_key_hash> inflight_;  ///< keys our loads write
};

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/pipeline/impl/prefetch_controller.hpp>
