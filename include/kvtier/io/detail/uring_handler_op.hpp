#pragma once
// uring_handler_op<Desc, Handler>: one io_uring operation (Desc, one type per opcode, see
// file_ops.hpp) bound to its completion handler. Allocated with the handler's associated
// allocator, or, when it has none (callbacks, use_awaitable), from the ring's op_recycler,
// so steady state takes no malloc. Holds work on the handler's executor while in flight
// and hooks the handler's cancellation slot to the ring's cancel.

#include <kvtier/config.hpp>
#include <kvtier/io/detail/op_recycler.hpp>
#include <kvtier/io/detail/uring_core.hpp>
#include <kvtier/io/detail/uring_op.hpp>

#include <boost/asio/associated_allocator.hpp>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

/// A handler with its arguments, ready to be posted or dispatched as a nullary function.
/// Keeps the handler's allocator (so Asio's own queueing uses it).
template <class Handler, class Args>
class bound_handler {
 public:
  using allocator_type = boost::asio::associated_allocator_t<Handler>;

  bound_handler(Handler&& h, Args&& args) : handler_(std::move(h)), args_(std::move(args)) {}

  [[nodiscard]] allocator_type get_allocator() const noexcept {
    return boost::asio::get_associated_allocator(handler_);
  }

  void operator()() { std::apply(std::move(handler_), std::move(args_)); }

 private:
  Handler handler_;
  Args args_;
};

/// Whether a handler's executor is the ring's own, so the ring may call it inline when it
/// completes ops from inside that executor (what dispatch would do, minus a type-erased hop).
template <class HandlerExecutor>
[[nodiscard]] bool same_executor(const HandlerExecutor& h, const uring_core::executor_type& ring) noexcept {
  if constexpr (std::is_same_v<HandlerExecutor, uring_core::executor_type>) return h == ring;
  else return false;
}

template <class Desc, class Handler>
class uring_handler_op final : public uring_op {
 public:
  using io_executor = uring_core::executor_type;
  using default_allocator = recycling_op_allocator<void>;
  using allocator_type = boost::asio::associated_allocator_t<Handler, default_allocator>;
  using self_allocator = typename std::allocator_traits<allocator_type>::template rebind_alloc<uring_handler_op>;
  using self_traits = std::allocator_traits<self_allocator>;
  using handler_executor = boost::asio::associated_executor_t<Handler, io_executor>;
  using work_guard = boost::asio::executor_work_guard<handler_executor>;
  using slot_type = boost::asio::associated_cancellation_slot_t<Handler>;

  /// Allocates and builds the op; the caller hands it to uring_core::start.
  template <class H>
  [[nodiscard]] static uring_handler_op* create(H&& handler, uring_core& core, const Desc& desc) {
    allocator_type alloc = boost::asio::get_associated_allocator(handler, default_allocator(core.recycler()));
    self_allocator a(alloc);
    uring_handler_op* p = self_traits::allocate(a, 1);
    try {
      ::new (static_cast<void*>(p)) uring_handler_op(std::forward<H>(handler), core, desc, alloc);
    } catch (...) {
      self_traits::deallocate(a, p, 1);
      throw;
    }
    return p;
  }

  uring_handler_op(const uring_handler_op&) = delete;
  uring_handler_op& operator=(const uring_handler_op&) = delete;

 private:
  template <class H>
  uring_handler_op(H&& handler, uring_core& core, const Desc& desc, const allocator_type& alloc)
      : uring_op(&do_prepare, &do_complete),
        desc_(desc),
        handler_(std::forward<H>(handler)),
        alloc_(alloc),
        work_(boost::asio::get_associated_executor(handler_, core.get_executor())),
        same_executor_(same_executor(work_.get_executor(), core.get_executor())),
        slot_(boost::asio::get_associated_cancellation_slot(handler_)) {
    if (slot_.is_connected()) slot_.template emplace<uring_cancel_handler>(&core, this);
  }

  ~uring_handler_op() = default;

  static void do_prepare(uring_op* base, ::io_uring_sqe* sqe) noexcept {
    auto* self = static_cast<uring_handler_op*>(base);
    self->desc_.prepare(sqe);
    ::io_uring_sqe_set_data(sqe, base);
  }

  static void do_complete(uring_op* base, long res, bool post) {
    auto* self = static_cast<uring_handler_op*>(base);
    if (self->slot_.is_connected()) self->slot_.clear();
    // Move out everything the upcall needs, then free the op before it runs (Asio's rule:
    // the handler may start the next op, which can then reuse this memory).
    self_allocator a(self->alloc_);
    Handler handler(std::move(self->handler_));
    work_guard work(std::move(self->work_));
    const bool call_inline = !post && self->same_executor_;
    self->~uring_handler_op();
    self_traits::deallocate(a, self, 1);

    auto args = Desc::args(res);
    if (call_inline) {
      std::apply(std::move(handler), std::move(args));
      return;
    }
    bound_handler<Handler, decltype(args)> bound(std::move(handler), std::move(args));
    if (post) boost::asio::post(work.get_executor(), std::move(bound));
    else boost::asio::dispatch(work.get_executor(), std::move(bound));
  }

  Desc desc_;
  Handler handler_;
  allocator_type alloc_;
  work_guard work_;
  bool same_executor_;
  slot_type slot_;
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
