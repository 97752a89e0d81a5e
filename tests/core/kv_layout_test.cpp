#include <kvtier/core/kv_layout.hpp>

#include <catch2/catch.hpp>

using namespace kvtier;

namespace {
constexpr model_shape llama8b{32, 8, 128, 2, attention_kind::mha};
constexpr model_shape qwen05b{24, 2, 64, 2, attention_kind::mha};
}  // namespace

TEST_CASE("chunk_layout sizes match the issue's reference shapes", "[core][kv_layout]") {
  const chunk_layout c8{llama8b, 256};
  CHECK(llama8b.token_bytes() == 128 * 1024);        // 128 KiB per token
  CHECK(c8.object_bytes() == 32ull * 1024 * 1024);   // 32 MiB per chunk
  const chunk_layout c05{qwen05b, 256};
  CHECK(c05.object_bytes() == 3ull * 1024 * 1024);   // 3 MiB per chunk
  const paged_kv_layout p8{llama8b, 16, 100};
  CHECK(p8.segment_bytes() == 32 * 1024);            // 32 KiB per block segment
  const paged_kv_layout p05{qwen05b, 16, 100};
  CHECK(p05.segment_bytes() == 4 * 1024);            // 4 KiB per block segment
}

TEST_CASE("chunk_layout offsets are layer-major, then plane, then token", "[core][kv_layout]") {
  const chunk_layout c{{2, 1, 4, 2, attention_kind::mha}, 8};  // 8 bytes per token-plane
  CHECK(c.slab_bytes() == 64);
  CHECK(c.offset(0, 0, 0) == 0);
  CHECK(c.offset(0, 1, 0) == 64);
  CHECK(c.offset(1, 0, 3) == 128 + 24);
  CHECK(c.object_bytes() == 256);
}

TEST_CASE("MLA layouts have one plane", "[core][kv_layout]") {
  const model_shape mla{61, 1, 576, 2, attention_kind::mla};
  CHECK(mla.planes() == 1);
  CHECK(mla.validation_error().empty());
  const paged_kv_layout p{mla, 64, 10};
  CHECK(p.layer_bytes() == 10ull * 64 * 576 * 2);
  CHECK(p.offset_in_layer(0, 3, 1) == 3ull * 64 * 1152 + 1152);
  model_shape bad = mla;
  bad.num_kv_heads = 2;
  CHECK_FALSE(bad.validation_error().empty());
}

TEST_CASE("layout validation says what is wrong", "[core][kv_layout]") {
  CHECK(model_shape{}.validation_error() == "num_layers must be in 1..1024");
  model_shape s = qwen05b;
  s.dtype_bytes = 3;
  CHECK(s.validation_error() == "dtype_bytes must be 1, 2 or 4");
  const paged_kv_layout p{qwen05b, 16, 64};
  CHECK(p.validation_error().empty());
  CHECK(p.compatibility_error(chunk_layout{qwen05b, 256}).empty());
  CHECK(p.compatibility_error(chunk_layout{qwen05b, 250}) ==
        "chunk_tokens (250) must be a multiple of block_size (16)");
  CHECK_FALSE(p.compatibility_error(chunk_layout{llama8b, 256}).empty());
  CHECK(paged_kv_layout{qwen05b, 16, 0}.validation_error() == "num_blocks must be > 0");
}

TEST_CASE("a paged layout larger than max_total_bytes is refused before any size wraps around 64 bits",
          "[core][kv_layout]") {
  // Found by the cuda_descriptor fuzz target (tests/fuzz/regressions/cuda_descriptor/): every
  // dimension at its limit and 2^30 + 1 blocks make layer_bytes() 2^71 + 2^41, which wraps
  // to 2^41, so a descriptor claiming a 2 TiB allocation passed validate().
  const model_shape widest{1, 1024, 65536, 4, attention_kind::mha};
  const paged_kv_layout wraps{widest, 4096, (1U << 30) + 1};
  CHECK_THAT(wraps.validation_error(), Catch::Contains("1 PiB"));
  const paged_kv_layout one_block{widest, 4096, 1};  // 2 TiB: valid
  CHECK(one_block.validation_error().empty());
  CHECK(one_block.total_bytes() == std::uint64_t{1} << 41);
  // The largest layout that passes has total_bytes() <= max_total_bytes, exactly computed.
  const paged_kv_layout at_limit{llama8b, 16,
                                 static_cast<std::uint32_t>(paged_kv_layout::max_total_bytes /
                                                            (std::uint64_t{16} * 8 * 128 * 2 * 2 * 32))};
  CHECK(at_limit.validation_error().empty());
  CHECK(at_limit.total_bytes() <= paged_kv_layout::max_total_bytes);
  const paged_kv_layout over{at_limit.model, 16, at_limit.num_blocks + 1};
  CHECK_THAT(over.validation_error(), Catch::Contains("1 PiB"));
  const paged_kv_layout llama{llama8b, 16, 100000};  // 400 GiB: fine
  CHECK(llama.validation_error().empty());
}
