#pragma once
// engine::connector, descriptions of chunks for the KV events of a server that publishes them
// (issue 28; docs/integration.md, "Routers"): describe_chunks, sent fire and forget like
// free_lookup_locks and end_request, and the per-connection state that keeps it cheap:
// whether the connection's server wants descriptions at all (its first answer says), and the
// window of chunks already described on the connection. Declarations and the contract:
// kvtier/engine/connector.hpp.

#include <kvtier/engine/connector.hpp>

#include <algorithm>
#include <bit>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

namespace detail {
/// The body one description is split at (the protocol's default body limit is 16 MiB; a
/// server may be configured lower): 4 MiB is 1M tokens, far beyond a usual prompt.
inline constexpr std::size_t max_description_body_bytes = std::size_t{4} << 20;
}  // namespace detail

template <class Bus>
hash128 connector<Bus>::described_key(const hash128& h, std::string_view salt) noexcept {
  if (salt.empty()) return h;
  // Another salt is another chunk (another model id): its key must differ from the hash.
  const std::uint64_t s = std::hash<std::string_view>{}(salt) | 1;
  return hash128{h.lo ^ (s * 0x9e3779b97f4a7c15ULL), h.hi ^ std::rotl(s, 29)};
}

template <class Bus>
bool connector<Bus>::mark_described_locked(const hash128& key) {
  if (!described_.insert(key).second) return false;
  described_order_.push_back(key);
  while (described_order_.size() > options_.described_chunks_window) {
    described_.erase(described_order_.front());
    described_order_.pop_front();
  }
  return true;
}

template <class Bus>
std::uint32_t connector<Bus>::description_block_size(std::size_t chunks, std::size_t token_count,
                                                     std::string_view cache_salt,
                                                     const chunk_description_extras& extras) const {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("kvtier::engine::connector::describe_chunks: " + what);
  };
  const std::uint32_t ct = options_.chunk_tokens;
  check_salt(cache_salt);
  if (token_count < chunks * ct)
    fail(std::to_string(chunks) + " chunks need " + std::to_string(chunks * ct) + " tokens, got " +
         std::to_string(token_count));
  std::uint32_t bs = extras.block_size != 0 ? extras.block_size : options_.block_size;
  if (bs == 0) bs = region_ != nullptr ? region_->layout().block_size : ct;
  if (ct % bs != 0) fail("block_size " + std::to_string(bs) + " does not divide chunk_tokens " + std::to_string(ct));
  const std::size_t blocks = chunks * (ct / bs);
  if (!extras.block_extra_keys.empty() && extras.block_extra_keys.size() != blocks)
    fail(std::to_string(extras.block_extra_keys.size()) + " block extra keys for " + std::to_string(blocks) +
         " blocks: give one per block or none");
  for (const std::string& k : extras.block_extra_keys)
    if (k.size() > protocol::max_block_extra_key_bytes) fail("a block's extra keys take more than 4096 bytes");
  if (extras.lora_name.size() > protocol::max_lora_name_bytes) fail("a LoRA name has at most 256 bytes");
  if (extras.lora_id < -1) fail("lora_id is -1 (none) or an adapter id >= 0");
  return bs;
}

template <class Bus>
protocol::describe_chunks_request connector<Bus>::description_of(std::span<const hash128> hashes,
                                                                 std::span<const token_id> tokens,
                                                                 std::string_view cache_salt,
                                                                 const chunk_description_extras& extras,
                                                                 std::uint32_t block_size, std::size_t begin,
                                                                 std::size_t end, std::uint64_t model_id) const {
  const std::size_t ct = options_.chunk_tokens;
  const std::size_t bpc = ct / block_size;
  auto at = [](auto& v, std::size_t i) { return v.begin() + static_cast<std::ptrdiff_t>(i); };
  protocol::describe_chunks_request req;
  req.model_id = model_id;
  req.world_size = options_.world_size;
  req.cache_salt = std::string(cache_salt);
  req.block_size = block_size;
  req.has_parent = begin > 0 || extras.parent.has_value();
  if (req.has_parent) req.parent_hash = begin > 0 ? hashes[begin - 1] : *extras.parent;
  req.chunk_hashes.assign(at(hashes, begin), at(hashes, end));
  req.token_ids.assign(at(tokens, begin * ct), at(tokens, end * ct));
  req.lora_name = extras.lora_name;
  req.lora_id = extras.lora_id;
  if (!extras.block_extra_keys.empty())
    req.block_extra_keys.assign(at(extras.block_extra_keys, begin * bpc), at(extras.block_extra_keys, end * bpc));
  return req;
}

