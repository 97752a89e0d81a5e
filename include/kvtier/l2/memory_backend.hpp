#pragma once
// memory_backend: an L2 backend in RAM with a bandwidth and latency model (like LMCache's
// mock adapter), for tests and benchmarks. Objects carry an XXH3-64 checksum verified on
// load, so corrupt_stored() (used by the fault injector) is caught like on a real device.
//
// The model: one transfer channel per backend. Each key of a load or store occupies the
// channel for bytes / bandwidth after the operation's latency; keys finish one after the
// other, so a deadline cuts a batch after the keys that fit. Data is copied when a key
// "finishes", on the backend's executor: the buffer contract of l2_backend holds trivially.
// Eviction: FIFO by insertion, skipping pinned objects, when a store needs room.
// Key listener (key_announcing_backend): told under the backend's mutex as each store lands
// (stored), each FIFO eviction (evicted), each object a load found corrupt (corrupt) and each
// async_remove (deleted).
// Cancellation (the handler's slot, terminal) ends the wait of the key in transfer: the
// operation completes with operation_aborted (keys already done keep their outcome) and
// copies nothing more.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/detail/coroutine_backend.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

struct memory_backend_options {
  std::string name = "memory";
  std::uint64_t capacity_bytes = std::uint64_t{1} << 30;
  /// Bytes per second of the modelled channel; 0 disables the model (memcpy speed).
  double bandwidth_bytes_per_second = 0;
  /// Added once per operation (lookups included), like a round trip to a remote store.
  std::chrono::nanoseconds latency{0};
};

class memory_backend : public detail::coroutine_backend<memory_backend> {
 public:
  using executor_type = boost::asio::any_io_executor;

  memory_backend(executor_type executor, memory_backend_options options)
      : executor_(std::move(executor)), options_(std::move(options)) {
    if (options_.capacity_bytes == 0) throw std::invalid_argument("memory_backend: capacity_bytes must be > 0");
    if (options_.bandwidth_bytes_per_second < 0)
      throw std::invalid_argument("memory_backend: bandwidth_bytes_per_second must be >= 0");
  }

  memory_backend(const memory_backend&) = delete;
  memory_backend& operator=(const memory_backend&) = delete;

  [[nodiscard]] std::string_view name() const noexcept { return options_.name; }
  [[nodiscard]] executor_type get_executor() const noexcept { return executor_; }

  [[nodiscard]] usage_info usage() const {
    std::lock_guard g(mutex_);
    return {bytes_used_, options_.capacity_bytes, objects_.size()};
  }
  [[nodiscard]] health_info health() const {
    std::lock_guard g(mutex_);
    return health_;
  }
  /// Changes the modelled bandwidth and latency (affects operations that start afterwards).
  void set_model(double bandwidth_bytes_per_second, std::chrono::nanoseconds latency) {
    std::lock_guard g(mutex_);
    options_.bandwidth_bytes_per_second = bandwidth_bytes_per_second;
    options_.latency = latency;
  }

  /// Marks the backend down (every operation answers `unavailable`) or up again.
  void set_health(health_info h) {
    std::lock_guard g(mutex_);
    health_ = std::move(h);
  }

  // async_lookup_and_pin, async_load (also with a load_observer: keys finish one after the
  // other on the modelled channel), async_store, async_remove, async_list (every object,
  // its payload bytes; no channel time): detail/coroutine_backend.hpp.
  static constexpr bool tells_landed_keys = true;
  static constexpr bool lists_objects = true;

  void unpin(std::span<const chunk_key> keys) {
    std::lock_guard g(mutex_);
    for (const auto& k : keys)
      if (auto it = objects_.find(k); it != objects_.end() && it->second.pins > 0) --it->second.pins;
  }

  /// Flips a byte of the stored payload (the checksum is kept): the next load answers
  /// `corrupt` and drops the object. Returns false when the key is absent.
  bool corrupt_stored(const chunk_key& key) {
    std::lock_guard g(mutex_);
    auto it = objects_.find(key);
    if (it == objects_.end() || it->second.size == 0) return false;
    it->second.data[0] ^= std::byte{0xff};
    return true;
  }

  /// Pins currently held on key (for tests).
  [[nodiscard]] std::uint32_t pins(const chunk_key& key) const {
    std::lock_guard g(mutex_);
    auto it = objects_.find(key);
    return it == objects_.end() ? 0 : it->second.pins;
  }

  /// Replaces the key listener (types.hpp; empty: none): called under the backend's mutex.
  void set_key_listener(key_listener l) {
    std::lock_guard g(mutex_);
    listener_ = std::move(l);
  }

