#pragma once
// Options of io::uring_context: ring size, how the kernel runs completion work, fixed buffers.

#include <kvtier/config.hpp>

#include <cstdint>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

/// How the kernel runs the work that turns a finished I/O into a CQE (io_uring_setup(2)).
/// All three post CQEs that the ring's eventfd announces, so all three work with the Asio
/// reactor; they differ in who pays and in the threading rule.
enum class taskrun_mode : std::uint8_t {
  /// IORING_SETUP_COOP_TASKRUN | TASKRUN_FLAG (default): completion work runs when the
  /// submitting thread next enters the kernel, which the reactor's epoll_wait does anyway; no
  /// inter-processor interrupt of a busy thread. Any thread may tear the ring down.
  coop,
  /// IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN | TASKRUN_FLAG: completion work runs only
  /// when the ring asks for it (one io_uring_enter per wakeup fetches everything). Stricter:
  /// every call that enters the ring, the destructor included, must come from ONE OS thread
  /// for the ring's whole life (the ring is created disabled and bound to the thread that
  /// runs its first executor turn). Not for strands over a thread pool.
  defer,
  /// No flag: the kernel interrupts the submitting thread to run completion work (what
  /// kernels before 5.19 do). Kept for comparison and as the fallback of the other two.
  interrupt,
};

[[nodiscard]] constexpr std::string_view to_string(taskrun_mode m) noexcept {
  switch (m) {
    case taskrun_mode::coop: return "coop";
    case taskrun_mode::defer: return "defer";
    case taskrun_mode::interrupt: return "interrupt";
  }
  return "?";
}

struct uring_options {
  /// SQ entries (the kernel rounds up to a power of two; the CQ gets twice as many). 256
  /// holds 8 objects of 32 MiB in 1 MiB parts, far above the useful queue depth (8-32 per
  /// device, docs/io.md). Operations beyond the CQ size wait in the ring's own queue.
  unsigned entries = 256;
  taskrun_mode taskrun = taskrun_mode::coop;
  /// When false, register_buffers() registers nothing and every op uses plain READ/WRITE.
  bool fixed_buffers = true;
  /// The most io-wq "bounded" workers: the kernel threads that run the regular-file work it
  /// cannot complete inline (fsync, fdatasync, openat, renameat, an O_DIRECT write into blocks
  /// not yet written, which ext4 refuses without waiting). 0 keeps the kernel's default,
  /// 4 per CPU: 8 on a 2-CPU machine, fewer than one store's writes and syncs in flight, so
  /// they queue behind each other (fio's jobs each have their own). Applied with
  /// io_uring_register_iowq_max_workers(3); a kernel that refuses it (before 5.15) is logged.
  unsigned max_bounded_workers = 0;
};

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
