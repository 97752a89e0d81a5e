#pragma once
// request_error: how the server refuses a request, an errc and a message that says what to
// change, sent back as error_response; request_result<T>: a handler's value or its refusal.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/messages.hpp>

#include <boost/assert/source_location.hpp>
#include <boost/system/result.hpp>
#include <boost/system/system_error.hpp>

#include <string>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// A refused request: the code and the reason sent back in error_response.
struct request_error {
  errc code = errc::invalid_argument;
  std::string message;

  [[nodiscard]] protocol::error_response response() const { return protocol::error_response::make(code, message); }
};

[[noreturn]] inline void throw_exception_from_error(const request_error& e, const boost::source_location&) {
  throw boost::system::system_error(make_error_code(e.code), e.message);
}

/// A value or the request_error that refuses the request.
template <class T>
using request_result = boost::system::result<T, request_error>;

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
