#pragma once
// Who is at the other end of the connector's socket, and how to learn that it is gone:
// SO_PEERCRED names the server's process, a pidfd (pidfd_open(2), Linux >= 5.3) becomes
// readable when that process has exited. Quarantined blocks are released on that signal: a
// process that has exited writes nothing any more (docs/fault-tolerance.md).
//
// SO_PEERCRED on a connected Unix stream socket gives the credentials the listening socket
// was created with: the process that called listen(). The rule therefore assumes the process
// that listens is the one that serves (the server does; a server that forked its workers
// after listen() would need the pid in the protocol instead).

#include <kvtier/config.hpp>

#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {
namespace detail {

/// The pid of the peer of the connected Unix socket `fd`; 0 when unknown (another pid
/// namespace, or the call failed).
[[nodiscard]] inline ::pid_t peer_pid(int fd) noexcept {
  ::ucred cred{};
  ::socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) return 0;
  return cred.pid > 0 ? cred.pid : 0;
}

/// A close-on-exec pidfd for `pid`, or -1 (errno set: ESRCH when the process is already gone,
/// ENOSYS on kernels before 5.3, EPERM under some seccomp profiles).
[[nodiscard]] inline int open_pidfd(::pid_t pid) noexcept {
  if (pid <= 0) {
    errno = ESRCH;
    return -1;
  }
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace detail
}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
