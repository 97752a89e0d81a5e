#pragma once
// Setting up the ring of io::uring_context: the io_uring_setup(2) flags of each task-running
// mode, the ring itself (closed with its holder), and the fallback to the flags an older
// kernel accepts. See uring_options.hpp for the modes, uring_core.hpp for the ring's use.

#include <kvtier/config.hpp>
#include <kvtier/io/uring_options.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/system/system_error.hpp>

#include <liburing.h>

#include <cerrno>
#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

/// Names of the setup flags that matter here, for the log.
[[nodiscard]] inline std::string describe_setup_flags(unsigned f) {
  std::string s;
  auto add = [&](unsigned bit, const char* name) {
    if ((f & bit) == 0) return;
    if (!s.empty()) s += '|';
    s += name;
  };
  add(IORING_SETUP_COOP_TASKRUN, "coop_taskrun");
  add(IORING_SETUP_SINGLE_ISSUER, "single_issuer");
  add(IORING_SETUP_DEFER_TASKRUN, "defer_taskrun");
  add(IORING_SETUP_TASKRUN_FLAG, "taskrun_flag");
  add(IORING_SETUP_SUBMIT_ALL, "submit_all");
  add(IORING_SETUP_CLAMP, "clamp");
  add(IORING_SETUP_R_DISABLED, "r_disabled");
  return s.empty() ? std::string("none") : s;
}

[[nodiscard]] constexpr unsigned taskrun_flags(taskrun_mode m) noexcept {
  switch (m) {
    case taskrun_mode::coop: return IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    case taskrun_mode::defer:
      return IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG |
             IORING_SETUP_R_DISABLED;
    case taskrun_mode::interrupt: return 0;
  }
  return 0;
}

/// A liburing ring, closed (io_uring_queue_exit) with its holder once set up.
struct ring_holder {
  ::io_uring ring{};
  bool live = false;
  unsigned flags = 0;                      ///< the io_uring_setup flags it got
  taskrun_mode mode = taskrun_mode::coop;  ///< the task-running mode they mean

  ring_holder() = default;
  ring_holder(const ring_holder&) = delete;
  ring_holder& operator=(const ring_holder&) = delete;
  ~ring_holder() {
    if (live) ::io_uring_queue_exit(&ring);
  }

  /// Sets up the ring with `entries` SQ entries in the mode asked for, dropping, newest
  /// first, each flag an older kernel rejects with EINVAL (down to interrupt mode; logged).
  /// Throws boost::system::system_error with the kernel's errno when io_uring is refused.
  void setup(unsigned entries, taskrun_mode wanted, telemetry::logger* log) {
    const unsigned common = IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL;
    struct attempt {
      unsigned flags;
      taskrun_mode mode;
    };
    const attempt attempts[] = {
        {common | taskrun_flags(wanted), wanted},
        {IORING_SETUP_CLAMP | taskrun_flags(wanted), wanted},
        {IORING_SETUP_CLAMP, taskrun_mode::interrupt},
    };
    int r = -EINVAL;
    for (const auto& a : attempts) {
      ::io_uring_params p{};
      p.flags = a.flags;
      r = ::io_uring_queue_init_params(entries, &ring, &p);
      if (r == 0) {
        live = true;
        flags = a.flags;
        mode = a.mode;
        if (mode != wanted && log != nullptr)
          log->warn("io_uring: the kernel refused {} task running (EINVAL); running {}", to_string(wanted),
                    to_string(mode));
        return;
      }
      if (r != -EINVAL) break;
    }
    throw boost::system::system_error(-r, boost::system::system_category(), "io_uring_queue_init_params");
  }
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
