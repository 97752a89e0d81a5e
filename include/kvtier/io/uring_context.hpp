#pragma once
// uring_context: file I/O on a liburing ring whose completions resume Asio coroutines (and
// run Asio handlers) on their executor. The L2 disk backend's file I/O where the kernel allows
// io_uring (io/probe.hpp decides; io/any_file_io.hpp holds whichever implementation was chosen).
//
// How it works (details in detail/uring_core.hpp):
//   - one ring (default 256 SQ entries, COOP_TASKRUN; never IOPOLL or SQPOLL: IOPOLL reads
//     fail with EOPNOTSUPP on the target kernel, SQPOLL burns a core of a 2-core machine),
//   - its completion eventfd (io_uring_register_eventfd) read by an asio stream_descriptor:
//     a wakeup reaps every CQE and completes each op; user_data is the op's address,
//   - batched submission: starting an op only fills an SQE; one "turn" posted per executor
//     turn submits all of them with one io_uring_enter (also forced when the SQ is full),
//     then reaps what completed inline (page-cache hits),
//   - registered buffers: register_buffers() registers the L1 slot arena (add_buffers(): a
//     piece at a time, each next to the others); reads and writes
//     whose buffer lies inside it use READ_FIXED / WRITE_FIXED with its buf_index. Where
//     the kernel refuses (ENOMEM under RLIMIT_MEMLOCK without CAP_IPC_LOCK, EFAULT...),
//     it logs once, counts it, and the same memory is used with plain READ / WRITE,
//   - no heap allocation per op in steady state: an op lives in memory from the handler's
//     associated allocator, or, for handlers without one (callbacks, use_awaitable), in a
//     per-ring cache of freed blocks (stats().op_heap_allocations stays flat after warm-up).
//
// THREADING RULE: the ring belongs to its executor, which must never run two of its handlers
// at once: a single-threaded io_context (the server's I/O thread) or a strand. Start ops,
// cancel them, call register_buffers() and shutdown() only from inside that executor (or
// before it runs anything). Completion handlers run on their associated executor: when
// that is the ring's executor they are called inline from the reaping loop, else
// dispatched to it. With taskrun_mode::defer, the executor must furthermore stay on one
// OS thread for the ring's whole life (destructor included). Destroy the ring before its
// io_context, never from inside one of its own completion handlers, and not while the
// executor runs ring handlers on another thread.
//
// CANCELLATION CONTRACT (the prefetch controller relies on it: "a cancelled read never lands
// in a reused slot"):
//   - every op completes EXACTLY ONCE, cancelled or not;
//   - its buffer (and iovec array, and path strings) belongs to the kernel until then: the
//     handler runs only after the op's own CQE arrived (the kernel has completed or
//     cancelled it), or, for an op still queued in the ring, without it ever having been
//     given to the kernel. Do not reuse or free the memory before the handler runs;
//   - cancelling (terminal, partial or total, through the handler's cancellation slot,
//     e.g. `co_await (read || timer)`, or shutdown()) is a request: an op the kernel can
//     stop (a read waiting on a pipe or socket, a request not yet issued) completes with
//     operation_aborted; one it already finished or cannot stop (a buffered file read in
//     progress, an O_DIRECT read in the device) completes with its real result, and the
//     data in the buffer is then valid;
//   - shutdown() cancels everything in flight and refuses new ops (errc::shutting_down);
//     the destructor does the same, then BLOCKS until every in-flight op has its CQE, and
//     posts each handler to its executor (so a destroyed ring never leaves the kernel
//     writing into memory).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/detail/file_io_operations.hpp>
#include <kvtier/io/detail/file_ops.hpp>
#include <kvtier/io/detail/uring_core.hpp>
#include <kvtier/io/detail/uring_handler_op.hpp>
#include <kvtier/io/stats.hpp>
#include <kvtier/io/uring_options.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::io {

class any_file_io;

class uring_context : public detail::file_io_operations<uring_context> {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Sets up the ring on `ex` (see the threading rule). Throws boost::system::system_error
  /// with the kernel's errno when io_uring is refused (run io::probe_uring() first, or use
  /// any_file_io, which falls back), std::invalid_argument on bad options.
  explicit uring_context(executor_type ex, uring_options opts = {}, telemetry::logger* log = nullptr)
      : core_(std::move(ex), opts, log) {}

  uring_context(const uring_context&) = delete;
  uring_context& operator=(const uring_context&) = delete;

  /// Cancels, waits for every in-flight op, posts their handlers; see the contract above.
  ~uring_context() = default;

