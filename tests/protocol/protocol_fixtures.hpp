#pragma once
// Shared by the protocol tests: one filled sample of every message, a byte builder for
// hand-made (and rule-breaking) frames, and a count of this process's open fds.

#include <kvtier/protocol/codec.hpp>
#include <kvtier/protocol/messages.hpp>

#include <dirent.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::test {

/// One message of every type, every field away from its default.
inline std::vector<protocol::message> sample_messages() {
  namespace p = protocol;
  std::vector<p::message> m;
  p::register_kv_request reg;
  reg.instance_id = 0x1122334455667788ULL;
  reg.rank = 3;
  reg.world_size = 8;
  reg.model_name = "meta-llama/Llama-3.1-70B-Instruct";
  reg.model = model_shape{80, 8, 128, dtype_kind::bf16, attention_kind::mha};
  reg.block_size = 16;
  reg.num_blocks = 4096;
  reg.chunk_tokens = 256;
  reg.region_bytes = 0x0000'0012'3456'7000ULL;
  reg.layout_kind = kv_layout_kind::hnd;
  reg.region = p::region_kind::cuda_ipc;
  reg.region_descriptor = std::string(
      "KVCR"
      "descriptor bytes\0\xff",
      22);
  reg.cache_salt = "tenant-7";
  reg.prefill_tokens_per_second = 50000;
  reg.strides = {0x1'0000'0000ULL, 128, 16 * 8 * 256, 8 * 256, 256};  // K|V packed per (token, head)
  reg.engine_id = "0b6c7e5e-8f1a-4c2d-9e3b-5a7d1c2e4f60_dp1";
  m.emplace_back(reg);
  m.emplace_back(p::unregister_kv_request{});
  m.emplace_back(
      p::lookup_request{"cmpl-1234-0", 0xfeedULL, 4, {hash128{1, 2}, hash128{3, 4}, hash128{~0ULL, 0}}, "salt-l", true});
  m.emplace_back(p::query_prefetch_request{"cmpl-query"});
  m.emplace_back(
      p::retrieve_request{"cmpl-r", 2, 5, {hash128{7, 8}, hash128{9, 10}}, {1, 2, 3, 4, 0xffffffffu, 6}, 17, "salt-r", true});
  m.emplace_back(
      p::store_request{"cmpl-s", 1, 9, {hash128{11, 12}}, {100, 101}, {0x8000000000000001ULL, 42}, "salt-s"});
  m.emplace_back(p::free_lookup_locks_request{"cmpl-free"});
  m.emplace_back(p::end_request_request{"cmpl-end"});
  m.emplace_back(p::ping_request{4242});
  m.emplace_back(p::clear_request{true});
  m.emplace_back(p::get_chunk_size_request{});
  m.emplace_back(p::status_request{});
  m.emplace_back(p::error_response{static_cast<std::uint32_t>(errc::not_registered), "register first"});
  m.emplace_back(p::register_kv_response{0xb007ULL, 7, 0xabcdefULL, 256, 30000});
  m.emplace_back(p::unregister_kv_response{});
  m.emplace_back(p::lookup_response{p::prefetch_state::pending, 0, 0});
  m.emplace_back(p::query_prefetch_response{p::prefetch_state::done, 12, 5});
  m.emplace_back(p::retrieve_response{11});
  m.emplace_back(p::store_response{3, 2, 1});
  m.emplace_back(p::free_lookup_locks_response{});
  m.emplace_back(p::end_request_response{});
  m.emplace_back(p::ping_response{0xb007ULL, 123456789ULL});
  m.emplace_back(p::clear_response{});
  m.emplace_back(p::get_chunk_size_response{256});
  m.emplace_back(p::status_response{R"({"registrations":[],"l1":{"used_bytes":0}})"});
  m.emplace_back(p::retrieve_progress{31, 2});
  m.emplace_back(p::list_objects_request{});
  m.emplace_back(p::evict_request{false, true, "meta-llama/Llama-3.1-8B", true, "tenant-a", false, 0, "l1,disk", true});
  m.emplace_back(p::list_objects_response{R"({"tiers":[{"name":"l1"}],"namespaces":[]})"});
  m.emplace_back(p::evict_response{12, 49152, 2, 1, R"({"tiers":[]})"});
  p::describe_chunks_request d;
  d.model_id = 0xfeedULL;
  d.world_size = 4;
  d.cache_salt = "salt-d";
  d.block_size = 2;
  d.has_parent = true;
  d.parent_hash = hash128{0x55, 0x66};
  d.chunk_hashes = {hash128{1, 2}, hash128{~0ULL, 3}};
  d.token_ids = {1, 2, 3, 4, 0xffffffffu, 6, 7, 8};
  d.lora_name = "adapter-a";
  d.lora_id = -7;  // not a legal adapter id (the server refuses it): the codec keeps the sign
  d.block_extra_keys = {std::string("\x91\xa1x", 3), "", std::string("\0\xff", 2), "\xc0"};
  m.emplace_back(d);
  m.emplace_back(p::describe_chunks_response{true});
  m.emplace_back(p::list_keys_request{"disk", 10});
  m.emplace_back(p::list_keys_response{R"({"tier":"disk","keys":[],"total":0,"truncated":false})"});
  return m;
}

/// Little-endian bytes, by hand (independent of the codec under test).
struct bytes_builder {
  std::vector<std::byte> bytes;

  bytes_builder& u8(std::uint8_t v) { return put(v, 1); }
  bytes_builder& u16(std::uint16_t v) { return put(v, 2); }
  bytes_builder& u32(std::uint32_t v) { return put(v, 4); }
  bytes_builder& u64(std::uint64_t v) { return put(v, 8); }
  bytes_builder& raw(std::string_view s) {
    for (char c : s) bytes.push_back(static_cast<std::byte>(c));
    return *this;
  }
  bytes_builder& str(std::string_view s) { return u32(static_cast<std::uint32_t>(s.size())).raw(s); }
  bytes_builder& fill(std::size_t n, std::uint8_t v = 0) {
    bytes.insert(bytes.end(), n, std::byte{v});
    return *this;
  }

 private:
  bytes_builder& put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    return *this;
  }
};

/// A frame around `body`, with any header values (the body length follows the body unless
/// given).
inline std::vector<std::byte> make_frame(protocol::message_type type, std::uint64_t call_id,
                                         const std::vector<std::byte>& body,
                                         std::uint16_t version = protocol::protocol_version,
                                         std::optional<std::uint32_t> body_bytes = std::nullopt) {
  bytes_builder b;
  b.raw("KVT1").u16(version).u16(static_cast<std::uint16_t>(type)).u64(call_id);
  b.u32(body_bytes.value_or(static_cast<std::uint32_t>(body.size())));
  b.bytes.insert(b.bytes.end(), body.begin(), body.end());
  return b.bytes;
}

/// Encodes or fails the test.
inline std::vector<std::byte> encode_or_throw(std::uint64_t call_id, const protocol::message& m) {
  auto r = protocol::encode_frame(call_id, m);
  if (!r) throw std::runtime_error("encode failed: " + r.error().message());
  return std::move(*r);
}

/// Open file descriptors of this process (entries of /proc/self/fd, less the one reading it).
inline std::size_t open_fd_count() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) throw std::runtime_error("cannot open /proc/self/fd");
  std::size_t n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;
}

}  // namespace kvtier::test
