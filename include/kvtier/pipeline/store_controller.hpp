#pragma once
// store_controller: the store pipeline, L1 -> L2. Offered keys (written to L1 and admitted,
// or staged when L1 had no room) are queued; per batch the store policy picks the backends,
// the keys are read-locked in L1 (pinned) and stored, one task per backend, in-flight bytes
// bounded; no blind retry. docs/pipelines.md, "Store pipeline", holds the steps, staging,
// stop and threads.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/status.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/concepts.hpp>
#include <kvtier/pipeline/work_tracker.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
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

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace pipeline {

struct store_options {
  /// Keys per backend store task, at most (task_keys: also at most half the in-flight bound).
  std::size_t max_batch_keys = 64;
  /// Bytes being stored at once; also the bound of the staging memory of stores larger than L1.
  std::uint64_t max_inflight_bytes = std::uint64_t{2} << 30;
  std::chrono::nanoseconds task_timeout = std::chrono::seconds(30);  ///< deadline of one task
};

/// Keys per backend store task for objects of up to `object_bytes` (L1's slot size): at most
/// max_batch_keys, and at most half of max_inflight_bytes' worth (one key at least), so that a
/// second task is always in flight beside one: a task's tail (its last keys' writes and syncs,
/// a disk backend's directory fsyncs) overlaps the next task's writes. 64 keys of 32 MiB
/// filled the 2 GiB bound alone, and the device idled through every task's tail
/// (docs/performance.md, "L2 disk vs fio").
[[nodiscard]] inline std::size_t task_keys(const store_options& o, std::size_t object_bytes) noexcept {
  const std::size_t most = std::max<std::size_t>(1, o.max_batch_keys);
  if (object_bytes == 0) return most;
  const std::uint64_t by_bytes = std::max<std::uint64_t>(1, o.max_inflight_bytes / 2 / object_bytes);
  return by_bytes < most ? static_cast<std::size_t>(by_bytes) : most;
}

/// Keys written into staging memory instead of L1 (a store larger than L1), with that memory.
struct staged_keys {
  std::vector<chunk_key> keys;
  std::vector<aligned_buffer> buffers;  ///< buffers[i] holds keys[i]'s object (object_bytes of it)
  std::size_t object_bytes = 0;
  std::uint64_t reserved_bytes = 0;  ///< what try_reserve_staging granted for these buffers
};

template <class Tier, store_policy StorePolicy, bus::event_bus Bus>
class store_controller {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// `tracker` counts every coroutine and handler the controller starts; it must outlive
  /// the controller, whose owner waits on it (after stop()) before destroying it.
  store_controller(executor_type executor, Tier& l1, std::vector<l2::any_backend>& backends, Bus& bus,
                   work_tracker& tracker, StorePolicy policy = StorePolicy{}, store_options options = {})
      : executor_(std::move(executor)),
        l1_(l1),
        backends_(backends),
        bus_(bus),
        tracker_(tracker),
        policy_(std::move(policy)),
        options_(options),
        completed_(executor_, boost::asio::steady_timer::time_point::max()) {}

  store_controller(const store_controller&) = delete;
  store_controller& operator=(const store_controller&) = delete;

  /// Stops taking work and drops what is queued (docs/pipelines.md, "Stop"). Any thread;
  /// idempotent.
  void stop() {
    if (stopping_.exchange(true)) return;
    {
      std::lock_guard g(mutex_);
      pending_.clear();
      for (auto& s : pending_staged_) release_staging(s.reserved_bytes);
      pending_staged_.clear();
    }
    tracker_.post(executor_, [this] { completed_.cancel(); });  // a loop waiting for room ends
  }

  /// Queues keys for L2. Thread-safe. Ignored once stopped or without backends.
  void offer(std::span<const chunk_key> keys) {
    if (keys.empty() || backends_.empty() || stopping_.load(std::memory_order_relaxed)) return;
    bool start = false;
    {
      std::lock_guard g(mutex_);
      pending_.insert(pending_.end(), keys.begin(), keys.end());
      start = !running_;
      running_ = true;
    }
    if (start) tracker_.spawn(executor_, run());
  }

  /// Reserves `bytes` of staging memory: false when what is staged (or in flight from
  /// staging) would pass max_inflight_bytes, when stopped, or without backends. Thread-safe.
  [[nodiscard]] bool try_reserve_staging(std::uint64_t bytes) {
    if (backends_.empty() || stopping_.load(std::memory_order_relaxed)) return false;
    std::uint64_t cur = staged_bytes_.load(std::memory_order_relaxed);
    do {
      if (cur + bytes > options_.max_inflight_bytes) return false;
    } while (!staged_bytes_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
    return true;
  }
  /// Gives back staging memory reserved and not handed to offer_staged. Thread-safe.
  void release_staging(std::uint64_t bytes) noexcept { staged_bytes_.fetch_sub(bytes, std::memory_order_relaxed); }

  /// Queues staged keys for L2, taking their memory and its reservation. Thread-safe.
  void offer_staged(staged_keys staged) {
    if (staged.keys.empty()) {
      release_staging(staged.reserved_bytes);
      return;
    }
    bool start = false;
    {
      std::lock_guard g(mutex_);
      if (stopping_.load(std::memory_order_relaxed) || backends_.empty()) {
        release_staging(staged.reserved_bytes);
        return;
      }
      pending_staged_.push_back(std::move(staged));
      start = !running_;
      running_ = true;
    }
    if (start) tracker_.spawn(executor_, run());
  }

  [[nodiscard]] StorePolicy& policy() noexcept { return policy_; }

  /// Bytes handed to backends and not yet completed (for the in-flight gauge).
  [[nodiscard]] std::uint64_t inflight_bytes() const noexcept { return inflight_bytes_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t inflight_tasks() const noexcept { return inflight_tasks_.load(std::memory_order_relaxed); }
  /// Bytes of staging memory reserved or in flight.
  [[nodiscard]] std::uint64_t staged_bytes() const noexcept { return staged_bytes_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::size_t pending_keys() const {
    std::lock_guard g(mutex_);
    std::size_t n = pending_.size();
    for (const auto& s : pending_staged_) n += s.keys.size();
    return n;
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

  // The memory of staged keys, shared by their tasks; freed (and its reservation given
  // back) when the last one completed.
  struct staged_memory {
    store_controller* owner = nullptr;
    staged_keys staged;
    ~staged_memory() {
      if (owner != nullptr) owner->release_staging(staged.reserved_bytes);
    }
  };

  struct store_task {
    std::size_t backend = 0;
    std::vector<chunk_key> keys;
    std::vector<std::span<const std::byte>> sources;
    std::uint64_t bytes = 0;
    bool from_l1 = true;                    ///< false: staged (no L1 locks to release, nothing to drop)
    std::shared_ptr<staged_memory> memory;  ///< staged: keeps the sources alive
  };

  bool idle() const {
    std::lock_guard g(mutex_);
    return pending_.empty() && pending_staged_.empty() && inflight_tasks_.load(std::memory_order_relaxed) == 0 &&
           !running_;
  }

  void notify_idle() {
    if (!idle()) return;
    for (auto* t : idle_waiters_) t->cancel();
  }

  [[nodiscard]] bool stopping() const noexcept { return stopping_.load(std::memory_order_relaxed); }

  boost::asio::awaitable<void> run() {
    for (;;) {
      std::vector<chunk_key> keys;
      std::vector<staged_keys> staged;
      {
        std::lock_guard g(mutex_);
        keys.swap(pending_);
        staged.swap(pending_staged_);
        if ((keys.empty() && staged.empty()) || stopping()) {
          for (auto& s : staged) release_staging(s.reserved_bytes);
          running_ = false;
          break;
        }
      }
      if (!keys.empty()) co_await submit(std::move(keys));
      for (auto& s : staged) co_await submit_staged(std::move(s));
    }
    notify_idle();
  }

  boost::asio::awaitable<void> submit(std::vector<chunk_key> keys) {
    std::vector<bitmap> targets;
    policy_.select_targets(keys, backends_.size(), targets);
    const std::size_t per_task = task_keys(options_, l1_.slot_bytes());
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      std::vector<chunk_key> mine;
      for (std::size_t i = 0; i < keys.size(); ++i)
        if (b < targets.size() && targets[b].test(i)) mine.push_back(keys[i]);
      for (std::size_t at = 0; at < mine.size() && !stopping(); at += per_task) {
        const std::size_t n = std::min(per_task, mine.size() - at);
        co_await submit_task(b, std::span(mine).subspan(at, n));
      }
    }
  }

  boost::asio::awaitable<void> submit_staged(staged_keys s) {
    auto memory = std::make_shared<staged_memory>();
    memory->owner = this;
    memory->staged = std::move(s);
    const auto& keys = memory->staged.keys;
    std::vector<bitmap> targets;
    policy_.select_targets(keys, backends_.size(), targets);
    const std::size_t per_task = task_keys(options_, memory->staged.object_bytes);
    for (std::size_t b = 0; b < backends_.size(); ++b) {
      std::vector<std::size_t> mine;
      for (std::size_t i = 0; i < keys.size(); ++i)
        if (b < targets.size() && targets[b].test(i)) mine.push_back(i);
      for (std::size_t at = 0; at < mine.size() && !stopping(); at += per_task) {
        auto task = std::make_shared<store_task>();
        task->backend = b;
        task->from_l1 = false;
        task->memory = memory;
        const std::size_t n = std::min(per_task, mine.size() - at);
        for (std::size_t j = at; j < at + n; ++j) {
          task->keys.push_back(keys[mine[j]]);
          task->sources.emplace_back(memory->staged.buffers[mine[j]].data(), memory->staged.object_bytes);
          task->bytes += memory->staged.object_bytes;
        }
        // Already in memory: submitted at once, the wait for room would only hold it longer.
        start_task(task);
      }
    }
    co_return;
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

    while (!stopping() && inflight_bytes_.load(std::memory_order_relaxed) > 0 &&
           inflight_bytes_.load(std::memory_order_relaxed) + task->bytes > options_.max_inflight_bytes) {
      completed_.expires_at(boost::asio::steady_timer::time_point::max());
      co_await completed_.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    }
    if (stopping()) {  // never submitted: give the locks back
      std::vector<l1::status> rs(task->keys.size());
      l1_.finish_read(task->keys, 0, l1::lock_lifetime::pinned, rs);
      co_return;
    }
    if (!policy_.keep_in_l1())
      for (const auto& k : task->keys) {
        auto& d = drops_[k];
        ++d.remaining;
      }
    start_task(task);
  }

  void start_task(const std::shared_ptr<store_task>& task) {
    inflight_bytes_.fetch_add(task->bytes, std::memory_order_relaxed);
    inflight_tasks_.fetch_add(1, std::memory_order_relaxed);
    bus_.publish(bus::l2_store_submitted{static_cast<std::uint8_t>(task->backend), backends_[task->backend].name(),
                                         static_cast<std::uint32_t>(task->keys.size()), task->bytes});
    tracker_.spawn(executor_, run_task(task));
  }

  boost::asio::awaitable<void> run_task(std::shared_ptr<store_task> task) {
    const auto t0 = l2::clock::now();
    auto [ec, result] = co_await backends_[task->backend].async_store(
        task->keys, task->sources, t0 + options_.task_timeout, boost::asio::as_tuple(boost::asio::use_awaitable));
    const auto duration = l2::clock::now() - t0;
    // The backend no longer reads the sources: release the pinned read locks (L1 keys), or
    // let the staging memory go with the last task that uses it.
    if (task->from_l1) {
      std::vector<l1::status> st(task->keys.size());
      l1_.finish_read(task->keys, 0, l1::lock_lifetime::pinned, st);
    }

    std::uint32_t ok = 0;
    std::uint64_t ok_bytes = 0;
    std::vector<chunk_key> drop_now;
    const bool drops = task->from_l1 && !policy_.keep_in_l1();
    for (std::size_t i = 0; i < task->keys.size(); ++i) {
      const bool stored = i < result.size() && (result.outcomes[i] == l2::key_outcome::ok ||
                                                result.outcomes[i] == l2::key_outcome::exists);
      if (stored) {
        ++ok;
        ok_bytes += task->sources[i].size();
      }
      if (drops) {
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
    task->memory.reset();
    inflight_bytes_.fetch_sub(task->bytes, std::memory_order_relaxed);
    inflight_tasks_.fetch_sub(1, std::memory_order_relaxed);
    completed_.cancel();
    notify_idle();
  }

  executor_type executor_;
  Tier& l1_;
  std::vector<l2::any_backend>& backends_;
  Bus& bus_;
  work_tracker& tracker_;
  StorePolicy policy_;
  store_options options_;
  boost::asio::steady_timer completed_;
  mutable std::mutex mutex_;
  std::vector<chunk_key> pending_;
  std::vector<staged_keys> pending_staged_;
  bool running_ = false;  ///< the loop is running (guarded by mutex_)
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> inflight_bytes_{0};
  std::atomic<std::size_t> inflight_tasks_{0};
  std::atomic<std::uint64_t> staged_bytes_{0};
  std::unordered_map<chunk_key, pending_drop, chunk_key_hash> drops_;
  std::vector<boost::asio::steady_timer*> idle_waiters_;
};

}  // namespace pipeline
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
