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

TEST_CASE("all-zero strides are the dense layout of the order, and the same strides given explicitly change nothing",
          "[core][kv_layout]") {
  const model_shape m{2, 3, 4, dtype_kind::fp16, attention_kind::mha};  // 8-byte rows
  const paged_kv_layout nhd{m, 5, 7, kv_layout_kind::nhd};
  const paged_kv_layout hnd{m, 5, 7, kv_layout_kind::hnd};
  CHECK(nhd.strides.dense());
  CHECK(nhd.effective_strides() == kv_strides{2 * 7 * 120, 7 * 120, 120, 24, 8});
  CHECK(hnd.effective_strides() == kv_strides{2 * 7 * 120, 7 * 120, 120, 8, 40});
  const model_shape mla{2, 1, 8, dtype_kind::bf16, attention_kind::mla};
  CHECK(paged_kv_layout{mla, 4, 3}.effective_strides() == kv_strides{3 * 64, 3 * 64, 64, 16, 16});
  for (const paged_kv_layout& dense : {nhd, hnd}) {
    paged_kv_layout explicit_ = dense;
    explicit_.strides = dense.dense_strides();
    CHECK(explicit_.validation_error() == "");
    CHECK(explicit_.segment_contiguous());
    CHECK(explicit_.layer_bytes() == dense.layer_bytes());
    CHECK(explicit_.total_bytes() == dense.total_bytes());
    for (std::uint32_t p = 0; p < 2; ++p)
      for (std::uint32_t b = 0; b < 7; ++b)
        for (std::uint32_t t = 0; t < 5; ++t)
          for (std::uint32_t h = 0; h < 3; ++h)
            CHECK(explicit_.offset_in_layer(p, b, t, h) == dense.offset_in_layer(p, b, t, h));
  }
}

TEST_CASE("explicit strides place rows where the engine's tensor has them, and size the layer by its last row",
          "[core][kv_layout]") {
  // vLLM's CPU backend: shape (B, H, N, 2D), memory (B, H, 2, N, D): 7 blocks, 3 heads, 5
  // tokens, 4 fp16 elements.
  const model_shape m{2, 3, 4, dtype_kind::fp16, attention_kind::mha};
  paged_kv_layout cpu{m, 5, 7, kv_layout_kind::hnd};
  const std::uint64_t e = 2;
  cpu.strides = {0, 5 * 4 * e, 3 * 2 * 5 * 4 * e, 4 * e, 2 * 5 * 4 * e};
  cpu.strides.layer = cpu.layer_bytes();
  CHECK(cpu.validation_error() == "");
  CHECK_FALSE(cpu.segment_contiguous());  // a head's K rows, then its V rows
  CHECK(cpu.layer_bytes() == 7ull * 3 * 2 * 5 * 4 * e);
  CHECK(cpu.total_bytes() == 2 * cpu.layer_bytes());
  CHECK(cpu.offset_in_layer(1, 6, 4, 2) == ((((6 * 3 + 2) * 2 + 1) * 5 + 4) * 4) * e);
  // GPU packed NHD: memory (B, N, H, 2D), K then V in each (token, head).
  paged_kv_layout gpu{m, 5, 7, kv_layout_kind::nhd};
  gpu.strides = {0, 4 * e, 5 * 3 * 8 * e, 3 * 8 * e, 8 * e};
  gpu.strides.layer = gpu.layer_bytes();
  CHECK(gpu.validation_error() == "");
  CHECK_FALSE(gpu.segment_contiguous());
  CHECK(gpu.offset_in_layer(1, 6, 4, 2) == (((6 * 5 + 4) * 3 + 2) * 8 + 4) * e);
  // FlashInfer's blocks-first (B, 2, N, H, D): segments stay whole.
  paged_kv_layout fi{m, 5, 7, kv_layout_kind::nhd};
  fi.strides = {0, 5 * 3 * 4 * e, 2 * 5 * 3 * 4 * e, 3 * 4 * e, 4 * e};
  fi.strides.layer = fi.layer_bytes();
  CHECK(fi.validation_error() == "");
  CHECK(fi.segment_contiguous());
  // The description names the shape and the strides.
  CHECK_THAT(cpu.describe(), Catch::Contains("kv_heads 3") && Catch::Contains("token 8") &&
                                 Catch::Contains("head 80") && Catch::Contains("block 240"));
}

