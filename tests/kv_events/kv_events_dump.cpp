// kvtier_kv_events_dump: prints sample KV event batches as our encoder writes them, one line
// each, "<sample> <form> <payload in hex>", every sample in every form (map, array,
// array_batch).
// tests/python/test_kv_events_format.py decodes them with python3-msgpack and compares them,
// field by field and byte for byte, with the same batches built by hand as vLLM's msgspec
// writes them. The samples here and there must stay the same.
#include <kvtier/kv_events/vllm_format.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kvtier::kv_events;

std::string hex(const std::string& bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

block_stored minimal_stored() {
  block_stored e;
  e.block_hashes = {byte_string{std::string(32, '\xab')}, std::uint64_t{0xfedcba9876543210ULL}};
  e.token_ids = {1, 2, 151643};
  e.block_size = 16;
  e.medium = std::string(medium_cpu);
  return e;
}

block_stored full_stored() {
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

std::vector<std::pair<const char*, event_batch>> samples() {
  block_stored window_only = minimal_stored();
  window_only.kv_cache_spec_sliding_window = 128;
  std::vector<std::pair<const char*, event_batch>> out;
  out.emplace_back("cleared", event_batch{1.5, {all_blocks_cleared{}}, 0});
  out.emplace_back("removed", event_batch{2.0,
                                          {block_removed{{std::uint64_t{1}, std::int64_t{-1}}, "CPU", std::nullopt},
                                           block_removed{{byte_string{"\x01\x02"}}, std::nullopt, 3}},
                                          1});
  out.emplace_back("stored", event_batch{1'700'000'000.25, {minimal_stored(), full_stored()}, 0});
  out.emplace_back("no_rank", event_batch{3.0, {window_only}, std::nullopt});
  out.emplace_back("empty", event_batch{0.0, {}, 0});
  return out;
}

}  // namespace

int main() {
  for (const auto& [name, batch] : samples()) {
    for (const event_form form : {event_form::map, event_form::array, event_form::array_batch}) {
      std::printf("%s %s %s\n", name, std::string(to_string(form)).c_str(), hex(encode(batch, form)).c_str());
    }
  }
  return 0;
}
