#pragma once
// msgpack_writer: the MessagePack encoder the KV events use (vllm_format.hpp), appending to a
// std::string. Only what an encoder of vLLM's EventBatch needs: nil, bool, integers, float64,
// str, bin and the array and map headers; each value in its smallest form, as the msgpack
// spec (github.com/msgpack/msgpack/blob/master/spec.md) and msgspec / msgpack-python write
// it, so our bytes equal theirs for the same value.
//
// Why our own: Debian 12's libmsgpack-cxx-dev depends on libboost-dev 1.74, which cannot be
// installed beside the libboost1.81-dev kvtier builds with; ~150 lines here cost less than a
// second Boost. Standard library only.

#include <kvtier/config.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

/// Appends MessagePack values to a string it does not own. A map or an array is its header
/// (the number of entries) followed by that many values (a map: key, value, key, value...);
/// the writer does not check that the caller writes as many as it announced.
class msgpack_writer {
 public:
  explicit msgpack_writer(std::string& out) noexcept : out_(&out) {}

  [[nodiscard]] std::string& out() const noexcept { return *out_; }

  void nil() { byte(0xc0); }
  void boolean(bool v) { byte(v ? 0xc3 : 0xc2); }

  /// A non-negative value: positive fixint (0..127), uint8, uint16, uint32 or uint64.
  void unsigned_int(std::uint64_t v) {
    if (v <= 0x7f) {
      byte(static_cast<std::uint8_t>(v));
    } else if (v <= 0xff) {
      byte(0xcc);
      big_endian(v, 1);
    } else if (v <= 0xffff) {
      byte(0xcd);
      big_endian(v, 2);
    } else if (v <= 0xffffffffU) {
      byte(0xce);
      big_endian(v, 4);
    } else {
      byte(0xcf);
      big_endian(v, 8);
    }
  }

  /// A signed value: a non-negative one as unsigned_int (what msgspec and msgpack-python do),
  /// a negative one as negative fixint (-32..-1), int8, int16, int32 or int64.
  void signed_int(std::int64_t v) {
    if (v >= 0) return unsigned_int(static_cast<std::uint64_t>(v));
    const auto bits = static_cast<std::uint64_t>(v);  // two's complement
    if (v >= -32) {
      byte(static_cast<std::uint8_t>(bits & 0xff));
    } else if (v >= std::numeric_limits<std::int8_t>::min()) {
      byte(0xd0);
      big_endian(bits, 1);
    } else if (v >= std::numeric_limits<std::int16_t>::min()) {
      byte(0xd1);
      big_endian(bits, 2);
    } else if (v >= std::numeric_limits<std::int32_t>::min()) {
      byte(0xd2);
      big_endian(bits, 4);
    } else {
      byte(0xd3);
      big_endian(bits, 8);
    }
  }

  /// Always float64 (0xcb), as Python's float is: a reader never sees float32.
  void float64(double v) {
    byte(0xcb);
    big_endian(std::bit_cast<std::uint64_t>(v), 8);
  }

  /// UTF-8 text (the caller's to be valid): fixstr, str8, str16 or str32.
  void str(std::string_view s) {
    const std::uint64_t n = s.size();
    if (n <= 31) {
      byte(static_cast<std::uint8_t>(0xa0 | n));
    } else {
      sized_header(n, 0xd9, 0xda, 0xdb);
    }
    out_->append(s);
  }

  /// Raw bytes (Python's bytes): bin8, bin16 or bin32.
  void bin(std::span<const std::byte> b) {
    sized_header(b.size(), 0xc4, 0xc5, 0xc6);
    out_->append(reinterpret_cast<const char*>(b.data()), b.size());
  }
  void bin(std::string_view b) { bin(std::as_bytes(std::span<const char>(b.data(), b.size()))); }

  /// Header of an array of n values: fixarray (n <= 15), array16 or array32.
  void array_header(std::size_t n) { container_header(n, 0x90, 0xdc, 0xdd); }
  /// Header of a map of n key-value pairs: fixmap (n <= 15), map16 or map32.
  void map_header(std::size_t n) { container_header(n, 0x80, 0xde, 0xdf); }

 private:
  void byte(std::uint8_t b) { out_->push_back(static_cast<char>(b)); }

  void big_endian(std::uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) byte(static_cast<std::uint8_t>(v >> (8 * i)));
  }

  static void check_length(std::uint64_t n) {
    if (n > 0xffffffffU) throw std::length_error("msgpack_writer: a value longer than 2^32-1 cannot be encoded");
  }

  // str and bin: an 8-, 16- or 32-bit length after the marker.
  void sized_header(std::uint64_t n, std::uint8_t m8, std::uint8_t m16, std::uint8_t m32) {
    check_length(n);
    if (n <= 0xff) {
      byte(m8);
      big_endian(n, 1);
    } else if (n <= 0xffff) {
      byte(m16);
      big_endian(n, 2);
    } else {
      byte(m32);
      big_endian(n, 4);
    }
  }

  // array and map: the count in the marker's low 4 bits up to 15, then 16- or 32-bit.
  void container_header(std::uint64_t n, std::uint8_t fix, std::uint8_t m16, std::uint8_t m32) {
    check_length(n);
    if (n <= 15) {
      byte(static_cast<std::uint8_t>(fix | n));
    } else if (n <= 0xffff) {
      byte(m16);
      big_endian(n, 2);
    } else {
      byte(m32);
      big_endian(n, 4);
    }
  }

  std::string* out_;
};

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
