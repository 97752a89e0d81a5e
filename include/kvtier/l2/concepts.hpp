#pragma once
// The l2_backend concept: what every L2 tier (memory, disk, Redis, a fault injector around
// any of them) provides to the store and prefetch pipelines: async_lookup_and_pin, unpin,
// async_load, async_store, async_remove (Asio-shaped, error_code first, each with a
// deadline), usage, health, name; and the optional listing, observable-load,
// buffer-registering, key-announcing and corruptible refinements. docs/pipelines.md, "L2
// backends", holds each operation's contract, the buffer contract and the threading rule.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/any_io_executor.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

namespace detail {
// Archetype completion handlers: the concept is checked with plain callbacks, which every
// Asio completion token reduces to.
struct lookup_handler_archetype {
  void operator()(error_code, bitmap) const {}
};
struct batch_handler_archetype {
  void operator()(error_code, batch_result) const {}
};
struct list_handler_archetype {
  void operator()(error_code, std::vector<listed_object>) const {}
};
}  // namespace detail

/// An L2 backend. The spans passed in stay valid until the operation completes. A load
/// completes only once nothing will write its destinations any more (its deadline stops and
/// cancels, it does not abandon them); a store only reads its sources until it completes.
/// Found keys stay pinned (never evicted by this backend) until unpin().
template <class B>
concept l2_backend = requires(B& b, const B& cb, std::span<const chunk_key> keys,
                              std::span<const std::span<std::byte>> destinations,
                              std::span<const std::span<const std::byte>> sources, deadline d) {
  { cb.name() } -> std::convertible_to<std::string_view>;
  { b.get_executor() } -> std::convertible_to<boost::asio::any_io_executor>;
  b.async_lookup_and_pin(keys, d, detail::lookup_handler_archetype{});
  b.unpin(keys);
  b.async_load(keys, destinations, d, detail::batch_handler_archetype{});
  b.async_store(keys, sources, d, detail::batch_handler_archetype{});
  b.async_remove(keys, d, detail::batch_handler_archetype{});
  { cb.usage() } -> std::same_as<usage_info>;
  { cb.health() } -> std::same_as<health_info>;
};

/// Backends whose loads tell each key as it lands (async_load with a load_observer before the
/// token, types.hpp): the prefetch makes each key readable at once instead of at the end of
/// the batch. Others are served through the plain async_load (any_backend falls back).
template <class B>
concept observable_load_backend =
    l2_backend<B> && requires(B& b, std::span<const chunk_key> keys, std::span<const std::span<std::byte>> dst,
                              deadline d, load_observer o) {
      b.async_load(keys, dst, d, o, detail::batch_handler_archetype{});
    };

/// Backends that read into registered memory faster (the disk backend: io_uring fixed
/// buffers, READ_FIXED, no page pinning per read): the host hands them the L1 arena once,
/// before the first operation (any_backend::register_buffers), or a piece at a time from
/// the backend's executor where it also has add_buffers (the server, once L1 is resident).
template <class B>
concept buffer_registering_backend = l2_backend<B> && requires(B& b, std::span<std::byte> region) {
  { b.register_buffers(region) } -> std::same_as<error_code>;
};

/// Backends that can list what they store: async_list(filter, deadline, token) ->
/// void(error_code, std::vector<listed_object>), the objects stored (visible to a lookup)
/// when it ran whose key `filter` accepts (every object for an empty filter), in no
/// particular order. A snapshot: objects stored or removed meanwhile may or may not be in
/// it. A listing cut by its deadline completes with errc::timeout and what it had found; a
/// backend that cannot reach its store, with the error and nothing.
template <class B>
concept listing_backend = l2_backend<B> && requires(B& b, key_filter f, deadline d) {
  b.async_list(f, d, detail::list_handler_archetype{});
};

/// Backends that tell a key_listener (types.hpp) how their index changes:
/// set_key_listener(listener) replaces the listener (empty: none); set it before the
/// operations whose changes it should hear of. Once set_key_listener returns, the previous
/// listener is not running and is never called again.
template <class B>
concept key_announcing_backend = l2_backend<B> && requires(B& b, key_listener l) { b.set_key_listener(l); };

/// Backends that can damage their own stored copy of a key on command (for tests and the
/// fault injector): the next load of that key must answer `corrupt`, never serve the bytes.
template <class B>
concept corruptible_backend = l2_backend<B> && requires(B& b, const chunk_key& k) {
  { b.corrupt_stored(k) } -> std::same_as<bool>;
};

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

/// The smallest type that models l2_backend, for checking the concept without a backend.
struct l2_backend_archetype {
  [[nodiscard]] std::string_view name() const { return "archetype"; }
  [[nodiscard]] boost::asio::any_io_executor get_executor() const { return {}; }
  template <class Token>
  void async_lookup_and_pin(std::span<const chunk_key>, deadline, Token&&) {}
  void unpin(std::span<const chunk_key>) {}
  template <class Token>
  void async_load(std::span<const chunk_key>, std::span<const std::span<std::byte>>, deadline, Token&&) {}
  template <class Token>
  void async_store(std::span<const chunk_key>, std::span<const std::span<const std::byte>>, deadline, Token&&) {}
  template <class Token>
  void async_remove(std::span<const chunk_key>, deadline, Token&&) {}
  [[nodiscard]] usage_info usage() const { return {}; }
  [[nodiscard]] health_info health() const { return {}; }
};
static_assert(l2_backend<l2_backend_archetype>);

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
