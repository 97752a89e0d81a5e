#pragma once
// cuda/check: CUDA runtime errors as std::error_code, and the device probe every CUDA entry
// point and test starts with. Standard library and the CUDA runtime only.
//
//   cuda_category()            the error category of cudaError_t ("kvtier.cuda")
//   make_error_code(cudaError_t)
//   throw_on_error(e, what)    std::system_error for the calls whose failure is misuse or bad
//                              configuration (a constructor has no other way to report)
//   probe_devices()            cudaGetDeviceCount, with "no device" told apart from errors
//
// cudaError_t is CUDA's enum, not ours, so std::is_error_code_enum is not specialised for it
// (another library doing the same would break the one-definition rule): convert explicitly
// with make_error_code.
//
// The cuda/ headers are compiled by the engine with nvcc; they set KVTIER_WITH_CUDA to 1 when
// the build did not (kvtier::cuda does), and refuse a translation unit that already fixed it
// to 0, since its ABI tag would differ from the rest of the program.

#ifndef KVTIER_WITH_CUDA
#define KVTIER_WITH_CUDA 1
#endif
#if !KVTIER_WITH_CUDA
#error "kvtier/cuda headers need KVTIER_WITH_CUDA=1: link kvtier::cuda, or include them before any other kvtier header"
#endif

#include <kvtier/config.hpp>

#include <cuda_runtime_api.h>

#include <string>
#include <system_error>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cuda {

namespace detail {

class cuda_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "kvtier.cuda"; }

  /// "cudaErrorInsufficientDriver (35): CUDA driver version is insufficient ...". The runtime
  /// answers these two calls without a driver, so the text is there on a machine with no GPU.
  [[nodiscard]] std::string message(int ev) const override {
    const auto e = static_cast<cudaError_t>(ev);
    const char* name = cudaGetErrorName(e);
    const char* text = cudaGetErrorString(e);
    return std::string(name ? name : "cudaError") + " (" + std::to_string(ev) + "): " +
           (text ? text : "unknown CUDA error");
  }

  /// The few runtime errors that have a portable meaning compare equal to std::errc values.
  [[nodiscard]] std::error_condition default_error_condition(int ev) const noexcept override {
    switch (static_cast<cudaError_t>(ev)) {
      case cudaErrorInvalidValue: return std::make_error_condition(std::errc::invalid_argument);
      case cudaErrorMemoryAllocation: return std::make_error_condition(std::errc::not_enough_memory);
      case cudaErrorNoDevice:
      case cudaErrorInsufficientDriver:
      case cudaErrorInvalidDevice: return std::make_error_condition(std::errc::no_such_device);
      case cudaErrorNotSupported: return std::make_error_condition(std::errc::not_supported);
      default: return {ev, *this};
    }
  }
};

}  // namespace detail

/// The category of cudaError_t values; one instance per program.
[[nodiscard]] inline const std::error_category& cuda_category() noexcept {
  static const detail::cuda_category_impl category;
  return category;
}

/// {} for cudaSuccess, else the error in cuda_category().
[[nodiscard]] inline std::error_code make_error_code(cudaError_t e) noexcept {
  if (e == cudaSuccess) return {};
  return {static_cast<int>(e), cuda_category()};
}

/// Throws std::system_error("kvtier::cuda: <what>: <message>") unless e is cudaSuccess.
inline void throw_on_error(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::system_error(make_error_code(e), std::string("kvtier::cuda: ") + what);
}

/// The error of the last launch on this thread, cleared (cudaGetLastError after <<<>>>).
[[nodiscard]] inline std::error_code last_launch_error() noexcept { return make_error_code(cudaGetLastError()); }

namespace detail {

/// The code of a call that failed with e, the thread's last error (which the failed call also
/// set) cleared: what the cuda/ functions return for a CUDA error.
[[nodiscard]] inline std::error_code cuda_fail(cudaError_t e) noexcept {
  (void)cudaGetLastError();
  return make_error_code(e);
}

}  // namespace detail

/// What cudaGetDeviceCount said.
struct device_probe {
  int count = 0;          ///< devices this process sees (0 when error is set)
  std::error_code error;  ///< cuda_category(); empty when the call succeeded

  /// True when there is nothing to run on: no driver (35, cudaErrorInsufficientDriver: what a
  /// machine without a GPU answers), no device (100), or a count of 0.
  [[nodiscard]] bool no_device() const noexcept {
    if (!error) return count == 0;
    return error.category() == cuda_category() &&
           (error.value() == cudaErrorInsufficientDriver || error.value() == cudaErrorNoDevice);
  }
  [[nodiscard]] bool usable() const noexcept { return !error && count > 0; }
};

/// Calls cudaGetDeviceCount once. Without a driver the runtime leaves the count unset and
/// answers 35, not 100: both mean "no device" (device_probe::no_device).
[[nodiscard]] inline device_probe probe_devices() noexcept {
  device_probe p;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    p.error = detail::cuda_fail(e);
    return p;
  }
  p.count = n;
  return p;
}

}  // namespace cuda
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