 private:
  friend class detail::coroutine_backend<memory_backend>;

  using lookup_result = std::tuple<error_code, bitmap>;
  using batch_tuple = std::tuple<error_code, batch_result>;

  struct object {
    std::unique_ptr<std::byte[]> data;
    std::size_t size = 0;
    std::uint64_t checksum = 0;
    std::uint32_t pins = 0;
    std::list<chunk_key>::iterator fifo_pos;
  };

  std::chrono::nanoseconds latency() const {
    std::lock_guard g(mutex_);
    return options_.latency;
  }

  static error_code unavailable_error() { return make_error_code(errc::backend_unavailable); }

  // Waits until t (or returns at once when t has passed). False when cancelled.
  /// Waits until t on the executor; false when the caller cancelled the operation (before or
  /// during the wait).
  boost::asio::awaitable<bool> wait_until(clock::time_point t) {
    const auto cs = co_await boost::asio::this_coro::cancellation_state;
    if (cs.cancelled() != boost::asio::cancellation_type::none) co_return false;
    if (t <= clock::now()) co_return true;
    boost::asio::steady_timer timer(executor_, t);
    auto [ec] = co_await timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
    co_return !ec;
  }

  // Reserves the channel for `bytes` (plus the operation latency when first); returns when
  // the transfer finishes. Never reserves past the deadline: returns nullopt instead.
  std::optional<clock::time_point> reserve_channel(std::size_t bytes, bool first, deadline d) {
    std::lock_guard g(mutex_);
    const auto start = std::max(clock::now(), channel_free_);
    auto finish = start + (first ? options_.latency : std::chrono::nanoseconds{0});
    if (options_.bandwidth_bytes_per_second > 0)
      finish += std::chrono::nanoseconds(
          static_cast<std::int64_t>(static_cast<double>(bytes) * 1e9 / options_.bandwidth_bytes_per_second));
    if (finish > d) return std::nullopt;
    if (options_.bandwidth_bytes_per_second > 0) channel_free_ = finish;
    return finish;
  }

