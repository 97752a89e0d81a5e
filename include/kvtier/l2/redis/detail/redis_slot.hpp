#pragma once
// Redis Cluster key slots: CRC16 (XMODEM: polynomial 0x1021, initial value 0, no reflection,
// no final xor, the one of the Redis Cluster specification) of the key, or of its hash tag,
// modulo 16384. Standard library only.
//
// Hash tag (cluster-spec "Hash tags"): when the key contains '{' and, after it, a '}' with at
// least one character between them, only the bytes between the FIRST '{' and the first '}'
// after it are hashed. "{user1000}.following" and "{user1000}.followers" share a slot;
// "foo{}{bar}" hashes the whole key (empty first tag); "foo{{bar}}zap" hashes "{bar".

#include <kvtier/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

inline constexpr std::uint16_t redis_cluster_slots = 16384;

namespace redis_slot_detail {
constexpr std::array<std::uint16_t, 256> make_crc16_table() noexcept {
  std::array<std::uint16_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t crc = i << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? ((crc << 1) ^ 0x1021) : (crc << 1);
    t[i] = static_cast<std::uint16_t>(crc & 0xffff);
  }
  return t;
}
inline constexpr std::array<std::uint16_t, 256> crc16_table = make_crc16_table();
}  // namespace redis_slot_detail

/// CRC16/XMODEM of bytes ("123456789" -> 0x31C3).
[[nodiscard]] constexpr std::uint16_t redis_crc16(std::string_view bytes) noexcept {
  std::uint16_t crc = 0;
  for (char c : bytes) {
    const auto b = static_cast<std::uint8_t>(c);
    crc = static_cast<std::uint16_t>((crc << 8) ^ redis_slot_detail::crc16_table[((crc >> 8) ^ b) & 0xff]);
  }
  return crc;
}

/// The part of a key that decides its slot (the hash tag when there is a non-empty one).
[[nodiscard]] constexpr std::string_view redis_hash_tag(std::string_view key) noexcept {
  const auto open = key.find('{');
  if (open == std::string_view::npos) return key;
  const auto close = key.find('}', open + 1);
  if (close == std::string_view::npos || close == open + 1) return key;
  return key.substr(open + 1, close - open - 1);
}

/// The cluster slot of a key, in [0, 16384): what CLUSTER KEYSLOT answers.
[[nodiscard]] constexpr std::uint16_t redis_key_slot(std::string_view key) noexcept {
  return static_cast<std::uint16_t>(redis_crc16(redis_hash_tag(key)) & (redis_cluster_slots - 1));
}

static_assert(redis_crc16("123456789") == 0x31C3);
static_assert(redis_key_slot("123456789") == 12739);

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
