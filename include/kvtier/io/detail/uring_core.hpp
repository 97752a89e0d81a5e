#pragma once
// uring_core: the untyped part of io::uring_context: the ring, its eventfd watched by the
// Asio reactor, the queues of operations, batched submission, reaping, cancellation and
// teardown. Setting the ring up is in uring_setup.hpp, its registered buffers in
// fixed_buffers.hpp, the typed part (handlers, allocation) in uring_handler_op.hpp; the
// public face and its contracts are in io/uring_context.hpp.
//
// Life of an operation (all on the ring's executor):
//   start():  prepare an SQE right away when there is room (no syscall), else queue it
//             (`pending_`: more ops than the CQ can hold, or an SQ that stays full).
//             Posts one "turn" per executor turn.
//   turn:     one io_uring_enter submits every SQE prepared since the last turn, then the
//             completions already there (page-cache hits complete inline) are reaped.
//             submit_now() submits at once instead, from a handler about to work on the CPU.
//   wake:     the eventfd (registered with io_uring_register_eventfd) is read by a pending
//             async_read_some on an asio stream_descriptor; when it fires, every CQE is
//             reaped and each op completes: its handler is dispatched to its executor.
// The eventfd read is armed before each submission and re-armed after each wake whenever an
// SQE is outstanding. A completion that lands while no read is armed is not lost: the
// reactor then marks the descriptor for a speculative read, which the next arm performs.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/detail/file_ops.hpp>
#include <kvtier/io/detail/fixed_buffers.hpp>
#include <kvtier/io/detail/op_recycler.hpp>
#include <kvtier/io/detail/uring_op.hpp>
#include <kvtier/io/detail/uring_setup.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/io/uring_options.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/system/system_error.hpp>

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

