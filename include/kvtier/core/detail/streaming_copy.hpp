#pragma once
// detail/streaming_copy: the byte copies core/kv_transfer.hpp is made of. Standard library
// only: the streaming (non-temporal) stores are compiler builtins inside functions marked
// with a target attribute and chosen at run time, so no intrinsics header is needed and the
// consumer's -march decides nothing (the library is header-only).
//
//   copy_kernel::copy     one run of bytes, any length, any alignment
//   copy_kernel::streams  up to max_copy_streams runs of the same length at once, 256 bytes
//                         of each in turn (destinations 64-byte aligned, length a multiple
//                         of 64): the gather/scatter of block segments
//   store_fence()         orders the streaming stores before what the thread does next
//   available_copies()    the kernels this CPU runs: memcpy, AVX-512, AVX2 (probed once)
//
// Why several runs at once (docs/performance.md, "Gather/scatter"): one core's copy to cold
// memory is bound by the cache misses it keeps in flight, and the hardware prefetcher starts
// over at every 4 KiB page. Copying eight block segments side by side keeps eight page
// streams going: on the dev VM a gather went from 0.86x (32 KiB segments) and 0.63x (4 KiB)
// of the benchmark's baseline with one segment at a time to 0.93-1.04x and 0.84-0.88x. A
// contiguous copy gains from it too (8 parts side by side: 1.04-1.25x one part), which is
// why that baseline copies 8 parts side by side as well.

#include <kvtier/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

