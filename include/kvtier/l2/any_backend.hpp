#pragma once
// any_backend: a type-erased l2_backend. The server builds its L2 backends from run-time
// configuration (JSON), so the pipelines hold a vector of these. The erasure costs one
// virtual call and one type-erased handler per batch operation, nothing per key.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/detail/async.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

class any_backend {
 public:
  using executor_type = boost::asio::any_io_executor;
  using lookup_handler = boost::asio::any_completion_handler<void(error_code, bitmap)>;
  using batch_handler = boost::asio::any_completion_handler<void(error_code, batch_result)>;
  using list_handler = boost::asio::any_completion_handler<void(error_code, std::vector<listed_object>)>;

  /// Shares ownership of `backend`; keep the shared_ptr to reach the concrete type.
  template <l2_backend B>
  explicit any_backend(std::shared_ptr<B> backend) : impl_(std::make_shared<model<B>>(std::move(backend))) {}

  [[nodiscard]] std::string_view name() const { return impl_->name(); }
  [[nodiscard]] executor_type get_executor() const { return impl_->executor(); }
  [[nodiscard]] usage_info usage() const { return impl_->usage(); }
  [[nodiscard]] health_info health() const { return impl_->health(); }
  void unpin(std::span<const chunk_key> keys) { impl_->unpin(keys); }

