#pragma once
// kv_layout: the byte shapes kvtier copies between. Standard library only.
//
//   dtype_kind       the element type of the KV (fp32, fp16, bf16, fp8 e4m3/e5m2, int8): two
//                    kinds of one size (fp16/bf16, e4m3/e5m2) never share objects.
//   kv_layout_kind   how an engine orders one paged block: NHD (token-major, FlashAttention),
//                    HND (head-major, vLLM's CPU backend and FlashInfer), MLA (one latent).
//   model_shape      a model's KV geometry: layers, KV heads, head dim, dtype kind, MHA/MLA.
//   chunk_layout     one chunk object (the unit stored in L1 and L2):
//                      [layer][plane][token][kv_heads * head_dim] elements,
//                    plane = K then V for MHA, the single latent for MLA. Layer-major, so a
//                    layer's KV is one contiguous run (layer-wise loading stays possible).
//   paged_kv_layout  an engine's paged KV cache, per layer vLLM's
//                      NHD: [2][num_blocks][block_size][kv_heads][head_dim]
//                      HND: [2][num_blocks][kv_heads][block_size][head_dim]
//                      MLA:    [num_blocks][block_size][latent_dim]
//                    so one (layer, plane, block) is a contiguous "block segment" (token-major
//                    inside it for NHD and MLA, head-major for HND).
//
// A chunk object holds the chunk's block segments back to back per (layer, plane), in chunk
// order, exactly as the engine's blocks hold them. For NHD and MLA that is the token-major
// [layer][plane][token][kv_heads * head_dim] of chunk_layout::offset; for HND each block's
// segment stays head-major: [layer][plane][block of the chunk][kv_head][token in block]
// [head_dim] (paged_kv_layout::object_offset gives a row's place in either). A copy therefore
// moves whole segments in both orders and never transposes; HND objects are only ever read
// back into HND caches, since the layout kind is part of the model id (make_model_id).
// Skipping the first t tokens of a block is one leading run of t token rows for NHD and MLA,
// and for HND the first t rows of each of the kv_heads runs of block_size rows
// (segment_runs(), run_bytes(), run_offset()).

#include <kvtier/config.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvtier::inline KVTIER_ABI_TAG {

enum class attention_kind : std::uint8_t {
  mha = 0,  ///< separate K and V per KV head (also GQA/MQA)
  mla = 1,  ///< one compressed latent per token (DeepSeek MLA): num_kv_heads = 1
};

/// The element type of the KV cache. Values are stable (they travel in register_kv_request
/// and are folded into model ids): append, never renumber.
enum class dtype_kind : std::uint8_t {
  fp32 = 0,
  fp16 = 1,
  bf16 = 2,
  fp8_e4m3 = 3,
  fp8_e5m2 = 4,
  int8 = 5,
};
inline constexpr dtype_kind last_dtype_kind = dtype_kind::int8;

/// Bytes of one element; 0 for a value that names no kind.
[[nodiscard]] constexpr std::uint32_t bytes_of(dtype_kind d) noexcept {
  switch (d) {
    case dtype_kind::fp32:
      return 4;
    case dtype_kind::fp16:
    case dtype_kind::bf16:
      return 2;
    case dtype_kind::fp8_e4m3:
    case dtype_kind::fp8_e5m2:
    case dtype_kind::int8:
      return 1;
  }
  return 0;
}

/// "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8" ("unknown" otherwise).
[[nodiscard]] constexpr std::string_view name(dtype_kind d) noexcept {
  switch (d) {
    case dtype_kind::fp32:
      return "fp32";
    case dtype_kind::fp16:
      return "fp16";
    case dtype_kind::bf16:
      return "bf16";
    case dtype_kind::fp8_e4m3:
      return "fp8_e4m3";
    case dtype_kind::fp8_e5m2:
      return "fp8_e5m2";
    case dtype_kind::int8:
      return "int8";
  }
  return "unknown";
}

