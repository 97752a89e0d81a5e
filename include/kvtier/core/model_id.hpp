#pragma once
// The model namespace of chunk keys: make_model_id (model name, KV shape, layout kind,
// registration salt -> 64-bit model id) and salted_model_id (a request's cache_salt).
//
// Dependencies beyond the standard library: xxhash.h (header-only, core/detail/xxhash.hpp).
// No OpenSSL: the server computes model ids without the token hasher (core/token_hasher.hpp,
// kvtier::engine), which includes this header.

#include <kvtier/config.hpp>
#include <kvtier/core/detail/xxhash.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

namespace detail {

inline void put_le64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

}  // namespace detail

/// The model namespace of chunk keys: XXH3-64 over the model name, the KV shape (layers,
/// KV heads, head dim, dtype KIND, MHA/MLA), the paged layout kind and an optional salt, so
/// different models, dtypes of one size (fp16/bf16, fp8 e4m3/e5m2), layouts or tenants never
/// share objects. Encoding (version 2): name || 0 || u32 layers, u32 heads, u32 head dim,
/// u8 dtype kind, u8 attention, u8 layout kind (LE) || 0 || salt.
[[nodiscard]] inline std::uint64_t make_model_id(std::string_view model_name, const model_shape& shape,
                                                 kv_layout_kind layout = kv_layout_kind::nhd,
                                                 std::string_view salt = {}) noexcept {
  std::array<std::byte, 15> fields{};
  auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (int i = 0; i < 4; ++i)
      fields[at + static_cast<std::size_t>(i)] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
  };
  put32(0, shape.num_layers);
  put32(4, shape.num_kv_heads);
  put32(8, shape.head_dim);
  fields[12] = static_cast<std::byte>(shape.dtype);
  fields[13] = static_cast<std::byte>(shape.attention);
  // An MLA model has one block order: its id does not depend on what the caller passed.
  fields[14] = static_cast<std::byte>(shape.attention == attention_kind::mla ? kv_layout_kind::mla : layout);
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, model_name.data(), model_name.size());
  const char sep = '\0';
  XXH3_64bits_update(&state, &sep, 1);
  XXH3_64bits_update(&state, fields.data(), fields.size());
  XXH3_64bits_update(&state, &sep, 1);
  XXH3_64bits_update(&state, salt.data(), salt.size());
  return XXH3_64bits_digest(&state);
}

/// The model id of one request's chunks: `model_id` itself for an empty salt, else XXH3-64
/// over "kvtier.salt.v1" || model_id (u64 LE) || salt. vLLM's per-request `cache_salt`
/// (multi-tenant isolation): the same tokens under different salts never share a chunk, and
/// under the same salt they do.
[[nodiscard]] inline std::uint64_t salted_model_id(std::uint64_t model_id, std::string_view salt) noexcept {
  if (salt.empty()) return model_id;
  static constexpr std::string_view tag = "kvtier.salt.v1";
  std::array<std::byte, 8> id{};
  detail::put_le64(id.data(), model_id);
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, tag.data(), tag.size());
  XXH3_64bits_update(&state, id.data(), id.size());
  XXH3_64bits_update(&state, salt.data(), salt.size());
  return XXH3_64bits_digest(&state);
}

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
