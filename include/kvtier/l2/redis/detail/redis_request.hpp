#pragma once
// The vocabulary between a redis_link (one connection) and those who use it: a request (the
// bytes to send, what kind of reply to expect, where an object's payload goes), the event
// that answers it, the sink that receives that event, the owner told when the link goes up
// or down, and the link's options. See redis_link.hpp.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/detail/redis_wire.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

/// What came back for one request.
struct redis_reply_event {
  enum class status : std::uint8_t {
    reply,           ///< generic reply in `reply` (never an error reply)
    error,           ///< an error reply ("-MOVED ...", "-OOM ...", ...): its text in `text`
    object_ok,       ///< object: the payload landed in the destination and passed its checks
    object_nil,      ///< object: no such key
    object_corrupt,  ///< object: not a valid object of the key asked for (header, key, length, checksum)
    object_size,     ///< object: a valid object of another size than the destination
    failed,          ///< no reply: the connection failed (or was closed) first
  };
  status st = status::failed;
  redis_reply_ptr reply;
  std::string text;
};

/// Receives the replies of the requests it submitted. Called on the link's executor.
struct redis_reply_sink {
  virtual void on_reply(std::size_t tag, redis_reply_event&& event) = 0;

 protected:
  ~redis_reply_sink() = default;
};

enum class redis_reply_kind : std::uint8_t { generic, object };

struct redis_request {
  // Outgoing bytes: head, then (SET) the object header and the caller's payload, then tail.
  std::string head;
  std::array<std::byte, object_header_bytes> object_header{};
  bool has_object_header = false;
  std::span<const std::byte> payload;  ///< the caller's memory, read while the request is written
  std::string tail;

  /// Bytes the reply will bring (object replies: the value; others ~0): the link keeps at
  /// most max_inflight_bytes of these outstanding (see redis_link_options).
  std::size_t reply_bytes = 0;

  redis_reply_kind kind = redis_reply_kind::generic;
  bool asking = false;       ///< head starts with ASKING: one "+OK" comes first
  std::span<std::byte> dst;  ///< object: where the payload goes (empty: discard)
  chunk_key expect;          ///< object: the key the header must carry

  redis_reply_sink* sink = nullptr;  ///< nullptr: abandoned, the reply is dropped
  std::size_t tag = 0;

  enum class io : std::uint8_t { queued, writing, written };
  io state = io::queued;
  bool reading_dst = false;  ///< the payload is being read into dst right now
};

/// Callbacks into the node pool that owns the link.
struct redis_link_owner {
  /// The connection is up and its handshake (AUTH, SELECT) succeeded.
  virtual void on_link_up(class redis_link& link) = 0;
  /// The connection failed or was closed; called once, after every request was failed.
  /// `handshake` says the failure was an AUTH/SELECT refusal.
  virtual void on_link_down(class redis_link& link, error_code ec, std::string_view why, bool was_up,
                            bool handshake) = 0;

 protected:
  ~redis_link_owner() = default;
};

struct redis_link_options {
  redis_endpoint endpoint;
  std::chrono::milliseconds connect_timeout{1000};
  std::string username;   ///< AUTH username password (empty: AUTH password)
  std::string password;   ///< empty: no AUTH
  unsigned database = 0;  ///< SELECT after connecting (standalone only)
  /// Requests are written while the replies outstanding on the connection are expected to
  /// bring fewer bytes than this (one request always goes). Redis answers a connection's
  /// pipelined commands as soon as it reads them, so 16 pipelined GETs of 3 MiB sit as 48 MiB
  /// in its output buffers and are copied cold: measured, loads ran at 0.6x redis-benchmark's
  /// GET rate that way, 1.0x with one or two per connection.
  std::size_t max_inflight_bytes = std::size_t{4} << 20;
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
