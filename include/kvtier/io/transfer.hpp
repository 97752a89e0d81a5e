#pragma once
// async_read_all / async_write_all: move one large object (3-32 MiB KV chunks) with any
// file_io engine, split into parts of ~1 MiB that run in parallel (at most
// max_parts_in_flight at a time), and complete once, after every part has completed.
//
// Why these numbers (docs/io.md): at >= 256 KiB per I/O the submission cost is under 1%
// even unbatched, and 8-32 requests in flight saturate an NVMe device; 1 MiB parts, 16 in
// flight, put a 32 MiB object in flight in two waves while the ring batches each wave into
// one io_uring_enter.
//
// Completion: void(error_code, std::size_t bytes). `bytes` is the prefix of the object that
// was transferred (parts complete out of order; only the contiguous prefix counts). The
// error is that of the FIRST failing part in file order: the kernel's error, eof for a
// read that came up short (the file ended), operation_aborted when cancelled. A short
// write is continued where it stopped (the kernel then reports the real error, e.g. ENOSPC);
// a write that moves 0 bytes fails with errc::io_error. After the first failure no new part
// starts; the op still waits for the parts in flight (the buffer contract of file_io: the
// handler runs only when the kernel is done with every byte of the buffer).
//
// Cancellation (the handler's slot, any type) stops launching parts and cancels the parts
// in flight; same exactly-once and buffer rules as a single op.
//
// Threading: the bookkeeping runs on the handler's associated executor (the engine's when it
// has none), which must not run two handlers at once (an io_context thread or a strand).
// For O_DIRECT, offset, buffer and size must be 4 KiB aligned; part_bytes is rounded up to
// 4 KiB so every part stays aligned.

#include <kvtier/config.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/concepts.hpp>

#include <boost/asio/associated_allocator.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/recycling_allocator.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::io {

struct transfer_options {
  /// Bytes per part (rounded up to 4 KiB). 1 MiB: see the header comment.
  std::size_t part_bytes = std::size_t{1} << 20;
  /// Parts in flight at once, 1 to 64.
  unsigned max_parts_in_flight = 16;
};

namespace detail {

template <class Io, class Handler, bool Write>
class transfer_op {
 public:
  using byte_type = std::conditional_t<Write, const std::byte, std::byte>;
  using executor_type = boost::asio::associated_executor_t<Handler, typename Io::executor_type>;
  using default_allocator = boost::asio::recycling_allocator<void>;
  using allocator_type = boost::asio::associated_allocator_t<Handler, default_allocator>;
  using self_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<transfer_op>;
  using signal_allocator =
      typename std::allocator_traits<allocator_type>::template rebind_alloc<boost::asio::cancellation_signal>;
  using work_guard = boost::asio::executor_work_guard<executor_type>;
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  /// Starts the transfer; never completes inline.
  template <class H>
  static void launch(H&& handler, Io& io, int fd, std::span<byte_type> buf, std::uint64_t offset,
                     const transfer_options& opts) {
    allocator_type alloc = boost::asio::get_associated_allocator(handler, default_allocator());
    self_allocator a(alloc);
    transfer_op* p = std::allocator_traits<self_allocator>::allocate(a, 1);
    try {
      ::new (static_cast<void*>(p)) transfer_op(std::forward<H>(handler), io, fd, buf, offset, opts, alloc);
    } catch (...) {
      std::allocator_traits<self_allocator>::deallocate(a, p, 1);
      throw;
    }
    p->launch_parts();
  }

  /// The handler of one part: runs on the transfer's executor, cancelled through its lane's
  /// signal (only when the transfer itself can be cancelled).
  struct part_handler {
    transfer_op* self;
    unsigned lane;
    using executor_type = transfer_op::executor_type;
    [[nodiscard]] executor_type get_executor() const noexcept { return self->work_.get_executor(); }
    using cancellation_slot_type = boost::asio::cancellation_slot;
    [[nodiscard]] cancellation_slot_type get_cancellation_slot() const noexcept {
      return self->signals_ != nullptr ? self->signals_[lane].slot() : cancellation_slot_type();
    }
    void operator()(const error_code& ec, std::size_t n) const { self->on_part(lane, ec, n); }
  };

