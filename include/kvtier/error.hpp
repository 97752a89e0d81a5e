#pragma once
// kvtier's error codes: `errc`, its error category, and `result<T>` for synchronous calls.
// Asynchronous operations complete with a boost::system::error_code first (Asio's shape).
// A cache miss is never an error: lookups answer with counts and bitmaps.

#include <kvtier/config.hpp>

#include <boost/system/error_code.hpp>
#include <boost/system/result.hpp>

#include <string>
#include <type_traits>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

using error_code = boost::system::error_code;

/// Values are stable (they travel in protocol replies): append, never renumber.
enum class errc : int {
  invalid_argument = 1,  ///< a caller passed something malformed (bad size, empty batch, ...)
  invalid_config,        ///< a configuration value is out of range; the message says which
  out_of_memory,         ///< L1 (or another bounded pool) has no room for the whole batch
  not_found,             ///< an id (registration, request, key) is unknown
  wrong_state,           ///< the object is not in the state the operation needs
  locked,                ///< the object is locked by a reader or writer
  timeout,               ///< the operation's deadline passed
  cancelled,             ///< the operation was cancelled (shutdown, caller gave up)
  io_error,              ///< a storage device or file system reported an error (EIO, ...)
  no_space,              ///< the backend is full (ENOSPC, or its configured capacity)
  corrupt_object,        ///< a stored object failed its header or checksum check
  backend_unavailable,   ///< an L2 backend is down or unreachable
  protocol_error,        ///< a frame or message is malformed
  version_mismatch,      ///< the peer speaks another protocol version
  message_too_large,     ///< a frame or field exceeds its size limit
  server_unavailable,    ///< the cache server is dead, hung or not yet connected
  layout_mismatch,       ///< a KV region or object does not match the declared layout
  not_registered,        ///< the client has not registered the region it refers to
  shutting_down,         ///< the component is stopping and takes no new work
  unsupported,           ///< the kernel or build lacks a feature (io_uring, CUDA, ...)
  no_kv_region,          ///< the connection registered without a KV region (a scheduler)
  permission_denied,     ///< the peer (its uid) is not allowed to use this server
  over_budget,           ///< a client or server budget is spent (connections, lookup keys)
};

namespace detail {

class kvtier_category final : public boost::system::error_category {
 public:
  // A fixed id lets codes compare equal across shared objects (Boost's recommendation).
  constexpr kvtier_category() noexcept : error_category(0x6b76746965724543ULL) {}

  [[nodiscard]] const char* name() const noexcept override { return "kvtier"; }

  [[nodiscard]] std::string message(int ev) const override { return describe(ev); }

  [[nodiscard]] static const char* describe(int ev) noexcept {
    switch (static_cast<errc>(ev)) {
      // clang-format off
      case errc::invalid_argument: return "invalid argument";
      case errc::invalid_config: return "invalid configuration";
      case errc::out_of_memory: return "out of L1 memory";
      case errc::not_found: return "not found";
      case errc::wrong_state: return "object in wrong state";
      case errc::locked: return "object is locked";
      case errc::timeout: return "deadline expired";
      case errc::cancelled: return "operation cancelled";
      case errc::io_error: return "I/O error";
      case errc::no_space: return "no space left in backend";
      case errc::corrupt_object: return "stored object is corrupt";
      case errc::backend_unavailable: return "L2 backend unavailable";
      case errc::protocol_error: return "protocol error";
      case errc::version_mismatch: return "protocol version mismatch";
      case errc::message_too_large: return "message too large";
      case errc::server_unavailable: return "cache server unavailable";
      case errc::layout_mismatch: return "KV layout mismatch";
      case errc::not_registered: return "KV region not registered";
      case errc::shutting_down: return "shutting down";
      case errc::unsupported: return "not supported here";
      case errc::no_kv_region: return "registered without a KV region";
      case errc::permission_denied: return "permission denied";
      case errc::over_budget: return "over budget";
      // clang-format on
    }
    return "unknown kvtier error";
  }
};

}  // namespace detail

/// The category of every kvtier::errc.
inline const boost::system::error_category& kvtier_category() noexcept {
  static constexpr detail::kvtier_category instance;
  return instance;
}

inline error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), kvtier_category()}; }

/// `result<T>`: a value or an error_code (boost::system::result), for synchronous calls.
template <class T>
using result = boost::system::result<T, error_code>;

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

template <>
struct boost::system::is_error_code_enum<kvtier::errc> : std::true_type {};
