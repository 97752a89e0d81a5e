#pragma once
// session (server/session/session.hpp): describe_chunks_request, the token ids of chunks an
// engine looked up (issue 28: KV events for routers; docs/integration.md, "Routers"). The
// handler checks the description against the connection's registration, folds the request's
// salt into the model id exactly as a lookup does (request_model_id), and, when something on
// the bus wants bus::chunks_described (the KV event publisher's relay is attached), publishes
// it for the bus's deferred path and answers described=true. A server that publishes no KV
// events keeps nothing and answers described=false: the connection then stops describing.
// The checks come first either way, so a malformed description is refused by every server.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/server/session/session.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {
namespace detail {

/// Whether `v` is exactly one complete msgpack value (a block's extra keys: the publisher
/// writes them into its stream as they are, so one malformed value would garble every later
/// event of the stream for every subscriber). Iterative (no recursion however deep the
/// nesting), linear in the size, and a container cannot claim more elements than bytes left.
[[nodiscard]] inline bool is_one_msgpack_value(std::string_view v) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  const std::size_t size = v.size();
  std::size_t at = 0;
  std::uint64_t pending = 1;  // values still to read
  auto be = [&](std::size_t n, std::uint64_t& out) {
    if (size - at < n) return false;
    out = 0;
    for (std::size_t i = 0; i < n; ++i) out = (out << 8) | p[at + i];
    at += n;
    return true;
  };
  auto skip = [&](std::uint64_t n) {
    if (size - at < n) return false;
    at += static_cast<std::size_t>(n);
    return true;
  };
  while (pending > 0) {
    if (at >= size) return false;
    const unsigned b = p[at++];
    --pending;
    std::uint64_t n = 0;
    std::uint64_t children = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      // fixint, nil, false, true
    } else if (b <= 0x8f) {
      children = 2 * std::uint64_t{b & 0x0fu};  // fixmap
    } else if (b <= 0x9f) {
      children = b & 0x0fu;  // fixarray
    } else if (b <= 0xbf) {
      if (!skip(b & 0x1fu)) return false;  // fixstr
    } else {
      // 0xc4-0xdf: a length of `len` bytes (0: none) then `fixed` bytes plus `per` per unit
      // of the length (bin, str, ext), or a count of `per` child values (array, map).
      struct head {
        std::uint8_t len, fixed, per;
        bool container;
      };
      static constexpr head heads[] = {
          {1, 0, 1, false},  {2, 0, 1, false}, {4, 0, 1, false},                    // c4-c6 bin8/16/32
          {1, 1, 1, false},  {2, 1, 1, false}, {4, 1, 1, false},                    // c7-c9 ext8/16/32 (+ type)
          {0, 4, 0, false},  {0, 8, 0, false},                                      // ca-cb float32/64
          {0, 1, 0, false},  {0, 2, 0, false}, {0, 4, 0, false}, {0, 8, 0, false},  // cc-cf uint
          {0, 1, 0, false},  {0, 2, 0, false}, {0, 4, 0, false}, {0, 8, 0, false},  // d0-d3 int
          {0, 2, 0, false},  {0, 3, 0, false}, {0, 5, 0, false}, {0, 9, 0, false},
          {0, 17, 0, false},                                      // d4-d8 fixext1..16 (+ type)
          {1, 0, 1, false},  {2, 0, 1, false}, {4, 0, 1, false},  // d9-db str8/16/32
          {2, 0, 1, true},   {4, 0, 1, true},                     // dc-dd array16/32
          {2, 0, 2, true},   {4, 0, 2, true},                     // de-df map16/32
      };
      if (b == 0xc1) return false;  // never used
      const head& h = heads[b - 0xc4];
      if (h.len != 0 && !be(h.len, n)) return false;
      if (h.container)
        children = h.per * n;
      else if (!skip(h.fixed + h.per * n))
        return false;
    }
    pending += children;
    if (pending > size - at) return false;  // each value takes at least one byte
  }
  return at == size;
}

}  // namespace detail

/// Why `r` does not describe chunks of registration `reg`, or nullopt.
inline std::optional<request_error> session::description_error(const registration& reg,
                                                               const protocol::describe_chunks_request& r) {
  const std::uint32_t ct = reg.chunk.chunk_tokens;
  auto refuse = [](std::string text) {
    return std::optional<request_error>{request_error{errc::invalid_argument, "describe_chunks_request" + text}};
  };
  if (r.model_id != reg.model_id)
    return refuse(".model_id " + std::to_string(r.model_id) + " is not this connection's model id " +
                  std::to_string(reg.model_id) + " (from register_kv_response)");
  if (r.world_size != reg.world_size)
    return refuse(".world_size " + std::to_string(r.world_size) + " differs from the registration's " +
                  std::to_string(reg.world_size));
  if (r.chunk_hashes.empty()) return refuse(": no chunk_hashes: describe at least one chunk");
  if (r.block_size == 0 || ct % r.block_size != 0)
    return refuse(".block_size " + std::to_string(r.block_size) + " does not divide the chunk size " +
                  std::to_string(ct) + ": send the engine's tokens per block");
  if (r.token_ids.size() != r.chunk_hashes.size() * ct)
    return refuse(": " + std::to_string(r.token_ids.size()) + " token ids for " +
                  std::to_string(r.chunk_hashes.size()) + " chunks; each chunk has " + std::to_string(ct) +
                  " tokens (chunk_tokens of the registration)");
  const std::size_t blocks = r.chunk_hashes.size() * (ct / r.block_size);
  if (!r.block_extra_keys.empty() && r.block_extra_keys.size() != blocks)
    return refuse(": " + std::to_string(r.block_extra_keys.size()) + " block_extra_keys for " + std::to_string(blocks) +
                  " blocks; send one per block (chunk_tokens " + std::to_string(ct) + " / block_size " +
                  std::to_string(r.block_size) + " per chunk) or none");
  for (std::size_t i = 0; i < r.block_extra_keys.size(); ++i)
    if (!detail::is_one_msgpack_value(r.block_extra_keys[i]))
      return refuse(".block_extra_keys[" + std::to_string(i) + "] is not one complete msgpack value");
  if (r.lora_id < -1) return refuse(".lora_id " + std::to_string(r.lora_id) + ": -1 (none) or an adapter id >= 0");
  return std::nullopt;
}

inline request_result<protocol::describe_chunks_response> session::on(const protocol::describe_chunks_request& r,
                                                                      call&) {
  auto reg_r = registered("describe_chunks_request");
  if (!reg_r) return reg_r.error();
  const registration& reg = **reg_r;
  if (auto refused = description_error(reg, r)) return *refused;
  // Building the event copies the tokens: only when the KV event publisher is attached.
  if (!bus::wants_kind<bus::chunks_described>(ctx_.bus)) return protocol::describe_chunks_response{false};
  bus::chunks_described e;
  e.model_id = request_model_id(reg, r.cache_salt);
  e.world_size = reg.world_size;
  e.chunk_tokens = reg.chunk.chunk_tokens;
  e.block_size = r.block_size;
  e.has_parent = r.has_parent;
  e.parent_hash = r.has_parent ? r.parent_hash : hash128{};
  e.chunk_hashes = r.chunk_hashes;
  e.token_ids = r.token_ids;
  e.lora_name = r.lora_name;
  e.lora_id = r.lora_id;
  e.block_extra_keys = r.block_extra_keys;
  ctx_.bus.publish(e);
  return protocol::describe_chunks_response{true};
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
