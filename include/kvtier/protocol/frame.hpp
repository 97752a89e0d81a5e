#pragma once
// The frame: a fixed 20-byte header and a body. This header also defines how decoding fails
// (decode_error, decode_result), shared by the codec and the incremental frame decoder.
//
//   offset  size  field
//        0     4  magic "KVT1"
//        4     2  protocol version (u16 LE), protocol_version (limits.hpp)
//        6     2  message type (u16 LE), messages.hpp
//        8     8  call id (u64 LE), chosen by the client, echoed in the response
//       16     4  body length (u32 LE), at most limits::max_body_bytes
//       20     -  body: the message's fields in order (codec.hpp)
//
// The header layout is frozen for all versions: only bodies and message types may change
// with the version.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/messages.hpp>
#include <kvtier/protocol/unique_fd.hpp>

#include <boost/assert/source_location.hpp>
#include <boost/system/result.hpp>
#include <boost/system/system_error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// Why a frame or message was refused.
///   errc::protocol_error     malformed: bad magic, truncated field, bad enum/bool value,
///                            trailing bytes, unknown type, inconsistent lengths
///   errc::version_mismatch   the frame's version is not protocol_version
///   errc::message_too_large  the body or a field is above its limit
struct decode_error {
  error_code code;
  std::string reason;        ///< for logs and error replies, e.g. "lookup_request.request_key: 300 bytes, limit 256"
  std::uint64_t call_id = 0; ///< the frame's call id when its header was readable, else 0
};

/// A value or a decode_error. Decoding never throws on bad input; value() on an error
/// throws boost::system::system_error carrying the code and the reason.
template <class T>
using decode_result = boost::system::result<T, decode_error>;

[[noreturn]] inline void throw_exception_from_error(const decode_error& e, const boost::source_location&) {
  throw boost::system::system_error(e.code, e.reason);
}

/// The decoded fixed header of a frame.
struct frame_header {
  std::uint16_t version = protocol_version;
  message_type type{};          ///< may hold a value no message has (checked by the codec)
  std::uint64_t call_id = 0;
  std::uint32_t body_bytes = 0;

  friend constexpr bool operator==(const frame_header&, const frame_header&) = default;
};

/// One complete frame as it came off the stream. `fd` is the file descriptor that arrived
/// with the frame (register_kv_request only; empty otherwise); it closes with the frame.
struct frame {
  frame_header header;
  std::vector<std::byte> body;
  unique_fd fd;
};

namespace detail {

template <class U>
constexpr void store_le(std::byte* p, U v) noexcept {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
template <class U>
[[nodiscard]] constexpr U load_le(const std::byte* p) noexcept {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v = static_cast<U>(v | (static_cast<U>(p[i]) << (8 * i)));
  return v;
}

[[nodiscard]] inline decode_error make_error(errc e, std::string reason, std::uint64_t call_id = 0) {
  return decode_error{make_error_code(e), std::move(reason), call_id};
}

}  // namespace detail

/// Writes `h` (with the magic) into the first frame_header_size bytes of `out`.
inline void encode_header(const frame_header& h, std::span<std::byte, frame_header_size> out) noexcept {
  std::memcpy(out.data(), frame_magic.data(), frame_magic.size());
  detail::store_le<std::uint16_t>(out.data() + 4, h.version);
  detail::store_le<std::uint16_t>(out.data() + 6, static_cast<std::uint16_t>(h.type));
  detail::store_le<std::uint64_t>(out.data() + 8, h.call_id);
  detail::store_le<std::uint32_t>(out.data() + 16, h.body_bytes);
}

/// Reads the header fields of a complete header, without any check (see check_header).
[[nodiscard]] inline frame_header read_header(std::span<const std::byte, frame_header_size> in) noexcept {
  frame_header h;
  h.version = detail::load_le<std::uint16_t>(in.data() + 4);
  h.type = static_cast<message_type>(detail::load_le<std::uint16_t>(in.data() + 6));
  h.call_id = detail::load_le<std::uint64_t>(in.data() + 8);
  h.body_bytes = detail::load_le<std::uint32_t>(in.data() + 16);
  return h;
}

/// Checks the first bytes of a frame as far as they go (`prefix` may be shorter than a
/// header): nullopt while nothing is wrong yet. The magic is checked byte by byte, so a
/// stream that is not ours fails on its first wrong byte; version and body length once the
/// whole header is there (then the error carries the call id, for the reply).
[[nodiscard]] inline std::optional<decode_error> check_header(std::span<const std::byte> prefix,
                                                              const limits& lim = {}) {
  const std::size_t magic_bytes = std::min(prefix.size(), frame_magic.size());
  if (!std::equal(prefix.begin(), prefix.begin() + static_cast<std::ptrdiff_t>(magic_bytes), frame_magic.begin()))
    return detail::make_error(errc::protocol_error, "bad frame magic (not a kvtier protocol stream)");
  if (prefix.size() < frame_header_size) return std::nullopt;
  const frame_header h = read_header(prefix.first<frame_header_size>());
  if (h.version != protocol_version)
    return detail::make_error(errc::version_mismatch,
                              "protocol version " + std::to_string(h.version) + ", this side speaks " +
                                  std::to_string(protocol_version),
                              h.call_id);
  if (h.body_bytes > lim.max_body_bytes)
    return detail::make_error(errc::message_too_large,
                              "frame body of " + std::to_string(h.body_bytes) + " bytes, limit " +
                                  std::to_string(lim.max_body_bytes),
                              h.call_id);
  return std::nullopt;
}

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
