#pragma once
// The on-disk layout of l2::disk_backend: where an object lives, what its file holds, and
// how a file found on disk is judged at start-up. Pure functions, no I/O (the backend does
// the I/O); see docs/l2-disk.md for the whole format.
//
//   <path>/FORMAT                    "kvtier-disk 1\n": marks the directory as ours
//   <path>/LOCK                      flock(LOCK_EX) by the one process using the directory
//   <path>/tmp/<key>.<seq>.tmp       objects being written (deleted at start-up)
//   <path>/objects/<ss>/<key>.kvo    committed objects; <ss> = shard_of(key) in 2 hex digits
//
// <key> is the 56 lowercase hex digits of chunk_key::encode() (28 bytes), so a file name
// names its key and a header whose key differs from its name is caught. An object file is
// one 4 KiB header block (the 72-byte object_header of object_format.hpp, then the segment
// table of a segmented object, zero padded) then the payload, padded with zeros to a whole
// 4 KiB block: every O_DIRECT transfer stays aligned, and the file size is exactly
// object_file_bytes(payload), which the recovery scan checks (a torn or truncated file fails
// it). The backend writes every non-empty object segmented, in disk_segment_bytes(payload)
// segments; it reads both segmented objects and the unsegmented ones of earlier versions.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l2/object_format.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

/// The unit of O_DIRECT alignment and of the file layout.
inline constexpr std::size_t disk_block_bytes = 4096;

/// Objects are spread over 256 directories: ~4k objects per directory at 1 TiB of 1 MiB
/// objects keeps ext4's htree lookups and the start-up scan's readdir short, and 256 open
/// directory fds (for the directory fsync after each batch) are cheap.
inline constexpr unsigned disk_shard_count = 256;

/// Hex digits of an encoded key.
inline constexpr std::size_t key_hex_chars = chunk_key::wire_size * 2;
inline constexpr std::string_view object_suffix = ".kvo";
inline constexpr std::string_view temp_suffix = ".tmp";
inline constexpr std::string_view format_marker = "kvtier-disk 1\n";

/// The largest payload a header may claim (1 TiB): guards the size arithmetic against a
/// header with a huge length (a 64-bit wrap would make a tiny file look complete).
inline constexpr std::uint64_t max_object_bytes = std::uint64_t{1} << 40;

[[nodiscard]] constexpr std::uint64_t round_up_block(std::uint64_t n) noexcept {
  return (n + disk_block_bytes - 1) & ~std::uint64_t{disk_block_bytes - 1};
}

/// The segment size the backend writes an object of `payload` bytes with (0 for an empty
/// payload: no segment, written unsegmented). ~16 segments per object, so that a layer-wise
/// reader gets the object in 16 steps (a 32 MiB object: 2 MiB segments, ~0.3 ms each at
/// 7 GB/s); none under 128 KiB, where a segment would cost more in completions and observer
/// calls than it saves in latency (a 128 KiB read is ~20 us at NVMe speeds, about one
/// completion's round trip through the I/O thread), so objects up to 128 KiB have one
/// segment; a multiple of 4 KiB (O_DIRECT). So at most 16 segments: the table (at most
/// max_object_segments) always fits the header block.
[[nodiscard]] constexpr std::uint64_t disk_segment_bytes(std::uint64_t payload) noexcept {
  if (payload == 0) return 0;
  constexpr std::uint64_t target_segments = 16;
  constexpr std::uint64_t min_segment = std::uint64_t{128} << 10;
  const std::uint64_t per = payload / target_segments + (payload % target_segments != 0 ? 1 : 0);
  return round_up_block(per > min_segment ? per : min_segment);
}
static_assert(segment_count(max_object_bytes, disk_segment_bytes(max_object_bytes)) <= 16);
static_assert(segment_count((std::uint64_t{3} << 20) + 100, disk_segment_bytes((std::uint64_t{3} << 20) + 100)) == 16);
static_assert(disk_segment_bytes(100) == (std::uint64_t{128} << 10));

/// Payload bytes up to the end of segment s of a `payload`-byte object in segments of
/// `segment_bytes` (0: unsegmented, its one segment the whole payload). Loads and stores
/// close a segment's checksum there.
[[nodiscard]] constexpr std::uint64_t segment_end(std::uint64_t segment_bytes, std::uint64_t payload,
                                                  std::uint64_t s) noexcept {
  if (segment_bytes == 0) return payload;
  const std::uint64_t end = segment_bytes * (s + 1);
  return end < payload ? end : payload;
}
static_assert(segment_end(0, 100, 0) == 100 && segment_end(4096, 10000, 1) == 8192 &&
              segment_end(4096, 10000, 2) == 10000);

/// The bytes after the header in an object's header block: where a segmented object's table
/// lives.
[[nodiscard]] inline std::span<std::byte> table_area(std::byte* header_block) noexcept {
  return {header_block + object_header_bytes, disk_block_bytes - object_header_bytes};
}
[[nodiscard]] inline std::span<const std::byte> table_area(std::span<const std::byte> header_block) noexcept {
  return header_block.subspan(object_header_bytes, disk_block_bytes - object_header_bytes);
}

/// Bytes of the file of an object with `payload` bytes: header block + padded payload.
[[nodiscard]] constexpr std::uint64_t object_file_bytes(std::uint64_t payload) noexcept {
  return disk_block_bytes + round_up_block(payload);
}

/// The shard (directory) of a key: the low byte of XXH3-64 of its encoding. Stable across
/// versions and platforms (the encoding is fixed little-endian), uniform whatever the keys.
[[nodiscard]] inline unsigned shard_of(const chunk_key& k) noexcept {
  const auto e = k.encode();
  return static_cast<unsigned>(XXH3_64bits(e.data(), e.size()) & (disk_shard_count - 1));
}

