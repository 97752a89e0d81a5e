#pragma once
// cuda/ipc_region: a GPU engine's paged KV cache shared with the cache server through CUDA
// IPC, the GPU counterpart of the CPU memfd kv_region: kv_region (engine side: allocate or
// adopt, export), opened_kv_region (server side: open, the layer table for copy_engine) and
// ipc_event (interprocess events). The descriptor's bytes: cuda/ipc_descriptor.hpp. Standard
// library and CUDA only. docs/integration.md, "Registering the region" and "Ordering between
// engine and server", holds the rest.

#include <kvtier/cuda/check.cuh>
#include <kvtier/cuda/ipc_descriptor.hpp>
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

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

/// The UUID of device `device` (an ordinal of this process).
[[nodiscard]] inline std::error_code get_device_uuid(int device, device_uuid& out) noexcept {
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) return detail::cuda_fail(e);
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

// The descriptor (region_descriptor, cuda/ipc_descriptor.hpp) carries the handle bytes.
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(ipc_allocation::handle));

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

  /// Allocates layout.total_bytes() on `device` (one cudaMalloc, not initialised; layer l at
  /// l * effective_strides().layer: back to back for a dense layout) and exports it.
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
    const std::uint64_t layer_stride = layout.effective_strides().layer;
    for (std::uint32_t l = 0; l < layout.model.num_layers; ++l) r.layers_.push_back(r.owned_ + l * layer_stride);
    if ((ec = r.describe(layout))) return kv_region{};
    return r;
  }

  /// Exports the engine's own layer tensors (device pointers on `device`, one per layer,
  /// layout.layer_bytes() each: the extent of the layer's rows under the layout's strides),
  /// whatever allocations they lie in. The layer stride is not used (each layer has its
  /// pointer), but must describe layers that do not overlap (validation_error()).
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

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