/// Parses what name(dtype_kind) writes (also torch's spellings "float32", "float16",
/// "bfloat16", "float8_e4m3fn", "float8_e5m2").
[[nodiscard]] constexpr std::optional<dtype_kind> parse_dtype_kind(std::string_view s) noexcept {
  if (s == "fp32" || s == "float32" || s == "float") return dtype_kind::fp32;
  if (s == "fp16" || s == "float16" || s == "half") return dtype_kind::fp16;
  if (s == "bf16" || s == "bfloat16") return dtype_kind::bf16;
  if (s == "fp8_e4m3" || s == "float8_e4m3fn" || s == "fp8") return dtype_kind::fp8_e4m3;
  if (s == "fp8_e5m2" || s == "float8_e5m2") return dtype_kind::fp8_e5m2;
  if (s == "int8") return dtype_kind::int8;
  return std::nullopt;
}

/// How an engine orders the tokens and heads of one paged block. Values are stable.
enum class kv_layout_kind : std::uint8_t {
  nhd = 0,  ///< [block_size][kv_heads][head_dim] per block: FlashAttention, vLLM's default
  hnd = 1,  ///< [kv_heads][block_size][head_dim] per block: vLLM's CPU backend, FlashInfer
  mla = 2,  ///< [block_size][latent_dim] per block (attention_kind::mla)
};
inline constexpr kv_layout_kind last_kv_layout_kind = kv_layout_kind::mla;

[[nodiscard]] constexpr std::string_view name(kv_layout_kind k) noexcept {
  switch (k) {
    case kv_layout_kind::nhd:
      return "NHD";
    case kv_layout_kind::hnd:
      return "HND";
    case kv_layout_kind::mla:
      return "MLA";
  }
  return "unknown";
}

/// Parses "NHD", "HND", "MLA" (either case).
[[nodiscard]] constexpr std::optional<kv_layout_kind> parse_kv_layout_kind(std::string_view s) noexcept {
  if (s == "NHD" || s == "nhd") return kv_layout_kind::nhd;
  if (s == "HND" || s == "hnd") return kv_layout_kind::hnd;
  if (s == "MLA" || s == "mla") return kv_layout_kind::mla;
  return std::nullopt;
}

struct model_shape {
  std::uint32_t num_layers = 0;
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;  ///< for MLA: the latent width (kv_lora_rank + rope dim)
  dtype_kind dtype = dtype_kind::bf16;
  attention_kind attention = attention_kind::mha;

  friend constexpr bool operator==(const model_shape&, const model_shape&) = default;

  /// Bytes of one element (bytes_of(dtype)).
  [[nodiscard]] constexpr std::uint32_t dtype_bytes() const noexcept { return bytes_of(dtype); }

  /// K and V (2) for MHA, the latent (1) for MLA.
  [[nodiscard]] constexpr std::uint32_t planes() const noexcept { return attention == attention_kind::mha ? 2 : 1; }
  /// Bytes of one token in one (layer, plane).
  [[nodiscard]] constexpr std::size_t token_plane_bytes() const noexcept {
    return std::size_t{num_kv_heads} * head_dim * dtype_bytes();
  }
  /// Bytes of one token's KV over all layers and planes.
  [[nodiscard]] constexpr std::size_t token_bytes() const noexcept {
    return token_plane_bytes() * planes() * num_layers;
  }

  /// Empty when valid, else what is wrong and how to fix it.
  [[nodiscard]] std::string validation_error() const {
    if (num_layers == 0 || num_layers > 1024) return "num_layers must be in 1..1024";
    if (num_kv_heads == 0 || num_kv_heads > 1024) return "num_kv_heads must be in 1..1024";
    if (head_dim == 0 || head_dim > 65536) return "head_dim must be in 1..65536";
    if (bytes_of(dtype) == 0) return "unknown dtype kind";
    if (attention == attention_kind::mla && num_kv_heads != 1) return "MLA layouts have num_kv_heads == 1";
    if (attention != attention_kind::mha && attention != attention_kind::mla) return "unknown attention kind";
    return {};
  }
};