  [[nodiscard]] executor_type get_executor() const noexcept { return core_.get_executor(); }
  [[nodiscard]] static constexpr file_io_kind kind() noexcept { return file_io_kind::uring; }

  // --- operations: file_io, see concepts.hpp and detail/file_io_operations.hpp -------------
  // async_read, async_write, async_readv, async_writev, async_fsync, async_fdatasync,
  // async_openat, async_close, async_renameat, async_unlinkat: each returns what its Token
  // makes of the completion.

  // --- registered buffers ------------------------------------------------------------------

  /// Registers the regions as fixed buffers (each split into 1 GiB buffers, the kernel's
  /// limit). Replaces an earlier registration. Registration pins, and so commits, every page
  /// of the regions. On failure (ENOMEM: RLIMIT_MEMLOCK; EFAULT: memory the kernel cannot
  /// pin, such as a shared file mapping) it logs once, counts
  /// stats().fixed_buffer_registration_failures and returns the error; every op then uses
  /// plain READ/WRITE into the same memory. errc::unsupported when options.fixed_buffers is
  /// false. Call before the ops that use the memory, on the ring's executor.
  error_code register_buffers(std::span<const buffer_region> regions) { return core_.register_buffers(regions); }
  /// Registers `region` next to what add_buffers() registered before, without unregistering
  /// it: only this region's pages are pinned, so a large arena can be registered a piece
  /// per executor turn (the kernel pins ~40-60 ms per GiB here, on this thread). Needs Linux
  /// 5.19 (a sparse buffer table): errc::unsupported before, and when options.fixed_buffers
  /// is false; errc::invalid_argument after register_buffers(); else failures as above. On
  /// the ring's executor.
  error_code add_buffers(buffer_region region) { return core_.add_buffers(region); }
  void unregister_buffers() noexcept { core_.unregister_buffers(); }
  [[nodiscard]] bool fixed_buffers_active() const noexcept { return core_.fixed_buffers_active(); }

  // --- lifetime and state ------------------------------------------------------------------

  /// Cancels every op (queued ones complete with operation_aborted in the next turn, in-flight
  /// ones when the kernel answers) and completes later ops with errc::shutting_down. Returns
  /// at once; the handlers tell when it is done.
  void shutdown() { core_.shutdown(); }

  /// Ops started whose handler has not been released yet.
  [[nodiscard]] std::size_t in_flight() const noexcept { return core_.in_flight(); }
  /// What the ring did; shared so a metrics callback may outlive the ring.
  [[nodiscard]] const io_stats& stats() const noexcept { return *core_.stats(); }
  [[nodiscard]] std::shared_ptr<const io_stats> shared_stats() const noexcept { return core_.stats(); }
  /// The io_uring_setup flags the ring got, and the task-running mode they mean.
  [[nodiscard]] unsigned setup_flags() const noexcept { return core_.setup_flags(); }
  [[nodiscard]] taskrun_mode mode() const noexcept { return core_.mode(); }
  [[nodiscard]] unsigned sq_entries() const noexcept { return core_.sq_entries(); }
  [[nodiscard]] unsigned cq_entries() const noexcept { return core_.cq_entries(); }

 private:
  friend class detail::file_io_operations<uring_context>;
  friend class any_file_io;

  /// Starts the op `desc` describes. A read or write whose buffer lies in a registered region
  /// becomes its fixed variant (READ_FIXED / WRITE_FIXED with the buffer's index).
  template <class Handler, class Desc>
  void submit(Handler&& handler, const Desc& desc) {
    if constexpr (std::is_same_v<Desc, detail::op_read> || std::is_same_v<Desc, detail::op_write>) {
      if (const int idx = core_.fixed_index(desc.data, desc.len); idx >= 0) {
        core_.count_fixed_op();
        using fixed =
            std::conditional_t<std::is_same_v<Desc, detail::op_read>, detail::op_read_fixed, detail::op_write_fixed>;
        start(std::forward<Handler>(handler), fixed{{}, desc.fd, desc.data, desc.len, desc.offset, idx});
        return;
      }
    }
    start(std::forward<Handler>(handler), desc);
  }

  template <class Handler, class Desc>
  void start(Handler&& handler, const Desc& desc) {
    using op_type = detail::uring_handler_op<Desc, std::decay_t<Handler>>;
    core_.start(op_type::create(std::forward<Handler>(handler), core_, desc));
  }

  detail::uring_core core_;
};

static_assert(file_io<uring_context>);

}  // namespace kvtier::inline KVTIER_ABI_TAG::io
