#pragma once
// The body codec behind codec.hpp: size, limit check, write and read of one field
// descriptor (field.hpp), and of a whole field list. The reader checks every length against
// the field's limit and against the bytes left before it allocates, never reads past its
// span, and never throws on bad input (only std::bad_alloc can escape, for legal sizes).

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/error.hpp>
#include <kvtier/protocol/field.hpp>
#include <kvtier/protocol/frame.hpp>

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {
namespace detail {

template <class T>
concept wire_unsigned = std::same_as<T, std::uint8_t> || std::same_as<T, std::uint16_t> ||
                        std::same_as<T, std::uint32_t> || std::same_as<T, std::uint64_t>;
/// Signed integers travel as the u64 of their two's complement (C++20 defines both
/// conversions), so -1 is ff ff ff ff ff ff ff ff.
template <class T>
concept wire_signed = std::same_as<T, std::int64_t>;

/// Element types a bounded vector may hold.
template <class T>
concept wire_element = std::same_as<T, std::uint32_t> || std::same_as<T, std::uint64_t> || std::same_as<T, hash128>;

template <class T>
inline constexpr bool is_vector_v = false;
template <class T, class A>
inline constexpr bool is_vector_v<std::vector<T, A>> = true;

template <class T>
constexpr std::size_t element_size() noexcept {
  if constexpr (std::same_as<T, hash128>) return 16;
  else return sizeof(T);
}

// On a little-endian host the wire image of u32/u64/hash128 arrays is their memory image
// (hash128 is {lo, hi}, both u64): vectors are copied with one memcpy (4 MiB of block ids in
// ~0.3 ms instead of a per-element loop).
inline constexpr bool native_wire = std::endian::native == std::endian::little && sizeof(hash128) == 16 &&
                                    offsetof(hash128, lo) == 0 && offsetof(hash128, hi) == 8;

// --------------------------------------------------------------------------------------
// Size and limits.
// --------------------------------------------------------------------------------------

template <class T>
constexpr std::size_t wire_size(const plain_field<T>& f) noexcept;
template <class T>
constexpr std::size_t wire_size(const bounded_field<T>& f) noexcept;
template <class E>
constexpr std::size_t wire_size(const enum_field<E>&) noexcept {
  static_assert(sizeof(E) == 1, "enumerations travel as one byte");
  return 1;
}
template <class T>
constexpr std::size_t wire_size(const string_list_field<T>& f) noexcept {
  std::size_t n = 4;
  for (const std::string& e : f.value) n += 4 + e.size();
  return n;
}

template <class Tuple>
constexpr std::size_t fields_size(const Tuple& fields) noexcept {
  return std::apply([](const auto&... f) { return (std::size_t{0} + ... + wire_size(f)); }, fields);
}

template <class T>
constexpr std::size_t wire_size(const plain_field<T>& f) noexcept {
  using V = std::remove_const_t<T>;
  if constexpr (std::same_as<V, bool>) return 1;
  else if constexpr (wire_unsigned<V>) return sizeof(V);
  else if constexpr (wire_signed<V>) return 8;
  else if constexpr (std::same_as<V, hash128>) return 16;
  else if constexpr (std::same_as<V, model_shape>) return fields_size(model_shape_fields(f.value));
  else static_assert(sizeof(V) == 0, "this type cannot travel as a plain field");
}

template <class T>
constexpr std::size_t wire_size(const bounded_field<T>& f) noexcept {
  using V = std::remove_const_t<T>;
  if constexpr (std::same_as<V, std::string>) return 4 + f.value.size();
  else if constexpr (is_vector_v<V>) {
    static_assert(wire_element<typename V::value_type>, "vectors hold u32, u64 or hash128");
    return 4 + f.value.size() * element_size<typename V::value_type>();
  } else static_assert(sizeof(V) == 0, "bounded fields are std::string or std::vector");
}

/// The first field above its limit, as (name, size, limit); nullopt when all fit.
struct limit_violation {
  std::string_view name;
  std::size_t size = 0;
  std::uint32_t limit = 0;
};

template <class Tuple>
std::optional<limit_violation> check_limits(const Tuple& fields) noexcept;

template <class F>
std::optional<limit_violation> check_limit(const F& f) noexcept {
  if constexpr (requires { f.max_bytes; }) {  // a string list: its count, then each string
    if (f.value.size() > f.max) return limit_violation{f.name, f.value.size(), f.max};
    for (const std::string& e : f.value)
      if (e.size() > f.max_bytes) return limit_violation{f.name, e.size(), f.max_bytes};
  } else if constexpr (requires { f.max; }) {
    if (f.value.size() > f.max) return limit_violation{f.name, f.value.size(), f.max};
  } else if constexpr (requires { model_shape_fields(f.value); }) {
    return check_limits(model_shape_fields(f.value));
  }
  return std::nullopt;
}

template <class Tuple>
std::optional<limit_violation> check_limits(const Tuple& fields) noexcept {
  std::optional<limit_violation> v;
  std::apply([&](const auto&... f) { static_cast<void>(((v = check_limit(f), !v.has_value()) && ...)); }, fields);
  return v;
}

// --------------------------------------------------------------------------------------
// Writing (into a buffer sized with wire_size, so no checks).
// --------------------------------------------------------------------------------------

class wire_writer {
 public:
  explicit wire_writer(std::span<std::byte> out) noexcept : p_(out.data()) {}

  template <class U>
  void put(U v) noexcept {
    store_le<U>(p_, v);
    p_ += sizeof(U);
  }
  void put_bytes(const void* data, std::size_t n) noexcept {
    if (n != 0) std::memcpy(p_, data, n);
    p_ += n;
  }
  [[nodiscard]] std::byte* position() const noexcept { return p_; }

 private:
  std::byte* p_;
};

template <class Tuple>
void write_fields(wire_writer& w, const Tuple& fields) noexcept;

template <class T>
void write_field(wire_writer& w, const plain_field<T>& f) noexcept {
  using V = std::remove_const_t<T>;
  if constexpr (std::same_as<V, bool>) w.put<std::uint8_t>(f.value ? 1 : 0);
  else if constexpr (wire_unsigned<V>) w.put<V>(f.value);
  else if constexpr (wire_signed<V>) w.put<std::uint64_t>(static_cast<std::uint64_t>(f.value));
  else if constexpr (std::same_as<V, hash128>) {
    w.put<std::uint64_t>(f.value.lo);
    w.put<std::uint64_t>(f.value.hi);
  } else write_fields(w, model_shape_fields(f.value));
}

template <class E>
void write_field(wire_writer& w, const enum_field<E>& f) noexcept {
  w.put<std::uint8_t>(static_cast<std::uint8_t>(f.value));
}

template <class T>
void write_field(wire_writer& w, const string_list_field<T>& f) noexcept {
  w.put<std::uint32_t>(static_cast<std::uint32_t>(f.value.size()));
  for (const std::string& e : f.value) {
    w.put<std::uint32_t>(static_cast<std::uint32_t>(e.size()));
    w.put_bytes(e.data(), e.size());
  }
}

template <class T>
void write_field(wire_writer& w, const bounded_field<T>& f) noexcept {
  using V = std::remove_const_t<T>;
  w.put<std::uint32_t>(static_cast<std::uint32_t>(f.value.size()));
  if constexpr (std::same_as<V, std::string>) {
    w.put_bytes(f.value.data(), f.value.size());
  } else {
    using E = typename V::value_type;
    if constexpr (native_wire) {
      w.put_bytes(f.value.data(), f.value.size() * element_size<E>());
    } else {
      for (const E& e : f.value) {
        if constexpr (std::same_as<E, hash128>) {
          w.put<std::uint64_t>(e.lo);
          w.put<std::uint64_t>(e.hi);
        } else {
          w.put<E>(e);
        }
      }
    }
  }
}

template <class Tuple>
void write_fields(wire_writer& w, const Tuple& fields) noexcept {
  std::apply([&](const auto&... f) { (write_field(w, f), ...); }, fields);
}

// --------------------------------------------------------------------------------------
// Reading.
// --------------------------------------------------------------------------------------

/// A bounds-checked cursor over one body. The first failure is kept (code and reason) and
/// every later read fails.
class wire_reader {
 public:
  wire_reader(std::span<const std::byte> in, std::string_view message_name) noexcept
      : in_(in), message_(message_name) {}

  [[nodiscard]] std::size_t remaining() const noexcept { return in_.size() - at_; }
  [[nodiscard]] bool failed() const noexcept { return code_ != errc{}; }
  [[nodiscard]] errc code() const noexcept { return code_; }
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

  /// The next n bytes, or null (and a truncation failure) when fewer are left.
  [[nodiscard]] const std::byte* take(std::size_t n, std::string_view field) {
    if (failed()) return nullptr;
    if (n > remaining()) {
      fail(errc::protocol_error, field,
           "truncated: needs " + std::to_string(n) + " bytes, " + std::to_string(remaining()) + " left");
      return nullptr;
    }
    const std::byte* p = in_.data() + at_;
    at_ += n;
    return p;
  }

  template <class U>
  [[nodiscard]] bool get(U& v, std::string_view field) {
    const std::byte* p = take(sizeof(U), field);
    if (p == nullptr) return false;
    v = load_le<U>(p);
    return true;
  }

  void fail(errc e, std::string_view field, std::string_view what) {
    if (failed()) return;
    code_ = e;
    reason_.reserve(message_.size() + field.size() + what.size() + 3);
    reason_.append(message_).append(".").append(field).append(": ").append(what);
  }

 private:
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
  std::string_view message_;
  errc code_{};
  std::string reason_;
};

template <class Tuple>
bool read_fields(wire_reader& r, const Tuple& fields);

template <class T>
bool read_field(wire_reader& r, const plain_field<T>& f) {
  if constexpr (std::same_as<T, bool>) {
    std::uint8_t b = 0;
    if (!r.get(b, f.name)) return false;
    if (b > 1) {
      r.fail(errc::protocol_error, f.name, "boolean byte " + std::to_string(b) + " is neither 0 nor 1");
      return false;
    }
    f.value = b == 1;
    return true;
  } else if constexpr (wire_unsigned<T>) {
    return r.get(f.value, f.name);
  } else if constexpr (wire_signed<T>) {
    std::uint64_t u = 0;
    if (!r.get(u, f.name)) return false;
    f.value = static_cast<T>(u);
    return true;
  } else if constexpr (std::same_as<T, hash128>) {
    return r.get(f.value.lo, f.name) && r.get(f.value.hi, f.name);
  } else {
    return read_fields(r, model_shape_fields(f.value));
  }
}

template <class E>
bool read_field(wire_reader& r, const enum_field<E>& f) {
  std::uint8_t b = 0;
  if (!r.get(b, f.name)) return false;
  if (b > static_cast<std::uint8_t>(f.last)) {
    r.fail(errc::protocol_error, f.name,
           "value " + std::to_string(b) + " above the last known " +
               std::to_string(static_cast<unsigned>(static_cast<std::uint8_t>(f.last))));
    return false;
  }
  f.value = static_cast<E>(b);
  return true;
}

template <class T>
bool read_field(wire_reader& r, const bounded_field<T>& f) {
  std::uint32_t n = 0;
  if (!r.get(n, f.name)) return false;
  // The limit first (the sender broke a rule), then the bytes left (a lie about the length);
  // only then allocate, so no header can make us allocate more than the body holds.
  if (n > f.max) {
    r.fail(errc::message_too_large, f.name,
           std::to_string(n) + (std::same_as<T, std::string> ? " bytes" : " elements") + ", limit " +
               std::to_string(f.max));
    return false;
  }
  if constexpr (std::same_as<T, std::string>) {
    const std::byte* p = r.take(n, f.name);
    if (p == nullptr) return false;
    f.value.assign(reinterpret_cast<const char*>(p), n);
    return true;
  } else {
    using E = typename T::value_type;
    const std::size_t bytes = std::size_t{n} * element_size<E>();
    const std::byte* p = r.take(bytes, f.name);
    if (p == nullptr) return false;
    f.value.resize(n);
    if constexpr (native_wire) {
      if (bytes != 0) std::memcpy(f.value.data(), p, bytes);
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (std::same_as<E, hash128>) {
          f.value[i].lo = load_le<std::uint64_t>(p + 16 * i);
          f.value[i].hi = load_le<std::uint64_t>(p + 16 * i + 8);
        } else {
          f.value[i] = load_le<E>(p + sizeof(E) * i);
        }
      }
    }
    return true;
  }
}

template <class T>
bool read_field(wire_reader& r, const string_list_field<T>& f) {
  std::uint32_t n = 0;
  if (!r.get(n, f.name)) return false;
  if (n > f.max) {
    r.fail(errc::message_too_large, f.name, std::to_string(n) + " strings, limit " + std::to_string(f.max));
    return false;
  }
  // Each string takes at least its u32 length: a count the body cannot hold is refused before
  // the vector is allocated.
  if (std::size_t{n} * 4 > r.remaining()) {
    r.fail(errc::protocol_error, f.name,
           "truncated: " + std::to_string(n) + " strings need at least " + std::to_string(std::size_t{n} * 4) +
               " bytes, " + std::to_string(r.remaining()) + " left");
    return false;
  }
  f.value.resize(n);
  for (std::string& e : f.value) {
    std::uint32_t len = 0;
    if (!r.get(len, f.name)) return false;
    if (len > f.max_bytes) {
      r.fail(errc::message_too_large, f.name,
             "a string of " + std::to_string(len) + " bytes, limit " + std::to_string(f.max_bytes));
      return false;
    }
    const std::byte* p = r.take(len, f.name);
    if (p == nullptr) return false;
    e.assign(reinterpret_cast<const char*>(p), len);
  }
  return true;
}

template <class Tuple>
bool read_fields(wire_reader& r, const Tuple& fields) {
  return std::apply([&](const auto&... f) { return (read_field(r, f) && ...); }, fields);
}

}  // namespace detail
}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