/// One chunk object: chunk_tokens tokens of every layer and plane.
struct chunk_layout {
  model_shape model;
  std::uint32_t chunk_tokens = 256;

  friend constexpr bool operator==(const chunk_layout&, const chunk_layout&) = default;

  /// Bytes of one (layer, plane) slab of the object.
  [[nodiscard]] constexpr std::size_t slab_bytes() const noexcept {
    return std::size_t{chunk_tokens} * model.token_plane_bytes();
  }
  /// Bytes of the whole object.
  [[nodiscard]] constexpr std::size_t object_bytes() const noexcept {
    return slab_bytes() * model.planes() * model.num_layers;
  }
  /// Offset of token t of (layer, plane) inside the object of an NHD or MLA cache (for any
  /// layout kind: paged_kv_layout::object_offset; t = 0 is the slab's start in every kind).
  [[nodiscard]] constexpr std::size_t offset(std::uint32_t layer, std::uint32_t plane,
                                             std::uint32_t token = 0) const noexcept {
    return (std::size_t{layer} * model.planes() + plane) * slab_bytes() +
           std::size_t{token} * model.token_plane_bytes();
  }

  [[nodiscard]] std::string validation_error() const {
    if (auto e = model.validation_error(); !e.empty()) return e;
    if (chunk_tokens == 0 || chunk_tokens > 65536) return "chunk_tokens must be in 1..65536";
    return {};
  }
};

/// An engine's paged KV cache (one kv region holds num_layers such layers back to back).
struct paged_kv_layout {
  model_shape model;
  std::uint32_t block_size = 16;  ///< tokens per block
  std::uint32_t num_blocks = 0;
  /// nhd or hnd for MHA models; an MLA model's blocks have one order whatever is set here
  /// (kind() answers mla).
  kv_layout_kind order = kv_layout_kind::nhd;

  /// The largest total_bytes() of a valid layout: 1 PiB, beyond any machine's memory, and
  /// small enough that no size or offset computed from a valid layout wraps around 64 bits
  /// (every dimension at its limit would give 2^83 bytes).
  static constexpr std::uint64_t max_total_bytes = std::uint64_t{1} << 50;

  friend constexpr bool operator==(const paged_kv_layout&, const paged_kv_layout&) = default;

  /// The layout kind: mla for MLA models, else `order`.
  [[nodiscard]] constexpr kv_layout_kind kind() const noexcept {
    return model.attention == attention_kind::mla ? kv_layout_kind::mla : order;
  }

