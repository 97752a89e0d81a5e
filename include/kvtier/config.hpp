#pragma once
// Feature switches: the only macros of kvtier. Each has a working default, so every header
// builds without any definition from CMake (the CUDA path builds these with nvcc alone).
// Standard library only.
//
//   KVTIER_WITH_CUDA   0 or 1. Set to 1 by the kvtier::cuda target (and by cuda/check.cuh
//                      when it comes first); the cuda/ headers refuse to build without it.
//                      It changes no type outside cuda/; it is part of the ABI tag below.
//
// Every declaration lives in the inline namespace `kvtier::KVTIER_ABI_TAG`, whose name
// encodes the switches that change types or layouts, so two translation units built with
// different switches fail to link instead of silently mixing. Headers open it nested, one
// namespace a line (`namespace kvtier {`, `inline namespace KVTIER_ABI_TAG {`,
// `namespace x {`), the form code tools read (docs/architecture.md, "Namespaces spelled
// nested").

#ifndef KVTIER_WITH_CUDA
#define KVTIER_WITH_CUDA 0
#endif

#if KVTIER_WITH_CUDA
#define KVTIER_ABI_TAG abi_v1_cuda
#else
#define KVTIER_ABI_TAG abi_v1
#endif

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace config {

/// True when compiled under AddressSanitizer or ThreadSanitizer (g++ and clang spellings).
inline constexpr bool asan_build =
#if defined(__SANITIZE_ADDRESS__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

inline constexpr bool tsan_build =
#if defined(__SANITIZE_THREAD__)
    true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

/// Factor by which default timeouts (ping, request deadlines, reap) are stretched: sanitizer
/// builds run 2-15x slower, and a health check must not mistake that for a hung server.
inline constexpr int timeout_scale = tsan_build ? 10 : (asan_build ? 4 : 1);

/// Bytes of a cache line, for padding contended atomics (std::hardware_destructive_
/// interference_size warns under g++ 12 when used in headers).
inline constexpr unsigned cache_line_size = 64;

}  // namespace config
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
