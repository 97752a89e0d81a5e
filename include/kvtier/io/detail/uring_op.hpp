#pragma once
// The intrusive base of every io_uring operation (stdexec's style: two function pointers, no
// vtable, no per-op heap node) and the list that threads ops through the ring's queues.
// The SQE's user_data is the op's address; the ring's own requests (cancels) use 0.

#include <kvtier/config.hpp>

#include <liburing.h>

#include <cstddef>
#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace io {
namespace detail {

class uring_core;

struct uring_op {
  /// Fills the SQE (never enters the kernel) and sets its user_data to the op.
  using prepare_fn = void (*)(uring_op*, ::io_uring_sqe*) noexcept;
  /// Frees the op and hands `res` (a CQE result: value or -errno) to the handler: inline
  /// when `post` is false and the handler's executor is the ring's, else posted. Throws
  /// whatever the handler throws; everything of the op is released before the handler runs.
  using complete_fn = void (*)(uring_op*, long res, bool post);

  /// Where an op is. Only the ring's thread reads or writes these fields.
  enum class state : std::uint8_t {
    queued,     ///< waiting in the ring's pending queue for room (no SQE yet)
    submitted,  ///< has an SQE (prepared or in the kernel): only its CQE may complete it
    ready,      ///< finished without a CQE (cancelled while queued, refused at shutdown)
  };

  uring_op(prepare_fn p, complete_fn c) noexcept : prepare(p), complete(c) {}

  prepare_fn prepare;
  complete_fn complete;
  uring_op* prev = nullptr;
  uring_op* next = nullptr;
  long res = 0;                     ///< the result of a `ready` op
  state st = state::queued;
  bool cancel_requested = false;    ///< a cancel was asked for (an ASYNC_CANCEL SQE is owed or sent)
  bool cancel_sent = false;         ///< the ASYNC_CANCEL SQE for this op was prepared
};

/// A doubly linked FIFO of ops threaded through their prev/next fields: O(1) push, pop and
/// removal, no allocation. An op is in at most one list.
class op_list {
 public:
  [[nodiscard]] bool empty() const noexcept { return head_ == nullptr; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] uring_op* front() const noexcept { return head_; }

  void push_back(uring_op* op) noexcept {
    op->next = nullptr;
    op->prev = tail_;
    if (tail_ != nullptr) tail_->next = op;
    else head_ = op;
    tail_ = op;
    ++size_;
  }

  void remove(uring_op* op) noexcept {
    if (op->prev != nullptr) op->prev->next = op->next;
    else head_ = op->next;
    if (op->next != nullptr) op->next->prev = op->prev;
    else tail_ = op->prev;
    op->prev = op->next = nullptr;
    --size_;
  }

  uring_op* pop_front() noexcept {
    uring_op* op = head_;
    if (op != nullptr) remove(op);
    return op;
  }

  /// Moves every op of `o` to the end of this list.
  void splice_back(op_list& o) noexcept {
    while (uring_op* op = o.pop_front()) push_back(op);
  }

 private:
  uring_op* head_ = nullptr;
  uring_op* tail_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace detail
}  // namespace io
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
