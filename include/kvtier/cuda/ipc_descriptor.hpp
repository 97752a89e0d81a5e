#pragma once
// cuda/ipc_descriptor: the bytes that describe a GPU engine's paged KV cache to the cache
// server (region_descriptor: serialize, parse, validate) and the errors of opening one.
// Standard library only, so the server-side parser builds, and is fuzzed
// (tests/fuzz/cuda_descriptor_fuzz.cpp), without the CUDA toolkit; cuda/ipc_region.cuh
// includes it and does the CUDA part (exporting and opening the IPC handles).
//
// Wire format (native byte order: engine and server share a machine; the magic tells a
// foreign byte order apart): a fixed 104-byte header (region_descriptor_header: the layout,
// its kv_strides included), then
// allocation_count ipc_allocation entries (72 bytes: the cudaIpcMemHandle_t bytes and the
// allocation's size), then layer_count ipc_layer entries (16 bytes: allocation index,
// offset). parse() checks every count and offset before it trusts one.

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>
#include <kvtier/core/kv_transfer.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

/// Why a descriptor or region was refused. Values are stable: append, never renumber.
enum class region_errc : int {
  bad_descriptor = 1,   ///< truncated, wrong magic, counts or offsets out of range
  unsupported_version,  ///< a descriptor version this build does not read
  device_not_found,     ///< no device this process sees has the descriptor's UUID
  outside_allocation,   ///< a layer does not lie inside its allocation
};

namespace detail {

class region_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "kvtier.cuda.region"; }
  [[nodiscard]] std::string message(int ev) const override {
    switch (static_cast<region_errc>(ev)) {
      case region_errc::bad_descriptor:
        return "malformed CUDA KV region descriptor";
      case region_errc::unsupported_version:
        return "unsupported CUDA KV region descriptor version";
      case region_errc::device_not_found:
        return "the KV region's GPU (by UUID) is not visible to this process (check CUDA_VISIBLE_DEVICES)";
      case region_errc::outside_allocation:
        return "a KV layer does not lie inside its device allocation";
    }
    return "unknown CUDA KV region error";
  }
  [[nodiscard]] std::error_condition default_error_condition(int ev) const noexcept override {
    switch (static_cast<region_errc>(ev)) {
      case region_errc::bad_descriptor:
        return std::make_error_condition(std::errc::bad_message);
      case region_errc::unsupported_version:
        return std::make_error_condition(std::errc::protocol_not_supported);
      case region_errc::device_not_found:
        return std::make_error_condition(std::errc::no_such_device);
      case region_errc::outside_allocation:
        return std::make_error_condition(std::errc::invalid_argument);
    }
    return {ev, *this};
  }
};

}  // namespace detail

[[nodiscard]] inline const std::error_category& region_category() noexcept {
  static const detail::region_category_impl category;
  return category;
}

[[nodiscard]] inline std::error_code make_error_code(region_errc e) noexcept {
  return {static_cast<int>(e), region_category()};
}

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

template <>
struct std::is_error_code_enum<kvtier::cuda::region_errc> : std::true_type {};

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

/// A GPU's 16-byte UUID (cudaDeviceProp::uuid), the same in every process.
using device_uuid = std::array<std::uint8_t, 16>;

// ---------------------------------------------------------------------------------------
// The descriptor: what travels from the engine to the server, as bytes.
// ---------------------------------------------------------------------------------------

inline constexpr std::uint32_t region_descriptor_magic = 0x5243564bu;  // "KVCR" in memory order
/// 3: the header carries the layout's kv_strides (104 bytes; version 2 had 64 and dense
/// layouts only).
inline constexpr std::uint16_t region_descriptor_version = 3;

/// The fixed head of a serialized descriptor (native byte order: engine and server share a
/// machine; the magic tells a foreign byte order apart).
struct region_descriptor_header {
  std::uint32_t magic = region_descriptor_magic;
  std::uint16_t version = region_descriptor_version;
  std::uint16_t header_bytes = 104;
  std::uint8_t device_uuid[16] = {};
  std::uint32_t num_layers = 0;  ///< paged_kv_layout::model
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t dtype = 0;      ///< dtype_kind
  std::uint32_t attention = 0;  ///< attention_kind
  std::uint32_t block_size = 0;
  std::uint32_t num_blocks = 0;
  std::uint32_t allocation_count = 0;  ///< ipc_allocation entries that follow
  std::uint32_t layer_count = 0;       ///< ipc_layer entries after those (== num_layers)
  std::uint32_t order = 0;             ///< kv_layout_kind of the blocks (paged_kv_layout::order)
  std::uint64_t strides[5] = {};       ///< paged_kv_layout::strides: layer, plane, block, token, head
};
static_assert(sizeof(region_descriptor_header) == 104 && std::is_trivially_copyable_v<region_descriptor_header>);

/// One exported device allocation.
struct ipc_allocation {
  std::array<std::uint8_t, 64> handle = {};  ///< cudaIpcMemHandle_t bytes
  std::uint64_t bytes = 0;                   ///< size of the allocation (checked when opened)
};
static_assert(sizeof(ipc_allocation) == 72 && std::is_trivially_copyable_v<ipc_allocation>);

/// Where one layer's tensor lies: inside allocation `allocation`, at `offset` bytes.
struct ipc_layer {
  std::uint32_t allocation = 0;
  std::uint32_t reserved = 0;
  std::uint64_t offset = 0;
};
static_assert(sizeof(ipc_layer) == 16 && std::is_trivially_copyable_v<ipc_layer>);

