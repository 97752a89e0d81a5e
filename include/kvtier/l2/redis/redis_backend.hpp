#pragma once
// redis_backend: an L2 backend on a shared Redis (standalone) or Redis Cluster, so that the
// cache servers of a fleet share KV through a store they already run. Target kvtier::redis
// (kvtier + hiredis, found with pkg-config). docs/l2-redis.md holds the rest: the transport,
// the stored form, what each operation sends and answers, failures, deadlines and buffers,
// the cluster, AUTH, threading; docs/deployment.md says when and how to use it.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/detail/coroutine_backend.hpp>
#include <kvtier/l2/redis/detail/redis_client.hpp>
#include <kvtier/l2/redis/detail/redis_operations.hpp>
#include <kvtier/l2/redis/redis_options.hpp>
#include <kvtier/l2/redis/redis_stats.hpp>
#include <kvtier/l2/types.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/post.hpp>

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

/// Operations may be started from any thread (the state lives on a strand of the executor
/// given) and complete on the caller's associated executor; unpin(), usage(), health() and
/// stats() are thread-safe. At its deadline or on cancellation an operation completes only
/// once nothing touches the caller's buffers any more.
class redis_backend : public detail::coroutine_backend<redis_backend> {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Validates the options (std::invalid_argument names the field), reads the password, and
  /// starts connecting in the background (operations may be started at once: they wait for
  /// the connections, within their deadlines). `log` (optional) must outlive the backend.
  redis_backend(executor_type executor, redis_backend_options options, telemetry::logger* log = nullptr) {
    options.validate();
    std::string password = read_password(options, log);
    client_ = std::make_shared<detail::redis_client>(std::move(executor), std::move(options), std::move(password), log);
    boost::asio::post(client_->strand(), [c = client_] { c->start(); });
  }

  redis_backend(const redis_backend&) = delete;
  redis_backend& operator=(const redis_backend&) = delete;

  ~redis_backend() {
    boost::asio::post(client_->strand(), [c = client_] { c->shutdown(); });
  }

  [[nodiscard]] std::string_view name() const noexcept { return client_->options().name; }
  [[nodiscard]] executor_type get_executor() const noexcept { return client_->strand(); }
  [[nodiscard]] const redis_backend_options& options() const noexcept { return client_->options(); }

  /// The Redis key of a chunk key (docs/l2-redis.md, "Stored form").
  [[nodiscard]] std::string key_of(const chunk_key& k) const { return client_->key_of(k); }

  // async_lookup_and_pin, async_load, async_store, async_remove, async_list:
  // detail/coroutine_backend.hpp over detail/redis_operations.hpp.
  static constexpr bool lists_objects = true;
  void unpin(std::span<const chunk_key> keys) { client_->unpin(keys); }

  /// Replaces the key listener (key_announcing_backend, types.hpp; empty: none), called on the
  /// backend's strand as each reply arrives: stored when a SET (NX) answered OK, removed when a
  /// DEL this backend sent deleted the key: deleted (async_remove), corrupt (a value a load
  /// found bad). Only what this backend does is told: Redis's own evictions (maxmemory) and
  /// expiries, and what other clients of the same Redis store or delete, are invisible here,
  /// and so is a command whose reply never came (its deadline passed, its connection broke).
  void set_key_listener(key_listener l) { client_->set_key_listener(std::move(l)); }

  [[nodiscard]] usage_info usage() const { return client_->usage(); }
  [[nodiscard]] health_info health() const { return client_->health(); }
  [[nodiscard]] redis_backend_stats stats() const { return client_->stats(); }
  /// The live counters behind stats(), shared: they stay readable after the backend is gone.
  [[nodiscard]] std::shared_ptr<const redis_counters> shared_stats() const noexcept { return client_->counter_cells(); }
  /// Pins this backend holds on key (for tests).
  [[nodiscard]] std::uint32_t pins(const chunk_key& key) const { return client_->pins(key); }

 private:
  friend class detail::coroutine_backend<redis_backend>;

  using lookup_tuple = detail::redis_lookup_tuple;
  using batch_tuple = detail::redis_batch_tuple;

  boost::asio::awaitable<lookup_tuple> lookup_impl(std::span<const chunk_key> keys, deadline d) {
    return detail::redis_lookup(client_, keys, d);
  }
  boost::asio::awaitable<batch_tuple> load_impl(std::span<const chunk_key> keys,
                                                std::span<const std::span<std::byte>> destinations, deadline d) {
    return detail::redis_load(client_, keys, destinations, d);
  }
  boost::asio::awaitable<batch_tuple> store_impl(std::span<const chunk_key> keys,
                                                 std::span<const std::span<const std::byte>> sources, deadline d) {
    return detail::redis_store(client_, keys, sources, d);
  }
  boost::asio::awaitable<batch_tuple> remove_impl(std::span<const chunk_key> keys, deadline d) {
    return detail::redis_remove(client_, keys, d);
  }
  boost::asio::awaitable<detail::redis_list_tuple> list_impl(key_filter filter, deadline d) {
    return detail::redis_list(client_, std::move(filter), d);
  }

  static std::string read_password(const redis_backend_options& o, telemetry::logger* log) {
    if (!o.password_env.empty()) {
      const char* v = std::getenv(o.password_env.c_str());
      if (v == nullptr)
        throw std::invalid_argument("redis_backend_options: password_env names '" + o.password_env +
                                    "', which is not set");
      return v;
    }
    if (!o.password_file.empty()) {
      std::ifstream f(o.password_file, std::ios::binary);
      if (!f)
        throw std::invalid_argument("redis_backend_options: password_file '" + o.password_file + "' cannot be read");
      std::ostringstream s;
      s << f.rdbuf();
      std::string p = s.str();
      while (!p.empty() && (p.back() == '\n' || p.back() == '\r')) p.pop_back();
      if (p.empty())
        throw std::invalid_argument("redis_backend_options: password_file '" + o.password_file + "' is empty");
      // A secret that other local users can read is not one: say so (it still works).
      struct ::stat st {};
      if (log != nullptr && ::stat(o.password_file.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
        log->warn("redis backend '{}': password_file {} is readable by group or others (mode {:04o}): chmod 600 {}",
                  o.name, o.password_file, st.st_mode & 07777, o.password_file);
      return p;
    }
    return {};
  }

  std::shared_ptr<detail::redis_client> client_;
};

static_assert(l2_backend<redis_backend> && listing_backend<redis_backend> && key_announcing_backend<redis_backend>);

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