class uring_core {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Sets up the ring. Throws boost::system::system_error with the kernel's errno when
  /// io_uring is refused (ENOSYS, EPERM: see io/probe.hpp), std::invalid_argument on bad
  /// options.
  uring_core(executor_type ex, const uring_options& opts, telemetry::logger* log)
      : ex_(std::move(ex)),
        opts_(opts),
        log_(log),
        stats_(std::make_shared<io_stats>()),
        recycler_(stats_.get()),
        life_(std::make_shared<liveness>()),
        eventfd_(ex_) {
    if (opts.entries == 0 || opts.entries > 32768)
      throw std::invalid_argument("kvtier::io::uring_context: entries must be in [1, 32768], got " +
                                  std::to_string(opts.entries));
    ring_.setup(opts.entries, opts.taskrun, log_);
    enabled_ = (ring_.flags & IORING_SETUP_R_DISABLED) == 0;
    if (opts.max_bounded_workers > 0) {
      unsigned limits[2] = {opts.max_bounded_workers, 0};  // {bounded, unbounded (0: unchanged)}
      if (const int r = ::io_uring_register_iowq_max_workers(&ring_.ring, limits); r < 0 && log_ != nullptr)
        log_->warn("io_uring: the kernel refused to raise io-wq's bounded workers to {}: {}", opts.max_bounded_workers,
                   std::strerror(-r));
    }
    const int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0) throw boost::system::system_error(errno, boost::system::system_category(), "eventfd");
    if (const int r = ::io_uring_register_eventfd(&ring_.ring, efd); r < 0) {
      ::close(efd);
      throw boost::system::system_error(-r, boost::system::system_category(), "io_uring_register_eventfd");
    }
    boost::system::error_code ec;
    eventfd_.assign(efd, ec);
    if (ec) {
      ::close(efd);
      throw boost::system::system_error(ec, "kvtier::io::uring_context: watching the ring's eventfd");
    }
    // Keep room in the CQ for the ring's own cancel requests, so user ops never overflow it.
    const std::size_t cq = ring_.ring.cq.ring_entries;
    op_limit_ = cq > 32 ? cq - cq / 8 : cq / 2 + 1;
    life_->self = this;
    if (log_ != nullptr)
      log_->info("io_uring ring ready: {} SQ / {} CQ entries, {} task running, flags {}", ring_.ring.sq.ring_entries,
                 ring_.ring.cq.ring_entries, to_string(ring_.mode), describe_setup_flags(ring_.flags));
  }

  uring_core(const uring_core&) = delete;
  uring_core& operator=(const uring_core&) = delete;

  /// Cancels what is in flight, waits (blocking) until the kernel has completed or cancelled
  /// every op, posts each handler to its executor with its result, then closes the ring.
  ~uring_core() {
    life_->self = nullptr;
    shutting_down_ = true;
    for (std::size_t n = ready_.size(); n > 0; --n) {
      uring_op* op = ready_.pop_front();
      finish(op, op->res, true);
    }
    while (uring_op* op = pending_.pop_front()) finish(op, -ECANCELED, true);
    request_cancel_all();
    for (;;) {
      reap(true);
      if (outstanding_sqes_ == 0) break;
      send_owed_cancels();
      enable_if_needed();
      const int r = ::io_uring_submit_and_wait(&ring_.ring, 1);
      bump_owned(stats_->enter_calls);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
        // Closing the ring now would let the kernel write into buffers the caller frees.
        std::fprintf(stderr, "kvtier::io::uring_context: cannot wait for %zu in-flight operations (%s): %s\n",
                     outstanding_sqes_, std::strerror(-r),
                     r == -EEXIST ? "a defer-mode ring must be destroyed on its own thread" : "aborting");
        std::terminate();
      }
    }
    boost::system::error_code ignored;
    eventfd_.close(ignored);  // the armed read completes with operation_aborted, sees life_->self == nullptr
  }

  [[nodiscard]] const executor_type& get_executor() const noexcept { return ex_; }
  [[nodiscard]] op_recycler& recycler() noexcept { return recycler_; }
  [[nodiscard]] const std::shared_ptr<io_stats>& stats() const noexcept { return stats_; }
  [[nodiscard]] unsigned setup_flags() const noexcept { return ring_.flags; }
  [[nodiscard]] taskrun_mode mode() const noexcept { return ring_.mode; }
  /// io-wq's bounded-worker limit for this ring as the kernel holds it (0 when it cannot say:
  /// a kernel before 5.15).
  [[nodiscard]] unsigned bounded_workers_limit() noexcept {
    unsigned limits[2] = {0, 0};  // zeros change nothing and read the limits back
    return ::io_uring_register_iowq_max_workers(&ring_.ring, limits) == 0 ? limits[0] : 0;
  }
  [[nodiscard]] unsigned sq_entries() const noexcept { return ring_.ring.sq.ring_entries; }
  [[nodiscard]] unsigned cq_entries() const noexcept { return ring_.ring.cq.ring_entries; }
  [[nodiscard]] bool shutting_down() const noexcept { return shutting_down_; }
  /// Ops started and not yet handed to their handler.
  [[nodiscard]] std::size_t in_flight() const noexcept {
    return in_flight_.size() + pending_.size() + ready_.size();
  }
  /// Ops waiting for room in the ring (not yet given an SQE).
  [[nodiscard]] std::size_t queued() const noexcept { return pending_.size(); }

  /// Takes a new op (initiation: never completes it inline).
  void start(uring_op* op) {
    bump_owned(stats_->ops_started);
    bump_owned(stats_->ops_in_flight, 1);
    if (shutting_down_) {
      make_ready(op, res_shutting_down);
    } else if (!pending_.empty() || !try_prepare(op)) {
      op->st = uring_op::state::queued;
      pending_.push_back(op);
    }
    post_turn();
  }

  /// Enters the kernel now with the SQEs prepared so far, which would otherwise wait for the
  /// end of this turn: for a completion handler about to work on the CPU (async_run_parts
  /// before a digesting plan's end_part). Their completions are reaped as any others.
  void submit_now() {
    if (!shutting_down_) submit();
  }

  /// Asks for `op` to be cancelled (from its cancellation slot). Queued: it completes with
  /// operation_aborted in the next turn, never having reached the kernel. Submitted: an
  /// ASYNC_CANCEL request goes to the kernel; the op completes with its own CQE
  /// (-ECANCELED, or its real result when the kernel had already finished it).
  void cancel(uring_op* op) {
    switch (op->st) {
      case uring_op::state::queued:
        pending_.remove(op);
        make_ready(op, -ECANCELED);
        post_turn();
        return;
      case uring_op::state::submitted:
        if (op->cancel_requested) return;
        op->cancel_requested = true;
        if (!send_cancel(op)) ++cancels_owed_;
        post_turn();
        return;
      case uring_op::state::ready: return;
    }
  }

  /// Stops taking ops (new ones complete with errc::shutting_down), completes queued ones
  /// with operation_aborted and asks the kernel to cancel the rest.
  void shutdown() {
    if (shutting_down_) return;
    shutting_down_ = true;
    while (uring_op* op = pending_.pop_front()) make_ready(op, -ECANCELED);
    request_cancel_all();
    post_turn();
  }

  // --- registered (fixed) buffers ---------------------------------------------------------

  error_code register_buffers(std::span<const buffer_region> regions) {
    if (!opts_.fixed_buffers) return make_error_code(errc::unsupported);
    return fixed_.register_regions(ring_.ring, regions, *stats_, log_);
  }
  error_code add_buffers(buffer_region region) {
    if (!opts_.fixed_buffers) return make_error_code(errc::unsupported);
    return fixed_.add_region(ring_.ring, region, *stats_, log_);
  }
  void unregister_buffers() noexcept { fixed_.unregister(ring_.ring, *stats_); }
  [[nodiscard]] bool fixed_buffers_active() const noexcept { return fixed_.active(); }
  /// The index of the registered buffer that holds all of [p, p + n), or -1.
  [[nodiscard]] int fixed_index(const void* p, std::size_t n) const noexcept { return fixed_.index_of(p, n); }

  void count_fixed_op() noexcept { bump_owned(stats_->fixed_ops); }

 private:
  /// Shared with the handlers the ring leaves in the executor's queue (turn, eventfd read),
  /// which may run after the ring is gone: they check `self` first.
  struct liveness {
    uring_core* self = nullptr;
    std::uint64_t eventfd_value = 0;  // the eventfd read lands here, not in the ring
  };

  struct turn_handler {
    std::shared_ptr<liveness> life;
    void operator()() const {
      if (uring_core* s = life->self) s->run_turn();
    }
  };

  struct wake_handler {
    std::shared_ptr<liveness> life;
    void operator()(const boost::system::error_code& ec, std::size_t) const {
      if (uring_core* s = life->self) s->on_wake(ec);
    }
  };

  /// Runs after a turn or wake, also when a handler threw out of it: re-queues work and
  /// re-arms the eventfd so the ring never stalls.
  struct after_work_guard {
    uring_core* c;
    ~after_work_guard() { c->after_work(); }
  };

  /// A defer-mode ring is created disabled and bound to the first thread that enters it.
  void enable_if_needed() {
    if (enabled_) return;
    const int r = ::io_uring_register(ring_.ring.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0);
    if (r < 0) {
      const int e = r == -1 ? errno : -r;
      throw boost::system::system_error(e, boost::system::system_category(), "io_uring: enabling the ring");
    }
    enabled_ = true;
  }

  void post_turn() {
    if (turn_posted_) return;
    boost::asio::post(ex_, turn_handler{life_});
    turn_posted_ = true;
  }

  void arm_wait() {
    if (wait_armed_ || outstanding_sqes_ == 0) return;
    eventfd_.async_read_some(boost::asio::buffer(&life_->eventfd_value, sizeof(life_->eventfd_value)),
                             wake_handler{life_});
    wait_armed_ = true;
  }

  void run_turn() {
    turn_posted_ = false;
    after_work_guard guard{this};
    send_owed_cancels();
    fill_from_pending();
    arm_wait();  // before entering the kernel: see the header comment
    submit();
    for (std::size_t n = ready_.size(); n > 0; --n) {
      uring_op* op = ready_.pop_front();
      finish(op, op->res, false);
    }
    reap(false);
  }

  void on_wake(const boost::system::error_code& ec) {
    wait_armed_ = false;
    after_work_guard guard{this};
    if (ec && ec != boost::asio::error::operation_aborted && log_ != nullptr)
      log_->error("io_uring: reading the ring's eventfd failed: {}", ec.message());
    reap(false);
  }

  void after_work() noexcept {
    try {
      fill_from_pending();
      // CQEs still in the ring (a handler threw out of the reaping loop, or they landed
      // after it) would not signal the eventfd again: a turn reaps them.
      if (::io_uring_sq_ready(&ring_.ring) > 0 || !ready_.empty() || cancels_owed_ > 0 ||
          ::io_uring_cq_ready(&ring_.ring) > 0)
        post_turn();
      arm_wait();
    } catch (const std::exception& e) {
      // Only allocation can fail here; the ring cannot make progress without its turn.
      std::fprintf(stderr, "kvtier::io::uring_context: cannot schedule the ring: %s\n", e.what());
      std::terminate();
    }
  }

  /// Enters the kernel once for everything prepared (defer mode: and fetches completions).
  void submit() {
    if (::io_uring_sq_ready(&ring_.ring) == 0) return;
    enable_if_needed();
    for (;;) {
      const int r = ring_.mode == taskrun_mode::defer ? ::io_uring_submit_and_get_events(&ring_.ring)
                                                      : ::io_uring_submit(&ring_.ring);
      bump_owned(stats_->enter_calls);
      if (r >= 0) {
        bump_owned(stats_->sqes_submitted, static_cast<std::uint64_t>(r));
        return;
      }
      if (r == -EINTR) continue;
      // EAGAIN/EBUSY: the kernel is short of memory or the CQ overflowed; the SQEs stay in
      // the ring and after_work() schedules another turn. EEXIST: defer mode used from a
      // second thread (a bug in the caller).
      if (log_ != nullptr && submit_log_.allow()) log_->error("io_uring: io_uring_enter failed: {}", std::strerror(-r));
      return;
    }
  }

  [[nodiscard]] bool kernel_has_more() const noexcept {
    return (IO_URING_READ_ONCE(*ring_.ring.sq.kflags) & (IORING_SQ_TASKRUN | IORING_SQ_CQ_OVERFLOW)) != 0;
  }

  /// Completes every op whose CQE is there; enters the kernel once when it says it holds
  /// more (task work to run, CQ overflow). Returns the number of ops completed.
  std::size_t reap(bool post) {
    std::size_t n = 0;
    bool fetched = false;
    for (;;) {
      if (::io_uring_cq_ready(&ring_.ring) == 0) {
        if (fetched || !kernel_has_more()) break;
        fetched = true;
        enable_if_needed();
        (void)::io_uring_get_events(&ring_.ring);
        bump_owned(stats_->enter_calls);
        continue;
      }
      ::io_uring_cqe* cqe = nullptr;
      if (::io_uring_peek_cqe(&ring_.ring, &cqe) != 0 || cqe == nullptr) break;
      const std::uint64_t ud = cqe->user_data;
      const long res = cqe->res;
      ::io_uring_cqe_seen(&ring_.ring, cqe);
      --outstanding_sqes_;
      if (ud == 0) continue;  // one of our cancel requests
      auto* op = reinterpret_cast<uring_op*>(ud);
      in_flight_.remove(op);
      finish(op, res, post);
      ++n;
    }
    return n;
  }

  /// Counts and completes one op (which frees it, then runs or posts its handler).
  void finish(uring_op* op, long res, bool post) {
    if (op->cancel_requested && res == -EINTR) res = -ECANCELED;  // how io-wq reports a cancelled blocking op
    bump_owned(stats_->ops_completed);
    bump_owned(stats_->ops_in_flight, -1);
    if (res == -ECANCELED) bump_owned(stats_->ops_cancelled);
    else if (res < 0) bump_owned(stats_->ops_failed);
    op->complete(op, res, post);
  }

  void make_ready(uring_op* op, long res) noexcept {
    op->st = uring_op::state::ready;
    op->res = res;
    ready_.push_back(op);
  }

  /// An SQE, entering the kernel once if the SQ is full; nullptr if it stays full.
  ::io_uring_sqe* get_sqe() {
    ::io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_.ring);
    if (sqe == nullptr) {
      submit();
      sqe = ::io_uring_get_sqe(&ring_.ring);
    }
    return sqe;
  }

  void prepare_into(uring_op* op, ::io_uring_sqe* sqe) noexcept {
    op->prepare(op, sqe);  // sets user_data = op
    op->st = uring_op::state::submitted;
    ++outstanding_sqes_;
    in_flight_.push_back(op);
  }

  bool try_prepare(uring_op* op) {
    if (outstanding_sqes_ >= op_limit_) return false;
    ::io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return false;
    prepare_into(op, sqe);
    return true;
  }

  void fill_from_pending() {
    while (!pending_.empty() && !shutting_down_ && outstanding_sqes_ < op_limit_) {
      ::io_uring_sqe* sqe = get_sqe();
      if (sqe == nullptr) return;
      prepare_into(pending_.pop_front(), sqe);
    }
  }

  /// IORING_OP_ASYNC_CANCEL, io_uring_prep_cancel64(3), keyed on the op's user_data.
  bool send_cancel(uring_op* op) {
    ::io_uring_sqe* sqe = get_sqe();
    if (sqe == nullptr) return false;
    ::io_uring_prep_cancel64(sqe, reinterpret_cast<std::uint64_t>(op), 0);
    ::io_uring_sqe_set_data64(sqe, 0);
    ++outstanding_sqes_;
    op->cancel_sent = true;
    return true;
  }

  void send_owed_cancels() {
    if (cancels_owed_ == 0) return;
    for (uring_op* op = in_flight_.front(); op != nullptr && cancels_owed_ > 0; op = op->next) {
      if (!op->cancel_requested || op->cancel_sent) continue;
      if (!send_cancel(op)) return;
      --cancels_owed_;
    }
  }

  /// One cancel per in-flight op (rather than one IORING_ASYNC_CANCEL_ANY): each result is
  /// then tied to its op, and the count of SQEs to wait for is exact.
  void request_cancel_all() {
    for (uring_op* op = in_flight_.front(); op != nullptr; op = op->next) {
      if (op->cancel_requested) continue;
      op->cancel_requested = true;
      if (!send_cancel(op)) ++cancels_owed_;
    }
  }

  ring_holder ring_;  // first member: closed last
  executor_type ex_;
  uring_options opts_;
  telemetry::logger* log_;
  std::shared_ptr<io_stats> stats_;
  op_recycler recycler_;
  std::shared_ptr<liveness> life_;
  boost::asio::posix::stream_descriptor eventfd_;
  op_list pending_;    // waiting for room (state queued)
  op_list ready_;      // finished without a CQE (state ready)
  op_list in_flight_;  // have an SQE (state submitted)
  std::size_t outstanding_sqes_ = 0;  // SQEs prepared whose CQE is not reaped (ops and cancels)
  std::size_t op_limit_ = 0;          // most outstanding SQEs before ops queue in pending_
  std::size_t cancels_owed_ = 0;      // cancels asked for but not yet given an SQE
  fixed_buffers fixed_;
  telemetry::log_throttle submit_log_;
  bool enabled_ = true;
  bool turn_posted_ = false;
  bool wait_armed_ = false;
  bool shutting_down_ = false;
};

/// The handler bound into an op's cancellation slot.
struct uring_cancel_handler {
  // A constructor, not an aggregate: Asio builds it with parentheses (emplace(core, op)),
  // which clang before 16 accepts only for a class with a constructor.
  uring_cancel_handler(uring_core* c, uring_op* o) noexcept : core(c), op(o) {}
  uring_core* core;
  uring_op* op;
  void operator()(boost::asio::cancellation_type_t type) const {
    using ct = boost::asio::cancellation_type;
    if ((type & (ct::terminal | ct::partial | ct::total)) != ct::none) core->cancel(op);
  }
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
