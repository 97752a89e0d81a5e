#pragma once
// The vocabulary of tiered_cache's whole copy operations (tiered_cache.hpp):
//
//   async_copy_out(request, sink, token)   L1 -> a destination (a retrieve: the engine's
//       blocks). Copies the request's keys, in order, each as soon as it is readable: keys L1
//       holds at once, keys the lookup's prefetch is loading as each lands, so the copy of
//       one object overlaps the load of the next. Completes once with the contiguous prefix
//       copied (a key that is missing, fails to load, or whose sink call fails ends it).
//   async_copy_in(request, source, fence, token)   a source (a store: the engine's blocks)
//       -> L1 (or staging straight to L2 for keys L1 has no room for). Reserves, copies each
//       key through the source, checks the fence, then finishes (readable, offered to L2) or
//       abandons (never readable) each key.
//
// The sink and the source run on the copy executor (cache_options::copy_executor: the
// server's worker pool; the cache's own executor when none is given), several at once when it
// has several threads; they must not call into the cache. Every object they touch stays
// locked in L1 (read-pinned for a copy out, write-locked for a copy in) until they returned.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/pipeline/concepts.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

/// Copies part `part` (of copy_out_request::parts) of key `index`'s object (all its bytes:
/// `object`) to the destination. false: this key's copy failed (the copied prefix ends there).
using copy_out_sink = std::function<bool(std::size_t index, std::size_t part, std::span<const std::byte> object)>;

/// Fills key `index`'s new object (`object`: object_bytes bytes) from the source. false: the
/// copy failed (the key is abandoned).
using copy_in_source = std::function<bool(std::size_t index, std::span<std::byte> object)>;

/// After every copy in: true when key `index`'s source was still valid during its copy (the
/// engine did not reuse its blocks: the generation fence); false abandons the key. Runs on
/// the completion's executor (the caller's), after all copies.
using copy_in_fence = std::function<bool(std::size_t index)>;

struct copy_out_request {
  /// The lookup whose holds and loads serve the copy (its holds on these keys are given
  /// back at the end, copied or not); 0: none (copies what L1 holds now).
  std::uint64_t lookup = 0;
  std::span<const chunk_key> keys;  ///< copied at initiation
  std::size_t object_bytes = 0;     ///< size of every object (another size ends the prefix)
  /// Slices of each object the sink copies one call at a time: part p is bytes
  /// [p * object / parts, (p + 1) * object / parts) (a layer of a layer-major object). With
  /// parts > 1 the copy goes part-major (part 0 of every key, then part 1, ...) and
  /// on_progress tells how many leading parts are done for every key: an engine can use the
  /// first layers while the rest is copied. Every key readable at the start: one task per
  /// part. Keys the lookup still loads: each part is copied once its bytes are final (the key
  /// landed, or the backend verified a prefix that covers it: the disk backend's segments),
  /// so the first layers of an L2 hit are usable before the last ones are read.
  std::size_t parts = 1;
  /// Called (on a copy thread) with the number of leading parts copied for every key of the
  /// prefix, each time it grows before the completion (parts > 1 only). A key whose load
  /// fails after some of its parts were reported ends the prefix there: what was reported
  /// holds for the shorter prefix, and the bytes reported were the stored, verified ones.
  std::function<void(std::size_t parts_done)> on_progress;
};

struct copy_in_request {
  std::span<const chunk_key> keys;  ///< copied at initiation
  std::size_t object_bytes = 0;     ///< size of each new object
  pipeline::write_context context;  ///< for the admission policy
};

struct copy_in_result {
  std::size_t stored = 0;           ///< copied, fenced ok, readable (and offered to L2)
  std::size_t already_present = 0;  ///< the cache had the key (nothing copied)
  std::size_t failed = 0;           ///< no memory, the copy failed, or fenced
};

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