  struct outer_cancel {
    transfer_op* self;
    void operator()(boost::asio::cancellation_type_t type) const { self->cancel(type); }
  };

 private:
  struct lane_state {
    std::size_t part = 0;
    std::size_t done = 0;  // bytes of the part already moved (short writes continue)
  };

  template <class H>
  transfer_op(H&& handler, Io& io, int fd, std::span<byte_type> buf, std::uint64_t offset,
              const transfer_options& opts, const allocator_type& alloc)
      : handler_(std::forward<H>(handler)),
        alloc_(alloc),
        work_(boost::asio::get_associated_executor(handler_, io.get_executor())),
        io_(io),
        fd_(fd),
        base_(buf.data()),
        size_(buf.size()),
        offset_(offset),
        part_bytes_(align_up(opts.part_bytes)),
        parts_(size_ == 0 ? 0 : (size_ + part_bytes_ - 1) / part_bytes_),
        lanes_count_(opts.max_parts_in_flight),
        free_lanes_(opts.max_parts_in_flight == 64 ? ~std::uint64_t{0}
                                                   : (std::uint64_t{1} << opts.max_parts_in_flight) - 1) {
    auto slot = boost::asio::get_associated_cancellation_slot(handler_);
    if (slot.is_connected()) {
      signal_allocator sa(alloc_);
      signals_ = std::allocator_traits<signal_allocator>::allocate(sa, lanes_count_);
      for (unsigned i = 0; i < lanes_count_; ++i) ::new (static_cast<void*>(signals_ + i)) boost::asio::cancellation_signal();
      slot_ = slot;
      slot_.template emplace<outer_cancel>(this);
    }
  }

  ~transfer_op() {
    if (signals_ != nullptr) {
      for (unsigned i = 0; i < lanes_count_; ++i) signals_[i].~cancellation_signal();
      signal_allocator sa(alloc_);
      std::allocator_traits<signal_allocator>::deallocate(sa, signals_, lanes_count_);
    }
  }

  [[nodiscard]] std::size_t part_size(std::size_t part) const noexcept {
    const std::size_t begin = part * part_bytes_;
    return size_ - begin < part_bytes_ ? size_ - begin : part_bytes_;
  }

  void launch_parts() {
    if (parts_ == 0) {
      // Nothing to move: complete, but never inline in the initiating call.
      boost::asio::post(work_.get_executor(), [self = this] { self->finish(); });
      return;
    }
    while (!stopped_ && next_part_ < parts_ && free_lanes_ != 0) {
      const auto lane = static_cast<unsigned>(std::countr_zero(free_lanes_));
      free_lanes_ &= ~(std::uint64_t{1} << lane);
      lanes_[lane] = lane_state{next_part_++, 0};
      ++in_flight_;
      submit(lane);
    }
  }

  void submit(unsigned lane) {
    const lane_state& l = lanes_[lane];
    const std::size_t at = l.part * part_bytes_ + l.done;
    const std::span<byte_type> piece(base_ + at, part_size(l.part) - l.done);
    if constexpr (Write) io_.async_write(fd_, piece, offset_ + at, part_handler{this, lane});
    else io_.async_read(fd_, piece, offset_ + at, part_handler{this, lane});
  }

  void on_part(unsigned lane, const error_code& ec, std::size_t n) {
    --in_flight_;
    lane_state& l = lanes_[lane];
    const std::size_t want = part_size(l.part) - l.done;
    if (ec) {
      record(l.part, l.done, ec);
    } else if (n < want) {
      if constexpr (!Write) {
        record(l.part, l.done + n, boost::asio::error::eof);
      } else {
        if (n == 0) record(l.part, l.done, make_error_code(errc::io_error));
        else if (stopped_) record(l.part, l.done + n, boost::asio::error::operation_aborted);
        else {
          l.done += n;
          ++in_flight_;
          submit(lane);
          return;
        }
      }
    }
    free_lanes_ |= std::uint64_t{1} << lane;
    launch_parts();
    if (in_flight_ == 0) finish();
  }

  /// Keeps the failure of the earliest part: it ends the transferred prefix.
  void record(std::size_t part, std::size_t done, const error_code& ec) noexcept {
    if (part < bad_part_) {
      bad_part_ = part;
      bad_done_ = done;
      error_ = ec;
    }
    stopped_ = true;
  }

