// An engine plugs its own L2 admission policy into the cache without touching the library:
// only chunks of prompts longer than N tokens go to L2 (short prompts are cheap to recompute
// and would only churn the disk). The policy is a plain struct checked by a concept; the
// engine names it in its traits.
//
//   kvtier_example_custom_admission        (exits non-zero if the policy did not apply)
#include <kvtier/bus/null_bus.hpp>
#include <kvtier/cache/tiered_cache.hpp>
#include <kvtier/core/model_id.hpp>
#include <kvtier/core/token_hasher.hpp>
#include <kvtier/l2/memory_backend.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

namespace {

/// Admits a chunk to L2 only when its prompt is longer than min_tokens.
struct long_prompts_only {
  std::uint32_t min_tokens = 4096;
  bool admit(const kvtier::chunk_key&, const kvtier::pipeline::write_context& ctx) const noexcept {
    return ctx.prompt_tokens > min_tokens;
  }
};
static_assert(kvtier::pipeline::admission_policy<long_prompts_only>);

struct engine_traits : kvtier::cache::default_traits {
  using admission_policy = long_prompts_only;
};

}  // namespace

int main() {
  using namespace kvtier;
  boost::asio::io_context io;
  bus::null_bus events;
  const chunk_layout layout{{24, 2, 64, dtype_kind::bf16, attention_kind::mha}, 256};  // 3 MiB chunks

  auto disk_standin = std::make_shared<l2::memory_backend>(io.get_executor(), l2::memory_backend_options{"l2"});
  cache::cache_options options;
  options.l1.slot_bytes = layout.object_bytes();
  options.l1.slot_count = 64;
  cache::tiered_cache<engine_traits> cache(io.get_executor(), options, events, {l2::any_backend(disk_standin)});

  const token_hasher hasher(layout.chunk_tokens);
  const std::uint64_t model = make_model_id("example-model", layout.model);
  auto write_prompt = [&](std::uint32_t tokens, token_id first) {
    std::vector<token_id> prompt(tokens);
    std::iota(prompt.begin(), prompt.end(), first);
    std::vector<chunk_key> keys;
    for (const auto& h : hasher.chunk_hashes(prompt)) keys.push_back({model, 1, 0, h});
    std::vector<l1::status> st(keys.size());
    std::vector<std::span<std::byte>> slots(keys.size());
    cache.reserve_write(keys, layout.object_bytes(), st, slots);
    for (auto& s : slots) std::fill(s.begin(), s.end(), std::byte{0x42});  // the engine's KV would go here
    cache.finish_write(keys, pipeline::write_context{0, tokens, 0}, st);
    return keys.size();
  };

  const std::size_t short_chunks = write_prompt(1024, 0);      // 4 chunks: below the bar
  const std::size_t long_chunks = write_prompt(10240, 50000);  // 40 chunks: admitted
  boost::asio::co_spawn(io, cache.wait_idle(), [&](std::exception_ptr) { io.stop(); });
  io.run();

  const auto in_l2 = disk_standin->usage().objects;
  std::printf("short prompt: %zu chunks, long prompt: %zu chunks, in L2: %llu (expected %zu)\n", short_chunks,
              long_chunks, static_cast<unsigned long long>(in_l2), long_chunks);
  return in_l2 == long_chunks ? 0 : 1;
}