/// Everything the server needs to open an engine's GPU KV cache.
struct region_descriptor {
  paged_kv_layout layout;
  device_uuid device{};
  std::vector<ipc_allocation> allocations;
  std::vector<ipc_layer> layers;  ///< layout.model.num_layers entries

  /// The most bytes a valid descriptor takes (1024 layers, one allocation each): ~90 KiB, the
  /// bound a protocol decoder applies before reading one.
  static constexpr std::size_t max_bytes =
      sizeof(region_descriptor_header) + 1024 * (sizeof(ipc_allocation) + sizeof(ipc_layer));

  /// Empty when every count and offset is consistent, else region_errc::bad_descriptor,
  /// outside_allocation (a layer's rows, layout.layer_bytes() from its offset, do not fit in
  /// its allocation) or transfer_errc::invalid_layout (validation_error(): strides included).
  [[nodiscard]] std::error_code validate() const {
    if (!layout.validation_error().empty()) return transfer_errc::invalid_layout;
    if (layers.size() != layout.model.num_layers) return region_errc::bad_descriptor;
    if (allocations.empty() || allocations.size() > layers.size()) return region_errc::bad_descriptor;
    const std::uint64_t layer_bytes = layout.layer_bytes();
    for (const ipc_layer& l : layers) {
      if (l.allocation >= allocations.size()) return region_errc::bad_descriptor;
      const std::uint64_t size = allocations[l.allocation].bytes;
      if (l.offset > size || size - l.offset < layer_bytes) return region_errc::outside_allocation;
    }
    return {};
  }

  /// The wire bytes: header, allocations, layers.
  [[nodiscard]] std::vector<std::byte> serialize() const {
    region_descriptor_header h;
    std::memcpy(h.device_uuid, device.data(), 16);
    h.num_layers = layout.model.num_layers;
    h.num_kv_heads = layout.model.num_kv_heads;
    h.head_dim = layout.model.head_dim;
    h.dtype = static_cast<std::uint32_t>(layout.model.dtype);
    h.order = static_cast<std::uint32_t>(layout.order);
    h.attention = static_cast<std::uint32_t>(layout.model.attention);
    h.block_size = layout.block_size;
    h.num_blocks = layout.num_blocks;
    h.strides[0] = layout.strides.layer;
    h.strides[1] = layout.strides.plane;
    h.strides[2] = layout.strides.block;
    h.strides[3] = layout.strides.token;
    h.strides[4] = layout.strides.head;
    h.allocation_count = static_cast<std::uint32_t>(allocations.size());
    h.layer_count = static_cast<std::uint32_t>(layers.size());
    std::vector<std::byte> out(sizeof h + allocations.size() * sizeof(ipc_allocation) +
                               layers.size() * sizeof(ipc_layer));
    std::byte* p = out.data();
    std::memcpy(p, &h, sizeof h);
    p += sizeof h;
    if (!allocations.empty()) std::memcpy(p, allocations.data(), allocations.size() * sizeof(ipc_allocation));
    p += allocations.size() * sizeof(ipc_allocation);
    if (!layers.empty()) std::memcpy(p, layers.data(), layers.size() * sizeof(ipc_layer));
    return out;
  }

  /// Reads bytes written by serialize(); checks sizes, magic, version and validate().
  [[nodiscard]] static std::error_code parse(std::span<const std::byte> bytes, region_descriptor& out) {
    region_descriptor_header h;
    if (bytes.size() < sizeof h) return region_errc::bad_descriptor;
    std::memcpy(&h, bytes.data(), sizeof h);
    if (h.magic != region_descriptor_magic) return region_errc::bad_descriptor;
    if (h.version != region_descriptor_version) return region_errc::unsupported_version;
    if (h.header_bytes != sizeof h || h.layer_count != h.num_layers || h.layer_count > 1024 ||
        h.allocation_count == 0 || h.allocation_count > h.layer_count)
      return region_errc::bad_descriptor;
    const std::size_t want = sizeof h + std::size_t{h.allocation_count} * sizeof(ipc_allocation) +
                             std::size_t{h.layer_count} * sizeof(ipc_layer);
    if (bytes.size() != want) return region_errc::bad_descriptor;
    if (h.attention > static_cast<std::uint32_t>(attention_kind::mla) ||
        h.dtype > static_cast<std::uint32_t>(last_dtype_kind) ||
        h.order > static_cast<std::uint32_t>(last_kv_layout_kind))
      return transfer_errc::invalid_layout;
    region_descriptor d;
    std::memcpy(d.device.data(), h.device_uuid, 16);
    d.layout.model = {h.num_layers, h.num_kv_heads, h.head_dim, static_cast<dtype_kind>(h.dtype),
                      static_cast<attention_kind>(h.attention)};
    d.layout.order = static_cast<kv_layout_kind>(h.order);
    d.layout.block_size = h.block_size;
    d.layout.num_blocks = h.num_blocks;
    d.layout.strides = {h.strides[0], h.strides[1], h.strides[2], h.strides[3], h.strides[4]};
    d.allocations.resize(h.allocation_count);
    d.layers.resize(h.layer_count);
    const std::byte* p = bytes.data() + sizeof h;
    std::memcpy(d.allocations.data(), p, d.allocations.size() * sizeof(ipc_allocation));
    p += d.allocations.size() * sizeof(ipc_allocation);
    std::memcpy(d.layers.data(), p, d.layers.size() * sizeof(ipc_layer));
    if (auto ec = d.validate()) return ec;
    out = std::move(d);
    return {};
  }
};

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