  void cancel(boost::asio::cancellation_type_t type) {
    if (next_part_ < parts_) record(next_part_, 0, boost::asio::error::operation_aborted);
    stopped_ = true;
    for (unsigned i = 0; i < lanes_count_; ++i)
      if ((free_lanes_ & (std::uint64_t{1} << i)) == 0) signals_[i].emit(type);
  }

  void finish() {
    if (slot_.is_connected()) slot_.clear();
    const error_code ec = error_;
    const std::size_t bytes = bad_part_ == npos ? size_ : bad_part_ * part_bytes_ + bad_done_;
    self_allocator a(alloc_);
    Handler handler(std::move(handler_));
    work_guard work(std::move(work_));
    this->~transfer_op();
    std::allocator_traits<self_allocator>::deallocate(a, this, 1);
    boost::asio::dispatch(work.get_executor(),
                          [h = std::move(handler), ec, bytes]() mutable { std::move(h)(ec, bytes); });
  }

  Handler handler_;
  allocator_type alloc_;
  work_guard work_;
  Io& io_;
  int fd_;
  byte_type* base_;
  std::size_t size_;
  std::uint64_t offset_;
  std::size_t part_bytes_;
  std::size_t parts_;
  unsigned lanes_count_;
  std::uint64_t free_lanes_;  // bit i set: lane i is free
  lane_state lanes_[64]{};
  boost::asio::cancellation_signal* signals_ = nullptr;  // one per lane, only when cancellable
  boost::asio::cancellation_slot slot_;
  std::size_t next_part_ = 0;
  unsigned in_flight_ = 0;
  bool stopped_ = false;
  std::size_t bad_part_ = npos;
  std::size_t bad_done_ = 0;
  error_code error_;
};

template <class Io, bool Write>
struct initiate_transfer {
  Io* io;
  using executor_type = typename Io::executor_type;
  [[nodiscard]] executor_type get_executor() const noexcept { return io->get_executor(); }
  template <class Handler, class Span>
  void operator()(Handler&& handler, int fd, Span buf, std::uint64_t offset, const transfer_options& opts) const {
    transfer_op<Io, std::decay_t<Handler>, Write>::launch(std::forward<Handler>(handler), *io, fd, buf, offset, opts);
  }
};

inline void check_transfer_options(const transfer_options& o) {
  if (o.part_bytes == 0) throw std::invalid_argument("kvtier::io transfer: part_bytes must be > 0");
  if (o.max_parts_in_flight == 0 || o.max_parts_in_flight > 64)
    throw std::invalid_argument("kvtier::io transfer: max_parts_in_flight must be in [1, 64]");
}

}  // namespace detail

/// Reads buffer.size() bytes at `offset` in parts; see the header comment.
template <file_io Io, class Token>
auto async_read_all(Io& io, int fd, std::span<std::byte> buffer, std::uint64_t offset, const transfer_options& opts,
                    Token&& token) {
  detail::check_transfer_options(opts);
  return boost::asio::async_initiate<Token, void(error_code, std::size_t)>(detail::initiate_transfer<Io, false>{&io},
                                                                           token, fd, buffer, offset, opts);
}

template <file_io Io, class Token>
auto async_read_all(Io& io, int fd, std::span<std::byte> buffer, std::uint64_t offset, Token&& token) {
  return async_read_all(io, fd, buffer, offset, transfer_options{}, std::forward<Token>(token));
}

/// Writes the whole buffer at `offset` in parts; see the header comment.
template <file_io Io, class Token>
auto async_write_all(Io& io, int fd, std::span<const std::byte> buffer, std::uint64_t offset,
                     const transfer_options& opts, Token&& token) {
  detail::check_transfer_options(opts);
  return boost::asio::async_initiate<Token, void(error_code, std::size_t)>(detail::initiate_transfer<Io, true>{&io},
                                                                           token, fd, buffer, offset, opts);
}

template <file_io Io, class Token>
auto async_write_all(Io& io, int fd, std::span<const std::byte> buffer, std::uint64_t offset, Token&& token) {
  return async_write_all(io, fd, buffer, offset, transfer_options{}, std::forward<Token>(token));
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::io
