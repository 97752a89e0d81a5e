#pragma once
// tier_announcer: turns the key events of the tiers (bus::tier_keys_stored, tier_keys_removed)
// and the engines' descriptions of their chunks (bus::chunks_described) into vLLM's KV events
// (vllm_format.hpp), handed to a kv_event_transport (the ZMQ publisher, publisher.hpp).
// It is the server's tier_key_sink: it runs on the bus's drain thread, one event at a time.
//
// What it keeps (docs/kv-events.md, "What the server announces"):
//   - per announced tier, the chunks the tier holds (rank 0's object of each chunk: a
//     tensor-parallel engine stores one object per rank, a router wants the chunk once), each
//     with the blocks it was announced with (0: held but not announced: no description yet);
//   - the descriptions (token ids, block size, LoRA, parent chunk), at most description_bytes,
//     least recently described first out.
// A chunk is announced (BlockStored) when a tier holds it and its description is known,
// whichever comes second; its removal (BlockRemoved) only when it was announced. So a router
// may miss a chunk (no description: `undescribed`), it never hears of one a tier lacks.
//
// Block hashes: block i of chunk K is the first 8 bytes of XXH3-64 over K's portable encoding
// (rank 0) and i (u32 LE), as an int64 (vLLM's integer form). Stable across processes,
// restarts and engines, and computable from the key alone, so a removal needs no table.

#include <kvtier/bus/events.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/detail/xxhash.hpp>
#include <kvtier/kv_events/tier_key_relay.hpp>
#include <kvtier/kv_events/vllm_format.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

/// What a transport tells of itself (metrics, status).
struct kv_event_transport_stats {
  std::uint64_t events_published = 0;  ///< in batches sent
  std::uint64_t events_dropped = 0;    ///< refused: queue full, stopped, or a batch the socket refused
  std::uint64_t batches_published = 0;
  std::uint64_t replay_requests = 0;
  std::uint64_t replay_gaps = 0;  ///< replays that asked for batches no longer held
  std::uint64_t replay_buffer_batches = 0;
  std::uint64_t replay_buffer_bytes = 0;
};

/// Where the announcer's events go (the ZMQ publisher: zmq_transport.hpp). offer() must
/// never block.
class kv_event_transport {
 public:
  virtual ~kv_event_transport() = default;
  /// Queues one event; false when it was dropped (counted by the transport).
  virtual bool offer(kv_event ev) noexcept = 0;
  [[nodiscard]] virtual kv_event_transport_stats stats() const { return {}; }
  /// Where subscribers connect (the bound endpoints), for the start-up line.
  [[nodiscard]] virtual std::string describe() const { return {}; }
};

