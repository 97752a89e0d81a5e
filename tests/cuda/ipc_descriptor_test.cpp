// The CUDA KV region descriptor's parser, host side (cuda/ipc_descriptor.hpp: standard
// library only, so it runs here; tests/cuda/cuda_test.cu checks the rest of the CUDA path
// with nvcc). Its wire format and every refusal are also checked there, and fuzzed by
// tests/fuzz/cuda_descriptor_fuzz.cpp.
#include <kvtier/cuda/ipc_descriptor.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

using namespace kvtier;
namespace kc = kvtier::cuda;

namespace {

kc::region_descriptor one_layer(const paged_kv_layout& layout, std::uint64_t allocation_bytes) {
  kc::region_descriptor d;
  d.layout = layout;
  kc::ipc_allocation a;
  a.handle.fill(0x11);
  a.bytes = allocation_bytes;
  d.allocations = {a};
  d.layers = {{0, 0, 0}};
  return d;
}

}  // namespace

TEST_CASE("a region descriptor survives serialize and parse", "[cuda][descriptor]") {
  const auto d = one_layer({{1, 8, 128, dtype_kind::bf16, attention_kind::mha}, 16, 64}, std::uint64_t{1} << 24);
  REQUIRE(!d.validate());
  const auto bytes = d.serialize();
  kc::region_descriptor back;
  REQUIRE(!kc::region_descriptor::parse(bytes, back));
  CHECK(back.layout == d.layout);
  CHECK(back.serialize() == bytes);
}

TEST_CASE("a region descriptor whose layer size wraps around 64 bits is refused", "[cuda][descriptor]") {
  // Found by the cuda_descriptor fuzz target (tests/fuzz/regressions/cuda_descriptor/):
  // 2^30 + 1 blocks of 2 TiB (every dimension at its limit) make layer_bytes() 2^71 + 2^41,
  // which wrapped to 2^41, so an allocation claimed as 2 TiB passed as holding the layer: the
  // server would have handed kernels block addresses far outside the mapping.
  const paged_kv_layout wraps{{1, 1024, 65536, dtype_kind::fp32, attention_kind::mha}, 4096, (1U << 30) + 1};
  const auto d = one_layer(wraps, std::uint64_t{1} << 41);
  CHECK(d.validate() == transfer_errc::invalid_layout);
  kc::region_descriptor out;
  CHECK(kc::region_descriptor::parse(d.serialize(), out) == transfer_errc::invalid_layout);
}
