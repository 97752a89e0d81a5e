#pragma once
// cuda/ipc_region: a GPU engine's paged KV cache shared with the cache server through CUDA
// IPC, the GPU counterpart of the CPU memfd kv_region. Standard library and CUDA only.
//
//   engine side   kv_region           allocates the paged KV (one cudaMalloc, layers back to
//                                     back) or adopts the engine's own per-layer tensors, and
//                                     exports them: one IPC handle per distinct allocation
//                                     (cudaIpcGetMemHandle), the device UUID, the layout.
//   the wire      region_descriptor   those facts as bytes the connector's register message
//                                     carries (serialize / parse, every count and offset
//                                     checked): a fixed 64-byte header, then the allocations,
//                                     then one entry per layer.
//   server side   opened_kv_region    parses, finds the device by UUID among the devices the
//                                     server sees, opens every handle (cudaIpcOpenMemHandle),
//                                     checks each opened allocation is as large as claimed,
//                                     uploads the layer table: paged_kv_view for copy_engine.
//                                     Closes the handles on destruction.
//   both          ipc_event           an interprocess event (cudaEventInterprocess): the
//                                     engine records it after a forward step and the server's
//                                     streams wait on it before reading blocks (and back).
//
// Why per-allocation handles and per-layer offsets: vLLM allocates one tensor per layer
// through PyTorch's caching allocator, so a layer's data pointer is usually not the base of
// a cudaMalloc allocation, and several layers can share one. An IPC handle names a whole
// allocation, and the importing process gets that allocation's base, so the descriptor
// carries (allocation, offset) per layer. kv_region::adopt finds each pointer's allocation
// with the driver's cuMemGetAddressRange, reached through cudaGetDriverEntryPoint so that
// nothing links libcuda directly. Memory from cudaMallocAsync pools or from the virtual
// memory API (PyTorch's expandable_segments) cannot be exported with cudaIpcGetMemHandle:
// adopt then fails with the runtime's error (see docs/integration.md).
//
// Why the UUID: device ordinals depend on CUDA_VISIBLE_DEVICES, which the engine and the
// server need not share; the UUID names the same GPU in both. The server must see that GPU.
//
// Event ordering across processes: cudaStreamWaitEvent waits for the most recent record of
// the event at the time of the wait call. The engine records, then sends its request; the
// server waits when the request arrives: it waits for that record or a later one, never an
// earlier one. One event per direction per connection is therefore enough; a later record
// only makes a wait longer, never wrong.
//
// Lifetime: the exporting allocation must outlive every importer's mapping (CUDA: freeing
// it while mapped elsewhere is undefined); the connector unregisters before the engine frees
// its KV cache, and a server reaps the registration of an engine that stopped pinging.

#include <kvtier/cuda/check.cuh>
#include <kvtier/cuda/kv_transfer.cuh>

#include <kvtier/config.hpp>
#include <kvtier/core/kv_layout.hpp>

#include <cuda.h>  // CUdeviceptr, CUresult for the driver entry point (libcuda is not linked)
#include <cuda_runtime.h>

#include <algorithm>
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

namespace kvtier::inline KVTIER_ABI_TAG::cuda {

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

}  // namespace kvtier::inline KVTIER_ABI_TAG::cuda

template <>
struct std::is_error_code_enum<kvtier::cuda::region_errc> : std::true_type {};

namespace kvtier::inline KVTIER_ABI_TAG::cuda {

/// A GPU's 16-byte UUID (cudaDeviceProp::uuid), the same in every process.
using device_uuid = std::array<std::uint8_t, 16>;

/// The UUID of device `device` (an ordinal of this process).
[[nodiscard]] inline std::error_code get_device_uuid(int device, device_uuid& out) noexcept {
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error_code(e);
  }
  static_assert(sizeof(prop.uuid.bytes) == 16);
  std::memcpy(out.data(), prop.uuid.bytes, 16);
  return {};
}

/// The ordinal, in this process, of the device with UUID `uuid`; region_errc::
/// device_not_found when none of the visible devices has it.
[[nodiscard]] inline std::error_code find_device(const device_uuid& uuid, int& device) noexcept {
  const device_probe probe = probe_devices();
  if (probe.error) return probe.error;
  for (int d = 0; d < probe.count; ++d) {
    device_uuid u{};
    if (auto ec = get_device_uuid(d, u)) return ec;
    if (u == uuid) {
      device = d;
      return {};
    }
  }
  return region_errc::device_not_found;
}