TEST_CASE("strides that overlap rows, leave the 1 PiB bound, overflow or disagree with the order are refused",
          "[core][kv_layout]") {
  const model_shape m{2, 2, 8, dtype_kind::bf16, attention_kind::mha};  // 16-byte rows
  const paged_kv_layout base{m, 4, 8, kv_layout_kind::nhd};
  auto with = [&](kv_strides s, kv_layout_kind order = kv_layout_kind::nhd) {
    paged_kv_layout l = base;
    l.order = order;
    l.strides = s;
    return l.validation_error();
  };
  const kv_strides ok = base.dense_strides();
  CHECK(with(ok) == "");
  // Overlapping rows: a token stride of one row with two heads; a head stride below a row;
  // two dimensions with the same stride; a zero stride.
  kv_strides s = ok;
  s.token = 16;
  CHECK_THAT(with(s), Catch::Contains("overlap") && Catch::Contains(" stride 16 is below") &&
                          Catch::Contains("strides (bytes)") && Catch::Contains("blocks 8"));
  s = ok;
  s.head = 8;
  CHECK_THAT(with(s), Catch::Contains("overlap") && Catch::Contains("head stride 8"));
  s = ok;
  s.plane = s.block;
  CHECK_THAT(with(s), Catch::Contains("overlap"));
  s = ok;
  s.layer = 0;
  s.block = 0;  // not all zero: explicit, and the blocks overlap
  CHECK_THAT(with(s), Catch::Contains("overlap"));
  // Layers that overlap (a layer stride below the layer's extent).
  s = ok;
  s.layer = base.layer_bytes() - 16;
  CHECK_THAT(with(s), Catch::Contains("overlap") && Catch::Contains("layer stride"));
  // Beyond 1 PiB, and strides whose products wrap around 64 bits.
  s = ok;
  s.block = std::uint64_t{1} << 48;
  CHECK_THAT(with(s), Catch::Contains("1 PiB"));
  s = ok;
  s.block = std::uint64_t{1} << 62;  // 7 * 2^62 wraps to 3 * 2^62 + ...: refused before it
  CHECK_THAT(with(s), Catch::Contains("1 PiB"));
  s = ok;
  s.layer = ~std::uint64_t{0};  // 1 * (2^64 - 1): no wrap, far out
  CHECK_THAT(with(s), Catch::Contains("1 PiB"));
  s = ok;
  s.head = std::uint64_t{1} << 63;  // 1 * 2^63, plus the rest
  CHECK_THAT(with(s), Catch::Contains("1 PiB"));
  // Sums near the bound: each term under 1 PiB, together above it.
  s = {std::uint64_t{1} << 49, std::uint64_t{1} << 49, 1024, 64, 16};
  {
    paged_kv_layout big{m, 4, 8, kv_layout_kind::nhd, s};
    CHECK_THAT(big.validation_error(), Catch::Contains("1 PiB"));
  }
  // The order must be the strides': token-major strides registered as HND, head-major as NHD.
  CHECK_THAT(with(ok, kv_layout_kind::hnd), Catch::Contains("order HND disagrees") && Catch::Contains("register NHD"));
  kv_strides head_major = ok;
  head_major.token = 16;
  head_major.head = 64;
  CHECK(with(head_major, kv_layout_kind::hnd) == "");
  CHECK_THAT(with(head_major), Catch::Contains("order NHD disagrees") && Catch::Contains("register HND"));
  // With one head (or one token per block) either order describes the same rows.
  const paged_kv_layout one_head{{2, 1, 8, dtype_kind::bf16, attention_kind::mha}, 4, 8, kv_layout_kind::hnd,
                                 {1024, 512, 64, 16, 0}};
  CHECK(one_head.validation_error() == "");
  // Dimensions of size 1 may have any stride (MLA's plane and head).
  const paged_kv_layout mla{{2, 1, 8, dtype_kind::bf16, attention_kind::mla}, 4, 8, kv_layout_kind::nhd,
                            {1024, 0, 128, 16, 0}};
  CHECK(mla.validation_error() == "");
}
