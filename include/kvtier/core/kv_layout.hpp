#pragma once
// kv_layout: the byte shapes kvtier copies between. Standard library only. dtype_kind and
// kv_layout_kind (NHD, HND, MLA: the order of the rows in a chunk object), model_shape (a
// model's KV geometry), chunk_layout (one chunk object, the unit stored in L1 and L2,
// layer-major) and paged_kv_layout (an engine's paged KV cache: vLLM's dense tensors by
// default, any non-overlapping kv_strides otherwise). docs/integration.md, "Layout
// assumptions", holds the layouts, the chunk object's byte order and why it depends on the
// order only, never on the strides.

#include <kvtier/config.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

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
  nhd = 0,  ///< [block_size][kv_heads][head_dim] per block and plane: vLLM's default (NHD) order
  hnd = 1,  ///< [kv_heads][block_size][head_dim] per block and plane: vLLM's HND order (CPU backend)
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

/// Byte strides of an engine's paged KV cache: from one layer, plane (K to V), block, token
/// and KV head to the next. A row (head_dim elements of one (layer, plane, block, token,
/// head)) is always contiguous. All zero (the default) means the dense layout of the
/// paged_kv_layout's `order` (paged_kv_layout::dense_strides()). The stride of a dimension
/// of size 1 (MLA's plane and head, one layer) is never used.
///
/// The layer stride places the layers in a kv_region (and cuda::kv_region::allocate); a
/// copy reads each layer's base from the view's pointer table instead, so a view of layers
/// that live apart (one tensor each) ignores it, but it must still describe layers that do
/// not overlap (pass the layer extent, paged_kv_layout::layer_bytes(), or more).
struct kv_strides {
  std::uint64_t layer = 0;
  std::uint64_t plane = 0;
  std::uint64_t block = 0;
  std::uint64_t token = 0;
  std::uint64_t head = 0;

  friend constexpr bool operator==(const kv_strides&, const kv_strides&) = default;

  /// All zero: the dense layout of the order.
  [[nodiscard]] constexpr bool dense() const noexcept {
    return layer == 0 && plane == 0 && block == 0 && token == 0 && head == 0;
  }
};

/// An engine's paged KV cache (one kv region holds num_layers such layers, at
/// effective_strides().layer from one another).
struct paged_kv_layout {
  model_shape model;
  std::uint32_t block_size = 16;  ///< tokens per block
  std::uint32_t num_blocks = 0;
  /// nhd or hnd for MHA models; an MLA model's blocks have one order whatever is set here
  /// (kind() answers mla). The order of the rows in a chunk object, and part of the model id.
  kv_layout_kind order = kv_layout_kind::nhd;
  /// Where the rows are in memory: all zero for the dense layout of `order`.
  kv_strides strides{};

  /// The largest total_bytes() of a valid layout: 1 PiB, beyond any machine's memory, and
  /// small enough that no size or offset computed from a valid layout wraps around 64 bits
  /// (every dimension at its limit would give 2^83 bytes).
  static constexpr std::uint64_t max_total_bytes = std::uint64_t{1} << 50;

  friend constexpr bool operator==(const paged_kv_layout&, const paged_kv_layout&) = default;

  /// The layout kind: mla for MLA models, else `order`.
  [[nodiscard]] constexpr kv_layout_kind kind() const noexcept {
    return model.attention == attention_kind::mla ? kv_layout_kind::mla : order;
  }

  /// Bytes of one (layer, plane, block) of KV: block_size tokens, the unit of a chunk object.
  [[nodiscard]] constexpr std::size_t segment_bytes() const noexcept {
    return std::size_t{block_size} * model.token_plane_bytes();
  }
  /// Bytes of one KV head's head_dim elements of one token (one row).
  [[nodiscard]] constexpr std::size_t head_row_bytes() const noexcept {
    return std::size_t{model.head_dim} * model.dtype_bytes();
  }
  /// The runs of rows one block segment of a chunk object is made of, in which a skip
  /// inside the block takes the leading rows: 1 for NHD and MLA (token-major: the segment is
  /// one run of block_size token rows), num_kv_heads for HND (one run of block_size rows per
  /// head).
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
  /// Offset of (token, head)'s row inside one block segment of a chunk object (and of a
  /// dense layout's block).
  [[nodiscard]] constexpr std::size_t offset_in_segment(std::uint32_t token, std::uint32_t head = 0) const noexcept {
    if (kind() == kv_layout_kind::hnd) return head * run_bytes() + std::size_t{token} * head_row_bytes();
    return std::size_t{token} * model.token_plane_bytes() + std::size_t{head} * head_row_bytes();
  }

