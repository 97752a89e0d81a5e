#pragma once
// One type per file operation (one per io_uring opcode). Each knows how to fill an SQE for
// the ring (`prepare`, noexcept, what the io_uring_prep_xxx(3) man page describes) and how
// to do the same thing with a blocking syscall for the thread-pool fallback (`perform`,
// noexcept, returns the value or -errno exactly as the CQE's res would), plus its completion
// signature. file_io_operations.hpp builds them for the ten async_ operations; uring_context
// and pread_pool wrap them with a handler; the arguments are plain values and pointers, so
// an op carries no allocation of its own.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>

#include <boost/system/error_code.hpp>

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <tuple>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

/// A result value no kernel returns: the op was refused because its file I/O is shutting down.
inline constexpr int res_shutting_down = INT_MIN;

/// The error_code of a CQE-style result (negative errno), or of res_shutting_down.
[[nodiscard]] inline error_code error_from_res(long res) noexcept {
  if (res >= 0) return {};
  if (res == res_shutting_down) return make_error_code(errc::shutting_down);
  return {static_cast<int>(-res), boost::system::system_category()};
}

// Completion kinds: how a result maps to handler arguments.
struct returns_size {
  using signature = void(error_code, std::size_t);
  static auto args(long res) noexcept {
    return std::tuple<error_code, std::size_t>(error_from_res(res), res >= 0 ? static_cast<std::size_t>(res) : 0U);
  }
};
struct returns_fd {
  using signature = void(error_code, int);
  static auto args(long res) noexcept {
    return std::tuple<error_code, int>(error_from_res(res), res >= 0 ? static_cast<int>(res) : -1);
  }
};
struct returns_nothing {
  using signature = void(error_code);
  static auto args(long res) noexcept { return std::tuple<error_code>(error_from_res(res)); }
};

[[nodiscard]] inline long errno_result(long r) noexcept { return r >= 0 ? r : -static_cast<long>(errno); }

/// Retries a syscall interrupted by a signal (EINTR) and returns its value or -errno.
template <class F>
[[nodiscard]] long retry_eintr(F&& f) noexcept {
  for (;;) {
    const long r = f();
    if (r >= 0 || errno != EINTR) return errno_result(r);
  }
}

[[nodiscard]] inline unsigned clamp_len(std::size_t n) noexcept {
  return static_cast<unsigned>(n < max_io_bytes ? n : max_io_bytes);
}

/// IORING_OP_READ, io_uring_prep_read(3): pread(2) into one buffer; on a pipe or socket the
/// offset is ignored (the fallback then uses read(2)).
struct op_read : returns_size {
  int fd;
  void* data;
  unsigned len;
  std::uint64_t offset;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_read(sqe, fd, data, len, offset); }
  [[nodiscard]] long perform() const noexcept {
    const long r = retry_eintr([&] { return ::pread(fd, data, len, static_cast<off_t>(offset)); });
    return r == -ESPIPE ? retry_eintr([&] { return ::read(fd, data, len); }) : r;
  }
};

/// IORING_OP_READ_FIXED, io_uring_prep_read_fixed(3): a read into a registered buffer
/// (buf_index names it; the kernel skips pinning the pages per op).
struct op_read_fixed : returns_size {
  int fd;
  void* data;
  unsigned len;
  std::uint64_t offset;
  int buf_index;
  void prepare(::io_uring_sqe* sqe) const noexcept {
    ::io_uring_prep_read_fixed(sqe, fd, data, len, offset, buf_index);
  }
  [[nodiscard]] long perform() const noexcept { return op_read{{}, fd, data, len, offset}.perform(); }
};

/// IORING_OP_WRITE, io_uring_prep_write(3): pwrite(2) from one buffer.
struct op_write : returns_size {
  int fd;
  const void* data;
  unsigned len;
  std::uint64_t offset;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_write(sqe, fd, data, len, offset); }
  [[nodiscard]] long perform() const noexcept {
    const long r = retry_eintr([&] { return ::pwrite(fd, data, len, static_cast<off_t>(offset)); });
    return r == -ESPIPE ? retry_eintr([&] { return ::write(fd, data, len); }) : r;
  }
};

