#pragma once
// store_controller: the store pipeline, L1 -> L2.
//
// Keys offered (written to L1 and admitted) are queued; one coroutine wakes per batch of
// offers, asks the store policy which backends get which keys, read-locks them in L1 with
// pinned locks (the backend reads the slot memory until it completes), and submits one
// store task per backend (split at max_batch_keys). On completion it releases the locks,
// publishes the per-backend counts and, for a policy that does not keep keys in L1
// (skip_l1), deletes from L1 the keys every target stored. No blind retry: a failed key is
// counted and L1 keeps its data. In-flight bytes are bounded: when a task would pass
// max_inflight_bytes the loop waits for completions before submitting more.
//
// Threading: offer() may be called from any thread; everything else runs on the executor
// given at construction, which must not run handlers concurrently (one thread or a strand). Events: l2_store_submitted, l2_store_completed (per backend task).

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/concepts.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::pipeline {

struct store_options {
  std::size_t max_batch_keys = 64;                   ///< keys per backend store task
  std::uint64_t max_inflight_bytes = std::uint64_t{2} << 30;  ///< bytes being stored at once
  std::chrono::nanoseconds task_timeout = std::chrono::seconds(30);  ///< deadline of one task
};

template <class Tier, store_policy StorePolicy, bus::event_bus Bus>
class store_controller {
 public:
  using executor_type = boost::asio::any_io_executor;

  store_controller(executor_type executor, Tier& l1, std::vector<l2::any_backend>& backends, Bus& bus,
                   StorePolicy policy = StorePolicy{}, store_options options = {})
      : executor_(std::move(executor)),
        l1_(l1),
        backends_(backends),
        bus_(bus),
        policy_(std::move(policy)),
        options_(options),
        wake_(executor_, boost::asio::steady_timer::time_point::max()),
        completed_(executor_, boost::asio::steady_timer::time_point::max()) {}

  store_controller(const store_controller&) = delete;
  store_controller& operator=(const store_controller&) = delete;

  /// Starts the loop on the executor. Call once.
  void start() {
    boost::asio::co_spawn(executor_, run(), boost::asio::detached);
  }

  /// Stops taking work: the loop ends once the queue is drained and tasks completed.
  void stop() {
    boost::asio::post(executor_, [this] {
      stopping_ = true;
      wake_.cancel();
    });
  }

  /// Queues keys for L2. Thread-safe.
  void offer(std::span<const chunk_key> keys) {
    if (keys.empty()) return;
    {
      std::lock_guard g(mutex_);
      pending_.insert(pending_.end(), keys.begin(), keys.end());
    }
    boost::asio::post(executor_, [this] { wake_.cancel(); });
  }

  [[nodiscard]] StorePolicy& policy() noexcept { return policy_; }

  /// Bytes handed to backends and not yet completed (for the in-flight gauge).
  [[nodiscard]] std::uint64_t inflight_bytes() const noexcept { return inflight_bytes_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t inflight_tasks() const noexcept { return inflight_tasks_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t pending_keys() const {
    std::lock_guard g(mutex_);
    return pending_.size();
  }

  /// Completes (on the executor) once nothing is queued or in flight: for tests and
  /// orderly shutdown.
  boost::asio::awaitable<void> wait_idle() {
    for (;;) {
      if (idle()) co_return;
      boost::asio::steady_timer t(executor_, boost::asio::steady_timer::time_point::max());
      idle_waiters_.push_back(&t);
      co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
      std::erase(idle_waiters_, &t);
    }
  }

 private:
  // A key whose L1 copy may be dropped once every target stored it (skip_l1).
  struct pending_drop {
    std::uint32_t remaining = 0;
    bool all_ok = true;
  };

  bool idle() const {
    std::lock_guard g(mutex_);
    return pending_.empty() && inflight_tasks_.load(std::memory_order_relaxed) == 0 && !batch_running_;
  }

  void notify_idle() {
    if (!idle()) return;
    for (auto* t : idle_waiters_) t->cancel();
  }

  boost::asio::awaitable<void> run() {
    for (;;) {
      std::vector<chunk_key> keys;
      {
        std::lock_guard g(mutex_);
        keys.swap(pending_);
        batch_running_ = !keys.empty();
      }
      if (keys.empty()) {
        notify_idle();
        if (stopping_) co_return;
        wake_.expires_at(boost::asio::steady_timer::time_point::max());
        co_await wake_.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
        continue;
      }
      co_await submit(std::move(keys));
      {
        std::lock_guard g(mutex_);
        batch_running_ = false;
      }
    }
  }

  boost::asio::awaitable<void> submit(std::vector<chunk_key> keys) {
    std::vector<bitmap> targets;
    policy_.select_targets(keys, backends_.size(), targets);
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      std::vector<chunk_key> mine;
      for (std::size_t i = 0; i < keys.size(); ++i)
        if (b < targets.size() && targets[b].test(i)) mine.push_back(keys[i]);
      for (std::size_t at = 0; at < mine.size(); at += options_.max_batch_keys) {
        const std::size_t n = std::min(options_.max_batch_keys, mine.size() - at);
        co_await submit_task(b, std::span(mine).subspan(at, n));
      }
    }
  }

  // Read-locks the keys (pinned), waits for room under the in-flight bound, and spawns the
  // backend task.
  boost::asio::awaitable<void> submit_task(std::size_t b, std::span<const chunk_key> keys) {
    std::vector<l1::status> st(keys.size());
    l1_.reserve_read(keys, 0, l1::lock_lifetime::pinned, st);
    auto task = std::make_shared<store_task>();
    task->backend = b;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (st[i] == l1::status::success) task->keys.push_back(keys[i]);  // evicted or rewritten: skip
    if (task->keys.empty()) co_return;
    std::vector<l1::status> vs(task->keys.size());
    std::vector<std::span<const std::byte>> views(task->keys.size());
    l1_.read_views(task->keys, vs, views);
    task->sources = std::move(views);
    for (const auto& v : task->sources) task->bytes += v.size();

    while (inflight_bytes_.load(std::memory_order_relaxed) > 0 &&
           inflight_bytes_.load(std::memory_order_relaxed) + task->bytes > options_.max_inflight_bytes) {
      completed_.expires_at(boost::asio::steady_timer::time_point::max());
      co_await completed_.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    if (!policy_.keep_in_l1())
      for (const auto& k : task->keys) {
        auto& d = drops_[k];
        ++d.remaining;
      }
    inflight_bytes_.fetch_add(task->bytes, std::memory_order_relaxed);
    inflight_tasks_.fetch_add(1, std::memory_order_relaxed);
    bus_.publish(bus::l2_store_submitted{static_cast<std::uint8_t>(b), backends_[b].name(),
                                         static_cast<std::uint32_t>(task->keys.size()), task->bytes});
    boost::asio::co_spawn(executor_, run_task(task), boost::asio::detached);
  }

  struct store_task {
    std::size_t backend = 0;
    std::vector<chunk_key> keys;
    std::vector<std::span<const std::byte>> sources;
    std::uint64_t bytes = 0;
  };

  boost::asio::awaitable<void> run_task(std::shared_ptr<store_task> task) {
    const auto t0 = l2::clock::now();
    auto [ec, result] = co_await backends_[task->backend].async_store(
        task->keys, task->sources, t0 + options_.task_timeout, boost::asio::as_tuple(boost::asio::use_awaitable));
    const auto duration = l2::clock::now() - t0;
    // The backend no longer reads the slots: release the pinned read locks.
    std::vector<l1::status> st(task->keys.size());
    l1_.finish_read(task->keys, 0, l1::lock_lifetime::pinned, st);

    std::uint32_t ok = 0;
    std::uint64_t ok_bytes = 0;
    std::vector<chunk_key> drop_now;
    for (std::size_t i = 0; i < task->keys.size(); ++i) {
      const bool stored = i < result.size() && (result.outcomes[i] == l2::key_outcome::ok ||
                                                result.outcomes[i] == l2::key_outcome::exists);
      if (stored) {
        ++ok;
        ok_bytes += task->sources[i].size();
      }
      if (!policy_.keep_in_l1()) {
        auto it = drops_.find(task->keys[i]);
        if (it != drops_.end()) {
          it->second.all_ok = it->second.all_ok && stored;
          if (--it->second.remaining == 0) {
            if (it->second.all_ok) drop_now.push_back(task->keys[i]);
            drops_.erase(it);
          }
        }
      }
    }
    if (!drop_now.empty()) {
      // Every target has the key: L1 was only its write buffer. Forced, so a key a reader
      // holds leaves the index now and its memory goes with the reader's last lock.
      std::vector<l1::status> rs(drop_now.size());
      l1_.remove(drop_now, true, rs);
    }
    bus_.publish(bus::l2_store_completed{
        static_cast<std::uint8_t>(task->backend), backends_[task->backend].name(), ok,
        static_cast<std::uint32_t>(task->keys.size()) - ok, ok_bytes,
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count())});
    inflight_bytes_.fetch_sub(task->bytes, std::memory_order_relaxed);
    inflight_tasks_.fetch_sub(1, std::memory_order_relaxed);
    completed_.cancel();
    notify_idle();
  }

  executor_type executor_;
  Tier& l1_;
  std::vector<l2::any_backend>& backends_;
  Bus& bus_;
  StorePolicy policy_;
  store_options options_;
  boost::asio::steady_timer wake_;
  boost::asio::steady_timer completed_;
  mutable std::mutex mutex_;
  std::vector<chunk_key> pending_;
  bool batch_running_ = false;
  bool stopping_ = false;
  std::atomic<std::uint64_t> inflight_bytes_{0};
  std::atomic<std::size_t> inflight_tasks_{0};
  std::unordered_map<chunk_key, pending_drop, chunk_key_hash> drops_;
  std::vector<boost::asio::steady_timer*> idle_waiters_;
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::pipeline
