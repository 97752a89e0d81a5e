#pragma once
// Shared by the fuzz targets (tests/fuzz/*_fuzz.cpp, docs/fuzzing.md).
//
//   fuzz_input     a cursor over libFuzzer's bytes: a target takes its own choices (how to
//                  cut a stream, which mode) from the front and hands the rest to the parser
//                  under test. Reads past the end give zeros, so every input is valid.
//   FUZZ_CHECK     a property the parser promises; when it does not hold, says which and
//                  aborts, so libFuzzer keeps the input as a crash (the replay test fails).
//
// A target never treats a refusal as a failure: refusing bad bytes is the parser's job.
// It fails on what the parser must never do: crash, read out of bounds (the sanitizers),
// leak, throw what it does not document, accept bytes and give back something else.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>

namespace kvtier::fuzz {

class fuzz_input {
 public:
  fuzz_input(const std::uint8_t* data, std::size_t size) noexcept
      : bytes_(reinterpret_cast<const std::byte*>(data), size) {}

  /// The next sizeof(U) bytes, little-endian; missing bytes read as zero.
  template <class U>
  [[nodiscard]] U take() noexcept {
    U v = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) {
      const auto b = at_ < bytes_.size() ? static_cast<std::uint8_t>(bytes_[at_++]) : std::uint8_t{0};
      v = static_cast<U>(v | (static_cast<U>(b) << (8 * i)));
    }
    return v;
  }

  /// Up to n bytes (fewer at the end).
  [[nodiscard]] std::span<const std::byte> take_bytes(std::size_t n) noexcept {
    n = std::min(n, remaining());
    const auto s = bytes_.subspan(at_, n);
    at_ += n;
    return s;
  }

  /// Everything not taken yet.
  [[nodiscard]] std::span<const std::byte> rest() noexcept { return take_bytes(remaining()); }

  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - at_; }

 private:
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

/// A small deterministic generator for choices derived from one input byte or word.
class fuzz_rng {
 public:
  explicit fuzz_rng(std::uint64_t seed) noexcept : s_(seed * 0x9E3779B97F4A7C15ULL + 1) {}
  [[nodiscard]] std::uint32_t next() noexcept {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return static_cast<std::uint32_t>(s_ >> 16);
  }

 private:
  std::uint64_t s_;
};

[[noreturn]] inline void check_failed(const char* cond, const char* file, int line, std::string_view what) {
  std::fprintf(stderr, "\nFUZZ_CHECK failed at %s:%d: %s\n  %.*s\n", file, line, cond, static_cast<int>(what.size()),
               what.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvtier::fuzz

/// Aborts with `what` (a string_view-convertible) when `cond` is false.
#define FUZZ_CHECK(cond, what) \
  ((cond) ? static_cast<void>(0) : ::kvtier::fuzz::check_failed(#cond, __FILE__, __LINE__, (what)))
