#pragma once
// coroutine_backend<Derived>: the asynchronous operations of l2_backend (concepts.hpp),
// written once for the backends whose operations are coroutines (memory, disk, Redis, the
// fault injector). Each async_xxx runs Derived's coroutine (lookup_impl, load_impl,
// store_impl, remove_impl: they return the completion's arguments as a std::tuple) on
// Derived's get_executor() through kvtier::detail::async_run, which forwards the caller's
// cancellation slot and completes on the caller's executor. async_load with a load_observer
// exists where Derived says `static constexpr bool tells_landed_keys = true` (its load_impl
// then takes the observer last). async_list exists where Derived says
// `static constexpr bool lists_objects = true` (its list_impl(filter, deadline) then returns
// std::tuple<error_code, std::vector<listed_object>>).
//
// Derived grants access to its coroutines with `friend class detail::coroutine_backend<Derived>;`.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/detail/async.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/types.hpp>

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

template <class Derived>
class coroutine_backend {
 public:
  /// void(error_code, bitmap found).
  template <class Token>
  auto async_lookup_and_pin(std::span<const chunk_key> keys, deadline d, Token&& token) {
    return run<void(error_code, bitmap)>(self().lookup_impl(keys, d), std::forward<Token>(token));
  }

  /// void(error_code, batch_result).
  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
                  Token&& token) {
    return run<void(error_code, batch_result)>(self().load_impl(keys, destinations, d), std::forward<Token>(token));
  }

  /// The same, telling each key as soon as it landed and was verified (load_observer).
  template <class Token, class D = Derived>
    requires D::tells_landed_keys
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
                  load_observer observer, Token&& token) {
    return run<void(error_code, batch_result)>(self().load_impl(keys, destinations, d, std::move(observer)),
                                               std::forward<Token>(token));
  }

  /// void(error_code, batch_result).
  template <class Token>
  auto async_store(std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> sources, deadline d,
                   Token&& token) {
    return run<void(error_code, batch_result)>(self().store_impl(keys, sources, d), std::forward<Token>(token));
  }

  /// void(error_code, batch_result).
  template <class Token>
  auto async_remove(std::span<const chunk_key> keys, deadline d, Token&& token) {
    return run<void(error_code, batch_result)>(self().remove_impl(keys, d), std::forward<Token>(token));
  }

  /// void(error_code, std::vector<listed_object>) (listing_backend, concepts.hpp).
  template <class Token, class D = Derived>
    requires D::lists_objects
  auto async_list(key_filter filter, deadline d, Token&& token) {
    return run<void(error_code, std::vector<listed_object>)>(self().list_impl(std::move(filter), d),
                                                             std::forward<Token>(token));
  }

 protected:
  coroutine_backend() = default;
  ~coroutine_backend() = default;

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }

  template <class Signature, class Body, class Token>
  auto run(Body body, Token&& token) {
    return ::kvtier::detail::async_run<Signature>(self().get_executor(), std::move(body), std::forward<Token>(token));
  }
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
