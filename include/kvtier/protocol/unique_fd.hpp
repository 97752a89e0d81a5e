#pragma once
// unique_fd: sole owner of a POSIX file descriptor (closed on destruction). File
// descriptors travel between engine and server with SCM_RIGHTS; every fd that arrives is
// wrapped at once, so an fd nobody claims is closed, never leaked.

#include <kvtier/config.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

class unique_fd {
 public:
  constexpr unique_fd() noexcept = default;
  /// Takes ownership of `fd` (-1: empty).
  explicit constexpr unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] constexpr int get() const noexcept { return fd_; }
  [[nodiscard]] constexpr bool valid() const noexcept { return fd_ >= 0; }
  explicit constexpr operator bool() const noexcept { return valid(); }

  /// Gives up ownership without closing.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes the current fd (if any) and owns `fd` instead.
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);  // close(2) releases the fd even when it reports EINTR on Linux
    fd_ = fd;
  }

  /// A close-on-exec duplicate of `fd`; empty (and errno set) when dup fails.
  [[nodiscard]] static unique_fd duplicate(int fd) noexcept { return unique_fd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

 private:
  int fd_ = -1;
};

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
