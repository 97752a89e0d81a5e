#pragma once
// quarantine: the engine blocks a server may still write into although the connector gave
// up on the call that handed them over (a retrieve that timed out, or that was in flight
// when the server turned unhealthy). The engine must not reuse a quarantined block: it
// recomputes that KV into other blocks (the blocks are also load errors). Pure bookkeeping,
// no I/O, not thread-safe (the connector guards it with its mutex).
//
// A call's blocks are released when it is proven that no copy can follow:
//   - the server answers that call after all (a late reply: its copy is over);
//   - the server closes the connection the call was made on (EOF, EPIPE, ECONNRESET): the
//     server closes a connection only after every copy it started for it has ended, and
//     starts none after (docs/protocol.md, "Closing a connection"), so release_epoch;
//   - the server process that held the call is known to be gone (its pidfd, docs/
//     fault-tolerance.md): a dead process writes nothing, so release_epoch;
//   - or, without proof, when they have been held longer than connector_timeouts::
//     quarantine_limit (10 minutes by default; 0: never): release_held_before.
// Nothing else releases them: neither a reconnect, nor a new boot token (the old process
// may be alive), nor the connector closing the connection itself (the server may be in the
// middle of a copy). A block handed to several failed calls stays quarantined until all of
// them are released.

#include <kvtier/config.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

class quarantine {
 public:
  using clock = std::chrono::steady_clock;

  explicit quarantine(std::uint32_t num_blocks) : holds_(num_blocks, 0) {}

  /// Quarantines `blocks` for call `call_id`, made on the connection of epoch `epoch`.
  /// Returns how many blocks became quarantined (were not already). A call id is held once;
  /// holding it again adds nothing. Block ids must be < num_blocks.
  std::size_t hold(std::uint64_t call_id, std::uint64_t epoch, std::span<const std::uint32_t> blocks,
                   clock::time_point now = clock::now()) {
    for (std::uint32_t b : blocks)
      if (b >= holds_.size()) throw std::out_of_range("kvtier::engine::quarantine: block id out of range");
    auto [it, inserted] = calls_.try_emplace(call_id);
    if (!inserted) return 0;
    it->second.epoch = epoch;
    it->second.since = now;
    it->second.blocks.assign(blocks.begin(), blocks.end());
    std::size_t added = 0;
    for (std::uint32_t b : blocks)
      if (holds_[b]++ == 0) ++added;
    quarantined_ += added;
    return added;
  }

  /// The server answered call `call_id`: its blocks are released. Returns how many blocks
  /// left quarantine (0 when the call is not held).
  std::size_t release_call(std::uint64_t call_id) {
    auto it = calls_.find(call_id);
    if (it == calls_.end()) return 0;
    const std::size_t n = unhold(it->second.blocks);
    calls_.erase(it);
    return n;
  }

  /// The server closed the connection of `epoch`, or the process behind it is gone: every
  /// call held for it is released. Returns how many blocks left quarantine.
  std::size_t release_epoch(std::uint64_t epoch) {
    std::size_t n = 0;
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (it->second.epoch == epoch) {
        n += unhold(it->second.blocks);
        it = calls_.erase(it);
      } else {
        ++it;
      }
    }
    return n;
  }

  /// Releases every call held since before `cutoff` (the optional quarantine limit).
  std::size_t release_held_before(clock::time_point cutoff) {
    std::size_t n = 0;
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (it->second.since < cutoff) {
        n += unhold(it->second.blocks);
        it = calls_.erase(it);
      } else {
        ++it;
      }
    }
    return n;
  }

  [[nodiscard]] bool contains(std::uint32_t block) const noexcept { return block < holds_.size() && holds_[block] != 0; }
  [[nodiscard]] bool holds_call(std::uint64_t call_id) const { return calls_.contains(call_id); }
  /// True when some call of connection `epoch` is held.
  [[nodiscard]] bool holds_epoch(std::uint64_t epoch) const {
    for (const auto& [id, c] : calls_)
      if (c.epoch == epoch) return true;
    return false;
  }
  /// Blocks quarantined now.
  [[nodiscard]] std::size_t size() const noexcept { return quarantined_; }
  [[nodiscard]] bool empty() const noexcept { return quarantined_ == 0; }
  /// Calls held now.
  [[nodiscard]] std::size_t calls() const noexcept { return calls_.size(); }
  /// The quarantined block ids, ascending.
  [[nodiscard]] std::vector<std::uint32_t> blocks() const {
    std::vector<std::uint32_t> out;
    out.reserve(quarantined_);
    for (std::uint32_t b = 0; b < holds_.size(); ++b)
      if (holds_[b] != 0) out.push_back(b);
    return out;
  }

 private:
  struct held_call {
    std::uint64_t epoch = 0;
    clock::time_point since{};
    std::vector<std::uint32_t> blocks;
  };

  std::size_t unhold(const std::vector<std::uint32_t>& blocks) noexcept {
    std::size_t n = 0;
    for (std::uint32_t b : blocks)
      if (--holds_[b] == 0) ++n;
    quarantined_ -= n;
    return n;
  }

  std::vector<std::uint32_t> holds_;  ///< per block: held calls that name it
  std::unordered_map<std::uint64_t, held_call> calls_;
  std::size_t quarantined_ = 0;       ///< blocks with holds_ != 0
};

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
