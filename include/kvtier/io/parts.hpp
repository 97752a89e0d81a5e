#pragma once
// async_run_parts: runs a list of reads (or writes) with any file_io, at most N in flight,
// started in list order, and completes once, after every part it started has completed. What
// to do is a `part_plan` (begin_part, end_part, result). io::async_read_all / async_write_all
// (object_io.hpp) run one object's parts through it; the disk backend runs every object of a
// batch through one queue. docs/io.md, "Operations", holds the plan's contract, short and
// failed parts, cancellation and the threading rule.

#include <kvtier/config.hpp>
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
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {

/// The most parts async_run_parts keeps in flight.
inline constexpr unsigned max_parts_in_flight_limit = 256;

/// One read or write: `size` bytes at `offset` of `fd`, into (read) or from (write) `data`.
struct file_part {
  int fd = -1;
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::uint64_t offset = 0;
};

/// How an async_run_parts ended, for Plan::result.
struct parts_outcome {
  bool cancelled = false;  ///< the caller cancelled it (some parts may not have started)
  std::size_t next = 0;    ///< the first part never started (part_count() when all did)
};

// clang-format off
/// What async_run_parts runs (docs/io.md, "Operations"). `writes` says whether the parts are
/// writes; `signature` is the completion signature and result() returns its arguments. A plan
/// whose end_part does real work on what a part moved (a checksum) says so with
/// `static constexpr bool digests_parts = true` (digests_parts_v).
template <class P>
concept part_plan = requires(P& p, std::size_t i, const error_code& ec, std::size_t n, parts_outcome o) {
  { P::writes } -> std::convertible_to<bool>;
  typename P::signature;
  { p.part_count() } -> std::convertible_to<std::size_t>;
  { p.begin_part(i) } -> std::same_as<std::optional<file_part>>;
  { p.end_part(i, ec, n) } -> std::same_as<bool>;
  p.result(o);
};
// clang-format on

/// Whether end_part of Plan digests what a part moved: async_run_parts then starts the next
/// parts for every part that landed whole in one reaping turn, and has the file I/O hand
/// them to the kernel in one submission (submit_now()), before it calls the end_part of the
/// first of them, so that the work overlaps the device's instead of leaving its queue short
/// (docs/io.md, "Operations").
template <class Plan>
inline constexpr bool digests_parts_v = requires {
  requires Plan::digests_parts;
};

namespace detail {

/// A part in flight on one lane.
struct part_lane {
  std::size_t part = 0;
  file_part io;          ///< the part (a short write continues at io.data + done)
  std::size_t done = 0;  ///< bytes of the part already moved
};

/// A part that completed and waits for its end_part (digesting plans only).
struct landed_part {
  std::size_t part = 0;
  error_code ec;
  std::size_t moved = 0;
  bool whole = false;  ///< moved all its bytes without an error
};

template <class Io, class Plan, class Handler>
class parts_op {
 public:
  using executor_type = boost::asio::associated_executor_t<Handler, typename Io::executor_type>;
  using default_allocator = boost::asio::recycling_allocator<void>;
  using allocator_type = boost::asio::associated_allocator_t<Handler, default_allocator>;
  using self_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<parts_op>;
  using signal_allocator =
      typename std::allocator_traits<allocator_type>::template rebind_alloc<boost::asio::cancellation_signal>;
  using lane_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<part_lane>;
  using landed_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<landed_part>;
  static constexpr bool digesting = digests_parts_v<Plan>;
  using work_guard = boost::asio::executor_work_guard<executor_type>;

  /// Starts the parts; never completes inline.
  template <class H>
  static void launch(H&& handler, Io& io, Plan&& plan, unsigned max_in_flight) {
    allocator_type alloc = boost::asio::get_associated_allocator(handler, default_allocator());
    self_allocator a(alloc);
    parts_op* p = std::allocator_traits<self_allocator>::allocate(a, 1);
    try {
      ::new (static_cast<void*>(p)) parts_op(std::forward<H>(handler), io, std::move(plan), max_in_flight, alloc);
    } catch (...) {
      std::allocator_traits<self_allocator>::deallocate(a, p, 1);
      throw;
    }
    p->start();
  }

  /// The handler of one part: runs on the operation's executor, cancelled through its
  /// lane's signal (only when the operation itself can be cancelled).
  struct part_handler {
    parts_op* self;
    unsigned lane;
    using executor_type = parts_op::executor_type;
    [[nodiscard]] executor_type get_executor() const noexcept { return self->work_.get_executor(); }
    using cancellation_slot_type = boost::asio::cancellation_slot;
    [[nodiscard]] cancellation_slot_type get_cancellation_slot() const noexcept {
      return self->signals_ != nullptr ? self->signals_[lane].slot() : cancellation_slot_type();
    }
    void operator()(const error_code& ec, std::size_t n) const { self->on_part(lane, ec, n); }
  };

  struct outer_cancel {
    // A constructor, not an aggregate: Asio constructs it with parentheses, which clang 14
    // does not take for an aggregate (P0960).
    explicit outer_cancel(parts_op* s) noexcept : self(s) {}
    parts_op* self;
    void operator()(boost::asio::cancellation_type_t type) const { self->cancel(type); }
  };

 private:
  static constexpr unsigned words = max_parts_in_flight_limit / 64;

  template <class H>
  parts_op(H&& handler, Io& io, Plan&& plan, unsigned max_in_flight, const allocator_type& alloc)
      : handler_(std::forward<H>(handler)),
        alloc_(alloc),
        work_(boost::asio::get_associated_executor(handler_, io.get_executor())),
        io_(io),
        plan_(std::move(plan)),
        parts_(plan_.part_count()),
        lanes_count_(max_in_flight) {
    lane_allocator la(alloc_);
    lanes_ = std::allocator_traits<lane_allocator>::allocate(la, lanes_count_);
    for (unsigned l = 0; l < lanes_count_; ++l) {
      ::new (static_cast<void*>(lanes_ + l)) part_lane();
      free_[l / 64] |= std::uint64_t{1} << (l % 64);
    }
    if constexpr (digesting) {
      landed_allocator da(alloc_);
      landed_ = std::allocator_traits<landed_allocator>::allocate(da, lanes_count_);
      for (unsigned l = 0; l < lanes_count_; ++l) ::new (static_cast<void*>(landed_ + l)) landed_part();
    }
    auto slot = boost::asio::get_associated_cancellation_slot(handler_);
    if (slot.is_connected()) {
      signal_allocator sa(alloc_);
      signals_ = std::allocator_traits<signal_allocator>::allocate(sa, lanes_count_);
      for (unsigned i = 0; i < lanes_count_; ++i)
        ::new (static_cast<void*>(signals_ + i)) boost::asio::cancellation_signal();
      slot_ = slot;
      slot_.template emplace<outer_cancel>(this);
    }
  }

  ~parts_op() {
    lane_allocator la(alloc_);
    std::allocator_traits<lane_allocator>::deallocate(la, lanes_, lanes_count_);
    if constexpr (digesting) {
      landed_allocator da(alloc_);
      std::allocator_traits<landed_allocator>::deallocate(da, landed_, lanes_count_);
    }
    if (signals_ != nullptr) {
      for (unsigned i = 0; i < lanes_count_; ++i) signals_[i].~cancellation_signal();
      signal_allocator sa(alloc_);
      std::allocator_traits<signal_allocator>::deallocate(sa, signals_, lanes_count_);
    }
  }

  [[nodiscard]] bool lane_busy(unsigned l) const noexcept {
    return (free_[l / 64] & (std::uint64_t{1} << (l % 64))) == 0;
  }

  /// A free lane, taken; lanes_count_ when none is free.
  unsigned take_lane() noexcept {
    for (unsigned w = 0; w < words; ++w) {
      if (free_[w] == 0) continue;
      const auto bit = static_cast<unsigned>(std::countr_zero(free_[w]));
      free_[w] &= ~(std::uint64_t{1} << bit);
      return w * 64 + bit;
    }
    return lanes_count_;
  }

  void release_lane(unsigned l) noexcept { free_[l / 64] |= std::uint64_t{1} << (l % 64); }

  void start() {
    launch_parts();
    // Nothing in flight (no parts, or every part skipped): complete, but never inline in the
    // initiating call.
    if (in_flight_ == 0) boost::asio::post(work_.get_executor(), [self = this] { self->finish(); });
  }

  void launch_parts() {
    while (!stopped_ && next_ < parts_ && in_flight_ < lanes_count_) {
      const std::size_t i = next_++;
      std::optional<file_part> p = plan_.begin_part(i);
      if (!p) continue;
      const unsigned lane = take_lane();
      lanes_[lane] = part_lane{i, *p, 0};
      ++in_flight_;
      submit(lane);
    }
  }

  void submit(unsigned lane) {
    const part_lane& l = lanes_[lane];
    const file_part& p = l.io;
    if constexpr (Plan::writes)
      io_.async_write(p.fd, std::span<const std::byte>(p.data + l.done, p.size - l.done), p.offset + l.done,
                      part_handler{this, lane});
    else
      io_.async_read(p.fd, std::span<std::byte>(p.data + l.done, p.size - l.done), p.offset + l.done,
                     part_handler{this, lane});
  }

  void on_part(unsigned lane, const error_code& ec, std::size_t n) {
    part_lane& l = lanes_[lane];
    error_code result = ec;
    if constexpr (Plan::writes) {
      if (!ec && l.done + n < l.io.size) {
        if (n == 0) {
          result = make_error_code(errc::io_error);
        } else if (stopped_) {
          l.done += n;
          n = 0;
          result = boost::asio::error::operation_aborted;
        } else {
          l.done += n;
          submit(lane);  // the same lane continues the part
          return;
        }
      }
    }
    --in_flight_;
    release_lane(lane);
    const std::size_t part = l.part;
    const std::size_t moved = l.done + n;
    if constexpr (digesting) {
      land(landed_part{part, result, moved, !result && moved == l.io.size});
    } else {
      if (plan_.end_part(part, result, moved)) stopped_ = true;
      launch_parts();
      if (in_flight_ == 0) finish();
    }
  }

  // Digesting plans. A part that landed whole makes room at once: its replacement is started
  // (the ring submits it with the turn's one io_uring_enter), and its end_part waits for
  // drain_landed(), posted once behind the completions of this reaping turn. So every part
  // that lands in one turn is replaced, and the replacements are in the kernel, before the
  // first of them is digested: a device that completes a batch at once (a VM's virtio disk)
  // gets a batch back in one submission, not one read per digest. end_parts run in the order
  // the parts completed, as they did inline.
  void land(const landed_part& p) {
    if (landed_count_ == lanes_count_) drain_landed();  // never more than a lane's worth waits
    landed_[(landed_head_ + landed_count_) % lanes_count_] = p;
    ++landed_count_;
    if (!p.whole) ++landed_failures_;
    // After an error or a short read the plan decides first: it may skip or stop what follows.
    if (p.whole && landed_failures_ == 0) launch_parts();
    if (!drain_posted_) {
      drain_posted_ = true;
      boost::asio::post(work_.get_executor(), [self = this] { self->on_drain(); });
    }
  }

  void on_drain() {
    drain_posted_ = false;
    if constexpr (requires { io_.submit_now(); }) io_.submit_now();  // no-op when the turn already did
    drain_landed();
    launch_parts();
    if (in_flight_ == 0 && landed_count_ == 0) finish();
  }

  void drain_landed() {
    while (landed_count_ > 0) {
      const landed_part p = landed_[landed_head_];
      landed_head_ = (landed_head_ + 1) % lanes_count_;
      --landed_count_;
      if (!p.whole) --landed_failures_;
      if (plan_.end_part(p.part, p.ec, p.moved)) stopped_ = true;
    }
  }

  void cancel(boost::asio::cancellation_type_t type) {
    cancelled_ = stopped_ = true;
    for (unsigned i = 0; i < lanes_count_; ++i)
      if (lane_busy(i)) signals_[i].emit(type);
  }

  void finish() {
    if (slot_.is_connected()) slot_.clear();
    auto args = plan_.result(parts_outcome{cancelled_, next_});
    self_allocator a(alloc_);
    Handler handler(std::move(handler_));
    work_guard work(std::move(work_));
    this->~parts_op();
    std::allocator_traits<self_allocator>::deallocate(a, this, 1);
    boost::asio::dispatch(work.get_executor(), [h = std::move(handler), args = std::move(args)]() mutable {
      std::apply(std::move(h), std::move(args));
    });
  }

  Handler handler_;
  allocator_type alloc_;
  work_guard work_;
  Io& io_;
  Plan plan_;
  std::size_t parts_;
  unsigned lanes_count_;
  std::uint64_t free_[words]{};                          // bit l set: lane l is free
  part_lane* lanes_ = nullptr;                           // lanes_count_ of them
  landed_part* landed_ = nullptr;                        // digesting: a ring of lanes_count_
  unsigned landed_head_ = 0;                             // the oldest landed part
  unsigned landed_count_ = 0;                            // landed parts waiting for end_part
  unsigned landed_failures_ = 0;                         // of them, not whole
  bool drain_posted_ = false;                            // on_drain() is in the executor's queue
  boost::asio::cancellation_signal* signals_ = nullptr;  // one per lane, only when cancellable
  boost::asio::cancellation_slot slot_;
  std::size_t next_ = 0;
  unsigned in_flight_ = 0;
  bool stopped_ = false;
  bool cancelled_ = false;
};

template <class Io>
struct initiate_parts {
  Io* io;
  using executor_type = typename Io::executor_type;
  [[nodiscard]] executor_type get_executor() const noexcept { return io->get_executor(); }
  template <class Handler, class Plan>
  void operator()(Handler&& handler, Plan&& plan, unsigned max_in_flight) const {
    parts_op<Io, std::decay_t<Plan>, std::decay_t<Handler>>::launch(std::forward<Handler>(handler), *io,
                                                                    std::move(plan), max_in_flight);
  }
};

}  // namespace detail

/// Runs the plan's parts with at most `max_in_flight` (1 to 256) in flight; see the header
/// comment. The plan is moved into the operation (keep large state outside it, by reference).
template <file_io Io, part_plan Plan, class Token>
auto async_run_parts(Io& io, Plan plan, unsigned max_in_flight, Token&& token) {
  if (max_in_flight == 0 || max_in_flight > max_parts_in_flight_limit)
    throw std::invalid_argument("kvtier::io::async_run_parts: max_in_flight must be in [1, 256]");
  return boost::asio::async_initiate<Token, typename Plan::signature>(detail::initiate_parts<Io>{&io}, token,
                                                                      std::move(plan), max_in_flight);
}

}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
