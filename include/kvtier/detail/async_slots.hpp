#pragma once
// async_slots: a counting semaphore for coroutines that run on one executor (a strand).
// async_acquire(token) completes with (error_code) once one of the `count` slots is free
// (waiters are served in order); a non-zero code means the wait was cancelled (the token's
// cancellation slot, e.g. a deadline) and no slot was taken. Each slot taken goes back with
// release(), which a slot_guard does on scope exit. Not thread-safe: acquire and release run
// on the executor the slots were made with.
//
// Built on Asio's channel: `count` tokens sit in its buffer; acquiring receives one,
// releasing sends it back. The disk backend's stores share queue_depth / 2 "lanes" this way
// across every batch in flight (l2/disk/impl/disk_store.hpp).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/experimental/channel.hpp>

#include <stdexcept>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace detail {

class async_slots {
 public:
  async_slots(boost::asio::any_io_executor executor, unsigned count) : tokens_(std::move(executor), count) {
    if (count == 0) throw std::invalid_argument("kvtier::detail::async_slots: count must be positive");
    for (unsigned i = 0; i < count; ++i) (void)tokens_.try_send(error_code{});
  }

  /// Completes with (error_code): empty once a slot is taken, else the wait was cancelled.
  template <class Token>
  auto async_acquire(Token&& token) {
    return tokens_.async_receive(std::forward<Token>(token));
  }

  /// Gives back one slot taken by async_acquire.
  void release() noexcept { (void)tokens_.try_send(error_code{}); }

  /// Releases its slot on scope exit (unless moved from).
  class slot_guard {
   public:
    explicit slot_guard(async_slots& owner) noexcept : owner_(&owner) {}
    slot_guard(slot_guard&& o) noexcept : owner_(std::exchange(o.owner_, nullptr)) {}
    slot_guard(const slot_guard&) = delete;
    slot_guard& operator=(const slot_guard&) = delete;
    slot_guard& operator=(slot_guard&&) = delete;
    ~slot_guard() {
      if (owner_ != nullptr) owner_->release();
    }

   private:
    async_slots* owner_;
  };

 private:
  boost::asio::experimental::channel<void(error_code)> tokens_;
};

}  // namespace detail
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
