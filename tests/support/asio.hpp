#pragma once
// Test support: drive an io_context from a test body: run an awaitable to completion, run
// until a condition holds (bounded by a generous deadline), or until nothing is left to run
// now.

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>

#include <kvtier/config.hpp>

#include <chrono>
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

/// Generous: sanitizer builds are slow, and a deadline only guards against a hang.
inline std::chrono::seconds io_deadline() { return std::chrono::seconds(30 * config::timeout_scale); }

/// Runs handlers of `io` until `done()` holds or `limit` passes; returns done().
template <class Pred>
bool run_until(boost::asio::io_context& io, Pred done, std::chrono::steady_clock::duration limit = io_deadline()) {
  const auto end = std::chrono::steady_clock::now() + limit;
  io.restart();
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    io.run_one_for(std::chrono::milliseconds(50));
    if (io.stopped()) io.restart();
  }
  return true;
}

/// Runs every ready handler without blocking.
inline void poll(boost::asio::io_context& io) {
  io.restart();
  io.poll();
}

/// Runs handlers until none is ready (timers not yet due stay queued): whatever the code
/// under test does in reaction to what already happened has happened. On loopback a write
/// is readable by the peer as soon as it returns, so a message sent meanwhile between two
/// parties on this io_context has been read too.
inline void run_until_idle(boost::asio::io_context& io) {
  const auto end = std::chrono::steady_clock::now() + io_deadline();  // against a busy loop
  do io.restart();
  while (io.poll() > 0 && std::chrono::steady_clock::now() < end);
}

}  // namespace kvtier::test
