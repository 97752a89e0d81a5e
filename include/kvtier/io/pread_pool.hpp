#pragma once
// pread_pool: the fallback file I/O for kernels that refuse io_uring (io/probe.hpp): a few
// threads run the blocking syscalls and post each completion to the caller's executor. Same
// operations and contracts as uring_context (io/concepts.hpp), but a running syscall cannot
// be cancelled, there are no registered buffers, and each op allocates. docs/io.md,
// "pread_pool", holds the differences and the threading rule.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/detail/file_io_operations.hpp>
#include <kvtier/io/detail/file_ops.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_allocator.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/recycling_allocator.hpp>

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

struct pread_pool_options {
  /// Worker threads: one blocking syscall each at a time. 2 matches the target machines'
  /// cores; more helps only on devices with deep queues (fio: 86k IOPS at depth 8 vs 14.6k
  /// at depth 1 for 4 KiB random O_DIRECT reads).
  unsigned threads = 2;
};

class pread_pool;
class any_file_io;

namespace detail {

/// The intrusive base of a pool op. `perform` runs on a worker; `deliver` on the handler's
/// executor (it frees the op and calls the handler); `post_delivery` queues `deliver`.
struct pool_op {
  using perform_fn = long (*)(pool_op*) noexcept;
  using post_fn = void (*)(pool_op*);
  using deliver_fn = void (*)(pool_op*, bool invoke);

  enum class state : std::uint8_t {
    queued,   ///< in the pool's queue: cancel removes it
    running,  ///< a worker runs its syscall: cannot be cancelled
    done,     ///< result known, delivery posted (or about to be)
  };

  pool_op(perform_fn p, post_fn po, deliver_fn d) noexcept : perform(p), post_delivery(po), deliver(d) {}

  perform_fn perform;
  post_fn post_delivery;
  deliver_fn deliver;
  pool_op* prev = nullptr;
  pool_op* next = nullptr;
  long res = 0;
  /// Written under the pool's mutex; read without it by the cancel handler, which only
  /// acts when it sees `queued` and then re-checks under the mutex.
  std::atomic<state> st{state::queued};
};

/// The posted completion: delivers the op, or frees it without invoking the handler when
/// the executor is destroyed with it still queued.
struct pool_delivery {
  pool_op* op;
  explicit pool_delivery(pool_op* o) noexcept : op(o) {}
  pool_delivery(pool_delivery&& o) noexcept : op(std::exchange(o.op, nullptr)) {}
  pool_delivery& operator=(pool_delivery&&) = delete;
  ~pool_delivery() {
    if (op != nullptr) op->deliver(op, false);
  }
  void operator()() {
    pool_op* o = std::exchange(op, nullptr);
    o->deliver(o, true);
  }
};

struct pool_cancel_handler {
  // A constructor, not an aggregate: Asio builds it with parentheses (emplace(pool, op)),
  // which clang before 16 accepts only for a class with a constructor.
  pool_cancel_handler(pread_pool* p, pool_op* o) noexcept : pool(p), op(o) {}
  pread_pool* pool;
  pool_op* op;
  void operator()(boost::asio::cancellation_type_t type) const;
};

template <class Desc, class Handler>
class pool_handler_op final : public pool_op {
 public:
  using default_allocator = boost::asio::recycling_allocator<void>;
  using allocator_type = boost::asio::associated_allocator_t<Handler, default_allocator>;
  using self_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<pool_handler_op>;
  using self_traits = std::allocator_traits<self_allocator>;
  using handler_executor = boost::asio::associated_executor_t<Handler, boost::asio::any_io_executor>;
  using work_guard = boost::asio::executor_work_guard<handler_executor>;
  using slot_type = boost::asio::associated_cancellation_slot_t<Handler>;

  template <class H>
  [[nodiscard]] static pool_handler_op* create(H&& handler, pread_pool* pool, const boost::asio::any_io_executor& ex,
                                               const Desc& desc) {
    allocator_type alloc = boost::asio::get_associated_allocator(handler, default_allocator());
    self_allocator a(alloc);
    pool_handler_op* p = self_traits::allocate(a, 1);
    try {
      ::new (static_cast<void*>(p)) pool_handler_op(std::forward<H>(handler), pool, ex, desc, alloc);
    } catch (...) {
      self_traits::deallocate(a, p, 1);
      throw;
    }
    return p;
  }

