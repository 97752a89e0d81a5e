#pragma once
// The sample events the KV event tests share: the format test checks their bytes, the dump
// program prints them for tests/python/test_kv_events_format.py (whose hand-built fixtures
// must stay the same), the serve program publishes them. And hex(), to show bytes.
#include <kvtier/kv_events/vllm_format.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvtier::test::kv_event_samples {

using namespace kvtier::kv_events;

/// Bytes as hex digits, "c0ff01"; with a separator, "c0 ff 01".
inline std::string hex(const std::string& bytes, const char* separator = "") {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (i != 0) out += separator;
    const auto b = static_cast<unsigned char>(bytes[i]);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

/// Only the fields without a default: what vLLM's map form always writes.
inline block_stored minimal_stored() {
  block_stored e;
  e.block_hashes = {byte_string{std::string(32, '\xab')}, std::uint64_t{0xfedcba9876543210ULL}};
  e.token_ids = {1, 2, 151643};
  e.block_size = 16;
  e.medium = std::string(medium_cpu);
  return e;
}

/// Every field set, hashes of every kind.
inline block_stored full_stored() {
  block_stored e;
  e.block_hashes = {std::int64_t{-5}, std::uint64_t{18446744073709551615ULL}};
  e.parent_block_hash = byte_string{std::string("\x00\x01\x02", 3)};
  e.token_ids = {7, 8, 9, 10};
  e.block_size = 2;
  e.lora_id = 3;
  e.medium = std::string(medium_storage);
  e.lora_name = "adapter";
  e.extra_keys = std::vector<std::optional<std::vector<extra_key>>>{
      std::nullopt, std::vector<extra_key>{std::string("salt"), std::int64_t{7}, byte_string{"\x01"}}};
  e.group_idx = 0;
  e.kv_cache_spec_kind = "full_attention";
  e.kv_cache_spec_sliding_window = 4096;
  return e;
}

}  // namespace kvtier::test::kv_event_samples
