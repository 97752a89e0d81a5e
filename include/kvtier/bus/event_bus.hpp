#pragma once
// basic_event_bus<Subscribers...>: a compile-time event bus.
//
// publish(e) calls, inline, exactly the subscribers that declare `on(const E&)` with
// immediate delivery (the metrics subscriber: relaxed atomics on the publishing thread, so
// its counts are exact), and queues e for the deferred ones (loggers) when one of them wants
// it (an optional wants(e) filter, concepts.hpp: a logger wants only what its level writes),
// which run when drain() is called: from the bus's own drain thread (start_drain_thread) or
// from any executor the host chooses. The queue is bounded; when it is full the event is
// dropped for the deferred subscribers only, and dropped() counts it. An event type nobody
// handles costs nothing: publish<E> is an empty inline function.
//
// Thread safety: publish and enqueue from any thread; drain from any thread (one drainer at
// a time, others return 0 at once); subscribers of deferred delivery are never called
// concurrently with each other.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/detail/bounded_queue.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {

struct bus_options {
  std::size_t queue_capacity = 8192;  ///< deferred events held at most (rounded up to 2^k)
};

namespace detail {

// The variant of the event types some deferred subscriber handles (plus monostate). Built
// with one tuple_cat over all event types: linear, no recursive instantiation.
template <class Tuple>
struct variant_of;
template <class... Es>
struct variant_of<std::tuple<Es...>> {
  using type = std::variant<std::monostate, Es...>;
};

template <class Tuple, template <class> class Pred>
struct filter_variant;
template <class... Es, template <class> class Pred>
struct filter_variant<std::tuple<Es...>, Pred> {
  using filtered = decltype(std::tuple_cat(
      std::declval<std::conditional_t<Pred<Es>::value, std::tuple<Es>, std::tuple<>>>()...));
  using type = typename variant_of<filtered>::type;
};

}  // namespace detail

template <class... Subscribers>
class basic_event_bus {
 public:
  /// True when some subscriber handles E (otherwise publish<E> is a no-op).
  template <event E>
  static constexpr bool handles_event = (handles<Subscribers, E> || ...);

  /// True when some deferred subscriber handles E (publish<E> then also queues it).
  template <event E>
  static constexpr bool defers_event =
      ((handles<Subscribers, E> && delivery_of<Subscribers>() == delivery::deferred) || ...);

  explicit basic_event_bus(Subscribers... subscribers) : basic_event_bus(bus_options{}, std::move(subscribers)...) {}

  explicit basic_event_bus(bus_options options, Subscribers... subscribers)
      : subscribers_(std::move(subscribers)...), queue_(has_deferred ? options.queue_capacity : 2) {}

  basic_event_bus(const basic_event_bus&) = delete;
  basic_event_bus& operator=(const basic_event_bus&) = delete;

  /// Stops the drain thread, then delivers what is still queued.
  ~basic_event_bus() {
    stop_drain_thread();
    drain();
  }

  /// Delivers e to every subscriber that handles E: immediate ones now, deferred ones via
  /// the queue.
  template <event E>
  void publish(const E& e) {
    if constexpr (handles_event<E>) {
      std::apply([&e](auto&... s) { (deliver_immediate(s, e), ...); }, subscribers_);
      if constexpr (defers_event<E>) enqueue(e);
    }
  }

  /// Whether an event of type E would reach some subscriber now: an immediate subscriber
  /// handles E, or a deferred one handles it and wants it (asked with a default E, so wants()
  /// of E must not depend on its content for this answer to be exact). Publishers of the
  /// costly events (the key events: vectors) ask this before building one (bus::wants_kind).
  template <event E>
  [[nodiscard]] bool wants_kind() const noexcept {
    if constexpr (!handles_event<E>) {
      return false;
    } else if constexpr (((handles<Subscribers, E> && delivery_of<Subscribers>() == delivery::immediate) || ...)) {
      return true;
    } else {
      static const E probe{};
      return deferred_wants(probe);
    }
  }

  /// Queues e for the deferred subscribers. Returns false, and counts a drop, when the queue
  /// is full. A no-op returning true when no deferred subscriber handles E or wants e.
  template <event E>
  bool enqueue(const E& e) {
    if constexpr (defers_event<E>) {
      if (!deferred_wants(e)) return true;  // no deferred subscriber would use it: not queued
      // Copied before a cell is claimed (a copy may throw), then moved into the cell as the
      // variant's alternative E: no variant is moved (bounded_queue::try_emplace).
      static_assert(std::is_nothrow_move_constructible_v<E>,
                    "an event's move must not throw (bounded_queue::try_emplace)");
      E copy(e);
      if (!queue_.try_emplace(std::in_place_type<E>, std::move(copy))) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
      // Wake the drain thread only on the 0 -> 1 edge: one notify per drain cycle at most.
      if (pending_.exchange(1, std::memory_order_acq_rel) == 0) pending_.notify_one();
      return true;
    } else {
      return true;
    }
  }

