#pragma once
// Encoding messages into frames and decoding frame bodies into messages. One pair per
// message struct, derived from its field list (messages.hpp, field.hpp):
//
//   encode_frame(call_id, msg[, limits])   -> result<std::vector<std::byte>>   (header + body)
//   decode_body<T>(body, call_id)          -> decode_result<T>
//   decode_message(header, body[, limits]) -> decode_result<message>
//   decode_message(frame[, limits])        -> decode_result<message>
//
// Wire encoding of the body (little-endian throughout): unsigned integers as themselves,
// int64 as the u64 of its two's complement, bool as u8 0/1, enums as u8, hash128 as lo then
// hi, strings as u32 length + bytes (no terminator, not checked for UTF-8), vectors as u32
// count + elements (a list of strings: u32 count + each string); nested structs
// (model_shape) inline. No padding, no optional fields: a body is exactly its fields, and
// trailing bytes are an error.

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/detail/wire.hpp>
#include <kvtier/protocol/frame.hpp>
#include <kvtier/protocol/limits.hpp>
#include <kvtier/protocol/messages.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// Bytes of msg's body.
template <wire_message T>
[[nodiscard]] std::size_t body_size(const T& msg) noexcept {
  return detail::fields_size(T::fields(msg));
}

namespace detail {

/// Encodes without any check (tests use it to build frames that break the rules). The
/// header's body_bytes is set from the body; a body above 4 GiB is cut in the header.
template <wire_message T>
[[nodiscard]] std::vector<std::byte> encode_unchecked(frame_header h, const T& msg) {
  const std::size_t size = body_size(msg);
  h.body_bytes = static_cast<std::uint32_t>(size);
  std::vector<std::byte> out(frame_header_size + size);
  encode_header(h, std::span<std::byte, frame_header_size>(out.data(), frame_header_size));
  wire_writer w(std::span<std::byte>(out).subspan(frame_header_size));
  write_fields(w, T::fields(msg));
  return out;
}

}  // namespace detail

/// One frame (header + body) for `msg` with `call_id`. Fails, without encoding anything,
/// with errc::message_too_large when a field is above its limit or the body above
/// lim.max_body_bytes, and with errc::invalid_argument when the message is inconsistent
/// (store_request whose generations do not match its block ids).
template <wire_message T>
[[nodiscard]] result<std::vector<std::byte>> encode_frame(std::uint64_t call_id, const T& msg,
                                                          const limits& lim = {}) {
  if constexpr (requires { msg.wire_error(); }) {
    if (msg.wire_error() != nullptr) return make_error_code(errc::invalid_argument);
  }
  if (detail::check_limits(T::fields(msg))) return make_error_code(errc::message_too_large);
  if (body_size(msg) > lim.max_body_bytes) return make_error_code(errc::message_too_large);
  return detail::encode_unchecked(frame_header{protocol_version, T::type, call_id, 0}, msg);
}

/// The same for a message held in the variant.
[[nodiscard]] inline result<std::vector<std::byte>> encode_frame(std::uint64_t call_id, const message& msg,
                                                                 const limits& lim = {}) {
  return std::visit([&](const auto& m) { return encode_frame(call_id, m, lim); }, msg);
}

/// Decodes a body of type T. Every length is checked against its limit and the bytes left
/// before allocating; a short body, a bad enum or bool byte, trailing bytes and an
/// inconsistent message are errc::protocol_error, a field above its limit
/// errc::message_too_large. `call_id` only goes into the error.
template <wire_message T>
[[nodiscard]] decode_result<T> decode_body(std::span<const std::byte> body, std::uint64_t call_id = 0) {
  T msg;
  detail::wire_reader r(body, name(T::type));
  if (!detail::read_fields(r, T::fields(msg)))
    return decode_error{make_error_code(r.code()), r.reason(), call_id};
  if (r.remaining() != 0)
    return detail::make_error(errc::protocol_error,
                              std::string(name(T::type)) + ": " + std::to_string(r.remaining()) +
                                  " trailing bytes after the last field",
                              call_id);
  if constexpr (requires { msg.wire_error(); }) {
    if (const char* e = msg.wire_error(); e != nullptr)
      return detail::make_error(errc::protocol_error, std::string(name(T::type)) + ": " + e, call_id);
  }
  return msg;
}

namespace detail {
template <std::size_t... I>
decode_result<message> decode_any(message_type t, std::span<const std::byte> body, std::uint64_t call_id,
                                  std::index_sequence<I...>) {
  std::optional<decode_result<message>> out;
  const bool known = ((std::variant_alternative_t<I, message>::type == t
                           ? (out.emplace([&]() -> decode_result<message> {
                                auto r = decode_body<std::variant_alternative_t<I, message>>(body, call_id);
                                if (!r) return std::move(r).error();
                                return message(std::in_place_index<I>, std::move(*r));
                              }()),
                              true)
                           : false) ||
                      ...);
  if (!known)
    return make_error(errc::protocol_error,
                      "unknown message type " + std::to_string(static_cast<std::uint16_t>(t)), call_id);
  return std::move(*out);
}
}  // namespace detail

/// Decodes the body of a frame whose header is `h` (typically from frame_decoder). Checks
/// the version, the body length against the header and `lim`, and the type, then the body.
/// An unknown type or a bad body is answerable: the frame boundaries held, so the
/// connection may go on after an error_response.
[[nodiscard]] inline decode_result<message> decode_message(const frame_header& h, std::span<const std::byte> body,
                                                           const limits& lim = {}) {
  if (h.version != protocol_version)
    return detail::make_error(errc::version_mismatch,
                              "protocol version " + std::to_string(h.version) + ", this side speaks " +
                                  std::to_string(protocol_version),
                              h.call_id);
  if (body.size() != h.body_bytes)
    return detail::make_error(errc::protocol_error,
                              "body of " + std::to_string(body.size()) + " bytes, header says " +
                                  std::to_string(h.body_bytes),
                              h.call_id);
  if (h.body_bytes > lim.max_body_bytes)
    return detail::make_error(errc::message_too_large,
                              "frame body of " + std::to_string(h.body_bytes) + " bytes, limit " +
                                  std::to_string(lim.max_body_bytes),
                              h.call_id);
  return detail::decode_any(h.type, body, h.call_id, std::make_index_sequence<std::variant_size_v<message>>{});
}

[[nodiscard]] inline decode_result<message> decode_message(const frame& f, const limits& lim = {}) {
  return decode_message(f.header, f.body, lim);
}

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
