// kvtier_kv_events_dump: prints sample KV event batches as our encoder writes them, one line
// each, "<sample> <form> <payload in hex>", every sample in every form (map, array,
// array_batch).
// tests/python/test_kv_events_format.py decodes them with python3-msgpack and compares them,
// field by field and byte for byte, with the same batches built by hand as vLLM's msgspec
// writes them. The samples here and there must stay the same.
#include <kvtier/kv_events/vllm_format.hpp>

#include "kv_events/sample_events.hpp"

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kvtier::kv_events;
using namespace kvtier::test::kv_event_samples;

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
