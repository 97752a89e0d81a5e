#pragma once
// redis_backend: an L2 backend on a shared Redis (standalone) or Redis Cluster, so that the
// cache servers of a fleet share KV through a store they already run. Target kvtier::redis
// (kvtier + hiredis, found with pkg-config); docs/deployment.md says when and how to use it.
//
// Transport. hiredis formats the commands and parses the replies (redisFormatCommandArgv,
// redisReader); Asio owns the sockets: each node gets `connections_per_node` TCP
// connections, every command of a batch is issued before any reply is awaited, each to the
// least loaded connection, and pipelined there: small commands without limit, GETs while the
// replies outstanding on the connection stay under max_inflight_bytes_per_connection (deeper
// pipelining of large values piles them up in Redis's output buffers: measured 0.53x of
// redis-benchmark's rate unbounded, 1.0x with one 3 MiB GET per connection, docs/
// performance.md). Nothing blocks the executor. hiredis's own
// connection objects are not used: the async context would need an event-loop adapter for
// the same sockets, and its reader copies a GET's value twice (into its buffer, then into a
// reply object) reading 16 KiB per system call; here a GET's payload is read from the socket
// straight into the caller's L1 slot after its header was checked (detail/redis_link.hpp).
//
// Stored form. One Redis string per object: the 72-byte header of object_format.hpp (magic,
// version, the chunk key, payload size, XXH3 payload checksum, header checksum), then the
// payload, written with SET key value NX [EX ttl_seconds]. The key is
//     "<key_prefix>:<model id, 16 hex>:<world size>:<rank>:<chunk hash, 32 hex>"
// (key_of()); the model id folds the model name and the KV layout (make_model_id), so
// incompatible layouts never share a key, and the prefix separates deployments.
//
// Operations (all pipelined, all bounded by their deadline):
//   lookup_and_pin  EXISTS per key. "Pinned" means: this backend will not remove the key
//                   (async_remove answers `rejected`) until unpin(). Redis has no pins: its
//                   maxmemory policy, a TTL, or another server may still delete a pinned key.
//                   The load then answers not_found, which the prefetch pipeline counts as a
//                   failed key and recomputes; a wrong byte is never served. Pins are local to
//                   this process and cost nothing on Redis.
//   load            GET per key. ok only when the value is exactly a valid header carrying the
//                   requested key, a payload of the destination's size and a matching checksum.
//                   A value of a foreign key, a torn or garbage value answers `corrupt` and is
//                   deleted (DEL, awaited before the load completes, so a following lookup
//                   misses it); a valid object of another size answers `rejected` (kept).
//   store           SET NX per key: `exists` when the key is present (not rewritten), `ok`,
//                   `no_space` when Redis answers OOM (maxmemory with a noeviction policy).
//   remove          DEL per key: `ok`, `not_found`, or `rejected` for a key pinned here.
//   list            SCAN MATCH "<key_prefix>:*" on every master, then STRLEN per object
//                   key (its bytes, header included): every object under the prefix, the
//                   other servers' that share it too. Keys that are not object keys are
//                   skipped.
//   usage()         Redis's figures, refreshed every info_interval_ms in the background
//                   (INFO memory used_memory and maxmemory, DBSIZE, summed over the cluster's
//                   masters; bytes_capacity 0 when a master has no maxmemory); between two
//                   refreshes, this backend's own stores and removes are added. The whole
//                   database is counted, other prefixes included.
//   health()        healthy while every node that owns slots has a connection up.
// Failures: with no connection to a key's node the key answers `unavailable` at once (an
// operation where every key is unavailable completes with errc::backend_unavailable; a lookup
// then finds nothing); a node that does not answer leaves its keys to the deadline (`timeout`,
// errc::timeout); broken connections reconnect in the background with exponential backoff
// (reconnect_backoff_min_ms .. max_ms). Every failure is counted (stats(), shared_stats()) and
// logged through a log_throttle, at most once per log_interval_ms per kind.
// Deadlines and buffers: when an operation gives up, requests not yet sent are dropped, replies
// not yet begun are discarded when they come, and a connection still reading into (or writing
// from) the caller's buffer is closed; so when the operation completes nothing touches the
// buffers any more (the buffer contract of l2_backend).
// Cluster: keys go to the master of their CRC16 slot (hash tags honoured); the slot map comes
// from CLUSTER SLOTS at start, every info_interval_ms and after a MOVED (which also updates
// that slot at once); ASK is followed with ASKING on the named node; at most max_redirects
// redirects per command.
// AUTH (with username when set) and SELECT are sent on every (re)connection; the password is
// read once at construction from password_file or the variable named by password_env. A
// password_file that group or others may read gets a warning ("chmod 600 <file>").
//
// Threading: the backend serialises its state on a strand of the executor given (operations
// may be started from any thread; completions go to the caller's associated executor);
// unpin(), usage(), health() and stats() are thread-safe. Cancelling an operation (its
// handler's cancellation slot, terminal) makes it give up as at its deadline and complete
// with operation_aborted. Destroying the backend closes its connections from its strand
// (outstanding operations complete with their keys `unavailable`).

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

namespace kvtier::inline KVTIER_ABI_TAG::l2 {

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

  /// The Redis key of a chunk key (see the header comment).
  [[nodiscard]] std::string key_of(const chunk_key& k) const { return client_->key_of(k); }

  // async_lookup_and_pin, async_load, async_store, async_remove, async_list:
  // detail/coroutine_backend.hpp over detail/redis_operations.hpp.
  static constexpr bool lists_objects = true;
  void unpin(std::span<const chunk_key> keys) { client_->unpin(keys); }

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

static_assert(l2_backend<redis_backend> && listing_backend<redis_backend>);

}  // namespace kvtier::inline KVTIER_ABI_TAG::l2
