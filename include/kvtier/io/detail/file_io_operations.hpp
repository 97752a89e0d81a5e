#pragma once
// file_io_operations<Derived>: the ten operations of file_io (io/concepts.hpp), written once
// for every implementation. Each one describes its operation with the op type of its opcode
// (file_ops.hpp: plain values and pointers) and hands that description, with the caller's
// completion handler unchanged, to `Derived::submit(handler, desc)`, which each
// implementation provides: uring_context fills an SQE from it, pread_pool runs its syscall on
// a worker, any_file_io forwards it to whichever of the two runs. What an implementation
// adds is only how it runs an op; the operations, their arguments and their completion
// signatures cannot drift apart.
//
// Derived grants access to its private `submit` with `friend class
// detail::file_io_operations<Derived>;` and provides `executor_type` and `get_executor()`
// (the executor of handlers that have none of their own). The description is built when the
// operation is initiated and submitted when the token launches it (at once, or later for
// `deferred`), so a deferred read sees the registered buffers of the time it runs.

#include <kvtier/config.hpp>
#include <kvtier/io/detail/file_ops.hpp>

#include <boost/asio/async_result.hpp>

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

template <class Derived>
class file_io_operations {
 public:
  /// Reads up to buffer.size() bytes at `offset` (pread(2); IORING_OP_READ, or READ_FIXED
  /// when the buffer lies in a registered region). Completes with (error, bytes read);
  /// fewer bytes than asked means end of file.
  template <class Token>
  auto async_read(int fd, std::span<std::byte> buffer, std::uint64_t offset, Token&& token) {
    return initiate<op_read>(token, fd, static_cast<void*>(buffer.data()), clamp_len(buffer.size()), offset);
  }

  /// Writes buffer at `offset` (pwrite(2); IORING_OP_WRITE or WRITE_FIXED). Completes with
  /// (error, bytes written).
  template <class Token>
  auto async_write(int fd, std::span<const std::byte> buffer, std::uint64_t offset, Token&& token) {
    return initiate<op_write>(token, fd, static_cast<const void*>(buffer.data()), clamp_len(buffer.size()), offset);
  }

  /// preadv(2) (IORING_OP_READV). `iov` must stay valid until completion.
  template <class Token>
  auto async_readv(int fd, std::span<const ::iovec> iov, std::uint64_t offset, Token&& token) {
    return initiate<op_readv>(token, fd, iov.data(), static_cast<unsigned>(iov.size()), offset);
  }

  /// pwritev(2) (IORING_OP_WRITEV). `iov` must stay valid until completion.
  template <class Token>
  auto async_writev(int fd, std::span<const ::iovec> iov, std::uint64_t offset, Token&& token) {
    return initiate<op_writev>(token, fd, iov.data(), static_cast<unsigned>(iov.size()), offset);
  }

  /// fsync(2) (IORING_OP_FSYNC). Completes with (error).
  template <class Token>
  auto async_fsync(int fd, Token&& token) {
    return initiate<op_fsync>(token, fd, false);
  }

  /// fdatasync(2) (IORING_OP_FSYNC with IORING_FSYNC_DATASYNC).
  template <class Token>
  auto async_fdatasync(int fd, Token&& token) {
    return initiate<op_fsync>(token, fd, true);
  }

  /// openat(2) (IORING_OP_OPENAT: the kernel runs it on a worker, so a slow directory lookup
  /// never blocks the I/O thread). Completes with (error, new fd).
  template <class Token>
  auto async_openat(int dirfd, const char* path, int flags, ::mode_t mode, Token&& token) {
    return initiate<op_openat>(token, dirfd, path, flags, mode);
  }

  /// close(2) (IORING_OP_CLOSE).
  template <class Token>
  auto async_close(int fd, Token&& token) {
    return initiate<op_close>(token, fd);
  }

  /// renameat2(2) (IORING_OP_RENAMEAT), e.g. RENAME_NOREPLACE.
  template <class Token>
  auto async_renameat(int old_dirfd, const char* old_path, int new_dirfd, const char* new_path, unsigned flags,
                      Token&& token) {
    return initiate<op_renameat>(token, old_dirfd, old_path, new_dirfd, new_path, flags);
  }

  /// unlinkat(2) (IORING_OP_UNLINKAT).
  template <class Token>
  auto async_unlinkat(int dirfd, const char* path, int flags, Token&& token) {
    return initiate<op_unlinkat>(token, dirfd, path, flags);
  }

 protected:
  file_io_operations() = default;
  ~file_io_operations() = default;

 private:
  template <class Handler, class Desc>
  static void submit_to(Derived& self, Handler&& handler, const Desc& desc) {
    self.submit(std::forward<Handler>(handler), desc);
  }

  template <class Desc>
  struct initiation {
    Derived* self;
    using executor_type = typename Derived::executor_type;
    [[nodiscard]] executor_type get_executor() const noexcept { return self->get_executor(); }
    template <class Handler>
    void operator()(Handler&& handler, const Desc& desc) const {
      submit_to(*self, std::forward<Handler>(handler), desc);
    }
  };

  template <class Desc, class Token, class... Args>
  auto initiate(Token& token, Args... args) {
    return boost::asio::async_initiate<Token, typename Desc::signature>(initiation<Desc>{static_cast<Derived*>(this)},
                                                                        token, Desc{{}, args...});
  }
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
