#pragma once
// region_prefault: faults a registered KV region's pages in AFTER its registration was
// answered, in slices on the worker pool. (The server's own L1 arena is faulted in after the
// server listens, on a thread of its own: server/l1_residency.hpp.)
//
// An engine's region is a sparse memfd: without a prefault, the first copies into or out of
// it pay a page fault per 4 KiB (~0.25 ms per MiB, docs/performance.md). Prefaulting costs
// as long as allocating the pages: about a second per 4 GiB here, so tens of seconds for the
// KV cache of a large engine. Done before answering the registration, it made a large
// region's registration miss the connector's request deadline (2 s): the engine never
// registered. So the registration is answered once the region is mapped and checked, and
// the pages are faulted in behind it:
//   - with madvise(MADV_POPULATE_WRITE) only (kv_region::populate): it changes no byte and
//     never touches the memory itself, so copies may run into the same pages meanwhile, and
//     a region unmapped under it (the registration went) makes it fail, not crash;
//   - in slices of `slice_bytes`, each a task of its own on the worker pool, so a copy queued
//     meanwhile waits for one slice at most (~8 ms), not for the whole region;
//   - stopped before its next slice when its registration goes (prefault_token).
// Where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14), the registry prefaults
// before answering, as before (kv_region::prefault's read loop is not safe to race an unmap).

#include <kvtier/config.hpp>
#include <kvtier/core/kv_region.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/post.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// Owned by a registration: when it goes (destroyed, replaced), the background prefault of
/// its region stops before its next slice.
class prefault_token {
 public:
  prefault_token() = default;
  prefault_token(prefault_token&& o) noexcept : flag_(std::move(o.flag_)) {}
  prefault_token& operator=(prefault_token&& o) noexcept {
    if (this != &o) {
      cancel();
      flag_ = std::move(o.flag_);
    }
    return *this;
  }
  prefault_token(const prefault_token&) = delete;
  prefault_token& operator=(const prefault_token&) = delete;
  ~prefault_token() { cancel(); }

  /// The flag a background prefault reads: true once this token's owner went.
  [[nodiscard]] std::shared_ptr<const std::atomic<bool>> watch() {
    if (!flag_) flag_ = std::make_shared<std::atomic<bool>>(false);
    return flag_;
  }

 private:
  void cancel() noexcept {
    if (flag_) flag_->store(true, std::memory_order_release);
  }
  std::shared_ptr<std::atomic<bool>> flag_;
};

/// How a background prefault ended.
struct prefault_outcome {
  std::size_t bytes = 0;             ///< faulted in
  std::chrono::nanoseconds elapsed{};
  bool complete = false;             ///< the whole region (else: stopped or failed)
  int error = 0;                     ///< the errno of a failed madvise (0: none)
};

/// Faults [base, base + bytes) in on `pool`, one slice per task, until done or `stopped`;
/// then calls `done` on the pool. `before` (may be empty) runs on the pool before the first
/// slice (server_hooks::during_prefault).
inline void prefault_in_background(boost::asio::any_io_executor pool, std::byte* base, std::size_t bytes,
                                   std::shared_ptr<const std::atomic<bool>> stopped,
                                   std::function<void()> before, std::function<void(prefault_outcome)> done) {
  /// 32 MiB: ~8 ms of populating here, the longest a copy queued behind it waits.
  static constexpr std::size_t slice_bytes = std::size_t{32} << 20;
  struct task {
    boost::asio::any_io_executor pool;
    std::byte* base;
    std::size_t bytes;
    std::size_t next = 0;
    std::shared_ptr<const std::atomic<bool>> stopped;
    std::function<void()> before;
    std::function<void(prefault_outcome)> done;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();

    static void step(std::shared_ptr<task> t) {
      if (t->before) std::exchange(t->before, nullptr)();
      prefault_outcome o;
      if (!t->stopped->load(std::memory_order_acquire) && t->next < t->bytes) {
        const std::size_t n = std::min(slice_bytes, t->bytes - t->next);
        o.error = kv_region::populate(t->base + t->next, n);
        if (o.error == 0) t->next += n;
        if (o.error == 0 && t->next < t->bytes) {
          auto ex = t->pool;
          boost::asio::post(ex, [t = std::move(t)]() mutable { step(std::move(t)); });
          return;
        }
      }
      o.bytes = t->next;
      o.complete = t->next == t->bytes;
      o.elapsed = std::chrono::steady_clock::now() - t->start;
      if (t->done) t->done(o);
    }
  };
  auto t = std::make_shared<task>(task{pool, base, bytes, 0, std::move(stopped), std::move(before), std::move(done)});
  boost::asio::post(pool, [t = std::move(t)]() mutable { task::step(std::move(t)); });
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