  /// Bytes of one (layer, plane, block): block_size tokens, contiguous.
  [[nodiscard]] constexpr std::size_t segment_bytes() const noexcept {
    return std::size_t{block_size} * model.token_plane_bytes();
  }
  /// Bytes of one KV head's head_dim elements of one token (one row).
  [[nodiscard]] constexpr std::size_t head_row_bytes() const noexcept {
    return std::size_t{model.head_dim} * model.dtype_bytes();
  }
  /// The runs of rows one block segment is made of, in which a skip inside the block takes
  /// the leading rows: 1 for NHD and MLA (token-major: the segment is one run of block_size
  /// token rows), num_kv_heads for HND (one run of block_size rows per head).
  [[nodiscard]] constexpr std::uint32_t segment_runs() const noexcept {
    return kind() == kv_layout_kind::hnd ? model.num_kv_heads : 1;
  }
  /// Bytes of one run: segment_bytes() / segment_runs().
  [[nodiscard]] constexpr std::size_t run_bytes() const noexcept { return segment_bytes() / segment_runs(); }
  /// Bytes of the first `tokens` rows of a run (the part of each run a skip of `tokens`
  /// tokens inside a block leaves alone): tokens * token_plane_bytes() for NHD and MLA,
  /// tokens * head_row_bytes() for HND.
  [[nodiscard]] constexpr std::size_t run_offset(std::uint32_t tokens) const noexcept {
    return std::size_t{tokens} * (kind() == kv_layout_kind::hnd ? head_row_bytes() : model.token_plane_bytes());
  }
  /// Offset of (token, head)'s row inside one block segment.
  [[nodiscard]] constexpr std::size_t offset_in_segment(std::uint32_t token, std::uint32_t head = 0) const noexcept {
    if (kind() == kv_layout_kind::hnd) return head * run_bytes() + std::size_t{token} * head_row_bytes();
    return std::size_t{token} * model.token_plane_bytes() + std::size_t{head} * head_row_bytes();
  }
  /// Bytes of one layer's tensor.
  [[nodiscard]] constexpr std::size_t layer_bytes() const noexcept {
    return segment_bytes() * num_blocks * model.planes();
  }
  /// Bytes of all layers (the size of a CPU kv region).
  [[nodiscard]] constexpr std::size_t total_bytes() const noexcept { return layer_bytes() * model.num_layers; }
  /// Offset of the row of (token, head) of (plane, block) inside one layer's tensor; with
  /// the defaults, the segment's start. In the NHD and MLA orders a token's heads are one
  /// contiguous run of token_plane_bytes() (head 0 starts it); in HND each head's row is
  /// apart (head_row_bytes()).
  [[nodiscard]] constexpr std::size_t offset_in_layer(std::uint32_t plane, std::uint32_t block, std::uint32_t token = 0,
                                                      std::uint32_t head = 0) const noexcept {
    return (std::size_t{plane} * num_blocks + block) * segment_bytes() + offset_in_segment(token, head);
  }
  /// Offset of the row of (token, head) of (layer, plane) inside a chunk object gathered
  /// from this cache (`token` counts from the chunk's start). NHD and MLA: chunk.offset(
  /// layer, plane, token) plus the head's place; HND: the block's segment, head-major.
  [[nodiscard]] constexpr std::size_t object_offset(const chunk_layout& chunk, std::uint32_t layer, std::uint32_t plane,
                                                    std::uint32_t token, std::uint32_t head = 0) const noexcept {
    return chunk.offset(layer, plane) + std::size_t{token / block_size} * segment_bytes() +
           offset_in_segment(token % block_size, head);
  }

  [[nodiscard]] std::string validation_error() const {
    if (auto e = model.validation_error(); !e.empty()) return e;
    if (block_size == 0 || block_size > 4096) return "block_size must be in 1..4096";
    if (num_blocks == 0) return "num_blocks must be > 0";
    if (model.attention == attention_kind::mha && order == kv_layout_kind::mla)
      return "layout kind MLA needs an MLA model (attention_kind::mla): use NHD or HND";
    if (order != kv_layout_kind::nhd && order != kv_layout_kind::hnd && order != kv_layout_kind::mla)
      return "unknown layout kind";
    // Checked by division: with the bounds above, one block of every layer is at most 2^51
    // bytes, while num_blocks times that could wrap.
    const std::uint64_t per_block = std::uint64_t{block_size} * model.token_plane_bytes() * model.planes() *
                                    model.num_layers;
    if (num_blocks > max_total_bytes / per_block)
      return "num_blocks " + std::to_string(num_blocks) + " is too many: the KV cache of this model and block_size "
             "would exceed 1 PiB";
    return {};
  }

  /// Empty when chunks of `chunk` tokens can be gathered from this cache: the model shapes
  /// must match and a chunk must be a whole number of blocks.
  [[nodiscard]] std::string compatibility_error(const chunk_layout& chunk) const {
    if (!(chunk.model == model)) return "the chunk layout and the paged KV cache describe different models";
    if (chunk.chunk_tokens % block_size != 0)
      return "chunk_tokens (" + std::to_string(chunk.chunk_tokens) + ") must be a multiple of block_size (" +
             std::to_string(block_size) + ")";
    return {};
  }
};

}  // namespace kvtier::inline KVTIER_ABI_TAG
