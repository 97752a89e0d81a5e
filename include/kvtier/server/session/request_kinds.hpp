#pragma once
// request_kind_of: the server's mapping from wire message types (protocol/messages.hpp) onto
// the bus's request kinds (bus/events.hpp), which label server_request_started/finished and
// the request metrics. It lives here, not in protocol/, so that protocol/ knows no bus.

#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/protocol/messages.hpp>

#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The request a wire type belongs to (a response maps to its request), for the server's
/// request events and metrics; error_response and unknown values are `other`.
[[nodiscard]] constexpr bus::request_kind request_kind_of(protocol::message_type t) noexcept {
  using k = bus::request_kind;
  using protocol::message_type;
  switch (static_cast<message_type>(static_cast<std::uint16_t>(t) & ~protocol::response_bit)) {
    case message_type::register_kv_request:
      return k::register_kv;
    case message_type::unregister_kv_request:
      return k::unregister_kv;
    case message_type::lookup_request:
      return k::lookup;
    case message_type::query_prefetch_request:
      return k::query_prefetch;
    case message_type::retrieve_request:
      return k::retrieve;
    case message_type::store_request:
      return k::store;
    case message_type::free_lookup_locks_request:
      return k::free_lookup_locks;
    case message_type::end_request_request:
      return k::end_request;
    case message_type::ping_request:
      return k::ping;
    case message_type::clear_request:
      return k::clear;
    case message_type::get_chunk_size_request:
      return k::get_chunk_size;
    case message_type::status_request:
      return k::status;
    case message_type::list_objects_request:
      return k::list_objects;
    case message_type::evict_request:
      return k::evict;
    case message_type::describe_chunks_request:
      return k::describe_chunks;
    case message_type::list_keys_request:
      return k::list_keys;
    default:
      return k::other;
  }
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