/// Block i of the chunk `key` (its rank ignored), in vLLM's integer form.
[[nodiscard]] inline std::int64_t block_hash_of(const chunk_key& key, std::uint32_t i) noexcept {
  chunk_key k = key;
  k.rank = 0;
  std::array<std::byte, chunk_key::wire_size + 4> in{};
  k.encode(std::span<std::byte, chunk_key::wire_size>(in.data(), chunk_key::wire_size));
  for (std::size_t b = 0; b < 4; ++b) in[chunk_key::wire_size + b] = static_cast<std::byte>(i >> (8 * b));
  const std::uint64_t h = XXH3_64bits(in.data(), in.size());
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

struct tier_announcer_options {
  /// Per tier (index: bus::l1_tier, bus::l2_tier(b)): its medium name, empty for a tier that
  /// is not announced.
  std::vector<std::string> mediums;
  /// The descriptions kept at most (token ids and names): 64 MiB holds ~60,000 chunks of 256
  /// tokens.
  std::size_t description_bytes = std::size_t{64} << 20;
};

/// The announcer's counters (relaxed atomics: read from any thread, e.g. /metrics).
struct tier_announcer_stats {
  std::atomic<std::uint64_t> chunks_stored{0};       ///< BlockStored offered (one per chunk and tier)
  std::atomic<std::uint64_t> chunks_removed{0};      ///< BlockRemoved offered
  std::atomic<std::uint64_t> blocks_stored{0};       ///< their blocks
  std::atomic<std::uint64_t> blocks_removed{0};
  std::atomic<std::uint64_t> undescribed{0};         ///< chunks a tier took with no description known (not announced then)
  std::atomic<std::uint64_t> transport_drops{0};     ///< events the transport refused
  std::atomic<std::uint64_t> descriptions_held{0};   ///< now
  std::atomic<std::uint64_t> description_bytes{0};   ///< now
  std::atomic<std::uint64_t> descriptions_evicted{0};
  std::atomic<std::uint64_t> descriptions_refused{0};  ///< malformed (token count, block size)
  std::atomic<std::uint64_t> chunks_held{0};         ///< chunks the announced tiers hold now (all tiers)
  std::atomic<std::uint64_t> chunks_announced{0};    ///< of those, announced
};

class tier_announcer final : public tier_key_sink {
 public:
  tier_announcer(tier_announcer_options options, kv_event_transport& transport)
      : options_(std::move(options)), transport_(transport), tiers_(options_.mediums.size()) {}

  [[nodiscard]] const tier_announcer_stats& stats() const noexcept { return stats_; }
  [[nodiscard]] bool announces(std::uint8_t tier) const noexcept {
    return tier < options_.mediums.size() && !options_.mediums[tier].empty();
  }

  /// Tier t's medium name (empty: not announced).
  [[nodiscard]] const std::string& medium(std::uint8_t tier) const noexcept { return options_.mediums[tier]; }

  /// The start of a stream: a router forgets what it heard of this publisher before.
  void clear_all() {
    for (auto& t : tiers_) t.clear();
    stats_.chunks_held.store(0, std::memory_order_relaxed);
    stats_.chunks_announced.store(0, std::memory_order_relaxed);
    offer(all_blocks_cleared{});
  }

  void on(const bus::tier_keys_stored& e) override {
    if (!announces(e.tier)) return;
    auto& held = tiers_[e.tier];
    for (const chunk_key& key : e.keys) {
      if (key.rank != 0) continue;
      auto [it, inserted] = held.try_emplace(key, 0U);
      if (!inserted) continue;
      stats_.chunks_held.fetch_add(1, std::memory_order_relaxed);
      if (const description* d = find_description(key)) {
        it->second = announce_stored(e.tier, key, *d);
      } else {
        stats_.undescribed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void on(const bus::tier_keys_removed& e) override {
    if (!announces(e.tier)) return;
    auto& held = tiers_[e.tier];
    for (const chunk_key& key : e.keys) {
      if (key.rank != 0) continue;
      const auto it = held.find(key);
      if (it == held.end()) continue;
      if (it->second != 0) announce_removed(e.tier, key, it->second);
      held.erase(it);
      stats_.chunks_held.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  void on(const bus::chunks_described& e) override {
    const std::size_t n = e.chunk_hashes.size();
    if (n == 0 || e.block_size == 0 || e.chunk_tokens == 0 || e.chunk_tokens % e.block_size != 0 ||
        e.token_ids.size() != n * e.chunk_tokens) {
      stats_.descriptions_refused.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    for (std::size_t i = 0; i < n; ++i) {
      description d;
      d.tokens.assign(e.token_ids.begin() + static_cast<std::ptrdiff_t>(i * e.chunk_tokens),
                      e.token_ids.begin() + static_cast<std::ptrdiff_t>((i + 1) * e.chunk_tokens));
      d.block_size = e.block_size;
      if (i > 0) d.parent = e.chunk_hashes[i - 1];
      else if (e.has_parent) d.parent = e.parent_hash;
      d.lora_name = e.lora_name;
      d.lora_id = e.lora_id;
      const chunk_key key{e.model_id, e.world_size, 0, e.chunk_hashes[i]};
      remember(key, std::move(d));
      // A tier that took the chunk before its description announces it now.
      for (std::size_t t = 0; t < tiers_.size(); ++t) {
        const auto it = tiers_[t].find(key);
        if (it == tiers_[t].end() || it->second != 0) continue;
        if (const description* known = find_description(key))
          it->second = announce_stored(static_cast<std::uint8_t>(t), key, *known);
      }
    }
  }

  /// The chunks tier `t` holds as announced (tests; drain thread or after it stopped).
  [[nodiscard]] std::size_t announced_in(std::uint8_t t) const {
    std::size_t n = 0;
    if (t < tiers_.size())
      for (const auto& [k, blocks] : tiers_[t]) n += blocks != 0 ? 1 : 0;
    return n;
  }

 private:
  struct description {
    std::vector<std::uint32_t> tokens;
    std::uint32_t block_size = 0;
    std::optional<hash128> parent;
    std::string lora_name;
    std::int64_t lora_id = -1;
    [[nodiscard]] std::size_t bytes() const noexcept {
      return sizeof(description) + tokens.size() * sizeof(std::uint32_t) + lora_name.size() + 64;
    }
  };
  struct held_description {
    description d;
    std::list<chunk_key>::iterator order;
  };

  const description* find_description(const chunk_key& key) {
    const auto it = descriptions_.find(key);
    return it == descriptions_.end() ? nullptr : &it->second.d;
  }

  void remember(const chunk_key& key, description d) {
    if (auto it = descriptions_.find(key); it != descriptions_.end()) {
      held_bytes_ -= it->second.d.bytes();
      order_.erase(it->second.order);
      descriptions_.erase(it);
    }
    held_bytes_ += d.bytes();
    order_.push_back(key);
    descriptions_.emplace(key, held_description{std::move(d), std::prev(order_.end())});
    while (held_bytes_ > options_.description_bytes && !order_.empty()) {
      const auto oldest = descriptions_.find(order_.front());
      held_bytes_ -= oldest->second.d.bytes();
      descriptions_.erase(oldest);
      order_.pop_front();
      stats_.descriptions_evicted.fetch_add(1, std::memory_order_relaxed);
    }
    stats_.descriptions_held.store(descriptions_.size(), std::memory_order_relaxed);
    stats_.description_bytes.store(held_bytes_, std::memory_order_relaxed);
  }

  // Offers the BlockStored of `key` in tier t; returns its block count (never 0).
  std::uint32_t announce_stored(std::uint8_t t, const chunk_key& key, const description& d) {
    const auto blocks = static_cast<std::uint32_t>(d.tokens.size() / d.block_size);
    block_stored ev;
    ev.block_hashes.reserve(blocks);
    for (std::uint32_t i = 0; i < blocks; ++i) ev.block_hashes.emplace_back(block_hash_of(key, i));
    if (d.parent) {
      const chunk_key parent{key.model_id, key.world_size, 0, *d.parent};
      ev.parent_block_hash = block_hash_of(parent, blocks - 1);
    }
    ev.token_ids = d.tokens;
    ev.block_size = d.block_size;
    if (d.lora_id >= 0) ev.lora_id = d.lora_id;
    ev.medium = options_.mediums[t];
    if (!d.lora_name.empty()) ev.lora_name = d.lora_name;
    offer(std::move(ev));
    stats_.chunks_stored.fetch_add(1, std::memory_order_relaxed);
    stats_.blocks_stored.fetch_add(blocks, std::memory_order_relaxed);
    stats_.chunks_announced.fetch_add(1, std::memory_order_relaxed);
    return blocks;
  }

  void announce_removed(std::uint8_t t, const chunk_key& key, std::uint32_t blocks) {
    block_removed ev;
    ev.block_hashes.reserve(blocks);
    for (std::uint32_t i = 0; i < blocks; ++i) ev.block_hashes.emplace_back(block_hash_of(key, i));
    ev.medium = options_.mediums[t];
    offer(std::move(ev));
    stats_.chunks_removed.fetch_add(1, std::memory_order_relaxed);
    stats_.blocks_removed.fetch_add(blocks, std::memory_order_relaxed);
    stats_.chunks_announced.fetch_sub(1, std::memory_order_relaxed);
  }

  void offer(kv_event ev) {
    if (!transport_.offer(std::move(ev))) stats_.transport_drops.fetch_add(1, std::memory_order_relaxed);
  }

  tier_announcer_options options_;
  kv_event_transport& transport_;
  std::vector<std::unordered_map<chunk_key, std::uint32_t, chunk_key_hash>> tiers_;
  std::unordered_map<chunk_key, held_description, chunk_key_hash> descriptions_;
  std::list<chunk_key> order_;  // least recently described first
  std::size_t held_bytes_ = 0;
  tier_announcer_stats stats_;
};

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
