#pragma once
// The mini engine's "model": deterministic KV bytes, so any byte served for the wrong prefix,
// position, layer or head is detected.
//
// The KV of token t (one (layer, plane, kv head) row of head_dim elements) is a function of:
//   the prefix hash up to and including t (token-level rolling hash: a different earlier token
//   changes every later row), the position t, the layer, the plane (K or V) and the GLOBAL kv
//   head index (ranks of a tensor-parallel group hold different heads).
// Bytes come from a splitmix64 stream seeded by those fields: cheap (the engine writes ~12 KiB
// per token for the default shape) and never equal by accident across inputs.

#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/core/token_hasher.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace mini_engine {

inline std::uint64_t splitmix64(std::uint64_t& x) noexcept {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Token-level rolling prefix hashes: h[t] depends on tokens[0..t].
inline std::vector<std::uint64_t> prefix_hashes(std::span<const kvtier::token_id> tokens) {
  std::vector<std::uint64_t> h(tokens.size());
  std::uint64_t acc = 0x6b76746965722e6bULL;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    std::uint64_t x = acc ^ (std::uint64_t{tokens[t]} * 0x9e3779b97f4a7c15ULL);
    acc = splitmix64(x);
    h[t] = acc;
  }
  return h;
}

/// Which slice of the model this engine process (rank) holds.
struct shard {
  kvtier::model_shape shape;  ///< per-rank shape (num_kv_heads = global heads / world_size)
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  [[nodiscard]] std::uint32_t global_head(std::uint32_t local) const noexcept {
    return rank * shape.num_kv_heads + local;
  }
};

/// Fills `row` (one token of one (layer, plane, local head)) with its expected bytes.
inline void fill_row(std::span<std::byte> row, std::uint64_t prefix_hash, std::uint32_t position, std::uint32_t layer,
                     std::uint32_t plane, std::uint32_t head) noexcept {
  std::uint64_t seed = prefix_hash ^ (std::uint64_t{position} << 32) ^ (std::uint64_t{layer} << 20) ^
                       (std::uint64_t{plane} << 18) ^ (std::uint64_t{head} << 8);
  std::size_t i = 0;
  for (; i + 8 <= row.size(); i += 8) {
    const std::uint64_t v = splitmix64(seed);
    std::memcpy(row.data() + i, &v, 8);
  }
  if (i < row.size()) {
    const std::uint64_t v = splitmix64(seed);
    std::memcpy(row.data() + i, &v, row.size() - i);
  }
}

/// Writes (compute == true) or checks (compute == false) the KV of tokens [first, last) of a
/// sequence into its blocks of the region. `blocks[i]` holds tokens [i*block_size, ...).
/// Returns the number of mismatching rows (0 when writing). When checking, `stride` > 1 checks
/// every stride-th token and the last one only (a sample: a wrong block or chunk still shows).
inline std::size_t write_or_verify(const kvtier::kv_region& region, const shard& s,
                                   std::span<const std::uint64_t> hashes, std::span<const std::uint32_t> blocks,
                                   std::size_t first, std::size_t last, bool compute, std::size_t stride = 1) {
  const auto& layout = region.layout();
  const std::size_t row_bytes = std::size_t{s.shape.head_dim} * s.shape.dtype_bytes();
  std::vector<std::byte> expected(row_bytes);
  std::size_t bad = 0;
  for (std::size_t t = first; t < last; ++t) {
    if (!compute && stride > 1 && (t - first) % stride != 0 && t + 1 != last) continue;
    const std::uint32_t block = blocks[t / layout.block_size];
    const auto in_block = static_cast<std::uint32_t>(t % layout.block_size);
    for (std::uint32_t l = 0; l < s.shape.num_layers; ++l)
      for (std::uint32_t p = 0; p < s.shape.planes(); ++p)
        for (std::uint32_t h = 0; h < s.shape.num_kv_heads; ++h) {
          std::byte* at = region.layers()[l] + layout.offset_in_layer(p, block, in_block) + h * row_bytes;
          if (compute) {
            fill_row({at, row_bytes}, hashes[t], static_cast<std::uint32_t>(t), l, p, s.global_head(h));
          } else {
            fill_row(expected, hashes[t], static_cast<std::uint32_t>(t), l, p, s.global_head(h));
            if (std::memcmp(at, expected.data(), row_bytes) != 0) ++bad;
          }
        }
  }
  return bad;
}

}  // namespace mini_engine
