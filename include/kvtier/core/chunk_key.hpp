#pragma once
// chunk_key: the identity of one stored KV object, the KV of one chunk of tokens for one
// model namespace and one tensor-parallel rank. Standard library only.

#include <kvtier/config.hpp>

#include <array>
#include <bit>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

/// A 128-bit hash value (the rolling prefix hash of a chunk).
struct hash128 {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;

  friend constexpr auto operator<=>(const hash128&, const hash128&) = default;

  /// 32 lowercase hex digits, most significant first (hi then lo).
  [[nodiscard]] std::string to_hex() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s(32, '0');
    for (int i = 0; i < 16; ++i) {
      s[static_cast<std::size_t>(15 - i)] = digits[(hi >> (4 * i)) & 0xf];
      s[static_cast<std::size_t>(31 - i)] = digits[(lo >> (4 * i)) & 0xf];
    }
    return s;
  }

  /// Parses what to_hex() writes; nullopt on any other input.
  [[nodiscard]] static std::optional<hash128> from_hex(std::string_view s) noexcept {
    if (s.size() != 32) return std::nullopt;
    hash128 h;
    for (std::size_t i = 0; i < 32; ++i) {
      const char c = s[i];
      std::uint64_t v = 0;
      if (c >= '0' && c <= '9') v = static_cast<std::uint64_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v = static_cast<std::uint64_t>(c - 'a' + 10);
      else return std::nullopt;
      std::uint64_t& word = i < 16 ? h.hi : h.lo;
      word = (word << 4) | v;
    }
    return h;
  }
};

/// The key of one chunk object. `model_id` names a model namespace (model name plus KV
/// layout plus an optional tenant salt, see make_model_id in token_hasher.hpp), so objects of
/// incompatible layouts never meet; `world_size` and `rank` pick one tensor-parallel shard.
struct chunk_key {
  std::uint64_t model_id = 0;
  std::uint16_t world_size = 1;
  std::uint16_t rank = 0;
  hash128 hash;

  friend constexpr auto operator<=>(const chunk_key&, const chunk_key&) = default;

  /// Bytes of the portable encoding below.
  static constexpr std::size_t wire_size = 8 + 2 + 2 + 16;

  /// Little-endian encoding, the same on every machine: model_id, world_size, rank, hash.lo,
  /// hash.hi. Used in on-disk headers, Redis keys and protocol messages.
  void encode(std::span<std::byte, wire_size> out) const noexcept {
    std::size_t at = 0;
    put(out, at, model_id, 8);
    put(out, at, world_size, 2);
    put(out, at, rank, 2);
    put(out, at, hash.lo, 8);
    put(out, at, hash.hi, 8);
  }

  [[nodiscard]] std::array<std::byte, wire_size> encode() const noexcept {
    std::array<std::byte, wire_size> a{};
    encode(std::span<std::byte, wire_size>(a));
    return a;
  }

  [[nodiscard]] static chunk_key decode(std::span<const std::byte, wire_size> in) noexcept {
    std::size_t at = 0;
    chunk_key k;
    k.model_id = get(in, at, 8);
    k.world_size = static_cast<std::uint16_t>(get(in, at, 2));
    k.rank = static_cast<std::uint16_t>(get(in, at, 2));
    k.hash.lo = get(in, at, 8);
    k.hash.hi = get(in, at, 8);
    return k;
  }

  /// "model_id/world_size/rank/hash" in hex, for logs and file names.
  [[nodiscard]] std::string to_string() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string m(16, '0');
    for (int i = 0; i < 16; ++i) m[static_cast<std::size_t>(15 - i)] = digits[(model_id >> (4 * i)) & 0xf];
    return m + '/' + std::to_string(world_size) + '/' + std::to_string(rank) + '/' + hash.to_hex();
  }

 private:
  static void put(std::span<std::byte> out, std::size_t& at, std::uint64_t v, int bytes) noexcept {
    for (int i = 0; i < bytes; ++i) out[at++] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
  }
  static std::uint64_t get(std::span<const std::byte> in, std::size_t& at, int bytes) noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(in[at++]) << (8 * i);
    return v;
  }
};

/// Hash for unordered containers. The chunk hash is already uniform, so mixing in the other
/// fields with one multiply is enough.
struct chunk_key_hash {
  [[nodiscard]] std::size_t operator()(const chunk_key& k) const noexcept {
    std::uint64_t h = k.hash.lo ^ std::rotl(k.hash.hi, 29) ^ std::rotl(k.model_id, 17) ^
                      (static_cast<std::uint64_t>(k.world_size) << 48) ^
                      (static_cast<std::uint64_t>(k.rank) << 32);
    h *= 0x9e3779b97f4a7c15ULL;
    return static_cast<std::size_t>(h ^ (h >> 32));
  }
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

template <>
struct std::hash<kvtier::chunk_key> : kvtier::chunk_key_hash {};
