#pragma once
// token_hasher: the rolling prefix hash that names chunks of tokens,
//   h(i) = H(h(i-1) as 16 bytes LE || tokens of chunk i as u32 LE || extra(i)),
// H = XXH3-128 (default) or SHA-256 truncated to 16 bytes, fixed and little-endian so every
// process, run and machine computes the same hashes; only full chunks are hashed. Links
// OpenSSL (kvtier::engine); the model ids are core/model_id.hpp's. docs/integration.md,
// "vLLM: what names a chunk", holds the encoding of the extra bytes and why it is framed so.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/detail/xxhash.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/model_id.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <openssl/evp.h>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

using token_id = std::uint32_t;

enum class hash_algorithm : std::uint8_t { xxh3_128 = 0, sha256 = 1 };

[[nodiscard]] constexpr std::string_view to_string(hash_algorithm a) noexcept {
  return a == hash_algorithm::sha256 ? "sha256" : "xxh3_128";
}

/// Parses "xxh3_128" (also "xxh3") or "sha256".
[[nodiscard]] constexpr std::optional<hash_algorithm> parse_hash_algorithm(std::string_view s) noexcept {
  if (s == "xxh3_128" || s == "xxh3") return hash_algorithm::xxh3_128;
  if (s == "sha256") return hash_algorithm::sha256;
  return std::nullopt;
}

namespace detail {

inline std::uint64_t get_be64(const unsigned char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

}  // namespace detail

class token_hasher {
 public:
  static constexpr std::size_t default_chunk_size = 256;

  explicit token_hasher(std::size_t chunk_size = default_chunk_size,
                        hash_algorithm algorithm = hash_algorithm::xxh3_128)
      : chunk_size_(chunk_size), algorithm_(algorithm) {
    if (chunk_size == 0 || chunk_size > 65536)
      throw std::invalid_argument("kvtier::token_hasher: chunk_size must be in 1..65536");
  }

  [[nodiscard]] std::size_t chunk_size() const noexcept { return chunk_size_; }
  [[nodiscard]] hash_algorithm algorithm() const noexcept { return algorithm_; }

  /// Number of full chunks in n tokens.
  [[nodiscard]] std::size_t full_chunks(std::size_t n_tokens) const noexcept { return n_tokens / chunk_size_; }

  /// h(-1): the hash of the ASCII string "kvtier.root.v1" under the selected algorithm.
  [[nodiscard]] hash128 root() const {
    static constexpr std::string_view seed = "kvtier.root.v1";
    return digest(std::as_bytes(std::span(seed.data(), seed.size())), {}, {}, {});
  }

  /// h(i) from h(i-1), the chunk's tokens (chunk.size() must equal chunk_size()) and its
  /// extra bytes (empty: the hash of the tokens alone, as before extras existed).
  [[nodiscard]] hash128 next(hash128 prefix, std::span<const token_id> chunk,
                             std::span<const std::byte> extra = {}) const {
    if (chunk.size() != chunk_size_)
      throw std::invalid_argument("kvtier::token_hasher::next: a chunk has exactly chunk_size tokens");
    std::array<std::byte, 16> p{};
    detail::put_le64(p.data(), prefix.lo);
    detail::put_le64(p.data() + 8, prefix.hi);
    std::array<std::byte, 8> extra_len{};
    detail::put_le64(extra_len.data(), extra.size());
    const std::span<const std::byte> tail_len = extra.empty() ? std::span<const std::byte>{} : extra_len;
    if constexpr (std::endian::native == std::endian::little) {
      return digest(p, std::as_bytes(chunk), tail_len, extra);
    } else {
      std::vector<std::byte> le(chunk.size() * 4);
      for (std::size_t i = 0; i < chunk.size(); ++i)
        for (int b = 0; b < 4; ++b)
          le[i * 4 + static_cast<std::size_t>(b)] = static_cast<std::byte>((chunk[i] >> (8 * b)) & 0xff);
      return digest(p, le, tail_len, extra);
    }
  }

  /// Appends the hashes of the full chunks of `tokens` to `out`, continuing from `prefix`
  /// (root() for a sequence that starts at token 0). Returns the last hash (or prefix).
  /// `extras`: none (every chunk hashes its tokens alone) or one byte string per full chunk
  /// of `tokens` (extras[i] goes with the i-th chunk; an empty one = no extra); any other
  /// count is refused (std::invalid_argument), since a shifted extra would name the wrong KV.
  hash128 append_chunk_hashes(std::span<const token_id> tokens, std::vector<hash128>& out,
                              std::optional<hash128> prefix = std::nullopt,
                              std::span<const std::span<const std::byte>> extras = {}) const {
    hash128 h = prefix ? *prefix : root();
    const std::size_t n = full_chunks(tokens.size());
    if (!extras.empty() && extras.size() != n)
      throw std::invalid_argument("kvtier::token_hasher: " + std::to_string(extras.size()) + " extras for " +
                                  std::to_string(n) +
                                  " full chunks: give one extra (possibly empty) per full chunk, or none");
    out.reserve(out.size() + n);
    for (std::size_t i = 0; i < n; ++i) {
      h = next(h, tokens.subspan(i * chunk_size_, chunk_size_),
               extras.empty() ? std::span<const std::byte>{} : extras[i]);
      out.push_back(h);
    }
    return h;
  }

  /// The hashes of every full chunk of a sequence starting at token 0 (`extras` as in
  /// append_chunk_hashes).
  [[nodiscard]] std::vector<hash128> chunk_hashes(std::span<const token_id> tokens,
                                                  std::span<const std::span<const std::byte>> extras = {}) const {
    std::vector<hash128> out;
    append_chunk_hashes(tokens, out, std::nullopt, extras);
    return out;
  }

 private:
  /// H(a || b || c || d): the parts are hashed as one message (streamed, never concatenated).
  [[nodiscard]] hash128 digest(std::span<const std::byte> a, std::span<const std::byte> b, std::span<const std::byte> c,
                               std::span<const std::byte> d) const {
    const std::array<std::span<const std::byte>, 4> parts{a, b, c, d};
    if (algorithm_ == hash_algorithm::xxh3_128) {
      XXH3_state_t state;
      XXH3_INITSTATE(&state);
      XXH3_128bits_reset(&state);
      for (const auto& part : parts)
        if (!part.empty()) XXH3_128bits_update(&state, part.data(), part.size());
      const XXH128_hash_t h = XXH3_128bits_digest(&state);
      return {h.low64, h.high64};
    }
    // SHA-256 over a || b || c || d; the first 16 digest bytes, big-endian, become (hi, lo).
    EVP_MD_CTX* ctx = EVP_MD_CTX_new();
    if (ctx == nullptr) throw std::bad_alloc();
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    bool ok = EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1;
    for (const auto& part : parts) ok = ok && (part.empty() || EVP_DigestUpdate(ctx, part.data(), part.size()) == 1);
    ok = ok && EVP_DigestFinal_ex(ctx, md, &len) == 1;
    EVP_MD_CTX_free(ctx);
    if (!ok || len < 16) throw std::runtime_error("kvtier::token_hasher: OpenSSL SHA-256 failed");
    return {detail::get_be64(md + 8), detail::get_be64(md)};
  }

  std::size_t chunk_size_;
  hash_algorithm algorithm_;
};

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