  template <class Token>
  auto async_lookup_and_pin(std::span<const chunk_key> keys, deadline d, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, bitmap)>(
        [impl = impl_, keys, d](auto handler) { impl->lookup(keys, d, lookup_handler(std::move(handler))); }, token);
  }
  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
                  Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, batch_result)>(
        [impl = impl_, keys, destinations, d](auto handler) {
          impl->load(keys, destinations, d, batch_handler(std::move(handler)));
        },
        token);
  }
  /// async_load telling each key as it lands (load_observer); backends that cannot tell
  /// settle every key at the completion only (the observer is then never called).
  template <class Token>
  auto async_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
                  load_observer observer, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, batch_result)>(
        [impl = impl_, keys, destinations, d](auto handler, load_observer o) {
          impl->load_observed(keys, destinations, d, std::move(o), batch_handler(std::move(handler)));
        },
        token, std::move(observer));
  }
  /// Registers `region` (the L1 arena) for faster reads into it where the backend can
  /// (buffer_registering_backend: the disk backend's io_uring fixed buffers); call before the
  /// first operation. errc::unsupported from a backend that has nothing to register.
  error_code register_buffers(std::span<std::byte> region) { return impl_->register_buffers(region); }
  /// Registers `region` next to what add_buffers() registered before, pinning only it (the
  /// disk backend: io::uring_context::add_buffers), from the backend's executor: a large
  /// arena a piece per turn. errc::unsupported from a backend that cannot (then
  /// register_buffers the whole arena) or has nothing to register.
  error_code add_buffers(std::span<std::byte> region) { return impl_->add_buffers(region); }
  /// Whether async_load with an observer tells keys as they land.
  [[nodiscard]] bool observes_loads() const noexcept { return impl_->observes_loads(); }
  template <class Token>
  auto async_store(std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> sources, deadline d,
                   Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, batch_result)>(
        [impl = impl_, keys, sources, d](auto handler) {
          impl->store(keys, sources, d, batch_handler(std::move(handler)));
        },
        token);
  }
  template <class Token>
  auto async_remove(std::span<const chunk_key> keys, deadline d, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, batch_result)>(
        [impl = impl_, keys, d](auto handler) { impl->remove(keys, d, batch_handler(std::move(handler))); }, token);
  }

  /// async_list (listing_backend): void(error_code, std::vector<listed_object>). A backend
  /// that cannot list completes with errc::unsupported and nothing.
  template <class Token>
  auto async_list(key_filter filter, deadline d, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, std::vector<listed_object>)>(
        [impl = impl_, d](auto handler, key_filter f) { impl->list(std::move(f), d, list_handler(std::move(handler))); },
        token, std::move(filter));
  }
  /// Whether async_list lists (else it answers errc::unsupported).
  [[nodiscard]] bool lists_objects() const noexcept { return impl_->lists_objects(); }

  /// Sets the backend's key listener (key_announcing_backend, concepts.hpp; empty: none). A
  /// backend that does not announce keys ignores it: nothing is ever called.
  void set_key_listener(key_listener listener) { impl_->set_key_listener(std::move(listener)); }
  /// Whether the backend tells a key listener its changes.
  [[nodiscard]] bool announces_keys() const noexcept { return impl_->announces_keys(); }

  /// The concrete backend, when it is a B; nullptr otherwise.
  template <class B>
  [[nodiscard]] B* target() const noexcept {
    auto* m = dynamic_cast<model<B>*>(impl_.get());
    return m ? m->backend.get() : nullptr;
  }

 private:
  struct interface {
    virtual ~interface() = default;
    [[nodiscard]] virtual std::string_view name() const = 0;
    [[nodiscard]] virtual executor_type executor() const = 0;
    [[nodiscard]] virtual usage_info usage() const = 0;
    [[nodiscard]] virtual health_info health() const = 0;
    virtual void unpin(std::span<const chunk_key>) = 0;
    virtual void lookup(std::span<const chunk_key>, deadline, lookup_handler) = 0;
    virtual void load(std::span<const chunk_key>, std::span<const std::span<std::byte>>, deadline, batch_handler) = 0;
    virtual void load_observed(std::span<const chunk_key>, std::span<const std::span<std::byte>>, deadline,
                               load_observer, batch_handler) = 0;
    [[nodiscard]] virtual bool observes_loads() const noexcept = 0;
    virtual error_code register_buffers(std::span<std::byte>) = 0;
    virtual error_code add_buffers(std::span<std::byte>) = 0;
    virtual void store(std::span<const chunk_key>, std::span<const std::span<const std::byte>>, deadline,
                       batch_handler) = 0;
    virtual void remove(std::span<const chunk_key>, deadline, batch_handler) = 0;
    virtual void list(key_filter, deadline, list_handler) = 0;
    [[nodiscard]] virtual bool lists_objects() const noexcept = 0;
    virtual void set_key_listener(key_listener) = 0;
    [[nodiscard]] virtual bool announces_keys() const noexcept = 0;
  };

  template <class B>
  struct model final : interface {
    explicit model(std::shared_ptr<B> b) : backend(std::move(b)) {}
    std::string_view name() const override { return backend->name(); }
    executor_type executor() const override { return backend->get_executor(); }
    usage_info usage() const override { return backend->usage(); }
    health_info health() const override { return backend->health(); }
    void unpin(std::span<const chunk_key> keys) override { backend->unpin(keys); }
    void lookup(std::span<const chunk_key> keys, deadline d, lookup_handler h) override {
      backend->async_lookup_and_pin(keys, d, std::move(h));
    }
    void load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> dst, deadline d,
              batch_handler h) override {
      backend->async_load(keys, dst, d, std::move(h));
    }
    void load_observed(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> dst, deadline d,
                       load_observer o, batch_handler h) override {
      if constexpr (observable_load_backend<B>)
        backend->async_load(keys, dst, d, std::move(o), std::move(h));
      else
        backend->async_load(keys, dst, d, std::move(h));
    }
    bool observes_loads() const noexcept override { return observable_load_backend<B>; }
    error_code register_buffers(std::span<std::byte> region) override {
      if constexpr (buffer_registering_backend<B>)
        return backend->register_buffers(region);
      else
        return make_error_code(errc::unsupported);
    }
    error_code add_buffers(std::span<std::byte> region) override {
      if constexpr (requires { backend->add_buffers(region); })
        return backend->add_buffers(region);
      else
        return make_error_code(errc::unsupported);
    }
    void store(std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> src, deadline d,
               batch_handler h) override {
      backend->async_store(keys, src, d, std::move(h));
    }
    void remove(std::span<const chunk_key> keys, deadline d, batch_handler h) override {
      backend->async_remove(keys, d, std::move(h));
    }
    void list(key_filter f, deadline d, list_handler h) override {
      if constexpr (listing_backend<B>) {
        backend->async_list(std::move(f), d, std::move(h));
      } else {
        using result = std::tuple<error_code, std::vector<listed_object>>;
        ::kvtier::detail::async_run<void(error_code, std::vector<listed_object>)>(
            backend->get_executor(),
            []() -> boost::asio::awaitable<result> {
              co_return result{make_error_code(errc::unsupported), {}};
            }(),
            std::move(h));
      }
    }
    bool lists_objects() const noexcept override { return listing_backend<B>; }
    void set_key_listener(key_listener l) override {
      if constexpr (key_announcing_backend<B>) backend->set_key_listener(std::move(l));
    }
    bool announces_keys() const noexcept override { return key_announcing_backend<B>; }
    std::shared_ptr<B> backend;
  };

  std::shared_ptr<interface> impl_;
};

static_assert(l2_backend<any_backend> && listing_backend<any_backend> && key_announcing_backend<any_backend>);

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