  /// The strides of the dense layout of `order` (what all-zero strides mean): layer =
  /// layer_bytes(), plane = num_blocks segments, block = one segment, and inside a block
  /// token = kv_heads rows, head = one row (NHD, MLA) or head = block_size rows, token = one
  /// row (HND).
  [[nodiscard]] constexpr kv_strides dense_strides() const noexcept {
    const std::uint64_t row = head_row_bytes();
    const std::uint64_t seg = segment_bytes();
    const std::uint64_t plane = seg * num_blocks;
    kv_strides s{plane * model.planes(), plane, seg, std::uint64_t{model.num_kv_heads} * row, row};
    if (kind() == kv_layout_kind::hnd) {
      s.token = row;
      s.head = std::uint64_t{block_size} * row;
    }
    return s;
  }
  /// The strides in force: `strides`, or dense_strides() when they are all zero.
  [[nodiscard]] constexpr kv_strides effective_strides() const noexcept {
    return strides.dense() ? dense_strides() : strides;
  }
  /// Whether one (layer, plane, block) is one contiguous run of segment_bytes() in the
  /// order of a chunk object's segment (then a copy moves whole segments; else rows).
  /// Always true for dense layouts.
  [[nodiscard]] constexpr bool segment_contiguous() const noexcept {
    if (strides.dense()) return true;
    const std::uint64_t row = head_row_bytes();
    const std::uint64_t heads = model.num_kv_heads;
    if (kind() == kv_layout_kind::hnd)
      return (block_size == 1 || strides.token == row) && (heads == 1 || strides.head == block_size * row);
    return (heads == 1 || strides.head == row) && (block_size == 1 || strides.token == heads * row);
  }

  /// Bytes from a layer's base to the end of its last row (the size of one layer's tensor):
  /// num_blocks * planes segments for a dense layout.
  [[nodiscard]] constexpr std::size_t layer_bytes() const noexcept {
    if (strides.dense()) return segment_bytes() * num_blocks * model.planes();
    const kv_strides& s = strides;
    return span(model.planes(), s.plane) + span(num_blocks, s.block) + span(block_size, s.token) +
           span(model.num_kv_heads, s.head) + head_row_bytes();
  }
  /// Bytes from the first layer's base to the end of the last layer's last row (the data of
  /// a CPU kv region): layer_bytes() * num_layers for a dense layout.
  [[nodiscard]] constexpr std::size_t total_bytes() const noexcept {
    if (strides.dense()) return layer_bytes() * model.num_layers;
    return span(model.num_layers, strides.layer) + layer_bytes();
  }
  /// Offset of the row of (token, head) of (plane, block) from its layer's base; with the
  /// defaults, the block's first row. In a dense NHD or MLA layout a token's heads are one
  /// contiguous run of token_plane_bytes() (head 0 starts it); in HND each head's row is
  /// apart (head_row_bytes()); with explicit strides wherever they say.
  [[nodiscard]] constexpr std::size_t offset_in_layer(std::uint32_t plane, std::uint32_t block, std::uint32_t token = 0,
                                                      std::uint32_t head = 0) const noexcept {
    const kv_strides s = effective_strides();
    return plane * s.plane + block * s.block + token * s.token + head * s.head;
  }
  /// Offset of the row of (token, head) of (layer, plane) inside a chunk object gathered
  /// from this cache (`token` counts from the chunk's start). NHD and MLA: chunk.offset(
  /// layer, plane, token) plus the head's place; HND: the block's segment, head-major.
  [[nodiscard]] constexpr std::size_t object_offset(const chunk_layout& chunk, std::uint32_t layer, std::uint32_t plane,
                                                    std::uint32_t token, std::uint32_t head = 0) const noexcept {
    return chunk.offset(layer, plane) + std::size_t{token / block_size} * segment_bytes() +
           offset_in_segment(token % block_size, head);
  }

