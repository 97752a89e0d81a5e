#pragma once
// Shared by the tiered_cache tests: what a cache serves for a key, compared byte for byte.

#include <kvtier/core/chunk_key.hpp>
#include <kvtier/l1/status.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

namespace kvtier::test {

/// Whether `cache` holds `k` readable with exactly the bytes `want` (pins it for the copy,
/// as the server's retrieve does, and unpins it).
template <class Cache>
bool serves_bytes(Cache& cache, const chunk_key& k, std::span<const std::byte> want) {
  std::vector<l1::status> st(1);
  std::vector<std::span<const std::byte>> v(1);
  if (cache.pin_for_copy(std::span(&k, 1), st, v) != 1) return false;
  const bool same = v[0].size() == want.size() && std::memcmp(v[0].data(), want.data(), want.size()) == 0;
  cache.unpin_after_copy(std::span(&k, 1));
  return same;
}

}  // namespace kvtier::test
