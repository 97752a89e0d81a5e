// Fuzz target: the message codec (protocol/codec.hpp, detail/wire.hpp, messages.hpp), for
// every alternative of protocol::message: the bytes of a frame body the server (requests)
// or the connector (responses) decodes.
//
// Input: the message type (u16 LE, the frame header's field), then the body.
//
// Oracle: the encoding is canonical (a body is exactly its fields, no padding, no optional
// parts), so a body that decodes re-encodes to exactly its bytes; decode_message() on a
// header of that type agrees with decode_body<T>(); a refusal is protocol_error or
// message_too_large with a reason that names the message; an unknown type is refused as
// such. The list of types comes from the variant itself, so a message added to
// messages.hpp is fuzzed without touching this file (its seeds: codec_seeds.cpp).

#include <kvtier/protocol/codec.hpp>

#include "fuzz_support.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <variant>

namespace {

namespace p = kvtier::protocol;
using kvtier::errc;
using kvtier::fuzz::fuzz_input;

template <class T>
void check_type(std::span<const std::byte> body, std::uint64_t call_id) {
  const std::string name(p::name(T::type));
  auto r = p::decode_body<T>(body, call_id);

  p::frame_header h{p::protocol_version, T::type, call_id, static_cast<std::uint32_t>(body.size())};
  auto any = p::decode_message(h, body);
  FUZZ_CHECK(any.has_value() == r.has_value(), name + ": decode_message and decode_body disagree");

  if (!r) {
    const auto& e = r.error();
    FUZZ_CHECK(e.code == make_error_code(errc::protocol_error) || e.code == make_error_code(errc::message_too_large),
               name + ": unexpected error code " + e.code.message());
    FUZZ_CHECK(e.reason.starts_with(name), name + ": the reason does not name the message: " + e.reason);
    FUZZ_CHECK(e.call_id == call_id, name + ": the error lost the call id");
    FUZZ_CHECK(any.error().code == e.code && any.error().reason == e.reason,
               name + ": decode_message gave another error");
    return;
  }
  FUZZ_CHECK(std::holds_alternative<T>(*any) && std::get<T>(*any) == *r,
             name + ": decode_message gave another message");
  FUZZ_CHECK(p::body_size(*r) == body.size(), name + ": body_size() differs from the decoded body's size");

  auto frame = p::encode_frame(call_id, *r);
  FUZZ_CHECK(frame.has_value(), name + ": a decoded message does not encode: " + frame.error().message());
  FUZZ_CHECK(frame->size() == p::frame_header_size + body.size() &&
                 (body.empty() || std::memcmp(frame->data() + p::frame_header_size, body.data(), body.size()) == 0),
             name + ": re-encoding changed the body (the encoding must be canonical)");
  const auto hdr =
      p::read_header(std::span<const std::byte, p::frame_header_size>(frame->data(), p::frame_header_size));
  FUZZ_CHECK(hdr == h, name + ": the encoded header differs");
}

template <std::size_t... I>
bool dispatch(std::uint16_t type, std::span<const std::byte> body, std::uint64_t call_id, std::index_sequence<I...>) {
  return ((static_cast<std::uint16_t>(std::variant_alternative_t<I, p::message>::type) == type
               ? (check_type<std::variant_alternative_t<I, p::message>>(body, call_id), true)
               : false) ||
          ...);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz_input in(data, size);
  const auto type = in.take<std::uint16_t>();
  const auto body = in.rest();
  if (body.size() > p::default_max_body_bytes) return 0;  // decode_message refuses it first
  constexpr std::uint64_t call_id = 0x1122334455667788ULL;
  const bool known = dispatch(type, body, call_id, std::make_index_sequence<std::variant_size_v<p::message>>{});
  FUZZ_CHECK(known == p::is_known(type), "is_known() disagrees with the variant");
  if (!known) {
    p::frame_header h{p::protocol_version, static_cast<p::message_type>(type), call_id,
                      static_cast<std::uint32_t>(body.size())};
    auto m = p::decode_message(h, body);
    FUZZ_CHECK(!m && m.error().code == make_error_code(errc::protocol_error) &&
                   m.error().reason.find("unknown message type") != std::string::npos,
               "an unknown message type was not refused as such");
  }
  return 0;
}
