#pragma once
// make_cache(config, ...): the server's cache for a configuration, a cache::tiered_cache
// behind any_cache (session/any_cache.hpp). tiered_cache is instantiated once per shipped eviction
// policy (lru, s3fifo, arc, noop); the store and prefetch-wait policies differ only in a
// flag and a few numbers, so they are one run-time policy each (runtime_store_policy,
// runtime_wait_policy: config/runtime_policies.hpp) and cost no instantiation. Only the server
// (server.hpp) includes this file.

#include <kvtier/bus/event_bus.hpp>
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/config.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/kv_events/tier_key_relay.hpp>
#include <kvtier/l1/policy/arc.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/policy/noop.hpp>
#include <kvtier/l1/policy/s3fifo.hpp>
#include <kvtier/l2/any_backend.hpp>
#include <kvtier/pipeline/policies.hpp>
#include <kvtier/server/config/runtime_policies.hpp>
#include <kvtier/server/config/server_config.hpp>
#include <kvtier/server/session/any_cache.hpp>
#include <kvtier/telemetry/logging_subscriber.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The traits of the server's cache for one eviction policy.
template <class Eviction>
struct server_traits : cache::default_traits {
  using eviction_policy = Eviction;
  using bus_type = server_event_bus;
  using store_policy = runtime_store_policy;
  using wait_policy = runtime_wait_policy;
};

namespace detail {

template <class Eviction>
class cache_model final : public any_cache {
 public:
  using cache_type = cache::tiered_cache<server_traits<Eviction>>;

  cache_model(boost::asio::any_io_executor ex, cache::cache_options o, server_event_bus& bus,
              std::vector<l2::any_backend> backends, typename cache_type::policies p)
      : cache_(std::move(ex), std::move(o), bus, std::move(backends), std::move(p)) {}

  lookup_id start_lookup(const cache::lookup_request& r) override { return cache_.start_lookup(r); }
  std::optional<cache::lookup_status> poll(lookup_id id) const override { return cache_.poll(id); }
  bool known(lookup_id id) const override { return cache_.known(id); }
  void release_all(lookup_id id) override { cache_.release_all(id); }
  void release(lookup_id id, std::span<const chunk_key> keys) override { cache_.release(id, keys); }
  void wait(lookup_id id, wait_handler h) override { cache_.async_wait(id, std::move(h)); }
  void copy_out(cache::copy_out_request r, cache::copy_out_sink sink, copy_out_handler h) override {
    cache_.async_copy_out(std::move(r), std::move(sink), std::move(h));
  }
  void copy_in(cache::copy_in_request r, cache::copy_in_source source, cache::copy_in_fence fence,
               copy_in_handler h) override {
    cache_.async_copy_in(std::move(r), std::move(source), std::move(fence), std::move(h));
  }
  std::size_t clear(bool force) override { return cache_.clear(force); }
  void visit_l1(const std::function<void(const chunk_key&, std::size_t)>& f) override {
    cache_.l1().for_each_object([&](const chunk_key& k, std::size_t bytes, l1::object_state) { f(k, bytes); });
  }
  l1::removal_summary remove_l1_if(const std::function<bool(const chunk_key&)>& pred, bool force) override {
    return cache_.l1().remove_if(pred, force);
  }
  std::size_t expire() override { return cache_.expire(); }
  cache::cache_status status() const override { return cache_.status(); }
  void stop_prefetches() override { cache_.prefetch().stop(); }
  boost::asio::awaitable<void> wait_idle() override { return cache_.wait_idle(); }
  boost::asio::awaitable<void> stop() override {
    co_await cache_.async_stop(boost::asio::as_tuple(boost::asio::use_awaitable));
  }
  std::size_t slot_bytes() const noexcept override { return l1().slot_bytes(); }
  std::size_t slot_count() const noexcept override { return l1().slot_count(); }
  std::string_view eviction_policy() const noexcept override { return Eviction::name; }
  std::span<std::byte> l1_arena() noexcept override { return cache_.l1().arena(); }
  std::span<l2::any_backend> backends() noexcept override { return cache_.backends(); }
  cache::l1_registration register_l1_in_pieces() override { return cache_.register_l1_in_pieces(); }

