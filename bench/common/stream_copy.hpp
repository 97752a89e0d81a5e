#pragma once
// A plain streaming (non-temporal store) copy of contiguous bytes: the baseline for a copy
// whose destination is cold and not read back soon (gather/scatter of multi-MiB chunks). It
// is written here with intrinsics, independent of core/kv_transfer.hpp's copy functions, so
// the baseline does not move when the code under test does.
//
// The widest store the CPU has, probed once at run time: AVX-512 (64-byte stores), AVX (two
// 32-byte stores per line), else SSE2 (four 16-byte stores per line, every x86-64 CPU has
// it). Cached loads, four lines per loop iteration, both halves of a line stored back to
// back, one sfence at the end. Off x86-64 it is memcpy (named so in stream_copy_kind()).

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVTIER_BENCH_STREAM_X86 1
#endif

namespace kvtier::bench {

namespace detail_stream {

#ifdef KVTIER_BENCH_STREAM_X86
// Each copies n bytes (a multiple of 256) from src to a 64-byte aligned dst.
__attribute__((target("avx512f"))) inline void lines_avx512(std::byte* dst, const std::byte* src, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 256) {
    const __m512i a = _mm512_loadu_si512(src + i);
    const __m512i b = _mm512_loadu_si512(src + i + 64);
    const __m512i c = _mm512_loadu_si512(src + i + 128);
    const __m512i d = _mm512_loadu_si512(src + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
  }
}

__attribute__((target("avx"))) inline void lines_avx(std::byte* dst, const std::byte* src, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 256) {
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32 * k));
    for (int k = 0; k < 8; ++k) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32 * k), v[k]);
  }
}

inline void lines_sse2(std::byte* dst, const std::byte* src, std::size_t n) {
  for (std::size_t i = 0; i < n; i += 256) {
    __m128i v[16];
    for (int k = 0; k < 16; ++k) v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16 * k));
    for (int k = 0; k < 16; ++k) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16 * k), v[k]);
  }
}
#endif

using lines_fn = void (*)(std::byte*, const std::byte*, std::size_t);

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

/// Copies n bytes from src to dst (not overlapping) with non-temporal stores, then sfence.
inline void stream_copy(void* dst_v, const void* src_v, std::size_t n) {
  auto* dst = static_cast<std::byte*>(dst_v);
  const auto* src = static_cast<const std::byte*>(src_v);
  const auto& c = detail_stream::chosen();
  if (c.fn == nullptr || n < 512) {
    std::memcpy(dst, src, n);
    return;
  }
  // Head up to a 64-byte aligned destination, whole 256-byte groups, then the tail.
  const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
  std::memcpy(dst, src, head);
  const std::size_t body = (n - head) & ~std::size_t{255};
  c.fn(dst + head, src + head, body);
  std::memcpy(dst + head + body, src + head + body, n - head - body);
#ifdef KVTIER_BENCH_STREAM_X86
  _mm_sfence();
#endif
}

}  // namespace kvtier::bench
