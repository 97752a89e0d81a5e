// Fuzz target: the CUDA KV region descriptor parser, host side (cuda/ipc_descriptor.hpp,
// region_descriptor::parse): the bytes a GPU engine sends so that the server opens its KV
// cache with cudaIpcOpenMemHandle. No GPU and no CUDA toolkit needed.
//
// Input: the descriptor bytes, as they come.
//
// Oracle: parse() refuses with a region_errc or transfer_errc, or accepts a descriptor
// that keeps every promise opened_kv_region::open relies on before it hands the layer
// pointers to the copy kernels: counts within their bounds, a valid layout, every layer
// inside its allocation by exact (128-bit) arithmetic, the serialized size at most
// max_bytes; and what it accepted survives serialize() and parse() unchanged.

#include <kvtier/cuda/ipc_descriptor.hpp>

#include "fuzz_support.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <system_error>
#include <vector>

namespace {

namespace kc = kvtier::cuda;
__extension__ typedef unsigned __int128 u128;  // exact sizes (g++ -Wpedantic wants __extension__)

// Bytes of one layer's tensor, exactly: dense, or the end of its last row under explicit
// strides (kv_strides: each dimension's (entries - 1) * stride, plus a row).
u128 exact_layer_bytes(const kvtier::paged_kv_layout& l) {
  const u128 row = u128{l.model.head_dim} * l.model.dtype_bytes();
  if (l.strides.dense())
    return u128{l.block_size} * l.model.num_kv_heads * row * l.num_blocks * l.model.planes();
  auto span = [](std::uint64_t n, std::uint64_t stride) { return n > 1 ? u128{n - 1} * stride : u128{0}; };
  return span(l.model.planes(), l.strides.plane) + span(l.num_blocks, l.strides.block) +
         span(l.block_size, l.strides.token) + span(l.model.num_kv_heads, l.strides.head) + row;
}

bool same(const kc::region_descriptor& a, const kc::region_descriptor& b) {
  if (!(a.layout == b.layout) || a.device != b.device || a.allocations.size() != b.allocations.size() ||
      a.layers.size() != b.layers.size())
    return false;
  for (std::size_t i = 0; i < a.allocations.size(); ++i)
    if (a.allocations[i].handle != b.allocations[i].handle || a.allocations[i].bytes != b.allocations[i].bytes)
      return false;
  for (std::size_t i = 0; i < a.layers.size(); ++i)
    if (a.layers[i].allocation != b.layers[i].allocation || a.layers[i].offset != b.layers[i].offset) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  kc::region_descriptor d;
  const std::error_code ec = kc::region_descriptor::parse(bytes, d);
  if (ec) {
    FUZZ_CHECK(ec.category() == kc::region_category() || ec == kvtier::transfer_errc::invalid_layout,
               "parse failed with an error of another kind: " + ec.message());
    FUZZ_CHECK(ec != kc::region_errc::device_not_found, "parse looked for a device");
    return 0;
  }
  FUZZ_CHECK(size <= kc::region_descriptor::max_bytes, "accepted a descriptor above max_bytes");
  FUZZ_CHECK(d.layout.validation_error().empty(), "accepted an invalid layout: " + d.layout.validation_error());
  FUZZ_CHECK(d.layers.size() == d.layout.model.num_layers, "accepted a layer count that differs from num_layers");
  FUZZ_CHECK(!d.allocations.empty() && d.allocations.size() <= d.layers.size(), "accepted a bad allocation count");
  FUZZ_CHECK(!d.validate(), "parse accepted what validate() refuses");
  const u128 layer = exact_layer_bytes(d.layout);
  for (std::size_t i = 0; i < d.layers.size(); ++i) {
    const kc::ipc_layer& l = d.layers[i];
    FUZZ_CHECK(l.allocation < d.allocations.size(), "layer " + std::to_string(i) + " names no allocation");
    const u128 end = u128{l.offset} + layer;
    FUZZ_CHECK(end <= d.allocations[l.allocation].bytes,
               "layer " + std::to_string(i) + " ends past its allocation: offset " + std::to_string(l.offset) +
                   " + layer bytes (" +
                   (layer >> 64 ? std::string("more than 2^64") : std::to_string(std::uint64_t(layer))) + ") > " +
                   std::to_string(d.allocations[l.allocation].bytes));
  }
  const std::vector<std::byte> again = d.serialize();
  FUZZ_CHECK(again.size() == size, "serialize() of an accepted descriptor has another size");
  kc::region_descriptor back;
  FUZZ_CHECK(!kc::region_descriptor::parse(again, back), "serialize() of an accepted descriptor does not parse");
  FUZZ_CHECK(same(back, d), "serialize() and parse() changed the descriptor");
  return 0;
}
