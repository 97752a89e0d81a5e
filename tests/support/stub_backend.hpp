#pragma once
// An L2 backend for tests that answers when the test says so, so that a test can check what
// the cache or the server does while an operation is pending, without any timing. Objects
// live in memory (put). Each kind of operation is answered at once or held (stub_options):
//   lookups  find the keys it holds; held ones wait for release_lookups() (when_lookups_held
//            says when n have arrived);
//   loads    copy the keys it holds (ok; the others not_found); a held load (one at a time)
//            waits for the test to land or fail its keys one at a time and complete it (an
//            observable_load_backend: it tells each key as it lands, and a verified prefix
//            of a key when the test says so: verify);
//   stores and removes succeed at once and change nothing.
// A completion runs on the backend's executor, then on the handler's associated executor.

#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>

#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier::test {

/// What a stub_backend holds for the test, and its name.
struct stub_options {
  std::string_view name = "stub";  ///< what name() says (a string literal)
  bool hold_lookups = false;       ///< lookups wait for release_lookups()
  bool hold_loads = false;         ///< loads wait for land / fail / complete
};

class stub_backend {
 public:
  using executor_type = boost::asio::any_io_executor;

  explicit stub_backend(executor_type ex, stub_options o = {}) : ex_(std::move(ex)), options_(o) {}

  void put(const chunk_key& k, std::vector<std::byte> bytes) { objects_[k] = std::move(bytes); }

  [[nodiscard]] std::string_view name() const { return options_.name; }
  [[nodiscard]] executor_type get_executor() const { return ex_; }
  [[nodiscard]] l2::usage_info usage() const { return {}; }
  [[nodiscard]] l2::health_info health() const { return {}; }
  void unpin(std::span<const chunk_key>) {}

