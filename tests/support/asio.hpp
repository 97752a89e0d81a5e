#pragma once
// Test support: run an awaitable to completion on an io_context from a test body.

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>

#include <exception>
#include <optional>
#include <stdexcept>
#include <utility>

namespace kvtier::test {

/// Runs `io` until `a` completes (other work stays queued for the next run); returns its value.
template <class T>
T run_sync(boost::asio::io_context& io, boost::asio::awaitable<T> a) {
  std::optional<T> result;
  std::exception_ptr error;
  boost::asio::co_spawn(io, std::move(a), [&](std::exception_ptr e, T v) {
    error = e;
    result.emplace(std::move(v));
    io.stop();
  });
  io.restart();
  io.run();
  if (error) std::rethrow_exception(error);
  if (!result) throw std::logic_error("run_sync: the awaitable did not complete");
  return std::move(*result);
}

inline void run_sync(boost::asio::io_context& io, boost::asio::awaitable<void> a) {
  std::exception_ptr error;
  bool done = false;
  boost::asio::co_spawn(io, std::move(a), [&](std::exception_ptr e) {
    error = e;
    done = true;
    io.stop();
  });
  io.restart();
  io.run();
  if (error) std::rethrow_exception(error);
  if (!done) throw std::logic_error("run_sync: the awaitable did not complete");
}

}  // namespace kvtier::test
