#pragma once
// fault_injecting_backend<Backend>: wraps any l2_backend and, on command, fails, delays,
// corrupts or hangs chosen operations (fault_kind), for the tests (tests/l2, tests/cache).
// Call release_hung() before destroying it while operations hang. docs/pipelines.md, "L2
// backends", holds what each fault does and how cancellation passes through.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/detail/coroutine_backend.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

enum class fault_op : std::uint8_t { lookup, load, store, remove };
enum class fault_kind : std::uint8_t { fail, delay, corrupt, hang };

struct fault {
  fault_op op = fault_op::load;
  fault_kind kind = fault_kind::fail;
  /// Keys the fault applies to; empty: every key (and, for fail, the whole operation).
  std::function<bool(const chunk_key&)> match = {};
  key_outcome outcome = key_outcome::io_error;       ///< fail: per-key outcome
  error_code error = make_error_code(errc::io_error);  ///< fail without a filter: operation error
  std::chrono::nanoseconds delay{0};                  ///< delay
  int times = -1;                                     ///< operations affected; -1: until clear()
};

template <l2_backend Backend>
class fault_injecting_backend : public detail::coroutine_backend<fault_injecting_backend<Backend>> {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Wraps an existing backend (not owned; it must outlive the wrapper).
  explicit fault_injecting_backend(Backend& inner) : inner_(&inner) {}

  fault_injecting_backend(const fault_injecting_backend&) = delete;
  fault_injecting_backend& operator=(const fault_injecting_backend&) = delete;

  [[nodiscard]] Backend& inner() noexcept { return *inner_; }
  [[nodiscard]] std::string_view name() const { return inner_->name(); }
  [[nodiscard]] executor_type get_executor() const { return inner_->get_executor(); }
  [[nodiscard]] usage_info usage() const { return inner_->usage(); }
  [[nodiscard]] health_info health() const { return inner_->health(); }

  void inject(fault f) {
    std::lock_guard g(mutex_);
    faults_.push_back(std::move(f));
  }
  void clear() {
    std::lock_guard g(mutex_);
    faults_.clear();
  }
  /// Lets every hung operation proceed.
  void release_hung() {
    std::lock_guard g(mutex_);
    for (auto* t : hung_) t->cancel();
  }
  /// Operations currently hanging.
  [[nodiscard]] std::size_t hung() const {
    std::lock_guard g(mutex_);
    return hung_.size();
  }

  // async_lookup_and_pin, async_load, async_store, async_remove, async_list (when Backend
  // lists): detail/coroutine_backend.hpp.
  static constexpr bool lists_objects = listing_backend<Backend>;
  void unpin(std::span<const chunk_key> keys) { inner_->unpin(keys); }

  /// The wrapped backend's key listener (key_announcing_backend): the index is the inner
  /// backend's, and so are its changes (a failed or hung operation changes nothing).
  void set_key_listener(key_listener l)
    requires key_announcing_backend<Backend>
  {
    inner_->set_key_listener(std::move(l));
  }

 private:
  friend class detail::coroutine_backend<fault_injecting_backend>;

  using lookup_tuple = std::tuple<error_code, bitmap>;
  using batch_tuple = std::tuple<error_code, batch_result>;

  // The faults that apply to this operation (consuming one use of each).
  std::vector<fault> take(fault_op op) {
    std::lock_guard g(mutex_);
    std::vector<fault> out;
    for (auto it = faults_.begin(); it != faults_.end();) {
      if (it->op != op) {
        ++it;
        continue;
      }
      out.push_back(*it);
      if (it->times > 0 && --it->times == 0) it = faults_.erase(it);
      else ++it;
    }
    return out;
  }

  static bool matches(const fault& f, const chunk_key& k) { return !f.match || f.match(k); }

  static const fault* find(const std::vector<fault>& fs, fault_kind kind) {
    for (const auto& f : fs)
      if (f.kind == kind) return &f;
    return nullptr;
  }

  boost::asio::awaitable<void> hang_if(const std::vector<fault>& fs) {
    if (!find(fs, fault_kind::hang)) co_return;
    // A stuck device ignores the caller's cancellation; only release_hung() moves it on.
    co_await boost::asio::this_coro::reset_cancellation_state(boost::asio::disable_cancellation());
    boost::asio::steady_timer t(get_executor(), boost::asio::steady_timer::time_point::max());
    {
      std::lock_guard g(mutex_);
      hung_.push_back(&t);
    }
    co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    std::lock_guard g(mutex_);
    hung_.remove(&t);
  }

  /// A delay fault's wait; cut short (and skipped) once the caller cancelled the operation.
  boost::asio::awaitable<void> delay_if(const std::vector<fault>& fs) {
    const fault* f = find(fs, fault_kind::delay);
    if (f == nullptr) co_return;
    const boost::asio::cancellation_state cs = co_await boost::asio::this_coro::cancellation_state;
    if (cs.cancelled() != boost::asio::cancellation_type::none) co_return;
    boost::asio::steady_timer t(get_executor(), f->delay);
    co_await t.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  }

  void corrupt_if(const std::vector<fault>& fs, std::span<const chunk_key> keys) {
    if constexpr (corruptible_backend<Backend>) {
      if (const fault* f = find(fs, fault_kind::corrupt))
        for (const auto& k : keys)
          if (matches(*f, k)) inner_->corrupt_stored(k);
    }
  }

