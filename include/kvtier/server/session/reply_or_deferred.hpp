#pragma once
// reply_or_deferred: what a session's request handler answers (session/session.hpp): the
// reply the lane sends at once (a response, or error_response for a refusal), or `deferred`:
// the handler arranged for the answer to go out when it is decided (a lookup held until its
// prefetch decided, a query of a lookup still deciding), so the lane sends nothing for it.

#include <kvtier/config.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/server/session/request_error.hpp>

#include <optional>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// A handler's answer to one call: a reply to send now, or deferred (sent later by what the
/// handler set up; docs/server.md, "Every frame is answered").
class reply_or_deferred {
 public:
  /// The answer goes out later: the handler arranged it.
  [[nodiscard]] static reply_or_deferred deferred() noexcept { return reply_or_deferred(); }

  /// A response (or any message) to send now.
  template <protocol::wire_message Response>
  reply_or_deferred(Response r)  // NOLINT(google-explicit-constructor): a handler returns its response
      : reply_(protocol::message(std::move(r))) {}
  /// A refusal: error_response with its code and message.
  reply_or_deferred(const request_error& e)  // NOLINT(google-explicit-constructor)
      : reply_(protocol::message(e.response())) {}
  /// A handler's value or its refusal.
  template <class Response>
  reply_or_deferred(request_result<Response> r)  // NOLINT(google-explicit-constructor)
      : reply_(r ? protocol::message(std::move(*r)) : protocol::message(r.error().response())) {}

  [[nodiscard]] bool is_deferred() const noexcept { return !reply_.has_value(); }
  /// The reply to send; only when !is_deferred().
  [[nodiscard]] protocol::message& reply() noexcept { return *reply_; }
  [[nodiscard]] const protocol::message& reply() const noexcept { return *reply_; }

 private:
  reply_or_deferred() = default;
  std::optional<protocol::message> reply_;
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