/// True when ec is CUDA refusing interprocess sharing on this machine or in this container
/// (no IPC support, mapping refused, other process not permitted), as opposed to a bad
/// argument of ours. Tests skip on it.
[[nodiscard]] inline bool ipc_refused(const std::error_code& ec) noexcept {
  if (ec.category() != cuda_category()) return false;
  switch (static_cast<cudaError_t>(ec.value())) {
    case cudaErrorNotSupported:
    case cudaErrorMapBufferObjectFailed:
    case cudaErrorOperatingSystem:
    case cudaErrorInvalidDevice:
    case cudaErrorDeviceUninitialized:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorPeerAccessUnsupported:
    case cudaErrorNotPermitted:
    case cudaErrorSystemNotReady:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
      return true;
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------------------
// The descriptor: what travels from the engine to the server, as bytes.
// ---------------------------------------------------------------------------------------

inline constexpr std::uint32_t region_descriptor_magic = 0x5243564bu;  // "KVCR" in memory order
inline constexpr std::uint16_t region_descriptor_version = 2;

/// The fixed head of a serialized descriptor (native byte order: engine and server share a
/// machine; the magic tells a foreign byte order apart).
struct region_descriptor_header {
  std::uint32_t magic = region_descriptor_magic;
  std::uint16_t version = region_descriptor_version;
  std::uint16_t header_bytes = 64;
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
};
static_assert(sizeof(region_descriptor_header) == 64 && std::is_trivially_copyable_v<region_descriptor_header>);

/// One exported device allocation.
struct ipc_allocation {
  std::array<std::uint8_t, 64> handle = {};  ///< cudaIpcMemHandle_t bytes
  std::uint64_t bytes = 0;                   ///< size of the allocation (checked when opened)
};
static_assert(sizeof(ipc_allocation) == 72 && std::is_trivially_copyable_v<ipc_allocation>);
static_assert(sizeof(cudaIpcMemHandle_t) == 64);

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
  /// outside_allocation or transfer_errc::invalid_layout.
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

namespace detail {

/// cuMemGetAddressRange through the runtime's driver entry point: the base and size of the
/// allocation that contains p. std::errc::not_supported when the driver does not offer it,
/// std::errc::invalid_argument when p is not device memory of the current context.
[[nodiscard]] inline std::error_code allocation_range(const void* p, std::byte*& base, std::size_t& size) noexcept {
  using fn_t = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  static const fn_t fn = []() noexcept -> fn_t {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<fn_t>(f);
  }();
  if (fn == nullptr) return std::make_error_code(std::errc::not_supported);
  CUdeviceptr b = 0;
  std::size_t s = 0;
  if (fn(&b, &s, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS)
    return std::make_error_code(std::errc::invalid_argument);
  base = reinterpret_cast<std::byte*>(b);
  size = s;
  return {};
}

[[nodiscard]] inline std::error_code cuda_fail(cudaError_t e) noexcept {
  (void)cudaGetLastError();
  return make_error_code(e);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------
// Engine side.
// ---------------------------------------------------------------------------------------

/// An engine's paged KV cache on a GPU, exported for the cache server. Move-only. An
/// allocated region frees its memory on destruction (unregister from the server first); an
/// adopted one leaves the engine's tensors alone.
class kv_region {
 public:
  kv_region() noexcept = default;

  /// Allocates layout.total_bytes() on `device` (one cudaMalloc, layers back to back, not
  /// initialised) and exports it.
  [[nodiscard]] static kv_region allocate(const paged_kv_layout& layout, int device, std::error_code& ec) {
    ec.clear();
    kv_region r;
    if (!layout.validation_error().empty()) {
      ec = transfer_errc::invalid_layout;
      return r;
    }
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return r;
    }
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, layout.total_bytes()); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return r;
    }
    r.owned_ = static_cast<std::byte*>(p);
    r.device_ = device;
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l)
      r.layers_.push_back(r.owned_ + l * layout.layer_bytes());
    if ((ec = r.describe(layout))) return kv_region{};
    return r;
  }

  /// Exports the engine's own layer tensors (device pointers on `device`, one per layer,
  /// layout.layer_bytes() each), whatever allocations they lie in.
  [[nodiscard]] static kv_region adopt(const paged_kv_layout& layout, std::span<std::byte* const> layers, int device,
                                       std::error_code& ec) {
    ec.clear();
    kv_region r;
    if (!layout.validation_error().empty()) {
      ec = transfer_errc::invalid_layout;
      return r;
    }
    if (layers.size() != layout.model.num_layers) {
      ec = transfer_errc::layer_count;
      return r;
    }
    for (std::byte* p : layers)
      if (p == nullptr) {
        ec = transfer_errc::null_pointer;
        return r;
      }
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return r;
    }
    r.device_ = device;
    r.layers_.assign(layers.begin(), layers.end());
    if ((ec = r.describe(layout))) return kv_region{};
    return r;
  }

  kv_region(kv_region&& o) noexcept
      : owned_(std::exchange(o.owned_, nullptr)),
        device_(o.device_),
        layers_(std::move(o.layers_)),
        descriptor_(std::move(o.descriptor_)) {}
  kv_region& operator=(kv_region&& o) noexcept {
    if (this != &o) {
      release();
      owned_ = std::exchange(o.owned_, nullptr);
      device_ = o.device_;
      layers_ = std::move(o.layers_);
      descriptor_ = std::move(o.descriptor_);
    }
    return *this;
  }
  kv_region(const kv_region&) = delete;
  kv_region& operator=(const kv_region&) = delete;
  ~kv_region() { release(); }

  /// The layer base pointers, for the engine to build its per-layer tensors on.
  [[nodiscard]] std::span<std::byte* const> layers() const noexcept { return layers_; }
  /// The base of the memory allocate() made (nullptr for an adopted region).
  [[nodiscard]] std::byte* data() const noexcept { return owned_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const paged_kv_layout& layout() const noexcept { return descriptor_.layout; }
  [[nodiscard]] const region_descriptor& descriptor() const noexcept { return descriptor_; }
  [[nodiscard]] bool empty() const noexcept { return layers_.empty(); }

 private:
  /// Fills descriptor_: device UUID, one handle per distinct allocation, per-layer offsets.
  [[nodiscard]] std::error_code describe(const paged_kv_layout& layout) {
    region_descriptor d;
    d.layout = layout;
    if (auto ec = get_device_uuid(device_, d.device)) return ec;
    std::vector<std::byte*> bases;
    for (std::byte* p : layers_) {
      std::byte* base = owned_;
      std::size_t size = layout.total_bytes();
      if (owned_ == nullptr)
        if (auto ec = detail::allocation_range(p, base, size)) return ec;
      const auto it = std::find(bases.begin(), bases.end(), base);
      const auto index = static_cast<std::uint32_t>(it - bases.begin());
      if (it == bases.end()) {
        cudaIpcMemHandle_t h{};
        if (const cudaError_t e = cudaIpcGetMemHandle(&h, base); e != cudaSuccess) return detail::cuda_fail(e);
        ipc_allocation a;
        std::memcpy(a.handle.data(), &h, sizeof h);
        a.bytes = size;
        d.allocations.push_back(a);
        bases.push_back(base);
      }
      d.layers.push_back({index, 0, static_cast<std::uint64_t>(p - base)});
    }
    if (auto ec = d.validate()) return ec;
    descriptor_ = std::move(d);
    return {};
  }

  void release() noexcept {
    if (owned_) {
      (void)cudaSetDevice(device_);
      (void)cudaFree(owned_);
    }
    owned_ = nullptr;
    layers_.clear();
  }

  std::byte* owned_ = nullptr;
  int device_ = 0;
  std::vector<std::byte*> layers_;
  region_descriptor descriptor_;
};

// ---------------------------------------------------------------------------------------
// Server side.
// ---------------------------------------------------------------------------------------

/// An engine's GPU KV cache opened in the server. Move-only; closes every IPC mapping (and
/// frees the layer table) on destruction.
class opened_kv_region {
 public:
  opened_kv_region() noexcept = default;

  /// Finds the device by UUID, opens every allocation, checks its size, uploads the layer
  /// table. Leaves the found device current. ec: region_errc, a cuda_category() code
  /// (ipc_refused(ec) tells "this machine or container refuses CUDA IPC"), or a transfer_errc.
  [[nodiscard]] static opened_kv_region open(const region_descriptor& d, std::error_code& ec) {
    ec.clear();
    opened_kv_region r;
    if ((ec = d.validate())) return r;
    if ((ec = find_device(d.device, r.device_))) return r;
    if (const cudaError_t e = cudaSetDevice(r.device_); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return r;
    }
    r.layout_ = d.layout;
    for (const ipc_allocation& a : d.allocations) {
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, a.handle.data(), sizeof h);
      void* p = nullptr;
      if (const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        ec = detail::cuda_fail(e);
        return opened_kv_region{};  // r closes what it opened
      }
      r.mappings_.push_back(static_cast<std::byte*>(p));
      // The exporter's claimed size must not exceed the mapping: a lying descriptor must not
      // send the copies outside it. Checked where the driver offers the query.
      std::byte* base = nullptr;
      std::size_t size = 0;
      if (!detail::allocation_range(p, base, size) && (base != p || size < a.bytes)) {
        ec = region_errc::outside_allocation;
        return opened_kv_region{};
      }
    }
    std::vector<std::byte*> layers;
    for (const ipc_layer& l : d.layers) layers.push_back(r.mappings_[l.allocation] + l.offset);
    r.table_ = layer_table::upload(layers, ec);
    if (ec) return opened_kv_region{};
    return r;
  }

  /// Parses the wire bytes, then open().
  [[nodiscard]] static opened_kv_region open(std::span<const std::byte> descriptor_bytes, std::error_code& ec) {
    region_descriptor d;
    if ((ec = region_descriptor::parse(descriptor_bytes, d))) return {};
    return open(d, ec);
  }

  opened_kv_region(opened_kv_region&& o) noexcept
      : device_(o.device_), layout_(o.layout_), mappings_(std::move(o.mappings_)), table_(std::move(o.table_)) {
    o.mappings_.clear();
  }
  opened_kv_region& operator=(opened_kv_region&& o) noexcept {
    if (this != &o) {
      (void)close();
      device_ = o.device_;
      layout_ = o.layout_;
      mappings_ = std::move(o.mappings_);
      o.mappings_.clear();
      table_ = std::move(o.table_);
    }
    return *this;
  }
  opened_kv_region(const opened_kv_region&) = delete;
  opened_kv_region& operator=(const opened_kv_region&) = delete;
  ~opened_kv_region() { (void)close(); }

  /// The view the kernels and copy_engine take (valid while this object lives).
  [[nodiscard]] paged_kv_view view() const noexcept { return {layout_, table_.view()}; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const paged_kv_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] bool empty() const noexcept { return mappings_.empty(); }

  /// Closes every mapping now (the caller makes sure no copy still uses them). Returns the
  /// first error.
  std::error_code close() noexcept {
    std::error_code first;
    if (mappings_.empty() && table_.empty()) return first;
    (void)cudaSetDevice(device_);
    table_ = layer_table{};
    for (std::byte* p : mappings_)
      if (const cudaError_t e = cudaIpcCloseMemHandle(p); e != cudaSuccess && !first) first = detail::cuda_fail(e);
    mappings_.clear();
    return first;
  }

 private:
  int device_ = 0;
  paged_kv_layout layout_{};
  std::vector<std::byte*> mappings_;
  layer_table table_;
};