  pool_handler_op(const pool_handler_op&) = delete;
  pool_handler_op& operator=(const pool_handler_op&) = delete;

 private:
  template <class H>
  pool_handler_op(H&& handler, pread_pool* pool, const boost::asio::any_io_executor& ex, const Desc& desc,
                  const allocator_type& alloc)
      : pool_op(&do_perform, &do_post, &do_deliver),
        desc_(desc),
        handler_(std::forward<H>(handler)),
        alloc_(alloc),
        work_(boost::asio::get_associated_executor(handler_, ex)),
        slot_(boost::asio::get_associated_cancellation_slot(handler_)) {
    if (slot_.is_connected()) slot_.template emplace<pool_cancel_handler>(pool, this);
  }
  ~pool_handler_op() = default;

  static long do_perform(pool_op* base) noexcept { return static_cast<pool_handler_op*>(base)->desc_.perform(); }

  static void do_post(pool_op* base) {
    auto* self = static_cast<pool_handler_op*>(base);
    boost::asio::post(self->work_.get_executor(), pool_delivery(base));
  }

  static void do_deliver(pool_op* base, bool invoke) {
    auto* self = static_cast<pool_handler_op*>(base);
    if (self->slot_.is_connected()) self->slot_.clear();
    self_allocator a(self->alloc_);
    Handler handler(std::move(self->handler_));
    work_guard work(std::move(self->work_));
    const long res = self->res;
    self->~pool_handler_op();
    self_traits::deallocate(a, self, 1);
    if (invoke) std::apply(std::move(handler), Desc::args(res));
  }

  Desc desc_;
  Handler handler_;
  allocator_type alloc_;
  work_guard work_;
  slot_type slot_;
};

}  // namespace detail

class pread_pool : public detail::file_io_operations<pread_pool> {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Starts the workers. `ex` is the executor of handlers that have none of their own.
  explicit pread_pool(executor_type ex, pread_pool_options opts = {}, telemetry::logger* log = nullptr)
      : ex_(std::move(ex)), stats_(std::make_shared<io_stats>()) {
    if (opts.threads == 0 || opts.threads > 256)
      throw std::invalid_argument("kvtier::io::pread_pool: threads must be in [1, 256], got " +
                                  std::to_string(opts.threads));
    workers_.reserve(opts.threads);
    try {
      for (unsigned i = 0; i < opts.threads; ++i) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop_and_join();
      throw;
    }
    if (log != nullptr) log->info("pread pool ready: {} threads", opts.threads);
  }

  pread_pool(const pread_pool&) = delete;
  pread_pool& operator=(const pread_pool&) = delete;

  /// shutdown(), then waits for the workers to finish the syscalls in progress.
  ~pread_pool() { stop_and_join(); }

  [[nodiscard]] executor_type get_executor() const noexcept { return ex_; }
  [[nodiscard]] static constexpr file_io_kind kind() noexcept { return file_io_kind::pread; }

  // --- operations: file_io, see concepts.hpp and detail/file_io_operations.hpp -------------
  // async_read (read(2) on a pipe or socket), async_write, async_readv, async_writev,
  // async_fsync, async_fdatasync, async_openat, async_close, async_renameat, async_unlinkat.

  /// Nothing to register: plain syscalls read straight into the caller's memory.
  error_code register_buffers(std::span<const buffer_region>) noexcept { return {}; }
  error_code add_buffers(buffer_region) noexcept { return {}; }
  [[nodiscard]] static constexpr bool fixed_buffers_active() noexcept { return false; }

  /// Completes queued ops with operation_aborted and later ops with errc::shutting_down;
  /// ops being run finish normally. Returns at once.
  void shutdown() {
    std::unique_lock lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    detail::pool_op* aborted = std::exchange(head_, nullptr);
    tail_ = nullptr;
    for (detail::pool_op* op = aborted; op != nullptr; op = op->next) {
      op->res = -ECANCELED;
      op->st.store(detail::pool_op::state::done, std::memory_order_release);
    }
    lock.unlock();
    cv_.notify_all();
    while (aborted != nullptr) {
      detail::pool_op* next = aborted->next;
      complete(aborted);
      aborted = next;
    }
  }

