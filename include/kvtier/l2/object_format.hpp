#pragma once
// The stored form of one L2 object, shared by the disk and Redis backends so that a
// torn, corrupt or foreign object is recognised and never served: the 72-byte header and,
// for a segmented object, its table of per-segment checksums (layouts below, next to their
// constants; docs/l2-disk.md, "Object format" and "Segments").
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/detail/xxhash.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

// Layout v1 (little-endian), 72 bytes, then the payload:
//     0  u64  magic  0x4B5654494552424F ("KVTIEROB" as big-endian text)
//     8  u32  format version (1)
//    12  u32  header bytes (72)
//    16  28B  chunk_key (chunk_key::encode)
//    44  u32  flags: bit 0 `segmented` (object_flag_segmented); other bits 0
//    48  u64  payload bytes
//    56  u64  payload checksum: XXH3-64 of the payload; for a segmented object, XXH3-64 of
//             its segment table (below)
//    64  u64  header checksum: XXH3-64 of bytes 0..63
// The disk backend pads the header to one 4 KiB block so the payload stays O_DIRECT-aligned.
//
// A segmented object (flags bit 0) carries a segment table right after the header (inside
// the disk backend's 4 KiB header block):
//    72  u64  segment bytes: a multiple of 4 KiB, > 0
//    80  u32  segment count: ceil(payload bytes / segment bytes), 1..max_object_segments
//    84  u32  reserved (0): keeps the checksums 8-byte aligned
//    88  count x u64  XXH3-64 of each segment of the payload, in order (the last may be short)
// The table is 16 + 8 * count bytes; at most 501 segments, so that header and table fit one
// 4 KiB block. The header's payload checksum covers the table and the header checksum
// covers the header, so one check of each chains every segment's checksum to the header:
// a reader verifies (and may use) each segment as soon as it and the header block landed,
// instead of waiting for the whole payload (layer-wise loading: an object is layer-major,
// so its first segments hold its first layers). A writer still hashes the payload in one
// pass (one digest per segment boundary). The payload itself is laid out exactly as in an
// unsegmented object.
//
// Redis writes unsegmented objects (flags 0), the disk backend segmented ones (but an empty
// payload, which has no segment); both read both kinds (the disk backend: objects written
// before segments existed load and verify as before, whole).
inline constexpr std::uint64_t object_magic = 0x4B5654494552424FULL;
inline constexpr std::uint32_t object_format_version = 1;
inline constexpr std::size_t object_header_bytes = 72;

/// flags bit 0: a segment table follows the header, and payload_checksum is its checksum.
inline constexpr std::uint32_t object_flag_segmented = 1;
/// Every flag this version knows: a header with another bit set is not ours to serve.
inline constexpr std::uint32_t object_known_flags = object_flag_segmented;
/// Segment sizes are multiples of this (the disk backend's O_DIRECT unit).
inline constexpr std::size_t object_segment_unit = 4096;
/// The segment table's fixed part: segment bytes, count, reserved.
inline constexpr std::size_t segment_table_fixed_bytes = 16;
/// The most segments an object may have: header and table fit one 4 KiB block (501).
inline constexpr std::size_t max_object_segments =
    (4096 - object_header_bytes - segment_table_fixed_bytes) / sizeof(std::uint64_t);

/// Bytes of a segment table of `count` segments.
[[nodiscard]] constexpr std::size_t segment_table_bytes(std::size_t count) noexcept {
  return segment_table_fixed_bytes + sizeof(std::uint64_t) * count;
}

/// Segments of `segment_bytes` (> 0) that `payload` bytes take: ceil(payload / segment_bytes).
[[nodiscard]] constexpr std::uint64_t segment_count(std::uint64_t payload, std::uint64_t segment_bytes) noexcept {
  return segment_bytes == 0 ? 0 : payload / segment_bytes + (payload % segment_bytes != 0 ? 1 : 0);
}

/// XXH3-64 of the payload (the fastest kernel this CPU runs: core/detail/xxhash.hpp), small next to the device.
[[nodiscard]] inline std::uint64_t payload_checksum(std::span<const std::byte> payload) noexcept {
  return kvtier::detail::xxh3_64(payload.data(), payload.size());
}

struct object_header {
  chunk_key key;
  std::uint64_t payload_bytes = 0;
  std::uint64_t payload_checksum = 0;
  std::uint32_t flags = 0;

  friend bool operator==(const object_header&, const object_header&) = default;
};

