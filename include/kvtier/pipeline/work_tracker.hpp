#pragma once
// work_tracker: counts the work a component started on an executor (coroutines it spawned,
// handlers it posted) so that it can tell when none is left, for an asynchronous stop
// (async_wait_idle) and for a destructor that must not return while a coroutine still
// refers to the object (wait_idle, from another thread). The pipelines and the cache share
// one per tiered_cache.
//
// A piece of work is counted from spawn()/post() until it has finished: for a coroutine,
// until its frame is gone and its completion handler runs; nothing it captured is touched
// after that. end() is the last thing a piece of work does, and touches no member after the
// count reached zero and the waiters were taken, so a waiter may destroy the tracker's owner.
//
// Thread safety: every member may be called from any thread.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

class work_tracker {
 public:
  using idle_handler = boost::asio::any_completion_handler<void(error_code)>;

  work_tracker() = default;
  work_tracker(const work_tracker&) = delete;
  work_tracker& operator=(const work_tracker&) = delete;

  /// Spawns the awaitable on `ex`, counted until it ended. An exception escaping it is a
  /// bug and is dropped (as with asio::detached).
  template <class Executor, class Awaitable>
  void spawn(const Executor& ex, Awaitable&& a) {
    begin();
    boost::asio::co_spawn(ex, std::forward<Awaitable>(a), [this](std::exception_ptr) { end(); });
  }

  /// Posts `f` to `ex`, counted until it ran.
  template <class Executor, class F>
  void post(const Executor& ex, F&& f) {
    begin();
    boost::asio::post(ex, [this, f = std::forward<F>(f)]() mutable {
      f();
      end();
    });
  }

  /// Counts one piece of work by hand (pair with end()).
  void begin() {
    std::lock_guard g(mutex_);
    ++count_;
  }

  /// Ends one piece of work; at zero, wakes wait_idle and completes the async waiters.
  void end() {
    std::vector<std::pair<idle_handler, boost::asio::any_io_executor>> ready;
    {
      std::lock_guard g(mutex_);
      if (--count_ > 0) return;
      ready.swap(waiters_);
      idle_.notify_all();
    }
    // Nothing of *this is touched from here on: a waiter may destroy it.
    for (auto& [h, fallback] : ready) {
      auto ex = boost::asio::get_associated_executor(h, fallback);
      boost::asio::dispatch(ex, [h = std::move(h)]() mutable { std::move(h)(error_code{}); });
    }
  }

  /// Pieces of work not finished.
  [[nodiscard]] std::size_t count() const {
    std::lock_guard g(mutex_);
    return count_;
  }
  [[nodiscard]] bool idle() const { return count() == 0; }

  /// Blocks until no work is left. Only from a thread that does not run the work's executor.
  void wait_idle() {
    std::unique_lock g(mutex_);
    idle_.wait(g, [this] { return count_ == 0; });
  }

  /// Completes with void(error_code) once no work is left (at once, through `fallback` or
  /// the handler's own executor, when none is).
  template <class Token>
  auto async_wait_idle(boost::asio::any_io_executor fallback, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code)>(
        [this, fallback](auto handler) {
          {
            std::lock_guard g(mutex_);
            if (count_ > 0) {
              waiters_.emplace_back(idle_handler(std::move(handler)), fallback);
              return;
            }
          }
          auto ex = boost::asio::get_associated_executor(handler, fallback);
          boost::asio::post(ex, [h = std::move(handler)]() mutable { std::move(h)(error_code{}); });
        },
        token);
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable idle_;
  std::size_t count_ = 0;
  std::vector<std::pair<idle_handler, boost::asio::any_io_executor>> waiters_;
};

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
