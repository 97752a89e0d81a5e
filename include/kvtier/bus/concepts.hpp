#pragma once
// Contracts of the bus module: what a subscriber and an event bus are.

#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>

#include <concepts>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {

/// How a subscriber receives events.
enum class delivery {
  immediate,  ///< called inline on the publishing thread; must be thread-safe and cheap
  deferred,   ///< queued and called later by drain(), one drainer at a time
};

/// S handles E when it has `on(const E&)`. Subscribers simply do not declare the events they
/// ignore; the bus then never calls them for those.
template <class S, class E>
concept handles = event<E> && requires(S& s, const E& e) { s.on(e); };

/// A deferred subscriber S may filter what the bus queues for it with
/// `bool wants(const E&) const noexcept`, asked on the publishing thread (cheap: a level check,
/// say): an event no deferred subscriber wants is not queued, costs no queue slot and does not
/// wake the drain thread. Without wants(), S wants every event it handles.
template <class S, class E>
concept filters = handles<S, E> && requires(const S& s, const E& e) {
  { s.wants(e) } noexcept -> std::convertible_to<bool>;
};

/// A subscriber's delivery: `static constexpr bus::delivery delivery_mode = ...;`, immediate
/// when it does not say.
template <class S>
[[nodiscard]] consteval delivery delivery_of() {
  if constexpr (requires { S::delivery_mode; }) return S::delivery_mode;
  else return delivery::immediate;
}

/// Anything components can publish to: basic_event_bus<...> or null_bus.
template <class B>
concept event_bus = requires(B& b, const l1_read_finished& e) {
  b.publish(e);
  { B::template handles_event<l1_read_finished> } -> std::convertible_to<bool>;
};

/// Whether `b` would deliver an event of type E now: false when no subscriber handles E;
/// the bus's wants_kind<E>() when it has one (basic_event_bus); true otherwise. Publishers of
/// events that cost something to build ask it first.
template <event E, class B>
[[nodiscard]] bool wants_kind(const B& b) noexcept {
  if constexpr (!B::template handles_event<E>) return false;
  else if constexpr (requires { b.template wants_kind<E>(); }) return b.template wants_kind<E>();
  else return true;
}

/// An archetype event bus: the smallest type that models event_bus, for concept checks.
struct event_bus_archetype {
  template <event E>
  static constexpr bool handles_event = false;
  template <event E>
  void publish(const E&) noexcept {}
};
static_assert(event_bus<event_bus_archetype>);

}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
