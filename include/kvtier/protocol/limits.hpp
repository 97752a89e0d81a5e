#pragma once
// The constants of the engine <-> server wire protocol: the frame magic, the protocol
// version, the header size, and the size limit of every field. docs/protocol.md is the
// reference; each limit here is checked before anything is allocated for the field.

#include <kvtier/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace protocol {

/// The first four bytes of every frame: "KVT1".
inline constexpr std::array<std::byte, 4> frame_magic = {std::byte{'K'}, std::byte{'V'}, std::byte{'T'},
                                                         std::byte{'1'}};

/// The protocol version this build speaks; carried in every frame header. A frame with any
/// other version is refused with errc::version_mismatch (no negotiation: both sides of a
/// Unix socket ship together, and a silent downgrade would hide a deployment mistake).
inline constexpr std::uint16_t protocol_version = 5;

/// Bytes of the frame header: magic (4), version (u16), type (u16), call id (u64), body
/// length (u32), little-endian. This layout is frozen for every version, so a peer speaking
/// another version can still be told so, with its call id.
inline constexpr std::size_t frame_header_size = 4 + 2 + 2 + 8 + 4;

// Per-field limits (bytes for strings, elements for vectors). A field above its limit is
// errc::message_too_large, on encode and on decode.

/// An engine request id (vLLM's are ~40 bytes: "cmpl-" + uuid + suffixes).
inline constexpr std::uint32_t max_request_key_bytes = 256;
/// A model name ("meta-llama/Llama-3.1-70B-Instruct" is 33 bytes).
inline constexpr std::uint32_t max_model_name_bytes = 256;
/// Chunk hashes in one lookup/retrieve/store: 65536 chunks of 256 tokens = 16M tokens, far
/// beyond any context window; 1 MiB of hashes.
inline constexpr std::uint32_t max_chunk_hashes = 65536;
/// Block ids (and block generations) in one retrieve/store: 65536 chunks of 16 blocks.
/// 4 MiB of ids plus 8 MiB of generations: a maximal store body is ~13 MiB, under the
/// default body limit.
inline constexpr std::uint32_t max_block_ids = std::uint32_t{1} << 20;
/// A cache salt (vLLM's cache_salt is a short tenant string).
inline constexpr std::uint32_t max_cache_salt_bytes = 256;
/// An engine id (vLLM's kv_transfer_config.engine_id: a uuid4, 36 bytes, plus "_dp<rank>").
inline constexpr std::uint32_t max_engine_id_bytes = 128;
/// The region descriptor of a cuda_ipc registration (a cudaIpcMemHandle_t is 64 bytes; a
/// descriptor holds one per layer tensor plus the layout: 1024 layers fit).
inline constexpr std::uint32_t max_region_descriptor_bytes = std::uint32_t{256} << 10;
/// The tier list of an evict_request ("l1,disk,redis": names of the server's tiers).
inline constexpr std::uint32_t max_tier_list_bytes = 1024;
/// The JSON document of a status, list_objects or evict reply.
inline constexpr std::uint32_t max_status_json_bytes = std::uint32_t{4} << 20;
/// The text of an error reply.
inline constexpr std::uint32_t max_error_message_bytes = 4096;
/// Token ids in one describe_chunks_request (chunk_hashes.size() x chunk_tokens): 2M tokens,
/// 8 MiB, so that a maximal description fits the default body limit beside its hashes and
/// extra keys. A longer prompt is described in several requests (parent_hash links them).
inline constexpr std::uint32_t max_described_tokens = std::uint32_t{1} << 21;
/// A LoRA adapter's name in a describe_chunks_request (vLLM's lora_name).
inline constexpr std::uint32_t max_lora_name_bytes = 256;
/// Block extra keys in one describe_chunks_request (one per block, or none): 2M tokens in
/// blocks of 16.
inline constexpr std::uint32_t max_block_extra_keys = std::uint32_t{1} << 17;
/// One block's extra keys (one msgpack value: vLLM's tuple of multimodal hashes and offsets,
/// LoRA name, salt; ~100 bytes per image of the block).
inline constexpr std::uint32_t max_block_extra_key_bytes = 4096;

/// Default limit of one frame body: 16 MiB holds the largest legal store request (~13 MiB).
inline constexpr std::uint32_t default_max_body_bytes = std::uint32_t{16} << 20;

/// The run-time limits of one side of a connection.
struct limits {
  /// Bytes of one frame body, checked on the header before the body is buffered. A smaller
  /// value refuses large lookups/stores (errc::message_too_large); at most 4 GiB - 1 (u32).
  std::uint32_t max_body_bytes = default_max_body_bytes;
};

}  // namespace protocol
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
