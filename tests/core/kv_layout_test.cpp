#include <kvtier/core/kv_layout.hpp>

#include <catch2/catch.hpp>

using namespace kvtier;

namespace {
constexpr model_shape llama8b{32, 8, 128, dtype_kind::bf16, attention_kind::mha};
constexpr model_shape qwen05b{24, 2, 64, dtype_kind::bf16, attention_kind::mha};
}  // namespace

TEST_CASE("chunk_layout sizes match the issue's reference shapes", "[core][kv_layout]") {
  const chunk_layout c8{llama8b, 256};
  CHECK(llama8b.token_bytes() == 128 * 1024);       // 128 KiB per token
  CHECK(c8.object_bytes() == 32ull * 1024 * 1024);  // 32 MiB per chunk
  const chunk_layout c05{qwen05b, 256};
  CHECK(c05.object_bytes() == 3ull * 1024 * 1024);  // 3 MiB per chunk
  const paged_kv_layout p8{llama8b, 16, 100};
  CHECK(p8.segment_bytes() == 32 * 1024);  // 32 KiB per block segment
  const paged_kv_layout p05{qwen05b, 16, 100};
  CHECK(p05.segment_bytes() == 4 * 1024);  // 4 KiB per block segment
}

TEST_CASE("chunk_layout offsets are layer-major, then plane, then token", "[core][kv_layout]") {
  const chunk_layout c{{2, 1, 4, dtype_kind::bf16, attention_kind::mha}, 8};  // 8 bytes per token-plane
  CHECK(c.slab_bytes() == 64);
  CHECK(c.offset(0, 0, 0) == 0);
  CHECK(c.offset(0, 1, 0) == 64);
  CHECK(c.offset(1, 0, 3) == 128 + 24);
  CHECK(c.object_bytes() == 256);
}

TEST_CASE("MLA layouts have one plane", "[core][kv_layout]") {
  const model_shape mla{61, 1, 576, dtype_kind::bf16, attention_kind::mla};
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
  s.dtype = static_cast<dtype_kind>(9);
  CHECK(s.validation_error() == "unknown dtype kind");
  const paged_kv_layout p{qwen05b, 16, 64};
  CHECK(p.validation_error().empty());
  CHECK(p.compatibility_error(chunk_layout{qwen05b, 256}).empty());
  CHECK(p.compatibility_error(chunk_layout{qwen05b, 250}) ==
        "chunk_tokens (250) must be a multiple of block_size (16)");
  CHECK_FALSE(p.compatibility_error(chunk_layout{llama8b, 256}).empty());
  CHECK(paged_kv_layout{qwen05b, 16, 0}.validation_error() == "num_blocks must be > 0");
}

TEST_CASE("NHD and HND place a (token, head) row where vLLM's tensors have it", "[core][kv_layout]") {
  // 3 KV heads of 4 fp16 elements (8-byte rows), blocks of 5 tokens, 7 blocks.
  const model_shape m{2, 3, 4, dtype_kind::fp16, attention_kind::mha};
  const paged_kv_layout nhd{m, 5, 7, kv_layout_kind::nhd};
  const paged_kv_layout hnd{m, 5, 7, kv_layout_kind::hnd};
  CHECK(nhd.segment_bytes() == hnd.segment_bytes());
  CHECK(nhd.layer_bytes() == hnd.layer_bytes());
  CHECK(nhd.head_row_bytes() == 8);
  CHECK(nhd.segment_runs() == 1);
  CHECK(hnd.segment_runs() == 3);
  CHECK(nhd.run_bytes() == 5 * 24);
  CHECK(hnd.run_bytes() == 5 * 8);
  CHECK(nhd.run_offset(2) == 2 * 24);
  CHECK(hnd.run_offset(2) == 2 * 8);
  // Element (plane, block, token, head, 0) of a contiguous torch tensor of each shape:
  // NHD (2, 7, 5, 3, 4) and HND (2, 7, 3, 5, 4), in bytes.
  for (std::uint32_t plane = 0; plane < 2; ++plane)
    for (std::uint32_t block = 0; block < 7; ++block)
      for (std::uint32_t token = 0; token < 5; ++token)
        for (std::uint32_t head = 0; head < 3; ++head) {
          CHECK(nhd.offset_in_layer(plane, block, token, head) ==
                ((((plane * 7 + block) * 5 + token) * 3 + head) * 4) * 2);
          CHECK(hnd.offset_in_layer(plane, block, token, head) ==
                ((((plane * 7 + block) * 3 + head) * 5 + token) * 4) * 2);
        }
  // In a chunk object (2 blocks of 5 tokens): NHD is chunk_layout::offset, HND keeps each
  // block head-major.
  const chunk_layout c{m, 10};
  CHECK(nhd.object_offset(c, 1, 1, 7, 2) == c.offset(1, 1, 7) + 2 * 8);
  CHECK(hnd.object_offset(c, 1, 1, 7, 2) == c.offset(1, 1) + nhd.segment_bytes() + 2 * 5 * 8 + 2 * 8);
  // An MLA model has one order whatever `order` says.
  const model_shape mla{2, 1, 8, dtype_kind::bf16, attention_kind::mla};
  const paged_kv_layout mla_hnd{mla, 4, 3, kv_layout_kind::hnd};
  CHECK(mla_hnd.kind() == kv_layout_kind::mla);
  CHECK(mla_hnd.segment_runs() == 1);
  CHECK(mla_hnd.offset_in_layer(0, 2, 3) == (2 * 4 + 3) * 16);
}

TEST_CASE("a paged layout larger than max_total_bytes is refused before any size wraps around 64 bits",
          "[core][kv_layout]") {
  // Found by the cuda_descriptor fuzz target (tests/fuzz/regressions/cuda_descriptor/): every
  // dimension at its limit and 2^30 + 1 blocks make layer_bytes() 2^71 + 2^41, which wraps
  // to 2^41, so a descriptor claiming a 2 TiB allocation passed validate().
  const model_shape widest{1, 1024, 65536, dtype_kind::fp32, attention_kind::mha};
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