// ---------------------------------------------------------------------------------------
// Interprocess events.
// ---------------------------------------------------------------------------------------

/// cudaIpcEventHandle_t as bytes.
using ipc_event_handle = std::array<std::uint8_t, 64>;
static_assert(sizeof(cudaIpcEventHandle_t) == 64);

/// An event shared between engine and server. Move-only; destroys the event.
class ipc_event {
 public:
  ipc_event() noexcept = default;

  /// Creates an interprocess event on `device` (timing disabled, as CUDA requires).
  [[nodiscard]] static ipc_event create(int device, std::error_code& ec) noexcept {
    ec.clear();
    ipc_event ev;
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return ev;
    }
    if (const cudaError_t e = cudaEventCreateWithFlags(&ev.event_, cudaEventDisableTiming | cudaEventInterprocess);
        e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return ev;
    }
    cudaIpcEventHandle_t h{};
    if (const cudaError_t e = cudaIpcGetEventHandle(&h, ev.event_); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return ipc_event{};
    }
    std::memcpy(ev.handle_.data(), &h, sizeof h);
    return ev;
  }

  /// Opens an event another process created (the device must be current, or given).
  [[nodiscard]] static ipc_event open(const ipc_event_handle& handle, int device, std::error_code& ec) noexcept {
    ec.clear();
    ipc_event ev;
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return ev;
    }
    cudaIpcEventHandle_t h{};
    std::memcpy(&h, handle.data(), sizeof h);
    if (const cudaError_t e = cudaIpcOpenEventHandle(&ev.event_, h); e != cudaSuccess) {
      ec = detail::cuda_fail(e);
      return ev;
    }
    ev.handle_ = handle;
    return ev;
  }

  ipc_event(ipc_event&& o) noexcept : event_(std::exchange(o.event_, nullptr)), handle_(o.handle_) {}
  ipc_event& operator=(ipc_event&& o) noexcept {
    if (this != &o) {
      if (event_) (void)cudaEventDestroy(event_);
      event_ = std::exchange(o.event_, nullptr);
      handle_ = o.handle_;
    }
    return *this;
  }
  ipc_event(const ipc_event&) = delete;
  ipc_event& operator=(const ipc_event&) = delete;
  ~ipc_event() {
    if (event_) (void)cudaEventDestroy(event_);
  }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  [[nodiscard]] const ipc_event_handle& handle() const noexcept { return handle_; }
  [[nodiscard]] bool empty() const noexcept { return event_ == nullptr; }

 private:
  cudaEvent_t event_ = nullptr;
  ipc_event_handle handle_{};
};

}  // namespace kvtier::inline KVTIER_ABI_TAG::cuda
