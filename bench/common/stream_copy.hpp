#pragma once
// A plain streaming (non-temporal store) copy of contiguous bytes: the baseline for a copy
// whose destination is cold and not read back soon (gather/scatter of multi-MiB chunks). It
// is written here with intrinsics, independent of core/kv_transfer.hpp's copy functions, so
// the baseline does not move when the code under test does.
//
// The widest store the CPU has, probed once at run time: AVX-512 (64-byte stores), AVX (two
// 32-byte stores per line), else SSE2 (four 16-byte stores per line, every x86-64 CPU has
// it). Cached loads, one sfence at the end, no software prefetch (the hardware prefetcher
// follows a contiguous source on its own). Off x86-64 it is memcpy (named so in
// stream_copy_kind()).
//
// `streams`: the bytes are cut into that many equal parts, copied side by side, 256 bytes of
// each in turn (each 256 bytes: four lines loaded, then stored). One core's copy to cold
// memory is bound by the misses it keeps in flight, and the hardware prefetcher runs one
// stream per 4 KiB page: several parts at once keep several streams going. On the dev VM
// 4 streams copied 1.05-1.15x faster than 1 (docs/performance.md), so 4 is the default: the
// fastest contiguous copy we know how to write on one thread, which is what gather and
// scatter are judged against.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVTIER_BENCH_STREAM_X86 1
#endif

namespace kvtier::bench {

/// Parts stream_copy copies side by side unless told otherwise.
inline constexpr int stream_copy_default_streams = 8;

namespace detail_stream {

#ifdef KVTIER_BENCH_STREAM_X86
// 256 bytes: loaded whole, then stored whole, to a 64-byte aligned d.
struct avx512_256 {
  __attribute__((target("avx512f"))) static void copy(std::byte* d, const std::byte* s) {
    __m512i v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(s + 64 * j);
    for (int j = 0; j < 4; ++j) _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64 * j), v[j]);
  }
};
struct avx_256 {
  __attribute__((target("avx"))) static void copy(std::byte* d, const std::byte* s) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32 * j));
    for (int j = 0; j < 8; ++j) _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32 * j), v[j]);
  }
};
struct sse2_256 {
  static void copy(std::byte* d, const std::byte* s) {
    __m128i v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * j));
    for (int j = 0; j < 16; ++j) _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16 * j), v[j]);
  }
};

// Copies `streams` parts of `part` bytes (a multiple of 256), 256 bytes of each in turn: part
// k from src + k * part to the 64-byte aligned dst + k * part.
template <class Copy256>
inline void copy_parts(std::byte* dst, const std::byte* src, std::size_t part, int streams) {
  for (std::size_t i = 0; i < part; i += 256)
    for (int k = 0; k < streams; ++k) Copy256::copy(dst + k * part + i, src + k * part + i);
}

// The entry points carry the target attribute; `flatten` inlines copy_parts and the 256-byte
// copies into them.
__attribute__((target("avx512f"), flatten)) inline void lines_avx512(std::byte* dst, const std::byte* src,
                                                                     std::size_t part, int streams) {
  copy_parts<avx512_256>(dst, src, part, streams);
}
__attribute__((target("avx"), flatten)) inline void lines_avx(std::byte* dst, const std::byte* src, std::size_t part,
                                                              int streams) {
  copy_parts<avx_256>(dst, src, part, streams);
}
__attribute__((flatten)) inline void lines_sse2(std::byte* dst, const std::byte* src, std::size_t part, int streams) {
  copy_parts<sse2_256>(dst, src, part, streams);
}
#endif

using lines_fn = void (*)(std::byte*, const std::byte*, std::size_t, int);

struct choice {
  lines_fn fn;
  const char* name;
};

inline choice pick() {
#ifdef KVTIER_BENCH_STREAM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {&lines_avx512, "avx512"};
  if (__builtin_cpu_supports("avx")) return {&lines_avx, "avx"};
  return {&lines_sse2, "sse2"};
#else
  return {nullptr, "memcpy"};
#endif
}

inline const choice& chosen() {
  static const choice c = pick();
  return c;
}

}  // namespace detail_stream

/// Which stores stream_copy uses: "avx512", "avx", "sse2" or "memcpy".
[[nodiscard]] inline const char* stream_copy_kind() { return detail_stream::chosen().name; }

/// Copies n bytes from src to dst (not overlapping) with non-temporal stores, `streams`
/// (1..8) parts side by side, then sfence.
inline void stream_copy(void* dst_v, const void* src_v, std::size_t n, int streams = stream_copy_default_streams) {
  auto* dst = static_cast<std::byte*>(dst_v);
  const auto* src = static_cast<const std::byte*>(src_v);
  const auto& c = detail_stream::chosen();
  if (c.fn == nullptr || n < 512) {
    std::memcpy(dst, src, n);
    return;
  }
  streams = streams < 1 ? 1 : streams > 8 ? 8 : streams;
  // Head up to a 64-byte aligned destination, the parts (whole 256-byte groups), then the tail.
  const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
  std::memcpy(dst, src, head);
  const std::size_t part = (n - head) / static_cast<std::size_t>(streams) & ~std::size_t{255};
  const std::size_t body = part * static_cast<std::size_t>(streams);
  c.fn(dst + head, src + head, part, streams);
  std::memcpy(dst + head + body, src + head + body, n - head - body);
#ifdef KVTIER_BENCH_STREAM_X86
  _mm_sfence();
#endif
}

}  // namespace kvtier::bench