// x86-64 with GCC or clang (not nvcc, whose front end does not know the x86 builtins):
// streaming stores with AVX-512 or AVX2, chosen at run time. Elsewhere: memcpy only.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__)
#define KVTIER_DETAIL_X86_STREAMING 1
#else
#define KVTIER_DETAIL_X86_STREAMING 0
#endif

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace detail {

/// Copies n bytes from src to dst (not overlapping).
using copy_function = void (*)(std::byte* dst, const std::byte* src, std::size_t n) noexcept;

/// Copies `count` (1..max_copy_streams) runs of `len` bytes, src[k] to dst[k], in index
/// order wherever two runs write the same bytes (the higher k wins). Every dst[k] 64-byte
/// aligned, len a multiple of 64.
using streams_function = void (*)(std::byte* const* dst, const std::byte* const* src, std::size_t count,
                                  std::size_t len) noexcept;

/// The most runs one streams_function call copies side by side.
inline constexpr std::size_t max_copy_streams = 8;

/// A way to copy bytes: its name (for tests and benchmarks) and its functions.
struct copy_kernel {
  const char* name;
  copy_function copy;
  streams_function streams;
};

/// memcpy: plain stores, through the cache.
inline void copy_cached(std::byte* dst, const std::byte* src, std::size_t n) noexcept { std::memcpy(dst, src, n); }

/// memcpy of each run in turn.
inline void copy_streams_cached(std::byte* const* dst, const std::byte* const* src, std::size_t count,
                                std::size_t len) noexcept {
  for (std::size_t k = 0; k < count; ++k) std::memcpy(dst[k], src[k], len);
}

/// The runs side by side, 256 bytes (Lines::four) of each in turn, then the last lines
/// (Lines::one) likewise. Unrolled over the runs at compile time.
template <class Lines, std::size_t... K>
inline void copy_streams_unrolled(std::byte* const* dst, const std::byte* const* src, std::size_t len,
                                  std::index_sequence<K...>) noexcept {
  // Local copies: the stores cannot alias them, so the pointers stay in registers.
  std::byte* const d[] = {dst[K]...};
  const std::byte* const s[] = {src[K]...};
  std::size_t i = 0;
  for (; i + 256 <= len; i += 256) (Lines::four(d[K] + i, s[K] + i), ...);
  for (; i < len; i += 64) (Lines::one(d[K] + i, s[K] + i), ...);
}

/// Runs copy_streams_unrolled with the index sequence of length `count` among 1..sizeof...(N).
template <class Lines, std::size_t... N>
inline void copy_streams_counted(std::byte* const* dst, const std::byte* const* src, std::size_t count, std::size_t len,
                                 std::index_sequence<N...>) noexcept {
  (void)((count == N + 1 && (copy_streams_unrolled<Lines>(dst, src, len, std::make_index_sequence<N + 1>{}), true)) ||
         ...);
}

/// A streams_function over Lines: one unrolled body per number of runs.
template <class Lines>
inline void copy_streams_with(std::byte* const* dst, const std::byte* const* src, std::size_t count,
                              std::size_t len) noexcept {
  copy_streams_counted<Lines>(dst, src, count, len, std::make_index_sequence<max_copy_streams>{});
}

/// One run at any alignment over Lines: memcpy up to dst's first 64-byte boundary, whole
/// lines streamed, memcpy of the last partial line. The caller fences.
template <class Lines>
inline void copy_streaming_with(std::byte* dst, const std::byte* src, std::size_t n) noexcept {
  const std::size_t mis = reinterpret_cast<std::uintptr_t>(dst) & 63;
  const std::size_t head = mis == 0 ? 0 : (64 - mis < n ? 64 - mis : n);
  std::memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  const std::size_t body = n & ~std::size_t{63};
  copy_streams_unrolled<Lines>(&dst, &src, body, std::index_sequence<0>{});
  std::memcpy(dst + body, src + body, n - body);
}

#if KVTIER_DETAIL_X86_STREAMING

// GCC spells the streaming store as a builtin; clang has a generic one. The vector types
// are <immintrin.h>'s __m512i / __m256i (may_alias); loads go through memcpy, which both
// compilers turn into one unaligned vector load.
typedef long long v8di __attribute__((vector_size(64), may_alias));
typedef long long v4di __attribute__((vector_size(32), may_alias));

/// 64-byte lines with AVX-512: one load and one streaming store per line.
struct avx512_lines {
  __attribute__((target("avx512f"))) static void store(std::byte* dst, v8di v) noexcept {
#if defined(__clang__)
    __builtin_nontemporal_store(v, reinterpret_cast<v8di*>(dst));
#else
    __builtin_ia32_movntdq512(reinterpret_cast<v8di*>(dst), v);
#endif
  }
  __attribute__((target("avx512f"))) static void one(std::byte* dst, const std::byte* src) noexcept {
    v8di v;
    std::memcpy(&v, src, sizeof v);
    store(dst, v);
  }
  /// Four lines: four loads, then four stores. (Four variables, not an array: g++ copies a
  /// memcpy'd array through the stack.)
  __attribute__((target("avx512f"))) static void four(std::byte* dst, const std::byte* src) noexcept {
    v8di a, b, c, d;
    std::memcpy(&a, src, sizeof a);
    std::memcpy(&b, src + 64, sizeof b);
    std::memcpy(&c, src + 128, sizeof c);
    std::memcpy(&d, src + 192, sizeof d);
    store(dst, a);
    store(dst + 64, b);
    store(dst + 128, c);
    store(dst + 192, d);
  }
};

/// 64-byte lines with AVX2: two 32-byte halves stored back to back (g++ otherwise
/// interleaves the halves of neighbouring lines, which keeps more write-combining buffers
/// partly filled: measured 10-15% slower).
struct avx2_lines {
  __attribute__((target("avx2"))) static void one(std::byte* dst, const std::byte* src) noexcept {
    v4di lo, hi;
    std::memcpy(&lo, src, sizeof lo);
    std::memcpy(&hi, src + 32, sizeof hi);
#if defined(__clang__)
    __builtin_nontemporal_store(lo, reinterpret_cast<v4di*>(dst));
    __builtin_nontemporal_store(hi, reinterpret_cast<v4di*>(dst + 32));
#else
    __builtin_ia32_movntdq256(reinterpret_cast<v4di*>(dst), lo);
    __builtin_ia32_movntdq256(reinterpret_cast<v4di*>(dst + 32), hi);
#endif
    __asm__ volatile("" ::: "memory");
  }
  __attribute__((target("avx2"))) static void four(std::byte* dst, const std::byte* src) noexcept {
    for (int k = 0; k < 4; ++k) one(dst + 64 * k, src + 64 * k);
  }
};

// The entry points carry the target attribute; `flatten` inlines the generic loops and the
// line functions into them (a generic template cannot inline a target function itself).
__attribute__((target("avx512f"), flatten)) inline void copy_streaming_avx512(std::byte* dst, const std::byte* src,
                                                                              std::size_t n) noexcept {
  copy_streaming_with<avx512_lines>(dst, src, n);
}
__attribute__((target("avx512f"), flatten)) inline void copy_streams_avx512(std::byte* const* dst,
                                                                            const std::byte* const* src,
                                                                            std::size_t count,
                                                                            std::size_t len) noexcept {
  copy_streams_with<avx512_lines>(dst, src, count, len);
}
__attribute__((target("avx2"), flatten)) inline void copy_streaming_avx2(std::byte* dst, const std::byte* src,
                                                                         std::size_t n) noexcept {
  copy_streaming_with<avx2_lines>(dst, src, n);
}
__attribute__((target("avx2"), flatten)) inline void copy_streams_avx2(std::byte* const* dst,
                                                                       const std::byte* const* src, std::size_t count,
                                                                       std::size_t len) noexcept {
  copy_streams_with<avx2_lines>(dst, src, count, len);
}

/// Orders the streaming stores before anything this thread does next (a release that
/// publishes the destination must not overtake them).
inline void store_fence() noexcept { __builtin_ia32_sfence(); }

#else

inline void store_fence() noexcept {}

#endif

/// Every kernel this build and CPU can run: "memcpy", then "streaming_avx512" and
/// "streaming_avx2" where the CPU has them (best first). Probed once: a function-local
/// static, so thread-safe, and one guard load per call afterwards.
[[nodiscard]] inline std::span<const copy_kernel> available_copies() noexcept {
  struct table {
    copy_kernel entries[3];
    std::size_t size = 0;
  };
  static const table t = []() noexcept {
    table r{};
    r.entries[r.size++] = {"memcpy", &copy_cached, &copy_streams_cached};
#if KVTIER_DETAIL_X86_STREAMING
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
      r.entries[r.size++] = {"streaming_avx512", &copy_streaming_avx512, &copy_streams_avx512};
    if (__builtin_cpu_supports("avx2"))
      r.entries[r.size++] = {"streaming_avx2", &copy_streaming_avx2, &copy_streams_avx2};
#endif
    return r;
  }();
  return {t.entries, t.size};
}

/// memcpy, the kernel that writes through the cache.
[[nodiscard]] inline const copy_kernel& cached_copy() noexcept { return available_copies()[0]; }

/// The best streaming kernel this CPU has, or nullptr.
[[nodiscard]] inline const copy_kernel* streaming_copy() noexcept {
  const auto copies = available_copies();
  return copies.size() > 1 ? &copies[1] : nullptr;
}

}  // namespace detail
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#undef KVTIER_DETAIL_X86_STREAMING