  /// The shape and strides in words, for messages: "layers 2, planes 2, blocks 8, block_size
  /// 4, kv_heads 2, row 32 bytes; strides (bytes) layer 4096, plane 2048, block 256, token
  /// 64, head 32" (the effective strides; "dense NHD" when they are all zero).
  [[nodiscard]] std::string describe() const {
    const kv_strides s = effective_strides();
    return "layers " + std::to_string(model.num_layers) + ", planes " + std::to_string(model.planes()) + ", blocks " +
           std::to_string(num_blocks) + ", block_size " + std::to_string(block_size) + ", kv_heads " +
           std::to_string(model.num_kv_heads) + ", row " + std::to_string(head_row_bytes()) +
           " bytes; strides (bytes) layer " + std::to_string(s.layer) + ", plane " + std::to_string(s.plane) +
           ", block " + std::to_string(s.block) + ", token " + std::to_string(s.token) + ", head " +
           std::to_string(s.head) + (strides.dense() ? " (dense " + std::string(name(kind())) + ")" : "");
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
    if (!strides.dense()) return strides_error();
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

 private:
  /// Bytes a dimension of n entries `stride` apart spans before its last entry.
  [[nodiscard]] static constexpr std::uint64_t span(std::uint64_t n, std::uint64_t stride) noexcept {
    return n > 1 ? (n - 1) * stride : 0;
  }

  /// The checks of explicit strides (validation_error, after the shape's): every row of
  /// every (layer, plane, block, token, head) ends within max_total_bytes of the first
  /// layer's base, computed without overflow; no two rows overlap; `order` agrees with the
  /// strides. Injectivity is checked on the sorted strides: taking the dimensions of more
  /// than one entry from the smallest stride up, each stride must reach past everything
  /// the smaller ones span (a row to begin with), i.e. the layout nests. Every layout vLLM
  /// allocates does; one that interleaves dimensions without overlapping is refused too
  /// (rare, and never produced by a permutation of a contiguous tensor).
  [[nodiscard]] std::string strides_error() const {
    struct dim {
      const char* name;
      std::uint64_t n;
      std::uint64_t stride;
    };
    const kv_strides& s = strides;
    std::array<dim, 5> dims{{{"layer", model.num_layers, s.layer},
                             {"plane", model.planes(), s.plane},
                             {"block", num_blocks, s.block},
                             {"token", block_size, s.token},
                             {"head", model.num_kv_heads, s.head}}};
    const std::uint64_t row = head_row_bytes();
    std::uint64_t end = row;  // of the last row: sum of (n - 1) * stride, plus a row
    for (const dim& d : dims) {
      if (d.n <= 1) continue;
      // Each term at most 2^50 and five of them: the sum cannot wrap.
      if (d.stride > max_total_bytes / (d.n - 1))
        return "the " + std::string(d.name) + " stride " + std::to_string(d.stride) + " times " +
               std::to_string(d.n - 1) + " reaches beyond 1 PiB (" + describe() + ")";
      end += (d.n - 1) * d.stride;
    }
    if (end > max_total_bytes) return "the KV rows reach beyond 1 PiB (" + describe() + ")";
    std::stable_sort(dims.begin(), dims.end(), [](const dim& a, const dim& b) { return a.stride < b.stride; });
    std::uint64_t spanned = row;  // bytes the dimensions below the current one cover
    std::string inside = "a row";
    for (const dim& d : dims) {
      if (d.n <= 1) continue;
      if (d.stride < spanned)
        return "KV rows overlap: the " + std::string(d.name) + " stride " + std::to_string(d.stride) +
               " is below the " + std::to_string(spanned) + " bytes that " + inside + " span" +
               (inside == "a row" ? "s" : "") + " (" + describe() + ")";
      spanned += (d.n - 1) * d.stride;
      inside = inside == "a row" ? std::string("a row and the ") + d.name + " dimension"
                                 : inside + " and the " + d.name + " dimension";
    }
    // The order objects are made in must be the strides' own: HND iff heads are outer.
    if (model.attention == attention_kind::mha && model.num_kv_heads > 1 && block_size > 1) {
      const bool head_major = s.head > s.token;
      if (head_major != (order == kv_layout_kind::hnd))
        return "order " + std::string(name(order)) + " disagrees with the strides: the head stride " +
               std::to_string(s.head) + (head_major ? " exceeds" : " is below") + " the token stride " +
               std::to_string(s.token) + ", so the blocks are " + (head_major ? "head-major: register HND" :
                                                                      "token-major: register NHD") +
               " (" + describe() + ")";
    }
    return {};
  }
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
