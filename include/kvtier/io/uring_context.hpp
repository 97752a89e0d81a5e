#pragma once
// uring_context: file I/O on a liburing ring whose completions resume Asio coroutines (and
// run Asio handlers) on their executor: one ring, batched submission (one io_uring_enter per
// executor turn), registered buffers, no heap allocation per op (details in
// detail/uring_core.hpp). The L2 disk backend's file I/O where the kernel allows io_uring
// (io/probe.hpp decides; io/any_file_io.hpp holds whichever was chosen). docs/io.md,
// "uring_context", holds how it works, the threading rule and the cancellation contract.

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

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

class any_file_io;

/// The ring belongs to its executor, which must never run two of its handlers at once (one
/// thread or a strand): start and cancel ops, register buffers and shut down only from inside
/// it. Every op completes exactly once, and its memory belongs to the kernel until its
/// handler runs, cancelled or not (docs/io.md, "Cancellation contract").
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

  /// Cancels, waits for every in-flight op, posts their handlers; docs/io.md, "Cancellation contract".
  ~uring_context() = default;

  [[nodiscard]] executor_type get_executor() const noexcept { return core_.get_executor(); }
  [[nodiscard]] static constexpr file_io_kind kind() noexcept { return file_io_kind::uring; }

  // --- operations: file_io, see concepts.hpp and detail/file_io_operations.hpp -------------
  // async_read, async_write, async_readv, async_writev, async_fsync, async_fdatasync,
  // async_openat, async_close, async_renameat, async_unlinkat: each returns what its Token
  // makes of the completion.

  /// Hands the ops started so far to the kernel now instead of at the end of this executor
  /// turn (one io_uring_enter): from a completion handler that is about to work on the CPU
  /// (async_run_parts calls it before a digesting plan's end_part: docs/io.md, "Operations").
  /// On the ring's executor.
  void submit_now() { core_.submit_now(); }

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
  /// io-wq's bounded-worker limit as the kernel holds it (uring_options::max_bounded_workers;
  /// 0 when the kernel cannot say).
  [[nodiscard]] unsigned bounded_workers_limit() noexcept { return core_.bounded_workers_limit(); }
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

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