  boost::asio::awaitable<lookup_result> lookup_impl(std::span<const chunk_key> keys, deadline d) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancelled waits answer operation_aborted
    bitmap found(keys.size());
    if (!health().healthy) co_return lookup_result{unavailable_error(), found};
    const auto t = clock::now() + latency();
    if (t > d) {
      if (!co_await wait_until(d)) co_return lookup_result{boost::asio::error::operation_aborted, found};
      co_return lookup_result{make_error_code(errc::timeout), found};
    }
    if (!co_await wait_until(t)) co_return lookup_result{boost::asio::error::operation_aborted, found};
    std::lock_guard g(mutex_);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (auto it = objects_.find(keys[i]); it != objects_.end()) {
        ++it->second.pins;
        found.set(i);
      }
    }
    co_return lookup_result{error_code{}, found};
  }

  boost::asio::awaitable<batch_tuple> load_impl(std::span<const chunk_key> keys,
                                                std::span<const std::span<std::byte>> destinations, deadline d,
                                                load_observer observer = {}) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancelled waits answer operation_aborted
    batch_result r(keys.size(), key_outcome::timeout);
    if (keys.size() != destinations.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
    if (!health().healthy) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{unavailable_error(), r};
    }
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto finish = reserve_channel(destinations[i].size(), i == 0, d);
      if (!finish) {
        if (!co_await wait_until(d)) co_return batch_tuple{boost::asio::error::operation_aborted, r};
        co_return batch_tuple{make_error_code(errc::timeout), r};
      }
      if (!co_await wait_until(*finish)) co_return batch_tuple{boost::asio::error::operation_aborted, r};
      r.outcomes[i] = copy_out(keys[i], destinations[i]);
      if (observer && r.outcomes[i] == key_outcome::ok) observer(i, destinations[i].size());
    }
    co_return batch_tuple{error_code{}, r};
  }

  key_outcome copy_out(const chunk_key& key, std::span<std::byte> dst) {
    std::lock_guard g(mutex_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return key_outcome::not_found;
    object& o = it->second;
    if (o.size != dst.size()) return key_outcome::rejected;
    if (payload_checksum({o.data.get(), o.size}) != o.checksum) {
      erase(it);  // a wrong byte is never served: drop the object
      tell(key_change::removed, bus::key_removal::corrupt, {&key, 1});
      return key_outcome::corrupt;
    }
    std::memcpy(dst.data(), o.data.get(), o.size);
    return key_outcome::ok;
  }

  boost::asio::awaitable<batch_tuple> store_impl(std::span<const chunk_key> keys,
                                                 std::span<const std::span<const std::byte>> sources, deadline d) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancelled waits answer operation_aborted
    batch_result r(keys.size(), key_outcome::timeout);
    if (keys.size() != sources.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
    if (!health().healthy) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{unavailable_error(), r};
    }
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto finish = reserve_channel(sources[i].size(), i == 0, d);
      if (!finish) {
        if (!co_await wait_until(d)) co_return batch_tuple{boost::asio::error::operation_aborted, r};
        co_return batch_tuple{make_error_code(errc::timeout), r};
      }
      if (!co_await wait_until(*finish)) co_return batch_tuple{boost::asio::error::operation_aborted, r};
      r.outcomes[i] = copy_in(keys[i], sources[i]);
    }
    co_return batch_tuple{error_code{}, r};
  }

  key_outcome copy_in(const chunk_key& key, std::span<const std::byte> src) {
    std::lock_guard g(mutex_);
    if (objects_.contains(key)) return key_outcome::exists;
    if (src.size() > options_.capacity_bytes) return key_outcome::no_space;
    // FIFO eviction of unpinned objects until the new one fits.
    std::vector<chunk_key> evicted;
    for (auto it = fifo_.begin(); bytes_used_ + src.size() > options_.capacity_bytes && it != fifo_.end();) {
      auto obj = objects_.find(*it++);
      if (obj->second.pins > 0) continue;
      if (listener_) evicted.push_back(obj->first);
      erase(obj);
    }
    tell(key_change::removed, bus::key_removal::evicted, evicted);
    if (bytes_used_ + src.size() > options_.capacity_bytes) return key_outcome::no_space;
    object o;
    o.data = std::make_unique_for_overwrite<std::byte[]>(src.size());
    o.size = src.size();
    std::memcpy(o.data.get(), src.data(), src.size());
    o.checksum = payload_checksum(src);
    o.fifo_pos = fifo_.insert(fifo_.end(), key);
    bytes_used_ += o.size;
    objects_.emplace(key, std::move(o));
    tell(key_change::stored, {}, {&key, 1});
    return key_outcome::ok;
  }

  boost::asio::awaitable<batch_tuple> remove_impl(std::span<const chunk_key> keys, deadline) {
    co_await boost::asio::this_coro::throw_if_cancelled(false);  // cancelled waits answer operation_aborted
    batch_result r(keys.size(), key_outcome::not_found);
    if (!health().healthy) {
      std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::unavailable);
      co_return batch_tuple{unavailable_error(), r};
    }
    std::lock_guard g(mutex_);
    std::vector<chunk_key> removed;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto it = objects_.find(keys[i]);
      if (it == objects_.end()) continue;
      if (it->second.pins > 0) {
        r.outcomes[i] = key_outcome::rejected;  // pinned by an in-flight prefetch
        continue;
      }
      erase(it);
      if (listener_) removed.push_back(keys[i]);
      r.outcomes[i] = key_outcome::ok;
    }
    tell(key_change::removed, bus::key_removal::deleted, removed);
    co_return batch_tuple{error_code{}, r};
  }

  boost::asio::awaitable<std::tuple<error_code, std::vector<listed_object>>> list_impl(key_filter filter, deadline) {
    std::vector<listed_object> out;
    if (!health().healthy) co_return std::tuple{unavailable_error(), std::move(out)};
    std::lock_guard g(mutex_);
    for (const auto& [k, o] : objects_)
      if (!filter || filter(k)) out.push_back({k, o.size});
    co_return std::tuple{error_code{}, std::move(out)};
  }

  // Tells the listener, when there is one and keys is not empty (under mutex_).
  void tell(key_change c, bus::key_removal why, std::span<const chunk_key> keys) const {
    if (listener_ && !keys.empty()) listener_(c, why, keys);
  }

  void erase(std::unordered_map<chunk_key, object, chunk_key_hash>::iterator it) {
    bytes_used_ -= it->second.size;
    fifo_.erase(it->second.fifo_pos);
    objects_.erase(it);
  }

  executor_type executor_;
  memory_backend_options options_;
  mutable std::mutex mutex_;
  std::unordered_map<chunk_key, object, chunk_key_hash> objects_;
  std::list<chunk_key> fifo_;
  std::uint64_t bytes_used_ = 0;
  clock::time_point channel_free_{};
  health_info health_;
  key_listener listener_;
};

static_assert(corruptible_backend<memory_backend> && listing_backend<memory_backend> &&
              key_announcing_backend<memory_backend>);

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
