#pragma once
// async_read_all / async_write_all: move one large object (3-32 MiB KV chunks) with any
// file_io, split into parts of ~1 MiB that run in parallel (at most max_parts_in_flight at a
// time, through async_run_parts, parts.hpp), and complete once, after every part has
// completed, with the contiguous prefix transferred and the error of the first failing part
// in file order. docs/io.md, "Operations", holds the rules, the threading and why 1 MiB x 16.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>
#include <kvtier/io/parts.hpp>

#include <boost/asio/error.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

struct object_io_options {
  /// Bytes per part (rounded up to 4 KiB). 1 MiB: docs/io.md, "Operations".
  std::size_t part_bytes = std::size_t{1} << 20;
  /// Parts in flight at once, 1 to 256.
  unsigned max_parts_in_flight = 16;
};

namespace detail {

/// The parts of one object: part i is [i * part_bytes, ...) of the buffer, at offset + that.
/// Keeps the failure of the earliest part, which ends the transferred prefix.
template <bool Write>
class whole_object_plan {
 public:
  static constexpr bool writes = Write;
  using signature = void(error_code, std::size_t);
  using byte_type = std::conditional_t<Write, const std::byte, std::byte>;
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  whole_object_plan(int fd, std::span<byte_type> buf, std::uint64_t offset, std::size_t part_bytes) noexcept
      : fd_(fd),
        base_(const_cast<std::byte*>(buf.data())),  // written from, never into, when Write
        size_(buf.size()),
        offset_(offset),
        part_bytes_(align_up(part_bytes)) {}

  [[nodiscard]] std::size_t part_count() const noexcept {
    return size_ == 0 ? 0 : (size_ + part_bytes_ - 1) / part_bytes_;
  }

  std::optional<file_part> begin_part(std::size_t i) const noexcept {
    const std::size_t begin = i * part_bytes_;
    return file_part{fd_, base_ + begin, size_ - begin < part_bytes_ ? size_ - begin : part_bytes_, offset_ + begin};
  }

  bool end_part(std::size_t i, const error_code& ec, std::size_t n) noexcept {
    const std::size_t want = size_ - i * part_bytes_ < part_bytes_ ? size_ - i * part_bytes_ : part_bytes_;
    if (ec) record(i, n, ec);
    else if (n < want) record(i, n, boost::asio::error::eof);  // (a write: the runner continued it)
    else return false;
    return true;
  }

  [[nodiscard]] std::tuple<error_code, std::size_t> result(const parts_outcome& o) noexcept {
    if (o.cancelled && o.next < part_count()) record(o.next, 0, boost::asio::error::operation_aborted);
    return {error_, bad_part_ == npos ? size_ : bad_part_ * part_bytes_ + bad_done_};
  }

 private:
  void record(std::size_t part, std::size_t done, const error_code& ec) noexcept {
    if (part < bad_part_) {
      bad_part_ = part;
      bad_done_ = done;
      error_ = ec;
    }
  }

  int fd_;
  std::byte* base_;
  std::size_t size_;
  std::uint64_t offset_;
  std::size_t part_bytes_;
  std::size_t bad_part_ = npos;
  std::size_t bad_done_ = 0;
  error_code error_;
};

inline void check_object_io_options(const object_io_options& o) {
  if (o.part_bytes == 0) throw std::invalid_argument("kvtier::io object_io_options: part_bytes must be > 0");
  if (o.max_parts_in_flight == 0 || o.max_parts_in_flight > max_parts_in_flight_limit)
    throw std::invalid_argument("kvtier::io object_io_options: max_parts_in_flight must be in [1, 256]");
}

}  // namespace detail

/// Reads buffer.size() bytes at `offset` in parts (docs/io.md, "Operations").
template <file_io Io, class Token>
auto async_read_all(Io& io, int fd, std::span<std::byte> buffer, std::uint64_t offset, const object_io_options& opts,
                    Token&& token) {
  detail::check_object_io_options(opts);
  return async_run_parts(io, detail::whole_object_plan<false>(fd, buffer, offset, opts.part_bytes),
                         opts.max_parts_in_flight, std::forward<Token>(token));
}

template <file_io Io, class Token>
auto async_read_all(Io& io, int fd, std::span<std::byte> buffer, std::uint64_t offset, Token&& token) {
  return async_read_all(io, fd, buffer, offset, object_io_options{}, std::forward<Token>(token));
}

/// Writes the whole buffer at `offset` in parts (docs/io.md, "Operations").
template <file_io Io, class Token>
auto async_write_all(Io& io, int fd, std::span<const std::byte> buffer, std::uint64_t offset,
                     const object_io_options& opts, Token&& token) {
  detail::check_object_io_options(opts);
  return async_run_parts(io, detail::whole_object_plan<true>(fd, buffer, offset, opts.part_bytes),
                         opts.max_parts_in_flight, std::forward<Token>(token));
}

template <file_io Io, class Token>
auto async_write_all(Io& io, int fd, std::span<const std::byte> buffer, std::uint64_t offset, Token&& token) {
  return async_write_all(io, fd, buffer, offset, object_io_options{}, std::forward<Token>(token));
}

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