  /// Ops started whose handler has not been released yet (approximate while workers run).
  [[nodiscard]] std::size_t in_flight() const noexcept {
    const auto n = stats_->ops_in_flight.load(std::memory_order_relaxed);
    return n > 0 ? static_cast<std::size_t>(n) : 0U;
  }
  [[nodiscard]] const io_stats& stats() const noexcept { return *stats_; }
  [[nodiscard]] std::shared_ptr<const io_stats> shared_stats() const noexcept { return stats_; }
  [[nodiscard]] std::size_t thread_count() const noexcept { return workers_.size(); }

 private:
  friend struct detail::pool_cancel_handler;

  friend class detail::file_io_operations<pread_pool>;
  friend class any_file_io;

  /// Queues the op `desc` describes for a worker.
  template <class Handler, class Desc>
  void submit(Handler&& handler, const Desc& desc) {
    using op_type = detail::pool_handler_op<Desc, std::decay_t<Handler>>;
    start(op_type::create(std::forward<Handler>(handler), this, ex_, desc));
  }

  void start(detail::pool_op* op) {
    detail::bump_shared(stats_->ops_started);
    detail::bump_shared(stats_->ops_in_flight, 1);
    {
      std::lock_guard lock(mutex_);
      if (!stopping_) {
        op->next = nullptr;
        op->prev = tail_;
        if (tail_ != nullptr) tail_->next = op;
        else head_ = op;
        tail_ = op;
        cv_.notify_one();
        return;
      }
      op->res = detail::res_shutting_down;
      op->st.store(detail::pool_op::state::done, std::memory_order_release);
    }
    complete(op);
  }

  /// From the op's cancellation slot, on the handler's executor.
  void cancel(detail::pool_op* op) {
    if (op->st.load(std::memory_order_acquire) != detail::pool_op::state::queued) return;
    {
      std::lock_guard lock(mutex_);
      if (op->st.load(std::memory_order_relaxed) != detail::pool_op::state::queued) return;
      unlink(op);
      op->res = -ECANCELED;
      op->st.store(detail::pool_op::state::done, std::memory_order_release);
    }
    complete(op);
  }

  void unlink(detail::pool_op* op) noexcept {
    if (op->prev != nullptr) op->prev->next = op->next;
    else head_ = op->next;
    if (op->next != nullptr) op->next->prev = op->prev;
    else tail_ = op->prev;
    op->prev = op->next = nullptr;
  }

  /// Counts the result and posts the delivery (never inline).
  void complete(detail::pool_op* op) {
    const long res = op->res;
    detail::bump_shared(stats_->ops_completed);
    detail::bump_shared(stats_->ops_in_flight, -1);
    if (res == -ECANCELED) detail::bump_shared(stats_->ops_cancelled);
    else if (res < 0) detail::bump_shared(stats_->ops_failed);
    op->post_delivery(op);
  }

  void work() {
    for (;;) {
      detail::pool_op* op = nullptr;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || head_ != nullptr; });
        if (head_ == nullptr) return;  // stopping and nothing left
        op = head_;
        unlink(op);
        op->st.store(detail::pool_op::state::running, std::memory_order_relaxed);
      }
      op->res = op->perform(op);
      op->st.store(detail::pool_op::state::done, std::memory_order_release);
      complete(op);
    }
  }

  void stop_and_join() {
    shutdown();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
  }

  executor_type ex_;
  std::shared_ptr<io_stats> stats_;
  std::mutex mutex_;
  std::condition_variable cv_;
  detail::pool_op* head_ = nullptr;  // FIFO of queued ops (guarded by mutex_)
  detail::pool_op* tail_ = nullptr;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

inline void detail::pool_cancel_handler::operator()(boost::asio::cancellation_type_t type) const {
  using ct = boost::asio::cancellation_type;
  if ((type & (ct::terminal | ct::partial | ct::total)) != ct::none) pool->cancel(op);
}

static_assert(file_io<pread_pool>);

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
