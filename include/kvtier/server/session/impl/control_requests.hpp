#pragma once
// session (server/session/session.hpp): the requests that neither register, look up nor copy:
// ping (answered by the reader at once, never behind a copy: the connector judges the
// server's health by it), clear (L1), get_chunk_size, status (the server's status document).

#include <kvtier/server/session/session.hpp>

#include <chrono>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline request_result<protocol::ping_response> session::on(const protocol::ping_request&, call&) {
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now().time_since_epoch()).count();
  return protocol::ping_response{ctx_.boot_token, static_cast<std::uint64_t>(now)};
}

inline request_result<protocol::clear_response> session::on(const protocol::clear_request& r, call&) {
  const std::size_t n = ctx_.cache.clear(r.force);
  ctx_.log.info("client {}: cleared L1 ({} objects{})", id_, n, r.force ? ", forced" : "");
  return protocol::clear_response{};
}

inline request_result<protocol::get_chunk_size_response> session::on(const protocol::get_chunk_size_request&, call&) {
  return protocol::get_chunk_size_response{ctx_.config.chunk_tokens};
}

inline request_result<protocol::status_response> session::on(const protocol::status_request&, call&) {
  return protocol::status_response{host_.status_json()};
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