/// A NUL-terminated name in a fixed buffer (path strings must outlive an io_uring op; the
/// backend keeps these in its per-operation state, no heap allocation).
template <std::size_t N>
struct fixed_name {
  std::array<char, N> chars{};
  [[nodiscard]] const char* c_str() const noexcept { return chars.data(); }
  [[nodiscard]] std::string_view view() const noexcept { return chars.data(); }
};

inline void put_hex(char* out, std::span<const std::byte> bytes) noexcept {
  static constexpr char digits[] = "0123456789abcdef";
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const auto b = static_cast<unsigned>(bytes[i]);
    out[2 * i] = digits[b >> 4];
    out[2 * i + 1] = digits[b & 0xf];
  }
}

/// "ss/<key>.kvo": the object's path relative to <path>/objects.
using object_path = fixed_name<3 + key_hex_chars + 4 + 1>;
[[nodiscard]] inline object_path object_path_of(const chunk_key& k) noexcept {
  object_path p;
  const auto e = k.encode();
  const auto s = static_cast<std::byte>(shard_of(k));
  put_hex(p.chars.data(), std::span(&s, 1));
  p.chars[2] = '/';
  put_hex(p.chars.data() + 3, e);
  std::memcpy(p.chars.data() + 3 + key_hex_chars, object_suffix.data(), object_suffix.size());
  return p;
}

/// "<key>.<seq 16 hex>.tmp": a temporary file's name relative to <path>/tmp.
using temp_name = fixed_name<key_hex_chars + 1 + 16 + 4 + 1>;
[[nodiscard]] inline temp_name temp_name_of(const chunk_key& k, std::uint64_t seq) noexcept {
  temp_name t;
  const auto e = k.encode();
  put_hex(t.chars.data(), e);
  t.chars[key_hex_chars] = '.';
  std::array<std::byte, 8> s{};
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<std::byte>(seq >> (56 - 8 * i));
  put_hex(t.chars.data() + key_hex_chars + 1, s);
  std::memcpy(t.chars.data() + key_hex_chars + 17, temp_suffix.data(), temp_suffix.size());
  return t;
}

/// The key an object file name ("<key>.kvo") names; nullopt for any other name.
[[nodiscard]] inline std::optional<chunk_key> parse_object_name(std::string_view name) noexcept {
  if (name.size() != key_hex_chars + object_suffix.size() || !name.ends_with(object_suffix)) return std::nullopt;
  std::array<std::byte, chunk_key::wire_size> e{};
  for (std::size_t i = 0; i < key_hex_chars; ++i) {
    const char c = name[i];
    unsigned v = 0;
    if (c >= '0' && c <= '9') v = static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f') v = static_cast<unsigned>(c - 'a' + 10);
    else return std::nullopt;
    e[i / 2] = static_cast<std::byte>((static_cast<unsigned>(e[i / 2]) << 4) | v);
  }
  return chunk_key::decode(std::span<const std::byte, chunk_key::wire_size>(e));
}

/// Writes the header block: the 72-byte header, then zeros to 4 KiB.
inline void encode_header_block(const object_header& h, std::span<std::byte, disk_block_bytes> out) noexcept {
  std::memset(out.data(), 0, out.size());
  encode_header(h, std::span<std::byte, object_header_bytes>(out.data(), object_header_bytes));
}

/// Why a file on disk is not a servable object.
enum class object_check : std::uint8_t {
  ok,
  bad_header,  ///< magic, version, size or header checksum wrong: torn or foreign
  wrong_key,   ///< the header's key is not the key of the file name
  bad_flags,   ///< flags this version does not know
  bad_table,   ///< segmented, but its segment table is invalid or fails its checksum
  wrong_size,  ///< the file is not exactly header block + padded payload: torn or truncated
};

[[nodiscard]] constexpr std::string_view to_string(object_check c) noexcept {
  switch (c) {
    case object_check::ok: return "ok";
    case object_check::bad_header: return "bad header";
    case object_check::wrong_key: return "key differs from the file name";
    case object_check::bad_flags: return "unknown flags";
    case object_check::bad_table: return "bad segment table";
    case object_check::wrong_size: return "file size does not match the header (torn or truncated)";
  }
  return "?";
}

/// Judges a header block (disk_block_bytes) read from the file of `expected` whose size is
/// `file_bytes`; on success `out` holds the header and `segment_bytes`, when given, the
/// object's segment size (0: unsegmented, one checksum over the whole payload). A segmented
/// object's table is checked against the header here (the checksum chain); the payload's
/// checksums are checked by every load.
[[nodiscard]] inline object_check check_object(std::span<const std::byte> header_block, const chunk_key& expected,
                                               std::uint64_t file_bytes, object_header& out,
                                               std::uint64_t* segment_bytes = nullptr) noexcept {
  const auto h = decode_header(header_block);
  if (!h) return object_check::bad_header;
  if (h->key != expected) return object_check::wrong_key;
  if ((h->flags & ~object_known_flags) != 0) return object_check::bad_flags;
  if (h->payload_bytes > max_object_bytes) return object_check::wrong_size;
  if (file_bytes != object_file_bytes(h->payload_bytes)) return object_check::wrong_size;
  std::uint64_t segments = 0;
  if ((h->flags & object_flag_segmented) != 0) {
    if (header_block.size() < disk_block_bytes) return object_check::bad_table;
    const auto t = decode_segment_table(*h, table_area(header_block));
    if (!t) return object_check::bad_table;
    segments = t->segment_bytes;
  }
  out = *h;
  if (segment_bytes != nullptr) *segment_bytes = segments;
  return object_check::ok;
}

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