template <class Bus>
std::size_t connector<Bus>::description_end(std::size_t begin, std::size_t end, std::uint32_t block_size,
                                            const chunk_description_extras& extras) const {
  const std::size_t ct = options_.chunk_tokens;
  const std::size_t bpc = ct / block_size;
  const std::size_t max_chunks = std::min<std::size_t>(
      {protocol::max_chunk_hashes, protocol::max_described_tokens / ct,
       extras.block_extra_keys.empty() ? protocol::max_chunk_hashes : protocol::max_block_extra_keys / bpc});
  std::size_t stop = begin;
  std::size_t bytes = 0;
  while (stop < end && stop - begin < max_chunks) {
    std::size_t chunk_bytes = 16 + 4 * ct;
    for (std::size_t b = stop * bpc; b < (stop + 1) * bpc && !extras.block_extra_keys.empty(); ++b)
      chunk_bytes += 4 + extras.block_extra_keys[b].size();
    if (stop > begin && bytes + chunk_bytes > detail::max_description_body_bytes) break;
    bytes += chunk_bytes;
    ++stop;
  }
  return stop;
}

template <class Bus>
bool connector<Bus>::describes_chunks() const {
  if (!options_.describe_chunks) return false;
  std::lock_guard g(mu());
  return describe_state_ != describe_state::off;
}

template <class Bus>
void connector<Bus>::describe_chunks(std::span<const hash128> hashes, std::span<const token_id> tokens,
                                     std::string_view cache_salt, const chunk_description_extras& extras) {
  const std::uint32_t bs = description_block_size(hashes.size(), tokens.size(), cache_salt, extras);
  if (!options_.describe_chunks || hashes.empty()) return;

  // Under the lock: the chunks not described on this connection yet (marked now), as runs of
  // consecutive chunks [begin, end).
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  std::uint64_t generation = 0;
  std::uint64_t model_id = 0;
  {
    std::lock_guard g(mu());
    if (link_.state_locked() != health_state::healthy || link_.stopping_locked() ||
        describe_state_ == describe_state::off)
      return;
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      if (!mark_described_locked(described_key(hashes[i], cache_salt))) continue;
      if (!runs.empty() && runs.back().second == i)
        ++runs.back().second;
      else
        runs.emplace_back(i, i + 1);
    }
    generation = describe_generation_;
    model_id = link_.model_id_locked();
  }

  // Outside it: the frames, each run split to fit the protocol's limits.
  std::vector<std::pair<std::uint64_t, std::vector<std::byte>>> frames;
  std::size_t described_chunks = 0;
  for (auto [begin, end] : runs) {
    for (std::size_t stop = begin; begin < end; begin = stop) {
      stop = description_end(begin, end, bs, extras);
      const std::uint64_t id = link_.next_call_id();
      frames.emplace_back(id, detail::server_link::encode(
                                  id, description_of(hashes, tokens, cache_salt, extras, bs, begin, stop, model_id)));
      described_chunks += stop - begin;
    }
  }
  if (frames.empty()) return;

  detail::issue_lock g(link_);
  // Reconnected meanwhile (the new connection forgot what this one described), or told to
  // stop: these go nowhere.
  if (generation != describe_generation_ || describe_state_ == describe_state::off ||
      link_.state_locked() != health_state::healthy || link_.stopping_locked())
    return;
  for (auto& [id, frame] : frames)
    link_.issue_locked(id, call_kind::notify, protocol::describe_chunks_response::type, std::move(frame),
                       scaled(options_.timeouts.request_timeout),
                       [this, generation](pending_call&, call_result& r) { on_description_reply_io(generation, r); });
  descriptions_sent_ += frames.size();
  chunks_described_ += described_chunks;
}

template <class Bus>
void connector<Bus>::on_description_reply_io(std::uint64_t generation, const call_result& r) {
  if (generation != describe_generation_) return;  // an older connection's answer
  if (r.status == call_status::reply) {
    const bool described = std::get<protocol::describe_chunks_response>(r.reply).described;
    if (describe_state_ == describe_state::unknown || !described)
      describe_state_ = described ? describe_state::on : describe_state::off;
  } else if (r.status == call_status::error_reply) {
    // A server that does not know the message (older), or refused it: describing on this
    // connection is wasted.
    describe_state_ = describe_state::off;
  }
  if (describe_state_ == describe_state::off) {
    described_.clear();
    described_order_.clear();
  }
}

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
