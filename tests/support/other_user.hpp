#pragma once
// Test support: playing another local user. The tests run as root; a forked child drops to
// `nobody` (setgroups, setgid, setuid) and does what a hostile or a legitimate other user
// would: connect to a server, listen on a socket first, own a directory. Results come back
// through the child's exit status or a pipe.
//
// The child runs in a fresh single-threaded copy of the test process: fork() is called from
// the test thread while no other thread of the test runs (the tests fork before they start
// a connector or a server thread), so the child may use the C++ library freely; it ends with
// _exit (no Catch2, no destructors of the parent's objects).

#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace kvtier::test {

/// The uid and gid of `nobody` (65534 on Debian).
struct other_user {
  ::uid_t uid = 65534;
  ::gid_t gid = 65534;
};

[[nodiscard]] inline other_user nobody() {
  other_user u;
  if (const ::passwd* pw = ::getpwnam("nobody")) {
    u.uid = pw->pw_uid;
    u.gid = pw->pw_gid;
  }
  return u;
}

/// Whether this process may switch users (root): the tests that need a second uid skip
/// otherwise.
[[nodiscard]] inline bool can_play_other_user() { return ::geteuid() == 0; }

/// Gives `path` (a file or a directory) to `u`.
inline void give_to(const std::filesystem::path& path, const other_user& u) {
  if (::chown(path.c_str(), u.uid, u.gid) != 0)
    throw std::runtime_error("chown " + path.string() + ": " + std::strerror(errno));
}

/// A child process running `fn` as user `u`; its exit status is fn's return value (125 when
/// the switch failed, 126 when fn threw).
class process_as {
 public:
  process_as(const other_user& u, std::function<int()> fn) {
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid_ == 0) {
      if (::setgroups(0, nullptr) != 0 || ::setgid(u.gid) != 0 || ::setuid(u.uid) != 0) ::_exit(125);
      int rc = 126;
      try {
        rc = fn();
      } catch (...) {
      }
      ::_exit(rc);
    }
  }
  process_as(const process_as&) = delete;
  process_as& operator=(const process_as&) = delete;
  ~process_as() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
  }

  /// Waits up to `timeout` for the exit; the exit code (128 + signal when killed), nullopt on
  /// timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      const ::pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  [[nodiscard]] ::pid_t pid() const noexcept { return pid_; }

 private:
  ::pid_t pid_ = -1;
};

/// Runs `fn` as `u` and returns its exit code (fails with std::runtime_error after `timeout`).
inline int run_as(const other_user& u, std::function<int()> fn,
                  std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  process_as p(u, std::move(fn));
  auto rc = p.wait(timeout);
  if (!rc) throw std::runtime_error("the child running as another user did not finish in time");
  return *rc;
}

}  // namespace kvtier::test
