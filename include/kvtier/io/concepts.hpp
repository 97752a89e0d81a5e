#pragma once
// The contract of kvtier's file I/O: `file_io`, what the L2 disk backend is written against.
// Satisfied by io::uring_context (io_uring), io::pread_pool (the thread-pool fallback) and
// io::any_file_io (whichever of the two the run-time probe chose), so the backend never
// knows which one runs; io::file_io_archetype checks code against the contract alone.
// docs/io.md, "Operations", holds the operations and the rules every implementation obeys
// (completions, errors, short reads, memory until the handler runs).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>

#include <sys/types.h>
#include <sys/uio.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

/// Which implementation of file_io does the I/O.
enum class file_io_kind : std::uint8_t {
  uring,  ///< io_uring (io::uring_context)
  pread,  ///< the pread/pwrite thread pool (io::pread_pool)
};

[[nodiscard]] constexpr std::string_view to_string(file_io_kind k) noexcept {
  switch (k) {
    case file_io_kind::uring: return "io_uring";
    case file_io_kind::pread: return "pread";
  }
  return "?";
}

/// The most bytes one read or write moves (Linux's MAX_RW_COUNT, 2 GiB - 4 KiB): a longer
/// buffer completes short.
inline constexpr std::size_t max_io_bytes = 0x7ffff000;

/// A memory region handed to register_buffers (the L1 slot arena, one region or a few).
using buffer_region = std::span<std::byte>;

namespace detail {
// Handlers of each completion signature, for checking the concept.
struct size_handler_archetype {
  void operator()(error_code, std::size_t) const {}
};
struct fd_handler_archetype {
  void operator()(error_code, int) const {}
};
struct void_handler_archetype {
  void operator()(error_code) const {}
};
}  // namespace detail

// clang-format off
/// File I/O. `renameat` takes renameat2(2) flags (RENAME_NOREPLACE...), `unlinkat`
/// unlinkat(2) flags (AT_REMOVEDIR). register_buffers() is a hint: implementations that cannot use
/// registered memory, or whose kernel refuses it, return the reason and keep working with
/// plain reads into the same memory.
template <class T>
concept file_io = requires(T& io, const T& cio, int fd, std::span<std::byte> buf, std::span<const std::byte> cbuf,
                           std::span<const ::iovec> iov, std::uint64_t offset, const char* path, int flags,
                           unsigned rename_flags, ::mode_t mode, std::span<const buffer_region> regions,
                           detail::size_handler_archetype hs, detail::fd_handler_archetype hf,
                           detail::void_handler_archetype hv) {
  typename T::executor_type;
  { cio.get_executor() } -> std::same_as<typename T::executor_type>;
  { cio.kind() } -> std::same_as<file_io_kind>;
  io.async_read(fd, buf, offset, hs);
  io.async_write(fd, cbuf, offset, hs);
  io.async_readv(fd, iov, offset, hs);
  io.async_writev(fd, iov, offset, hs);
  io.async_fsync(fd, hv);
  io.async_fdatasync(fd, hv);
  io.async_openat(fd, path, flags, mode, hf);
  io.async_close(fd, hv);
  io.async_renameat(fd, path, fd, path, rename_flags, hv);
  io.async_unlinkat(fd, path, flags, hv);
  { io.register_buffers(regions) } -> std::same_as<error_code>;
  { cio.fixed_buffers_active() } -> std::same_as<bool>;
  io.shutdown();
};
// clang-format on

/// The smallest type that models file_io: declarations only, for checking generic code
/// (the object helpers, the disk backend) against the contract without a real implementation.
struct file_io_archetype {
  struct executor_type {
    friend bool operator==(const executor_type&, const executor_type&) noexcept = default;
  };
  executor_type get_executor() const noexcept { return {}; }
  file_io_kind kind() const noexcept { return file_io_kind::pread; }
  template <class Token> void async_read(int, std::span<std::byte>, std::uint64_t, Token&&);
  template <class Token> void async_write(int, std::span<const std::byte>, std::uint64_t, Token&&);
  template <class Token> void async_readv(int, std::span<const ::iovec>, std::uint64_t, Token&&);
  template <class Token> void async_writev(int, std::span<const ::iovec>, std::uint64_t, Token&&);
  template <class Token> void async_fsync(int, Token&&);
  template <class Token> void async_fdatasync(int, Token&&);
  template <class Token> void async_openat(int, const char*, int, ::mode_t, Token&&);
  template <class Token> void async_close(int, Token&&);
  template <class Token> void async_renameat(int, const char*, int, const char*, unsigned, Token&&);
  template <class Token> void async_unlinkat(int, const char*, int, Token&&);
  error_code register_buffers(std::span<const buffer_region>) { return {}; }
  bool fixed_buffers_active() const noexcept { return false; }
  void shutdown() {}
};
static_assert(file_io<file_io_archetype>);

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