  template <class Token>
  auto async_lookup_and_pin(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, bitmap)>(
        [this, keys](auto handler) {
          if (!options_.hold_lookups) return answer(std::move(handler), error_code{}, found(keys));
          held_lookups_.push_back(
              {std::vector<chunk_key>(keys.begin(), keys.end()), lookup_handler(std::move(handler))});
          ++lookups_arrived_;
          notify_lookups_held();
        },
        token);
  }

  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> dst, l2::deadline d,
                  Token&& token) {
    return async_load(keys, dst, d, l2::load_observer{}, std::forward<Token>(token));
  }
  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> dst, l2::deadline,
                  l2::load_observer observer, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, l2::batch_result)>(
        [this, keys, dst](auto handler, l2::load_observer o) {
          pending_load l{std::vector<chunk_key>(keys.begin(), keys.end()),
                         std::vector<std::span<std::byte>>(dst.begin(), dst.end()), std::move(o),
                         batch_handler(std::move(handler)), l2::batch_result(keys.size())};
          if (options_.hold_loads) {
            load_ = std::move(l);
            return;
          }
          boost::asio::post(ex_, [this, l = std::move(l)]() mutable {
            for (std::size_t j = 0; j < l.keys.size(); ++j) {
              if (objects_.contains(l.keys[j]))
                land(l, j);
              else
                l.result.outcomes[j] = l2::key_outcome::not_found;
            }
            answer(std::move(l.handler), error_code{}, std::move(l.result));
          });
        },
        token, std::move(observer));
  }

  template <class Token>
  auto async_store(std::span<const chunk_key> keys, std::span<const std::span<const std::byte>>, l2::deadline,
                   Token&& token) {
    return succeed(keys.size(), std::forward<Token>(token));
  }
  template <class Token>
  auto async_remove(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return succeed(keys.size(), std::forward<Token>(token));
  }

  // --- held lookups (stub_options::hold_lookups) -------------------------------------------------

  /// Calls f once (on the backend's executor) when `n` lookups have arrived in all.
  void when_lookups_held(std::size_t n, std::function<void()> f) {
    boost::asio::post(ex_, [this, n, f = std::move(f)] {
      lookups_wanted_ = n;
      on_lookups_held_ = f;
      notify_lookups_held();
    });
  }
  /// Answers every held lookup (with the keys it holds now), on the backend's executor.
  void release_lookups() {
    boost::asio::post(ex_, [this] {
      auto held = std::move(held_lookups_);
      held_lookups_.clear();
      for (auto& [keys, h] : held) std::move(h)(error_code{}, found(keys));
    });
  }

  // --- held loads (stub_options::hold_loads) -----------------------------------------------------

  /// Whether a load is waiting for the test, and its batch size.
  [[nodiscard]] bool loading() const { return load_.has_value(); }
  [[nodiscard]] std::size_t batch() const { return load_ ? load_->keys.size() : 0; }

  /// Lands key j of the pending load (copies its bytes, tells the observer).
  void land(std::size_t j) { land(*load_, j); }
  /// Verifies the first `bytes` bytes of key j of the pending load (copies them, tells the
  /// observer that prefix), as the disk backend does segment by segment.
  void verify(std::size_t j, std::size_t bytes) {
    std::memcpy(load_->dst[j].data(), objects_.at(load_->keys[j]).data(), bytes);
    if (load_->observer) load_->observer(j, bytes);
  }
  /// Writes `bytes` of garbage at `offset` of key j's destination (a read still landing
  /// there), telling nobody.
  void scribble(std::size_t j, std::size_t offset, std::size_t bytes) {
    std::memset(load_->dst[j].data() + offset, 0xee, bytes);
  }
  /// Fails key j of the pending load (told at the completion only, as a backend does).
  void fail(std::size_t j) { load_->result.outcomes[j] = l2::key_outcome::io_error; }
  /// Completes the pending load: keys neither landed nor failed answer timeout.
  void complete() {
    auto l = std::move(*load_);
    load_.reset();
    answer(std::move(l.handler), error_code{}, std::move(l.result));
  }

 private:
  using lookup_handler = boost::asio::any_completion_handler<void(error_code, bitmap)>;
  using batch_handler = boost::asio::any_completion_handler<void(error_code, l2::batch_result)>;

  struct held_lookup {
    std::vector<chunk_key> keys;
    lookup_handler handler;
  };
  struct pending_load {
    std::vector<chunk_key> keys;
    std::vector<std::span<std::byte>> dst;
    l2::load_observer observer;
    batch_handler handler;
    l2::batch_result result;
  };

  void land(pending_load& l, std::size_t j) {
    const auto& bytes = objects_.at(l.keys[j]);
    std::memcpy(l.dst[j].data(), bytes.data(), bytes.size());
    l.result.outcomes[j] = l2::key_outcome::ok;
    if (l.observer) l.observer(j, l.dst[j].size());
  }

  /// Which of `keys` it holds.
  [[nodiscard]] bitmap found(std::span<const chunk_key> keys) const {
    bitmap b(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (objects_.contains(keys[i])) b.set(i);
    return b;
  }

  /// Completes `h` with `args`: posted to the backend's executor, then dispatched to the
  /// handler's own.
  template <class Handler, class... Args>
  void answer(Handler h, Args... args) {
    boost::asio::post(ex_, [h = std::move(h), ... args = std::move(args)]() mutable {
      auto ex = boost::asio::get_associated_executor(h);
      boost::asio::dispatch(
          ex, [h = std::move(h), ... args = std::move(args)]() mutable { std::move(h)(std::move(args)...); });
    });
  }

  template <class Token>
  auto succeed(std::size_t n, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, l2::batch_result)>(
        [this, n](auto handler) {
          this->answer(std::move(handler), error_code{}, l2::batch_result(n, l2::key_outcome::ok));
        },
        token);
  }

  void notify_lookups_held() {
    if (on_lookups_held_ && lookups_arrived_ >= lookups_wanted_) std::exchange(on_lookups_held_, nullptr)();
  }

  executor_type ex_;
  stub_options options_;
  std::map<chunk_key, std::vector<std::byte>> objects_;
  std::vector<held_lookup> held_lookups_;
  std::size_t lookups_arrived_ = 0;
  std::size_t lookups_wanted_ = 0;
  std::function<void()> on_lookups_held_;
  std::optional<pending_load> load_;
};

}  // namespace kvtier::test
