#pragma once
// disk_index: the in-memory index of l2::disk_backend. Key -> object state (writing, ready,
// removing, stuck), size on disk, pins, position in the eviction order; and the byte
// accounting (allocated bytes, st_blocks * 512) that enforces the capacity. No I/O and no
// locking: the backend holds its mutex around every call. docs/l2-disk.md, "The index" and
// "Capacity and eviction", holds the states and the rules.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

/// Which object goes first when room is needed.
enum class disk_eviction : std::uint8_t {
  lru,   ///< least recently used first (a lookup hit or a load counts as a use)
  fifo,  ///< oldest stored first
  none,  ///< never evict: a full backend answers no_space until objects are removed
};

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

enum class entry_state : std::uint8_t { writing, ready, removing, stuck };

struct disk_entry {
  std::uint64_t payload_bytes = 0;
  /// The object's segment size (its table's; loads split their reads at its boundaries), 0
  /// for an unsegmented object (one checksum over the whole payload: earlier versions', or empty).
  std::uint64_t segment_bytes = 0;
  std::uint64_t allocated_bytes = 0;
  std::uint64_t generation = 0;
  std::uint32_t pins = 0;
  entry_state state = entry_state::writing;
  std::list<chunk_key>::iterator order_pos{};  ///< valid while ready
};

/// An object chosen for eviction: unlink its file, then finish_remove(key, generation).
struct disk_victim {
  chunk_key key;
  std::uint64_t generation = 0;
  std::uint64_t allocated_bytes = 0;
};

class disk_index {
 public:
  explicit disk_index(disk_eviction policy = disk_eviction::lru) : policy_(policy) {}

  [[nodiscard]] disk_entry* find(const chunk_key& k) noexcept {
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : &it->second;
  }
  [[nodiscard]] const disk_entry* find(const chunk_key& k) const noexcept {
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : &it->second;
  }
  /// The entry when it is ready (visible), else nullptr.
  [[nodiscard]] disk_entry* find_ready(const chunk_key& k) noexcept {
    disk_entry* e = find(k);
    return e != nullptr && e->state == entry_state::ready ? e : nullptr;
  }

  /// A recovered object, ready at once; call in eviction order (oldest first).
  void add_ready(const chunk_key& k, std::uint64_t payload, std::uint64_t allocated, std::uint64_t generation,
                 std::uint64_t segment_bytes = 0) {
    disk_entry e;
    e.payload_bytes = payload;
    e.segment_bytes = segment_bytes;
    e.allocated_bytes = allocated;
    e.generation = generation;
    e.state = entry_state::ready;
    e.order_pos = order_.insert(order_.end(), k);
    map_.emplace(k, e);
    bytes_used_ += allocated;
    ++ready_objects_;
  }

  /// Reserves `estimate` bytes for a store of k (absent). Returns the new entry.
  disk_entry& begin_write(const chunk_key& k, std::uint64_t payload, std::uint64_t estimate, std::uint64_t generation,
                          std::uint64_t segment_bytes = 0) {
    disk_entry e;
    e.payload_bytes = payload;
    e.segment_bytes = segment_bytes;
    e.allocated_bytes = estimate;
    e.generation = generation;
    e.state = entry_state::writing;
    bytes_used_ += estimate;
    return map_.emplace(k, e).first->second;
  }

  /// The store of (k, generation) committed: ready, `allocated` bytes measured on disk.
  bool commit(const chunk_key& k, std::uint64_t generation, std::uint64_t allocated) {
    disk_entry* e = find(k);
    if (e == nullptr || e->generation != generation || e->state != entry_state::writing) return false;
    bytes_used_ = bytes_used_ - e->allocated_bytes + allocated;
    e->allocated_bytes = allocated;
    e->state = entry_state::ready;
    e->order_pos = order_.insert(order_.end(), k);
    ++ready_objects_;
    return true;
  }

  /// The store of (k, generation) failed: its reservation goes.
  void abort_write(const chunk_key& k, std::uint64_t generation) {
    auto it = map_.find(k);
    if (it == map_.end() || it->second.generation != generation || it->second.state != entry_state::writing) return;
    bytes_used_ -= it->second.allocated_bytes;
    map_.erase(it);
  }

  /// A use of a ready entry (lookup hit, load): moves it to the back under LRU.
  void touch(disk_entry& e) noexcept {
    if (policy_ == disk_eviction::lru && e.state == entry_state::ready)
      order_.splice(order_.end(), order_, e.order_pos);
  }

  /// ready -> removing when (k, generation) is still the ready object (generation 0: any).
  /// Returns the entry's generation, nullopt when there is nothing to remove.
  std::optional<std::uint64_t> start_remove(const chunk_key& k, std::uint64_t generation = 0) {
    disk_entry* e = find(k);
    if (e == nullptr || e->state != entry_state::ready || (generation != 0 && e->generation != generation))
      return std::nullopt;
    to_removing(k, *e);
    return e->generation;
  }

