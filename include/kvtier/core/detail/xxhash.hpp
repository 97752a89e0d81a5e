#pragma once
// xxHash, used header-only (XXH_INLINE_ALL: every function static inline in the including
// translation unit, so kvtier links no libxxhash). The one place that defines the switch;
// token_hasher.hpp, l2/object_format.hpp and engine/finished_tracker.hpp include this.
//
// g++ 12 at -Og with Debian's xxHash 0.8.1: "inlining failed in call to 'always_inline'
// XXH3_accumulate_512_sse2" (reached through a function pointer that -Og does not fold). A
// translation unit built with -Og defines XXH_NO_INLINE_HINTS=1 before this. It is not
// defined here: without the hints large checksums run at half the speed at -O3.
//
// Object checksums (megabytes per call) go through xxh3_update and xxh3_64 below, which run
// xxHash's own AVX2 kernel (compiled for that target only, as its xxh_x86dispatch.c does) on
// CPUs that have AVX2, probed once: x86-64's baseline, which a header-only library's
// consumer builds for, is SSE2. Same digest (tests/core/xxhash_dispatch_test.cpp); speeds in
// docs/performance.md, "Checksums". It needs xxhash.h's internals, so it is on only for the
// version checked (0.8.1, Debian 12), when this header includes xxhash.h first, and when the
// build does not already target AVX2; its AVX-512 kernel needs a build for AVX-512.

#if !defined(XXHASH_H_5627135585666179) && (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && \
    !defined(__CUDACC__) && !defined(__AVX2__)
#define KVTIER_DETAIL_XXH3_DISPATCH 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#include <immintrin.h>  // the kernel's intrinsics (xxhash.h includes it only for its own XXH_VECTOR)
#else
#define KVTIER_DETAIL_XXH3_DISPATCH 0
#endif

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <kvtier/config.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

#if KVTIER_DETAIL_XXH3_DISPATCH && XXH_VERSION_NUMBER != 801
#undef KVTIER_DETAIL_XXH3_DISPATCH
#define KVTIER_DETAIL_XXH3_DISPATCH 0
#endif

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace detail {

/// Feeds n bytes to an XXH3 state (XXH3_64bits_update's signature).
using xxh3_update_function = void (*)(XXH3_state_t* state, const void* data, std::size_t n) noexcept;

/// The plain XXH3_64bits_update: the kernels the build's flags chose.
inline void xxh3_update_portable(XXH3_state_t* state, const void* data, std::size_t n) noexcept {
  XXH3_64bits_update(state, data, n);
}

#if KVTIER_DETAIL_XXH3_DISPATCH
XXH_TARGET_AVX2 inline void xxh3_update_avx2(XXH3_state_t* state, const void* data, std::size_t n) noexcept {
  XXH3_update(state, static_cast<const xxh_u8*>(data), n, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2);
}
#endif

/// An XXH3 update kernel: its name (for tests and benchmarks) and its function.
struct xxh3_kernel {
  const char* name;
  xxh3_update_function update;
};

/// The kernels this CPU runs, best first: the one xxh3_update uses, then the others down to
/// the portable one (always last; the only one where dispatch is off). Probed once: a
/// function-local static, so thread-safe, and one guard load per call afterwards.
[[nodiscard]] inline std::span<const xxh3_kernel> xxh3_kernels() noexcept {
  struct table {
    xxh3_kernel entries[2];
    std::size_t size = 0;
  };
  static const table t = []() noexcept {
    table r{};
#if KVTIER_DETAIL_XXH3_DISPATCH
    if (__builtin_cpu_supports("avx2")) r.entries[r.size++] = {"avx2", &xxh3_update_avx2};
#endif
    r.entries[r.size++] = {"portable", &xxh3_update_portable};
    return r;
  }();
  return {t.entries, t.size};
}

/// The fastest kernel this CPU runs.
[[nodiscard]] inline const xxh3_kernel& xxh3_best() noexcept { return xxh3_kernels()[0]; }

/// XXH3_64bits_update with the fastest kernel: the same state, the same digest.
inline void xxh3_update(XXH3_state_t* state, const void* data, std::size_t n) noexcept {
  xxh3_best().update(state, data, n);
}

/// XXH3_64bits(data, n), long inputs through xxh3_update (streaming gives the one-shot digest).
[[nodiscard]] inline std::uint64_t xxh3_64(const void* data, std::size_t n) noexcept {
  if (KVTIER_DETAIL_XXH3_DISPATCH == 0 || n < 4096) return XXH3_64bits(data, n);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  xxh3_update(&state, data, n);
  return XXH3_64bits_digest(&state);
}

}  // namespace detail
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
