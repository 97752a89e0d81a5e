#pragma once
// Field descriptors: each message struct lists its members once, in wire order, as a tuple
// of these (its static `fields(self)`), and the codec derives encode, decode, size and
// limit checks from that one list. Names are only for error reasons ("lookup_request.
// chunk_hashes: 70000 elements, limit 65536").
//
//   field(name, member)              an unsigned integer (u8..u64, LE), std::int64_t (its
//                                    two's complement u64, LE), bool (u8 0/1), hash128 (lo
//                                    then hi, LE) or a nested struct (model_shape)
//   bounded(name, member, max)       std::string (u32 length + bytes) or std::vector of
//                                    u32/u64/hash128 (u32 count + elements), at most `max`
//                                    bytes/elements
//   bounded_strings(name, member,    std::vector<std::string> (u32 count, then each string as
//                   max, max_bytes)  a bounded string): at most `max` strings of at most
//                                    `max_bytes` bytes each
//   enumerated(name, member, last)   an enum with underlying type u8, wire values 0..last

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// A fixed-size field (T may be const: the same list serves encode and decode).
template <class T>
struct plain_field {
  std::string_view name;
  T& value;
};

/// A length-prefixed field whose length (string bytes, vector elements) is at most `max`.
template <class T>
struct bounded_field {
  std::string_view name;
  T& value;
  std::uint32_t max;
};

/// A length-prefixed list of strings: at most `max` strings, each at most `max_bytes` bytes.
template <class T>
struct string_list_field {
  std::string_view name;
  T& value;
  std::uint32_t max;
  std::uint32_t max_bytes;
};

/// An enumeration sent as its u8 underlying value; values above `last` are refused.
template <class E>
struct enum_field {
  std::string_view name;
  E& value;
  std::remove_const_t<E> last;
};

template <class T>
[[nodiscard]] constexpr plain_field<T> field(std::string_view name, T& value) noexcept {
  return {name, value};
}
template <class T>
[[nodiscard]] constexpr bounded_field<T> bounded(std::string_view name, T& value, std::uint32_t max) noexcept {
  return {name, value, max};
}
template <class T>
requires std::same_as<std::remove_const_t<T>, std::vector<std::string>>
[[nodiscard]] constexpr string_list_field<T> bounded_strings(std::string_view name, T& value, std::uint32_t max,
                                                             std::uint32_t max_bytes) noexcept {
  return {name, value, max, max_bytes};
}
template <class E>
requires std::is_enum_v<std::remove_const_t<E>>
[[nodiscard]] constexpr enum_field<E> enumerated(std::string_view name, E& value,
                                                 std::remove_const_t<E> last) noexcept {
  return {name, value, last};
}

/// The wire fields of model_shape (core/kv_layout.hpp), nested in register_kv_request.
template <class S>
requires std::same_as<std::remove_const_t<S>, model_shape>
[[nodiscard]] constexpr auto model_shape_fields(S& s) noexcept {
  return std::tuple{field("num_layers", s.num_layers), field("num_kv_heads", s.num_kv_heads),
                    field("head_dim", s.head_dim), enumerated("dtype", s.dtype, last_dtype_kind),
                    enumerated("attention", s.attention, attention_kind::mla)};
}

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
