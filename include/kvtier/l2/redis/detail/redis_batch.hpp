#pragma once
// redis_batch: a set of commands that one operation of l2::redis_backend sends together
// (pipelined over the nodes' connections, routed by the client) and awaits together until a
// deadline, following MOVED/ASK per command; and redis_node, one Redis node with its
// connections. The batch's definitions need the whole client: they are in
// impl/redis_batch.hpp, which redis_client.hpp includes (so does this header, at its end).

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/detail/redis_link.hpp>
#include <kvtier/l2/redis/detail/redis_request.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/steady_timer.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

class redis_client;

/// One Redis node and its connections.
struct redis_node {
  struct conn {
    std::shared_ptr<redis_link> link;  ///< nullptr while waiting to reconnect
    std::unique_ptr<boost::asio::steady_timer> retry;
    std::chrono::milliseconds backoff{0};  ///< wait before the next attempt
    bool failed = false;                   ///< the last attempt or connection failed
  };
  redis_endpoint ep;
  std::string name;  ///< "host:port"
  std::vector<conn> conns;
  std::size_t rr = 0;  ///< round-robin cursor over conns
  std::string last_error;

  [[nodiscard]] std::size_t up() const noexcept {
    std::size_t n = 0;
    for (const auto& c : conns) n += c.link && c.link->up() ? 1 : 0;
    return n;
  }
};

/// A set of commands sent together (pipelined over the nodes' connections) and awaited
/// together until a deadline. Follows MOVED/ASK per command. Lives in the operation's
/// coroutine frame; its destructor detaches whatever is still outstanding.
class redis_batch final : public redis_reply_sink {
 public:
  enum class command : std::uint8_t { exists, get, set, del, raw };
  struct item {
    command cmd = command::raw;
    std::string key;  ///< the Redis key (routing and command argument)
    std::uint16_t slot = 0;
    redis_node* fixed = nullptr;                          ///< node-addressed command (INFO, DBSIZE, CLUSTER SLOTS)
    std::vector<std::string> args;                        ///< raw: the whole command
    std::array<std::byte, object_header_bytes> header{};  ///< set: the object header
    std::span<const std::byte> payload;                   ///< set: the caller's bytes
    std::span<std::byte> dst;                             ///< get: the caller's buffer
    chunk_key expect;                                     ///< get: the object's key; set, del: the key told
    /// set, del: tell the client's key listener when the reply says the key was stored
    /// (set: OK) or deleted (del: 1), with this reason (del).
    bool tell = false;
    bus::key_removal removal = bus::key_removal::deleted;

    std::shared_ptr<redis_link> link;  ///< where the command is outstanding
    redis_request* req = nullptr;
    std::uint32_t redirects = 0;
    bool done = false;       ///< result holds the answer
    bool timed_out = false;  ///< given up at the deadline (or cancelled)
    redis_reply_event result;
  };

  redis_batch(redis_client& c, deadline d);
  ~redis_batch() { abandon_all(); }
  redis_batch(const redis_batch&) = delete;
  redis_batch& operator=(const redis_batch&) = delete;

  item& add(command c, std::string key = {});
  [[nodiscard]] std::vector<item>& items() noexcept { return items_; }

  /// Sends everything and waits; errc::timeout at the deadline, operation_aborted when the
  /// caller cancelled (outstanding commands are then detached: timed_out).
  boost::asio::awaitable<error_code> run();

 private:
  void issue(std::size_t i, redis_node* n, bool asking);
  void on_reply(std::size_t tag, redis_reply_event&& e) override;
  void finish(std::size_t i, redis_reply_event&& e);
  void abandon_all();

  redis_client& client_;
  deadline deadline_;
  std::vector<item> items_;
  std::size_t remaining_ = 0;
  boost::asio::steady_timer wake_;
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/l2/redis/detail/redis_client.hpp>