  /// Delivers up to `max` queued events to the deferred subscribers; returns how many. When
  /// another thread is draining it returns 0 at once.
  std::size_t drain(std::size_t max = std::numeric_limits<std::size_t>::max()) {
    if constexpr (!has_deferred) {
      return 0;
    } else {
      std::unique_lock lock(drain_mutex_, std::try_to_lock);
      if (!lock.owns_lock()) return 0;
      std::size_t n = 0;
      while (n < max) {
        auto item = queue_.try_pop();
        if (!item) break;
        std::visit([&](const auto& e) { deliver_deferred(e); }, *item);
        ++n;
      }
      delivered_.fetch_add(n, std::memory_order_relaxed);
      return n;
    }
  }

  /// Events dropped because the deferred queue was full.
  [[nodiscard]] std::uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  /// Events delivered to the deferred subscribers so far.
  [[nodiscard]] std::uint64_t delivered() const noexcept { return delivered_.load(std::memory_order_relaxed); }
  /// Exceptions thrown by deferred subscribers (caught and counted; the event is skipped).
  [[nodiscard]] std::uint64_t subscriber_errors() const noexcept {
    return subscriber_errors_.load(std::memory_order_relaxed);
  }
  [[nodiscard]] std::size_t queue_capacity() const noexcept { return queue_.capacity(); }

  template <class S>
  [[nodiscard]] S& subscriber() noexcept {
    return std::get<S>(subscribers_);
  }
  template <class S>
  [[nodiscard]] const S& subscriber() const noexcept {
    return std::get<S>(subscribers_);
  }

  /// Starts a thread that drains as events arrive (it sleeps on a futex while idle). Idempotent.
  void start_drain_thread() {
    if constexpr (has_deferred) {
      std::lock_guard g(thread_mutex_);
      if (drain_thread_.joinable()) return;
      stopping_.store(false, std::memory_order_relaxed);
      drain_thread_ = std::thread([this] { drain_loop(); });
    }
  }

  /// Stops the drain thread after it has delivered everything queued so far. Idempotent.
  void stop_drain_thread() {
    std::lock_guard g(thread_mutex_);
    if (!drain_thread_.joinable()) return;
    stopping_.store(true, std::memory_order_release);
    pending_.store(1, std::memory_order_release);
    pending_.notify_one();
    drain_thread_.join();
  }

 private:
  template <class E>
  struct is_deferred : std::bool_constant<defers_event<E>> {};
  using queued_event = typename detail::filter_variant<all_events, is_deferred>::type;
  static constexpr bool has_deferred = std::variant_size_v<queued_event> > 1;

  /// Whether some deferred subscriber that handles e wants it (filters<S, E>).
  template <class E>
  bool deferred_wants(const E& e) const noexcept {
    return std::apply([&e](const auto&... s) { return (wants_one(s, e) || ...); }, subscribers_);
  }
  template <class S, class E>
  static bool wants_one(const S& s, const E& e) noexcept {
    if constexpr (handles<S, E> && delivery_of<S>() == delivery::deferred) {
      if constexpr (filters<S, E>) return s.wants(e);
      else return true;
    } else {
      return false;
    }
  }

  template <class S, class E>
  static void deliver_immediate(S& s, const E& e) {
    if constexpr (handles<S, E> && delivery_of<S>() == delivery::immediate) s.on(e);
  }

  void deliver_deferred(const std::monostate&) noexcept {}

  template <class E>
  void deliver_deferred(const E& e) noexcept {
    std::apply([&](auto&... s) { (deliver_one_deferred(s, e), ...); }, subscribers_);
  }

  template <class S, class E>
  void deliver_one_deferred(S& s, const E& e) noexcept {
    if constexpr (handles<S, E> && delivery_of<S>() == delivery::deferred) {
      try {
        s.on(e);
      } catch (...) {
        subscriber_errors_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void drain_loop() {
    for (;;) {
      // Taking the flag (acq_rel) makes every event pushed before the publisher set it visible.
      pending_.exchange(0, std::memory_order_acq_rel);
      drain();
      if (stopping_.load(std::memory_order_acquire)) {
        drain();
        return;
      }
      pending_.wait(0, std::memory_order_acquire);
    }
  }

  std::tuple<Subscribers...> subscribers_;
  detail::bounded_queue<queued_event> queue_;
  std::atomic<std::uint64_t> dropped_{0};
  std::atomic<std::uint64_t> delivered_{0};
  std::atomic<std::uint64_t> subscriber_errors_{0};
  std::atomic<std::uint32_t> pending_{0};  // 1: events may be queued since the last drain; 0: drained
  std::atomic<bool> stopping_{false};
  std::mutex drain_mutex_;
  std::mutex thread_mutex_;
  std::thread drain_thread_;
};

static_assert(event_bus<basic_event_bus<>>);

}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
