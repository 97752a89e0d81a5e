// A minimal engine-side consumer (kvtier::engine): hashes tokens into chunk keys, publishes
// events on a bus with the metrics subscriber and checks the exposition.
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/kvtier.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

int main() {
  using namespace kvtier;
  const model_shape shape{24, 2, 64, dtype_kind::bf16, attention_kind::mha};
  const token_hasher hasher(256);
  std::vector<token_id> tokens(1024);
  std::iota(tokens.begin(), tokens.end(), 0u);
  const auto hashes = hasher.chunk_hashes(tokens);
  const chunk_key key{make_model_id("consumer-model", shape), 1, 0, hashes.back()};

  telemetry::registry reg;
  bus::basic_event_bus<telemetry::metrics_subscriber> events{telemetry::metrics_subscriber{reg}};
  events.publish(bus::l1_write_finished{static_cast<std::uint32_t>(hashes.size())});
  const std::string text = telemetry::prometheus_text(reg);
  if (hashes.size() != 4 || text.find("kvtier_l1_write_keys_total 4\n") == std::string::npos) {
    std::printf("kvtier consumer FAILED\n");
    return 1;
  }
  std::printf("kvtier consumer ok: kvtier %s, key %s\n", version_string, key.to_string().c_str());
  return 0;
}