  /// stuck -> removing, to retry the unlink of a bad object's file. Returns the generation.
  std::optional<std::uint64_t> start_remove_stuck(const chunk_key& k) {
    disk_entry* e = find(k);
    if (e == nullptr || e->state != entry_state::stuck) return std::nullopt;
    e->state = entry_state::removing;
    pending_free_ += e->allocated_bytes;
    return e->generation;
  }

  /// The file of (k, generation) is gone (or will never be served again): forget it.
  void finish_remove(const chunk_key& k, std::uint64_t generation) {
    auto it = map_.find(k);
    if (it == map_.end() || it->second.generation != generation || it->second.state != entry_state::removing) return;
    bytes_used_ -= it->second.allocated_bytes;
    pending_free_ -= it->second.allocated_bytes;
    map_.erase(it);
  }

  /// The unlink of (k, generation) failed and its file is intact: removing -> ready again,
  /// at the back of the eviction order (so the next eviction tries other objects first).
  bool abort_remove(const chunk_key& k, std::uint64_t generation) {
    disk_entry* e = find(k);
    if (e == nullptr || e->generation != generation || e->state != entry_state::removing) return false;
    pending_free_ -= e->allocated_bytes;
    e->state = entry_state::ready;
    e->order_pos = order_.insert(order_.end(), k);
    ++ready_objects_;
    return true;
  }

  /// The unlink of a bad object (k, generation) failed: removing -> stuck (see the states).
  bool mark_stuck(const chunk_key& k, std::uint64_t generation) {
    disk_entry* e = find(k);
    if (e == nullptr || e->generation != generation || e->state != entry_state::removing) return false;
    pending_free_ -= e->allocated_bytes;
    e->state = entry_state::stuck;
    return true;
  }

  /// Bytes of a file that is not an object and could not be deleted (a failed store's
  /// temporary file): counted in bytes_used() until the next start-up's scan deletes it.
  void keep_stray(std::uint64_t bytes) noexcept {
    bytes_used_ += bytes;
    stray_bytes_ += bytes;
  }

  /// Makes room for `need` more bytes under `capacity`: when the bytes in use (not counting
  /// objects already being removed) plus `need` pass high * capacity, unpinned ready
  /// objects are chosen in eviction order until they fit under low * capacity (or no more
  /// can go). Returns the victims (now `removing`), or nullopt when `need` cannot fit
  /// under capacity even then: nothing is evicted in that case.
  std::optional<std::vector<disk_victim>> make_room(std::uint64_t need, std::uint64_t capacity, double high,
                                                    double low) {
    std::vector<disk_victim> victims;
    const std::uint64_t live = bytes_used_ - pending_free_;
    if (need > capacity) return std::nullopt;
    if (static_cast<double>(live + need) <= high * static_cast<double>(capacity)) return victims;
    if (policy_ == disk_eviction::none)
      return live + need <= capacity ? std::optional(std::move(victims)) : std::nullopt;
    const double target = low * static_cast<double>(capacity);
    std::uint64_t freed = 0;
    for (auto it = order_.begin(); it != order_.end(); ++it) {
      if (static_cast<double>(live - freed + need) <= target) break;
      const disk_entry& e = map_.at(*it);
      if (e.pins > 0) continue;
      victims.push_back({*it, e.generation, e.allocated_bytes});
      freed += e.allocated_bytes;
    }
    if (live - freed + need > capacity) return std::nullopt;
    for (const auto& v : victims) to_removing(v.key, map_.at(v.key));
    return victims;
  }

  /// Bytes allocated on disk by every object, including ones being written (their estimate),
  /// ones being removed (until their unlink completes), stuck ones and stray files.
  [[nodiscard]] std::uint64_t bytes_used() const noexcept { return bytes_used_; }
  /// Of those, the bytes of stray files (keep_stray).
  [[nodiscard]] std::uint64_t stray_bytes() const noexcept { return stray_bytes_; }
  /// Ready (visible) objects.
  [[nodiscard]] std::uint64_t objects() const noexcept { return ready_objects_; }
  [[nodiscard]] std::size_t entries() const noexcept { return map_.size(); }
  [[nodiscard]] disk_eviction policy() const noexcept { return policy_; }

  /// Calls f(key, entry) for every ready (visible) object, in no particular order; f must
  /// not change the index.
  template <class F>
  void for_each_ready(F&& f) const {
    for (const auto& [k, e] : map_)
      if (e.state == entry_state::ready) f(k, e);
  }

  /// Ready keys in eviction order (next victim first), for tests.
  [[nodiscard]] std::vector<chunk_key> eviction_order() const { return {order_.begin(), order_.end()}; }

 private:
  void to_removing(const chunk_key&, disk_entry& e) {
    order_.erase(e.order_pos);
    e.order_pos = {};
    e.state = entry_state::removing;
    pending_free_ += e.allocated_bytes;
    --ready_objects_;
  }

  disk_eviction policy_;
  std::unordered_map<chunk_key, disk_entry, chunk_key_hash> map_;
  std::list<chunk_key> order_;  // ready entries, next victim first
  std::uint64_t bytes_used_ = 0;
  std::uint64_t pending_free_ = 0;
  std::uint64_t stray_bytes_ = 0;
  std::uint64_t ready_objects_ = 0;
};

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