  // Indices of keys the fail fault leaves to the inner backend; whole == true when the fault
  // has no filter (the operation fails as a whole).
  struct split {
    const fault* fail = nullptr;
    bool whole = false;
    std::vector<std::size_t> passed;

    /// The elements of a per-key span (the keys, or their buffers) that passed: what the
    /// inner backend is given.
    template <class T>
    [[nodiscard]] std::vector<T> of(std::span<const T> all) const {
      std::vector<T> v;
      v.reserve(passed.size());
      for (auto i : passed) v.push_back(all[i]);
      return v;
    }
    /// Puts the inner backend's outcomes of the passed keys in their places of r.
    void merge(const batch_result& sub, batch_result& r) const {
      for (std::size_t j = 0; j < passed.size(); ++j)
        r.outcomes[passed[j]] = j < sub.size() ? sub.outcomes[j] : key_outcome::timeout;
    }
  };
  static split split_keys(const std::vector<fault>& fs, std::span<const chunk_key> keys) {
    split s;
    s.fail = find(fs, fault_kind::fail);
    s.whole = s.fail && !s.fail->match;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (!s.fail || (!s.whole && !matches(*s.fail, keys[i]))) s.passed.push_back(i);
    return s;
  }

  boost::asio::awaitable<lookup_tuple> lookup_impl(std::span<const chunk_key> keys, deadline d) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancellation: docs/pipelines.md
    const auto fs = take(fault_op::lookup);
    co_await hang_if(fs);
    const split s = split_keys(fs, keys);
    bitmap found(keys.size());
    if (s.whole) {
      co_await delay_if(fs);
      co_return lookup_tuple{s.fail->error, found};
    }
    const auto sub = s.of(keys);
    auto [ec, sub_found] = co_await inner_->async_lookup_and_pin(sub, d, boost::asio::as_tuple(boost::asio::use_awaitable));
    for (std::size_t j = 0; j < s.passed.size(); ++j)
      if (sub_found.size() > j && sub_found.test(j)) found.set(s.passed[j]);
    co_await delay_if(fs);
    co_return lookup_tuple{ec, found};
  }

  boost::asio::awaitable<batch_tuple> load_impl(std::span<const chunk_key> keys,
                                                std::span<const std::span<std::byte>> destinations, deadline d) {
    return pass_batch(fault_op::load, keys, destinations, [this, d](const auto& sub_keys, const auto& sub_dst) {
      return inner_->async_load(sub_keys, sub_dst, d, boost::asio::as_tuple(boost::asio::use_awaitable));
    });
  }

  boost::asio::awaitable<batch_tuple> store_impl(std::span<const chunk_key> keys,
                                                 std::span<const std::span<const std::byte>> sources, deadline d) {
    return pass_batch(fault_op::store, keys, sources, [this, d](const auto& sub_keys, const auto& sub_src) {
      return inner_->async_store(sub_keys, sub_src, d, boost::asio::as_tuple(boost::asio::use_awaitable));
    });
  }

  /// A load or store: the faults of its kind apply (a load's corruption before it reads, a
  /// store's after it wrote), the keys they pass go to the inner backend with their buffers.
  template <class Buffer, class Inner>
  boost::asio::awaitable<batch_tuple> pass_batch(fault_op op, std::span<const chunk_key> keys,
                                                 std::span<const Buffer> buffers, Inner inner) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancellation: docs/pipelines.md
    const auto fs = take(op);
    co_await hang_if(fs);
    if (op == fault_op::load) corrupt_if(fs, keys);
    const split s = split_keys(fs, keys);
    batch_result r(keys.size(), s.fail ? s.fail->outcome : key_outcome::timeout);
    if (s.whole) {
      co_await delay_if(fs);
      co_return batch_tuple{s.fail->error, r};
    }
    const auto sub_keys = s.of(keys);
    const auto sub_buffers = s.of(buffers);
    auto [ec, sub] = co_await inner(sub_keys, sub_buffers);
    s.merge(sub, r);
    if (op == fault_op::store) corrupt_if(fs, sub_keys);
    co_await delay_if(fs);
    co_return batch_tuple{ec, r};
  }

  boost::asio::awaitable<batch_tuple> remove_impl(std::span<const chunk_key> keys, deadline d) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancellation: docs/pipelines.md
    const auto fs = take(fault_op::remove);
    co_await hang_if(fs);
    const split s = split_keys(fs, keys);
    batch_result r(keys.size(), s.fail ? s.fail->outcome : key_outcome::timeout);
    if (s.whole) co_return batch_tuple{s.fail->error, r};
    const auto sub_keys = s.of(keys);
    auto [ec, sub] = co_await inner_->async_remove(sub_keys, d, boost::asio::as_tuple(boost::asio::use_awaitable));
    s.merge(sub, r);
    co_await delay_if(fs);
    co_return batch_tuple{ec, r};
  }

  boost::asio::awaitable<std::tuple<error_code, std::vector<listed_object>>> list_impl(key_filter filter, deadline d)
    requires listing_backend<Backend>
  {
    co_return co_await inner_->async_list(std::move(filter), d, boost::asio::as_tuple(boost::asio::use_awaitable));
  }

  Backend* inner_;
  mutable std::mutex mutex_;
  std::vector<fault> faults_;
  std::list<boost::asio::steady_timer*> hung_;
};

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
