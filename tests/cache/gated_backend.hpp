#pragma once
// An L2 backend for tests whose loads land only when the test says so, one key at a time
// (an observable_load_backend: it tells each key as it lands), so a test can check what the
// cache does between two landings without any timing. Objects live in memory.

#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>

#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace kvtier::test {

class gated_backend {
 public:
  using executor_type = boost::asio::any_io_executor;
  using batch_handler = boost::asio::any_completion_handler<void(error_code, l2::batch_result)>;

  explicit gated_backend(executor_type ex) : ex_(std::move(ex)) {}

  void put(const chunk_key& k, std::vector<std::byte> bytes) { objects_[k] = std::move(bytes); }

  [[nodiscard]] std::string_view name() const { return "gated"; }
  [[nodiscard]] executor_type get_executor() const { return ex_; }
  [[nodiscard]] l2::usage_info usage() const { return {}; }
  [[nodiscard]] l2::health_info health() const { return {}; }
  void unpin(std::span<const chunk_key>) {}

  template <class Token>
  auto async_lookup_and_pin(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, bitmap)>(
        [this, keys](auto handler) {
          bitmap found(keys.size());
          for (std::size_t i = 0; i < keys.size(); ++i)
            if (objects_.contains(keys[i])) found.set(i);
          boost::asio::post(ex_, [h = std::move(handler), found]() mutable {
            auto ex = boost::asio::get_associated_executor(h);
            boost::asio::dispatch(ex, [h = std::move(h), found]() mutable { std::move(h)(error_code{}, found); });
          });
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
          load_ = pending_load{std::vector<chunk_key>(keys.begin(), keys.end()),
                               std::vector<std::span<std::byte>>(dst.begin(), dst.end()), std::move(o),
                               batch_handler(std::move(handler)), l2::batch_result(keys.size())};
        },
        token, std::move(observer));
  }

  template <class Token>
  auto async_store(std::span<const chunk_key>, std::span<const std::span<const std::byte>> src, l2::deadline,
                   Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, l2::batch_result)>(
        [this, n = src.size()](auto handler) {
          boost::asio::post(ex_, [h = std::move(handler), n]() mutable {
            std::move(h)(error_code{}, l2::batch_result(n, l2::key_outcome::ok));
          });
        },
        token);
  }
  template <class Token>
  auto async_remove(std::span<const chunk_key> keys, l2::deadline, Token&& token) {
    return async_store(keys, {}, {}, std::forward<Token>(token));
  }

  /// Whether a load is waiting for the test, and its batch size.
  [[nodiscard]] bool loading() const { return load_.has_value(); }
  [[nodiscard]] std::size_t batch() const { return load_ ? load_->keys.size() : 0; }

  /// Lands key j of the pending load (copies its bytes, tells the observer).
  void land(std::size_t j) {
    auto& l = *load_;
    const auto& bytes = objects_.at(l.keys[j]);
    std::memcpy(l.dst[j].data(), bytes.data(), bytes.size());
    l.result.outcomes[j] = l2::key_outcome::ok;
    if (l.observer) l.observer(j);
  }
  /// Fails key j of the pending load (told at the completion only, as a backend does).
  void fail(std::size_t j) { load_->result.outcomes[j] = l2::key_outcome::io_error; }
  /// Completes the pending load: keys neither landed nor failed answer timeout.
  void complete() {
    auto l = std::move(*load_);
    load_.reset();
    boost::asio::post(ex_, [h = std::move(l.handler), r = std::move(l.result)]() mutable {
      auto ex = boost::asio::get_associated_executor(h);
      boost::asio::dispatch(
          ex, [h = std::move(h), r = std::move(r)]() mutable { std::move(h)(error_code{}, std::move(r)); });
    });
  }

 private:
  struct pending_load {
    std::vector<chunk_key> keys;
    std::vector<std::span<std::byte>> dst;
    l2::load_observer observer;
    batch_handler handler;
    l2::batch_result result;
  };
  executor_type ex_;
  std::map<chunk_key, std::vector<std::byte>> objects_;
  std::optional<pending_load> load_;
};

}  // namespace kvtier::test