/// IORING_OP_WRITE_FIXED, io_uring_prep_write_fixed(3): a write from a registered buffer.
struct op_write_fixed : returns_size {
  int fd;
  const void* data;
  unsigned len;
  std::uint64_t offset;
  int buf_index;
  void prepare(::io_uring_sqe* sqe) const noexcept {
    ::io_uring_prep_write_fixed(sqe, fd, data, len, offset, buf_index);
  }
  [[nodiscard]] long perform() const noexcept { return op_write{{}, fd, data, len, offset}.perform(); }
};

/// IORING_OP_READV, io_uring_prep_readv(3): preadv(2); the iovec array must outlive the op.
struct op_readv : returns_size {
  int fd;
  const ::iovec* iov;
  unsigned count;
  std::uint64_t offset;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_readv(sqe, fd, iov, count, offset); }
  [[nodiscard]] long perform() const noexcept {
    const int n = static_cast<int>(count);
    const long r = retry_eintr([&] { return ::preadv(fd, iov, n, static_cast<off_t>(offset)); });
    return r == -ESPIPE ? retry_eintr([&] { return ::readv(fd, iov, n); }) : r;
  }
};

/// IORING_OP_WRITEV, io_uring_prep_writev(3): pwritev(2); the iovec array must outlive the op.
struct op_writev : returns_size {
  int fd;
  const ::iovec* iov;
  unsigned count;
  std::uint64_t offset;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_writev(sqe, fd, iov, count, offset); }
  [[nodiscard]] long perform() const noexcept {
    const int n = static_cast<int>(count);
    const long r = retry_eintr([&] { return ::pwritev(fd, iov, n, static_cast<off_t>(offset)); });
    return r == -ESPIPE ? retry_eintr([&] { return ::writev(fd, iov, n); }) : r;
  }
};

/// IORING_OP_FSYNC, io_uring_prep_fsync(3): fsync(2), or fdatasync(2) with `datasync`
/// (IORING_FSYNC_DATASYNC).
struct op_fsync : returns_nothing {
  int fd;
  bool datasync;
  void prepare(::io_uring_sqe* sqe) const noexcept {
    ::io_uring_prep_fsync(sqe, fd, datasync ? IORING_FSYNC_DATASYNC : 0U);
  }
  [[nodiscard]] long perform() const noexcept {
    return retry_eintr([&] { return datasync ? ::fdatasync(fd) : ::fsync(fd); });
  }
};

/// IORING_OP_OPENAT, io_uring_prep_openat(3): openat(2); completes with the new fd. The
/// path must outlive the op (the kernel reads it when the SQE is submitted, at the end of
/// the executor turn, not when the op is started).
struct op_openat : returns_fd {
  int dirfd;
  const char* path;
  int flags;
  ::mode_t mode;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_openat(sqe, dirfd, path, flags, mode); }
  [[nodiscard]] long perform() const noexcept { return retry_eintr([&] { return ::openat(dirfd, path, flags, mode); }); }
};

/// IORING_OP_CLOSE, io_uring_prep_close(3): close(2). Never retried on EINTR (on Linux the
/// fd is gone either way).
struct op_close : returns_nothing {
  int fd;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_close(sqe, fd); }
  [[nodiscard]] long perform() const noexcept { return errno_result(::close(fd)); }
};

/// IORING_OP_RENAMEAT, io_uring_prep_renameat(3): renameat2(2) with its flags
/// (RENAME_NOREPLACE, RENAME_EXCHANGE). Both paths must outlive the op.
struct op_renameat : returns_nothing {
  int old_dirfd;
  const char* old_path;
  int new_dirfd;
  const char* new_path;
  unsigned flags;
  void prepare(::io_uring_sqe* sqe) const noexcept {
    ::io_uring_prep_renameat(sqe, old_dirfd, old_path, new_dirfd, new_path, flags);
  }
  [[nodiscard]] long perform() const noexcept {
    return retry_eintr([&] { return ::renameat2(old_dirfd, old_path, new_dirfd, new_path, flags); });
  }
};

/// IORING_OP_UNLINKAT, io_uring_prep_unlinkat(3): unlinkat(2) (AT_REMOVEDIR removes a
/// directory). The path must outlive the op.
struct op_unlinkat : returns_nothing {
  int dirfd;
  const char* path;
  int flags;
  void prepare(::io_uring_sqe* sqe) const noexcept { ::io_uring_prep_unlinkat(sqe, dirfd, path, flags); }
  [[nodiscard]] long perform() const noexcept { return retry_eintr([&] { return ::unlinkat(dirfd, path, flags); }); }
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