 private:
  const typename cache_type::tier_type& l1() const noexcept {
    return const_cast<cache_type&>(cache_).l1();  // tiered_cache only has a non-const l1()
  }
  cache_type cache_;
};

template <class Eviction>
std::unique_ptr<any_cache> make_cache_with(boost::asio::any_io_executor ex, const cache::cache_options& o,
                                           server_event_bus& bus, std::vector<l2::any_backend> backends,
                                           runtime_store_policy store, runtime_wait_policy wait) {
  typename cache_model<Eviction>::cache_type::policies p;
  p.store = store;
  p.wait = wait;
  return std::make_unique<cache_model<Eviction>>(std::move(ex), o, bus, std::move(backends), std::move(p));
}

}  // namespace detail

/// The cache options a configuration asks for.
[[nodiscard]] inline cache::cache_options cache_options_from(const server_config& c) {
  cache::cache_options o;
  o.l1.slot_bytes = c.l1_slot_bytes;
  o.l1.slot_count = c.l1_slot_count();
  o.l1.write_lock_ttl = std::chrono::duration_cast<l1::clock_type::duration>(server_config::seconds(c.l1_write_ttl_s));
  o.l1.read_lock_ttl = std::chrono::duration_cast<l1::clock_type::duration>(server_config::seconds(c.l1_read_ttl_s));
  o.l1.eviction_watermark = c.eviction_watermark;
  o.l1.eviction_target = c.eviction_target;
  o.prefetch.max_in_flight = c.prefetch_max_in_flight;
  o.prefetch.load_timeout = std::chrono::milliseconds(c.prefetch_load_timeout_ms);
  o.prefetch.probe_every = c.prefetch_probe_every;
  o.prefetch.probe_chunks = c.prefetch_probe_chunks;
  o.lookup_ttl = server_config::seconds(c.lookup_ttl_s);
  return o;
}

/// The cache a configuration asks for, over `backends`, publishing on `bus` (which must
/// outlive it); its copies run on `copy_executor` (the server's worker pool; empty: `ex`).
/// Throws std::invalid_argument for options L1 refuses, std::bad_alloc when the L1 arena
/// cannot be allocated.
[[nodiscard]] inline std::unique_ptr<any_cache> make_cache(const server_config& c, boost::asio::any_io_executor ex,
                                                           server_event_bus& bus,
                                                           std::vector<l2::any_backend> backends,
                                                           boost::asio::any_io_executor copy_executor = {}) {
  cache::cache_options o = cache_options_from(c);
  o.copy_executor = std::move(copy_executor);
  runtime_store_policy store{c.store_policy == store_kind::write_through};
  runtime_wait_policy wait;
  wait.kind = c.prefetch_policy;
  wait.base = std::chrono::milliseconds(c.prefetch_timeout_base_ms);
  wait.per_1k_tokens = std::chrono::milliseconds(c.prefetch_timeout_per_1k_tokens_ms);
  wait.cap = std::chrono::milliseconds(c.prefetch_timeout_cap_ms);
  switch (c.eviction) {
    case eviction_kind::lru:
      return detail::make_cache_with<l1::lru>(std::move(ex), o, bus, std::move(backends), store, wait);
    case eviction_kind::s3fifo:
      return detail::make_cache_with<l1::s3fifo>(std::move(ex), o, bus, std::move(backends), store, wait);
    case eviction_kind::arc:
      return detail::make_cache_with<l1::arc>(std::move(ex), o, bus, std::move(backends), store, wait);
    case eviction_kind::noop:
      return detail::make_cache_with<l1::noop>(std::move(ex), o, bus, std::move(backends), store, wait);
  }
  throw std::invalid_argument("kvtier::server::make_cache: unknown eviction policy");
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
