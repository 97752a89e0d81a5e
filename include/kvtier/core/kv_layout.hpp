#pragma once
// kv_layout: the byte shapes kvtier copies between. Standard library only.
//
//   model_shape      a model's KV geometry: layers, KV heads, head dim, dtype size, MHA/MLA.
//   chunk_layout     one chunk object (the unit stored in L1 and L2):
//                      [layer][plane][token][kv_heads * head_dim] elements,
//                    plane = K then V for MHA, the single latent for MLA. Layer-major, so a
//                    layer's KV is one contiguous run (layer-wise loading stays possible).
//   paged_kv_layout  an engine's paged KV cache, per layer vLLM's
//                      MHA: [2][num_blocks][block_size][kv_heads][head_dim]
//                      MLA:    [num_blocks][block_size][latent_dim]
//                    so one (layer, plane, block) is a contiguous "block segment".

#include <kvtier/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvtier::inline KVTIER_ABI_TAG {

enum class attention_kind : std::uint8_t {
  mha = 0,  ///< separate K and V per KV head (also GQA/MQA)
  mla = 1,  ///< one compressed latent per token (DeepSeek MLA): num_kv_heads = 1
};

struct model_shape {
  std::uint32_t num_layers = 0;
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;     ///< for MLA: the latent width (kv_lora_rank + rope dim)
  std::uint32_t dtype_bytes = 2;  ///< 2 for bf16/fp16, 1 for fp8, 4 for fp32
  attention_kind attention = attention_kind::mha;

  friend constexpr bool operator==(const model_shape&, const model_shape&) = default;

  /// K and V (2) for MHA, the latent (1) for MLA.
  [[nodiscard]] constexpr std::uint32_t planes() const noexcept {
    return attention == attention_kind::mha ? 2 : 1;
  }
  /// Bytes of one token in one (layer, plane).
  [[nodiscard]] constexpr std::size_t token_plane_bytes() const noexcept {
    return std::size_t{num_kv_heads} * head_dim * dtype_bytes;
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
    if (dtype_bytes != 1 && dtype_bytes != 2 && dtype_bytes != 4) return "dtype_bytes must be 1, 2 or 4";
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
  /// Offset of token t of (layer, plane) inside the object.
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

  /// The largest total_bytes() of a valid layout: 1 PiB, beyond any machine's memory, and
  /// small enough that no size or offset computed from a valid layout wraps around 64 bits
  /// (every dimension at its limit would give 2^83 bytes).
  static constexpr std::uint64_t max_total_bytes = std::uint64_t{1} << 50;

  friend constexpr bool operator==(const paged_kv_layout&, const paged_kv_layout&) = default;

  /// Bytes of one (layer, plane, block): block_size tokens, contiguous.
  [[nodiscard]] constexpr std::size_t segment_bytes() const noexcept {
    return std::size_t{block_size} * model.token_plane_bytes();
  }
  /// Bytes of one layer's tensor.
  [[nodiscard]] constexpr std::size_t layer_bytes() const noexcept {
    return segment_bytes() * num_blocks * model.planes();
  }
  /// Bytes of all layers (the size of a CPU kv region).
  [[nodiscard]] constexpr std::size_t total_bytes() const noexcept {
    return layer_bytes() * model.num_layers;
  }
  /// Offset of token t of (plane, block) inside one layer's tensor.
  [[nodiscard]] constexpr std::size_t offset_in_layer(std::uint32_t plane, std::uint32_t block,
                                                      std::uint32_t token = 0) const noexcept {
    return (std::size_t{plane} * num_blocks + block) * segment_bytes() +
           std::size_t{token} * model.token_plane_bytes();
  }

  [[nodiscard]] std::string validation_error() const {
    if (auto e = model.validation_error(); !e.empty()) return e;
    if (block_size == 0 || block_size > 4096) return "block_size must be in 1..4096";
    if (num_blocks == 0) return "num_blocks must be > 0";
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
