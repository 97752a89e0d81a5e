#pragma once
// Turning an internal coroutine into a public Asio-shaped operation.
//
// async_run<Sig>(executor, awaitable, token) runs the awaitable on `executor` (co_spawn) and
// completes the caller's token with the awaitable's result, a std::tuple matching Sig, e.g.
// std::tuple<error_code, bitmap> for void(error_code, bitmap). The caller's handler is invoked
// through its associated executor (so a coroutine caller resumes on its own executor) and its
// cancellation slot is forwarded to the coroutine (per-operation cancellation). An exception
// escaping the coroutine is a bug; it is rethrown on the caller's executor.

#include <kvtier/config.hpp>

#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>

#include <exception>
#include <tuple>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace detail {

namespace asio = boost::asio;

template <class Signature>
struct result_tuple;
template <class... Args>
struct result_tuple<void(Args...)> {
  using type = std::tuple<std::decay_t<Args>...>;
};

/// The std::tuple an internal coroutine returns for completion signature Sig.
template <class Signature>
using result_tuple_t = typename result_tuple<Signature>::type;

template <class Signature, class Executor, class Token>
auto async_run(Executor executor, asio::awaitable<result_tuple_t<Signature>> op, Token&& token) {
  return asio::async_initiate<Token, Signature>(
      [executor](auto handler, asio::awaitable<result_tuple_t<Signature>> body) mutable {
        auto slot = asio::get_associated_cancellation_slot(handler);
        auto handler_ex = asio::get_associated_executor(handler, executor);
        auto work = asio::make_work_guard(handler_ex);
        asio::co_spawn(
            executor, std::move(body),
            asio::bind_cancellation_slot(
                slot, [h = std::move(handler), w = std::move(work)](std::exception_ptr e,
                                                                    result_tuple_t<Signature> r) mutable {
                  auto ex = w.get_executor();
                  asio::dispatch(ex, [h = std::move(h), e, r = std::move(r)]() mutable {
                    if (e) std::rethrow_exception(e);
                    std::apply(std::move(h), std::move(r));
                  });
                }));
      },
      token, std::move(op));
}

}  // namespace detail
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
