#pragma once
// A small MessagePack reader for the KV event tests: decodes a payload into a tree so a test
// can look at a batch's fields by name. Reads every format msgpack_writer writes; throws on
// anything else, and on bytes left over.

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::test {

struct msgpack_value {
  enum class kind { nil, boolean, uint, sint, float64, str, bin, array, map };
  kind k = kind::nil;
  bool b = false;
  std::uint64_t u = 0;
  std::int64_t i = 0;
  double d = 0.0;
  std::string s;                     // str and bin
  std::vector<msgpack_value> items;  // array: the values; map: key, value, key, value...

  [[nodiscard]] bool is_nil() const { return k == kind::nil; }
  [[nodiscard]] std::size_t size() const { return k == kind::map ? items.size() / 2 : items.size(); }
  [[nodiscard]] const msgpack_value& operator[](std::size_t n) const { return items.at(n); }
  /// A map's value under a str key; throws when absent.
  [[nodiscard]] const msgpack_value& at(std::string_view key) const {
    for (std::size_t n = 0; n + 1 < items.size(); n += 2) {
      if (items[n].k == kind::str && items[n].s == key) return items[n + 1];
    }
    throw std::out_of_range("msgpack map has no key " + std::string(key));
  }
  [[nodiscard]] bool has(std::string_view key) const {
    for (std::size_t n = 0; n + 1 < items.size(); n += 2) {
      if (items[n].k == kind::str && items[n].s == key) return true;
    }
    return false;
  }
  /// A map's keys in order.
  [[nodiscard]] std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (std::size_t n = 0; n < items.size(); n += 2) out.push_back(items[n].s);
    return out;
  }
  /// Any integer as int64 (a uint above INT64_MAX wraps: use u for those).
  [[nodiscard]] std::int64_t integer() const {
    if (k == kind::uint) return static_cast<std::int64_t>(u);
    if (k == kind::sint) return i;
    throw std::logic_error("msgpack value is not an integer");
  }
};

class msgpack_reader {
 public:
  explicit msgpack_reader(std::string_view bytes) : in_(bytes) {}

  /// The one value of the payload; throws when bytes are left over.
  static msgpack_value decode(std::string_view bytes) {
    msgpack_reader r(bytes);
    msgpack_value v = r.value();
    if (!r.in_.empty()) throw std::runtime_error("msgpack payload has bytes after its value");
    return v;
  }

  msgpack_value value() {
    using k = msgpack_value::kind;
    msgpack_value v;
    const std::uint8_t m = byte();
    if (m <= 0x7f) return uint_value(m);
    if (m >= 0xe0) return sint_value(static_cast<std::int8_t>(m));
    if ((m & 0xf0) == 0x80) return container(k::map, m & 0x0f);
    if ((m & 0xf0) == 0x90) return container(k::array, m & 0x0f);
    if ((m & 0xe0) == 0xa0) return bytes_value(k::str, m & 0x1f);
    switch (m) {
      case 0xc0:
        return v;
      case 0xc2:
        v.k = k::boolean;
        return v;
      case 0xc3:
        v.k = k::boolean;
        v.b = true;
        return v;
      case 0xc4:
        return bytes_value(k::bin, big_endian(1));
      case 0xc5:
        return bytes_value(k::bin, big_endian(2));
      case 0xc6:
        return bytes_value(k::bin, big_endian(4));
      case 0xcb: {
        const std::uint64_t bits = big_endian(8);
        v.k = k::float64;
        std::memcpy(&v.d, &bits, 8);
        return v;
      }
      case 0xcc:
        return uint_value(big_endian(1));
      case 0xcd:
        return uint_value(big_endian(2));
      case 0xce:
        return uint_value(big_endian(4));
      case 0xcf:
        return uint_value(big_endian(8));
      case 0xd0:
        return sint_value(static_cast<std::int8_t>(big_endian(1)));
      case 0xd1:
        return sint_value(static_cast<std::int16_t>(big_endian(2)));
      case 0xd2:
        return sint_value(static_cast<std::int32_t>(big_endian(4)));
      case 0xd3:
        return sint_value(static_cast<std::int64_t>(big_endian(8)));
      case 0xd9:
        return bytes_value(k::str, big_endian(1));
      case 0xda:
        return bytes_value(k::str, big_endian(2));
      case 0xdb:
        return bytes_value(k::str, big_endian(4));
      case 0xdc:
        return container(k::array, big_endian(2));
      case 0xdd:
        return container(k::array, big_endian(4));
      case 0xde:
        return container(k::map, big_endian(2));
      case 0xdf:
        return container(k::map, big_endian(4));
      default:
        throw std::runtime_error("msgpack marker the reader does not know: " + std::to_string(m));
    }
  }

 private:
  std::uint8_t byte() {
    if (in_.empty()) throw std::runtime_error("msgpack payload ends early");
    const auto b = static_cast<std::uint8_t>(in_.front());
    in_.remove_prefix(1);
    return b;
  }
  std::uint64_t big_endian(int n) {
    std::uint64_t v = 0;
    for (int j = 0; j < n; ++j) v = (v << 8) | byte();
    return v;
  }
  static msgpack_value uint_value(std::uint64_t u) {
    msgpack_value v;
    v.k = msgpack_value::kind::uint;
    v.u = u;
    return v;
  }
  static msgpack_value sint_value(std::int64_t i) {
    msgpack_value v;
    v.k = msgpack_value::kind::sint;
    v.i = i;
    return v;
  }
  msgpack_value bytes_value(msgpack_value::kind kind, std::uint64_t n) {
    if (n > in_.size()) throw std::runtime_error("msgpack str/bin longer than the payload");
    msgpack_value v;
    v.k = kind;
    v.s = std::string(in_.substr(0, n));
    in_.remove_prefix(n);
    return v;
  }
  msgpack_value container(msgpack_value::kind kind, std::uint64_t n) {
    msgpack_value v;
    v.k = kind;
    const std::uint64_t values = kind == msgpack_value::kind::map ? 2 * n : n;
    for (std::uint64_t j = 0; j < values; ++j) v.items.push_back(value());
    return v;
  }

  std::string_view in_;
};

}  // namespace kvtier::test
