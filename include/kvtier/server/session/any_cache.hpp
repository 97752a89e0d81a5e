#pragma once
// any_cache: the server's cache::tiered_cache behind a small virtual interface, so the
// eviction policy (a compile-time parameter of l1::tier, intrusive hooks in every slot) can
// be chosen by configuration at run time (server/make_cache.hpp instantiates the tiered_cache of
// each shipped policy behind it). The sessions, which are most of the server's code, are
// compiled once, against this interface alone: a file that includes it instantiates no
// cache. A virtual call per request (not per key) is the price.

#include <kvtier/cache/copy.hpp>
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/any_backend.hpp>

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The tiered_cache façade as the sessions use it: whole operations only (a lookup, its
/// decided answer, a copy out, a copy in; see cache/tiered_cache.hpp for each member's
/// meaning). Thread safety as tiered_cache: any member from any thread.
class any_cache {
 public:
  using lookup_id = std::uint64_t;

  virtual ~any_cache() = default;

  using wait_handler = boost::asio::any_completion_handler<void(error_code, cache::lookup_status)>;
  using copy_out_handler = boost::asio::any_completion_handler<void(error_code, std::size_t)>;
  using copy_in_handler = boost::asio::any_completion_handler<void(error_code, cache::copy_in_result)>;

  virtual lookup_id start_lookup(const cache::lookup_request& r) = 0;
  /// The decided answer, nullopt while the prefetch decides (or for an unknown id).
  [[nodiscard]] virtual std::optional<cache::lookup_status> poll(lookup_id id) const = 0;
  [[nodiscard]] virtual bool known(lookup_id id) const = 0;
  virtual void release_all(lookup_id id) = 0;
  /// tiered_cache::release: gives back the lookup's holds on these keys (a rank's retrieve
  /// ended); the lookup stays known.
  virtual void release(lookup_id id, std::span<const chunk_key> keys) = 0;

  /// tiered_cache::async_wait: void(error_code, lookup_status) once the prefetch is decided.
  template <class Token>
  auto async_wait(lookup_id id, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, cache::lookup_status)>(
        [this, id](auto h) { wait(id, wait_handler(std::move(h))); }, token);
  }
  /// tiered_cache::async_copy_out: void(error_code, std::size_t copied).
  template <class Token>
  auto async_copy_out(cache::copy_out_request r, cache::copy_out_sink sink, Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, std::size_t)>(
        [this](auto h, cache::copy_out_request req, cache::copy_out_sink s) {
          copy_out(std::move(req), std::move(s), copy_out_handler(std::move(h)));
        },
        token, std::move(r), std::move(sink));
  }
  /// tiered_cache::async_copy_in: void(error_code, copy_in_result).
  template <class Token>
  auto async_copy_in(cache::copy_in_request r, cache::copy_in_source source, cache::copy_in_fence fence,
                     Token&& token) {
    return boost::asio::async_initiate<Token, void(error_code, cache::copy_in_result)>(
        [this](auto h, cache::copy_in_request req, cache::copy_in_source s, cache::copy_in_fence f) {
          copy_in(std::move(req), std::move(s), std::move(f), copy_in_handler(std::move(h)));
        },
        token, std::move(r), std::move(source), std::move(fence));
  }

  virtual void wait(lookup_id id, wait_handler h) = 0;
  virtual void copy_out(cache::copy_out_request r, cache::copy_out_sink sink, copy_out_handler h) = 0;
  virtual void copy_in(cache::copy_in_request r, cache::copy_in_source source, cache::copy_in_fence fence,
                       copy_in_handler h) = 0;
  virtual std::size_t clear(bool force) = 0;
  /// l1::tier::for_each_object: f(key, bytes) for every object L1 holds, under L1's mutex
  /// (f must not call into the cache).
  virtual void visit_l1(const std::function<void(const chunk_key&, std::size_t)>& f) = 0;
  /// l1::tier::remove_if: removes the L1 objects `pred` accepts (the locked ones only when
  /// forced, their memory freed when their last lock goes).
  virtual l1::removal_summary remove_l1_if(const std::function<bool(const chunk_key&)>& pred, bool force) = 0;
  virtual std::size_t expire() = 0;
  [[nodiscard]] virtual cache::cache_status status() const = 0;
  /// Stops the prefetches (pipeline::prefetch_controller::stop: every prefetch answered,
  /// the keys still loading failed, so a copy waiting for them ends now; the loads in flight
  /// end by their deadlines, and stop() waits for them). New lookups answer from L1 only.
  /// At shutdown, once nothing reads what a prefetch loads.
  virtual void stop_prefetches() = 0;
  /// Completes once no prefetch or store is running or queued.
  virtual boost::asio::awaitable<void> wait_idle() = 0;
  /// Stops the pipelines (tiered_cache::async_stop: every prefetch answered, queued stores
  /// dropped, operations in flight waited for); completes once every coroutine of the cache
  /// ended. Call at shutdown, after wait_idle().
  virtual boost::asio::awaitable<void> stop() = 0;
  [[nodiscard]] virtual std::size_t slot_bytes() const noexcept = 0;
  [[nodiscard]] virtual std::size_t slot_count() const noexcept = 0;
  [[nodiscard]] virtual std::string_view eviction_policy() const noexcept = 0;
  /// The L1 arena, faulted in at start (server/l1_residency.hpp), and the L2 backends.
  [[nodiscard]] virtual std::span<std::byte> l1_arena() noexcept = 0;
  [[nodiscard]] virtual std::span<l2::any_backend> backends() noexcept = 0;
  /// tiered_cache::register_l1_in_pieces: L1 registered with the L2 backends, a piece per step.
  [[nodiscard]] virtual cache::l1_registration register_l1_in_pieces() = 0;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