namespace detail {
inline void put_le(std::byte* p, std::uint64_t v, int n) noexcept {
  for (int i = 0; i < n; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
inline std::uint64_t get_le(const std::byte* p, int n) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}
}  // namespace detail

/// Writes the 72-byte header into out.
inline void encode_header(const object_header& h, std::span<std::byte, object_header_bytes> out) noexcept {
  std::byte* p = out.data();
  detail::put_le(p + 0, object_magic, 8);
  detail::put_le(p + 8, object_format_version, 4);
  detail::put_le(p + 12, object_header_bytes, 4);
  h.key.encode(std::span<std::byte, chunk_key::wire_size>(p + 16, chunk_key::wire_size));
  detail::put_le(p + 44, h.flags, 4);
  detail::put_le(p + 48, h.payload_bytes, 8);
  detail::put_le(p + 56, h.payload_checksum, 8);
  detail::put_le(p + 64, XXH3_64bits(p, 64), 8);
}

[[nodiscard]] inline std::array<std::byte, object_header_bytes> encode_header(const object_header& h) noexcept {
  std::array<std::byte, object_header_bytes> a{};
  encode_header(h, a);
  return a;
}

/// Parses a header; nullopt when the bytes are not a valid v1 header (wrong magic, version,
/// size, or header checksum): a torn or foreign object. The flags come back as stored: the
/// reader refuses bits it does not know (object_known_flags) and, for a segmented object,
/// decodes its table (decode_segment_table).
[[nodiscard]] inline std::optional<object_header> decode_header(std::span<const std::byte> in) noexcept {
  if (in.size() < object_header_bytes) return std::nullopt;
  const std::byte* p = in.data();
  if (detail::get_le(p, 8) != object_magic) return std::nullopt;
  if (detail::get_le(p + 8, 4) != object_format_version) return std::nullopt;
  if (detail::get_le(p + 12, 4) != object_header_bytes) return std::nullopt;
  if (detail::get_le(p + 64, 8) != XXH3_64bits(p, 64)) return std::nullopt;
  object_header h;
  h.key = chunk_key::decode(std::span<const std::byte, chunk_key::wire_size>(p + 16, chunk_key::wire_size));
  h.flags = static_cast<std::uint32_t>(detail::get_le(p + 44, 4));
  h.payload_bytes = detail::get_le(p + 48, 8);
  h.payload_checksum = detail::get_le(p + 56, 8);
  return h;
}

/// The checksum of segment s stored in an encoded table (decoded and checked by
/// decode_segment_table before its checksums are trusted).
[[nodiscard]] inline std::uint64_t stored_segment_checksum(std::span<const std::byte> table, std::size_t s) noexcept {
  return detail::get_le(table.data() + segment_table_fixed_bytes + sizeof(std::uint64_t) * s, 8);
}

/// A decoded segment table, viewing the bytes it was decoded from (they must outlive it).
struct segment_table {
  std::uint64_t segment_bytes = 0;
  std::uint32_t count = 0;
  std::uint64_t payload_bytes = 0;
  std::span<const std::byte> bytes;  ///< the whole table, as encoded

  /// The stored XXH3-64 of segment s (< count).
  [[nodiscard]] std::uint64_t checksum(std::size_t s) const noexcept { return stored_segment_checksum(bytes, s); }
  /// Payload offset where segment s begins.
  [[nodiscard]] std::uint64_t begin(std::size_t s) const noexcept { return segment_bytes * s; }
  /// Payload offset one past segment s (the payload's end for the last one).
  [[nodiscard]] std::uint64_t end(std::size_t s) const noexcept {
    const std::uint64_t e = segment_bytes * (s + 1);
    return e < payload_bytes ? e : payload_bytes;
  }
};

/// Writes the fixed part of a table of `count` segments of `segment_bytes` into the first
/// segment_table_bytes(count) bytes of `out`, its checksums zeroed (put_segment_checksum
/// fills them).
inline void encode_segment_table(std::uint64_t segment_bytes, std::uint32_t count, std::span<std::byte> out) noexcept {
  std::byte* p = out.data();
  detail::put_le(p + 0, segment_bytes, 8);
  detail::put_le(p + 8, count, 4);
  detail::put_le(p + 12, 0, 4);
  for (std::size_t s = 0; s < count; ++s) detail::put_le(p + segment_table_fixed_bytes + 8 * s, 0, 8);
}

/// Stores the checksum of segment s into an encoded table.
inline void put_segment_checksum(std::span<std::byte> table, std::size_t s, std::uint64_t checksum) noexcept {
  detail::put_le(table.data() + segment_table_fixed_bytes + sizeof(std::uint64_t) * s, checksum, 8);
}

/// XXH3-64 of an encoded table of `count` segments (the header's payload_checksum).
[[nodiscard]] inline std::uint64_t segment_table_checksum(std::span<const std::byte> table,
                                                          std::uint32_t count) noexcept {
  return XXH3_64bits(table.data(), segment_table_bytes(count));
}

/// The segment table of the segmented object whose header is h, from the bytes that follow
/// its header (`after_header`); nullopt when h is not segmented, or the table is not valid:
/// a segment size that is 0 or not a multiple of 4 KiB, a count out of 1..501 or other than
/// ceil(payload / segment size), a reserved field not 0, bytes missing, or a table whose
/// checksum is not the header's payload checksum (a torn or damaged table).
[[nodiscard]] inline std::optional<segment_table> decode_segment_table(
    const object_header& h, std::span<const std::byte> after_header) noexcept {
  if ((h.flags & object_flag_segmented) == 0 || after_header.size() < segment_table_fixed_bytes) return std::nullopt;
  const std::byte* p = after_header.data();
  segment_table t;
  t.segment_bytes = detail::get_le(p, 8);
  const std::uint64_t count = detail::get_le(p + 8, 4);
  if (t.segment_bytes == 0 || t.segment_bytes % object_segment_unit != 0) return std::nullopt;
  if (detail::get_le(p + 12, 4) != 0) return std::nullopt;
  if (count == 0 || count > max_object_segments || count != segment_count(h.payload_bytes, t.segment_bytes))
    return std::nullopt;
  t.count = static_cast<std::uint32_t>(count);
  if (after_header.size() < segment_table_bytes(t.count)) return std::nullopt;
  t.bytes = after_header.first(segment_table_bytes(t.count));
  if (segment_table_checksum(t.bytes, t.count) != h.payload_checksum) return std::nullopt;
  t.payload_bytes = h.payload_bytes;
  return t;
}

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
