#pragma once
// Feature switches: the only macros of kvtier. Each has a working default, so every header
// builds without any definition from CMake (the CUDA path builds these with nvcc alone).
// Standard library only.
//
//   KVTIER_WITH_CUDA   0 or 1. Set to 1 by the kvtier::cuda target (and by cuda/check.cuh
//                      when it comes first); the cuda/ headers refuse to build without it.
//                      It changes no type outside cuda/; it is part of the ABI tag below.
//   KVTIER_ASAN_BUILD  0 or 1, KVTIER_TSAN_BUILD 0 or 1: derived, never set; whether this
//                      translation unit is compiled under AddressSanitizer / ThreadSanitizer
//                      (g++ spells it __SANITIZE_*__, clang 14 answers __has_feature only).
//                      For code that must choose at preprocessing time; the rest reads
//                      config::asan_build / tsan_build.
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

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_ASAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_ASAN_BUILD 1
#endif
#endif
#ifndef KVTIER_ASAN_BUILD
#define KVTIER_ASAN_BUILD 0
#endif

#if defined(__SANITIZE_THREAD__)
#define KVTIER_TSAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TSAN_BUILD 1
#endif
#endif
#ifndef KVTIER_TSAN_BUILD
#define KVTIER_TSAN_BUILD 0
#endif

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace config {

/// True when compiled under AddressSanitizer or ThreadSanitizer (KVTIER_ASAN_BUILD / _TSAN_).
inline constexpr bool asan_build = KVTIER_ASAN_BUILD != 0;
inline constexpr bool tsan_build = KVTIER_TSAN_BUILD != 0;

/// Factor by which default timeouts (ping, request deadlines, reap) are stretched: sanitizer
/// builds run 2-15x slower, and a health check must not mistake that for a hung server.
inline constexpr int timeout_scale = tsan_build ? 10 : (asan_build ? 4 : 1);

/// Bytes of a cache line, for padding contended atomics (std::hardware_destructive_
/// interference_size warns under g++ 12 when used in headers).
inline constexpr unsigned cache_line_size = 64;

}  // namespace config
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
