#pragma once
// engine::connector, the worker side: retrieve and store, finished reporting, load errors
// and fencing (quarantine, block reuse). Declarations and the contract:
// kvtier/engine/connector.hpp.

#include <kvtier/engine/connector.hpp>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

// ---------------------------------------------------------------------------------------
// Worker side
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::retrieve(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                              std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens,
                              std::string_view cache_salt, retrieve_options how) {
  region_for("retrieve");
  if (block_ids.size() % blocks_per_chunk() != 0)
    throw std::invalid_argument("kvtier::engine::connector::retrieve: block ids are not whole chunks");
  const std::size_t chunks = block_ids.size() / blocks_per_chunk();
  const std::vector<hash128> hashes = hashes_of(tokens, first_chunk, chunks);
  retrieve_hashes(request_id, hashes, first_chunk, block_ids, skip_tokens, cache_salt, how);
}

template <class Bus>
void connector<Bus>::retrieve_hashes(std::string_view request_id, std::span<const hash128> hashes,
                                     std::uint32_t first_chunk, std::span<const std::uint32_t> block_ids,
                                     std::uint32_t skip_tokens, std::string_view cache_salt, retrieve_options how) {
  region_for("retrieve");
  check_request_id(request_id);
  check_salt(cache_salt);
  check_blocks(block_ids, hashes.size());
  if (std::uint64_t{skip_tokens} > std::uint64_t{hashes.size()} * options_.chunk_tokens)
    throw std::invalid_argument("kvtier::engine::connector::retrieve: skip_tokens exceeds the range");
  auto info = std::make_shared<retrieve_info>();
  info->request_id = std::string(request_id);
  info->block_ids.assign(block_ids.begin(), block_ids.end());
  info->chunks = static_cast<std::uint32_t>(hashes.size());
  info->skip_tokens = skip_tokens;
  info->started = clock::now();
  const std::uint64_t cid = link_.next_call_id();
  std::vector<std::byte> bytes;
  if (info->chunks != 0)
    bytes = detail::server_link::encode(
        cid, protocol::retrieve_request{info->request_id,
                                        options_.rank,
                                        first_chunk,
                                        std::vector<hash128>(hashes.begin(), hashes.end()),
                                        info->block_ids,
                                        skip_tokens,
                                        std::string(cache_salt),
                                        /*progress=*/true});
  detail::issue_lock g(link_);
  tracker_.retrieve_started(info->request_id, how.synchronous);
  if (info->chunks == 0) return finish_retrieve_locked(*info, 0, bus::connector_outcome::ok, nullptr);
  if (link_.state_locked() != health_state::healthy)
    return finish_retrieve_locked(*info, 0, bus::connector_outcome::unhealthy, nullptr);
  loads_.emplace(cid, load_in_flight{info->request_id, info->chunks, 0, 0});
  link_.issue_locked(cid, call_kind::retrieve, protocol::retrieve_response::type, std::move(bytes),
                     scaled(options_.timeouts.retrieve_timeout), [this, info](pending_call& c, call_result& r) {
                       std::uint32_t got = 0;
                       auto outcome = outcome_of(r.status);
                       if (r.status == call_status::reply) {
                         got = std::min(std::get<protocol::retrieve_response>(r.reply).retrieved_chunks, info->chunks);
                         outcome = got == info->chunks ? bus::connector_outcome::ok : bus::connector_outcome::partial;
                       } else if (auto it = loads_.find(c.id); it != loads_.end()) {
                         // Ended early (deadline, server gone): the chunks progress said were
                         // in the blocks, final, are retrieved; only the rest are load errors.
                         got = it->second.chunks_ready;
                       }
                       finish_retrieve_locked(*info, got, outcome, &c);
                     });
}

template <class Bus>
void connector<Bus>::finish_retrieve_locked(const retrieve_info& info, std::uint32_t retrieved,
                                            bus::connector_outcome outcome, const pending_call* call) {
  const std::uint32_t bpc = blocks_per_chunk();
  const std::uint64_t ct = options_.chunk_tokens;
  const std::uint64_t bs = region_->layout().block_size;
  // The blocks of the chunks that did not land, but those entirely inside the skipped prefix
  // (never to be written: the engine's own KV).
  std::vector<std::uint32_t> affected;
  for (std::uint32_t i = retrieved; i < info.chunks; ++i)
    for (std::uint32_t j = 0; j < bpc; ++j)
      if (i * ct + (j + 1) * bs > info.skip_tokens) affected.push_back(info.block_ids[std::size_t{i} * bpc + j]);
  std::size_t held = 0;
  // A call the server may still act on: its blocks wait for a proof that no copy can follow
  // (its answer, the connection's close by the server, the process's death). Released
  // because the server closed the connection: that is the proof already.
  const bool closed_by_server = call != nullptr && link_.closed_by_server_locked(call->epoch);
  if (call != nullptr && call->sent && !closed_by_server &&
      (outcome == bus::connector_outcome::timeout || outcome == bus::connector_outcome::unhealthy))
    held = quarantine_.hold(call->id, call->epoch, affected);
  for (std::uint32_t b : affected)
    if (!is_load_error_[b]) {
      is_load_error_[b] = true;
      load_errors_.push_back(b);
    }
  tracker_.retrieve_done(info.request_id);
  if (call != nullptr && loads_.erase(call->id) != 0) notify_waiters_locked();
  // The completion comes last: whoever waits for it sees the retrieve's other events.
  if (!affected.empty())
    bus_.publish(bus::connector_load_error{options_.rank, outcome, static_cast<std::uint32_t>(affected.size())});
  if (held != 0) publish_quarantine_locked(held, 0);
  bus_.publish(bus::connector_retrieve_completed{options_.rank, outcome, info.chunks, retrieved,
                                                 static_cast<std::uint32_t>(affected.size()),
                                                 detail::elapsed_ns(info.started)});
}

// ---------------------------------------------------------------------------------------
// Layer-wise loading
// ---------------------------------------------------------------------------------------

template <class Bus>
template <class Rep, class Period, class Done>
bool connector<Bus>::wait_for_locked(std::unique_lock<std::mutex>& lock, std::chrono::duration<Rep, Period> timeout,
                                     Done done) {
  // A timeout beyond a year is "no timeout" (and keeps the deadline from overflowing).
  if (timeout >= std::chrono::hours(24 * 365)) {
    waits_cv_.wait(lock, done);
    return true;
  }
  return waits_cv_.wait_until(lock, clock::now() + timeout, done);
}

template <class Bus>
std::uint32_t connector<Bus>::layers_ready(std::string_view request_id) const {
  const kv_region& region = region_for("layers_ready");
  std::uint32_t out = region.layout().model.num_layers;
  std::lock_guard g(mu());
  for (const auto& [cid, load] : loads_)
    if (load.request_id == request_id) out = std::min(out, load.layers_ready);
  return out;
}

template <class Bus>
bool connector<Bus>::wait_layers(std::span<const std::string> request_ids, std::uint32_t layers,
                                 std::chrono::milliseconds timeout) {
  region_for("wait_layers");
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] {
    return std::none_of(loads_.begin(), loads_.end(), [&](const auto& kv) {
      return kv.second.layers_ready < layers && listed(request_ids, kv.second.request_id);
    });
  });
}

template <class Bus>
bool connector<Bus>::wait_retrieves(std::span<const std::string> request_ids, std::chrono::milliseconds timeout) {
  region_for("wait_retrieves");
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] {
    return std::none_of(loads_.begin(), loads_.end(),
                        [&](const auto& kv) { return listed(request_ids, kv.second.request_id); });
  });
}

template <class Bus>
void connector<Bus>::store(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                           std::uint32_t chunk_count, std::span<const std::uint32_t> block_ids,
                           std::string_view cache_salt) {
  region_for("store");
  if (block_ids.size() != std::size_t{chunk_count} * blocks_per_chunk())
    throw std::invalid_argument("kvtier::engine::connector::store: " + std::to_string(block_ids.size()) +
                                " block ids for " + std::to_string(chunk_count) + " chunks");
  const std::vector<hash128> hashes = hashes_of(tokens, first_chunk, chunk_count);
  store_hashes(request_id, hashes, first_chunk, block_ids, cache_salt);
}

template <class Bus>
void connector<Bus>::store_hashes(std::string_view request_id, std::span<const hash128> hashes,
                                  std::uint32_t first_chunk, std::span<const std::uint32_t> block_ids,
                                  std::string_view cache_salt) {
  kv_region& region = region_for("store");
  check_request_id(request_id);
  check_salt(cache_salt);
  check_blocks(block_ids, hashes.size());
  // The fencing values: read now, at issue time, after the forward pass wrote the blocks.
  std::vector<std::uint64_t> generations(block_ids.size());
  for (std::size_t i = 0; i < block_ids.size(); ++i) generations[i] = region.generation(block_ids[i]);
  auto info = std::make_shared<store_info>();
  info->request_id = std::string(request_id);
  info->chunks = static_cast<std::uint32_t>(hashes.size());
  info->started = clock::now();
  const std::uint64_t cid = link_.next_call_id();
  std::vector<std::byte> bytes;
  if (info->chunks != 0)
    bytes = detail::server_link::encode(
        cid, protocol::store_request{info->request_id, options_.rank, first_chunk,
                                     std::vector<hash128>(hashes.begin(), hashes.end()),
                                     std::vector<std::uint32_t>(block_ids.begin(), block_ids.end()),
                                     std::move(generations), std::string(cache_salt)});
  detail::issue_lock g(link_);
  tracker_.store_started(info->request_id);
  if (info->chunks == 0) return finish_store_locked(*info, nullptr, bus::connector_outcome::ok);
  if (link_.state_locked() != health_state::healthy)
    return finish_store_locked(*info, nullptr, bus::connector_outcome::unhealthy);
  link_.issue_locked(
      cid, call_kind::store, protocol::store_response::type, std::move(bytes), scaled(options_.timeouts.store_timeout),
      [this, info](pending_call&, call_result& r) { finish_store_locked(*info, &r, outcome_of(r.status)); });
}

template <class Bus>
void connector<Bus>::finish_store_locked(const store_info& info, const call_result* r, bus::connector_outcome outcome) {
  bus::connector_store_completed e{options_.rank, outcome, info.chunks};
  if (r != nullptr && r->status == call_status::reply) {
    const auto& s = std::get<protocol::store_response>(r->reply);
    e.stored_chunks = s.stored;
    e.already_present_chunks = s.already_present;
    e.failed_chunks = s.failed;
  }
  e.duration_ns = detail::elapsed_ns(info.started);
  tracker_.store_done(info.request_id);
  notify_waiters_locked();
  bus_.publish(e);
}

template <class Bus>
bool connector<Bus>::wait_stores(std::span<const std::string> request_ids, std::chrono::milliseconds timeout) {
  region_for("wait_stores");
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] {
    return std::none_of(request_ids.begin(), request_ids.end(),
                        [&](const std::string& id) { return tracker_.pending_stores(id) != 0; });
  });
}

template <class Bus>
finished_requests connector<Bus>::get_finished(std::span<const std::string> finished_by_engine) {
  std::lock_guard g(mu());
  // While unhealthy nothing is in flight (the edge released every call and new ones are
  // skipped), so this drains nothing; it is the rule's safety net.
  if (link_.state_locked() == health_state::unhealthy) tracker_.drain();
  return tracker_.take_finished(finished_by_engine);
}

template <class Bus>
std::vector<std::uint32_t> connector<Bus>::take_load_error_blocks() {
  std::lock_guard g(mu());
  std::vector<std::uint32_t> out = std::move(load_errors_);
  load_errors_.clear();
  for (std::uint32_t b : out) is_load_error_[b] = false;
  return out;
}

// ---------------------------------------------------------------------------------------
// Fencing
// ---------------------------------------------------------------------------------------

template <class Bus>
bool connector<Bus>::block_is_quarantined(std::uint32_t block) const {
  std::lock_guard g(mu());
  return quarantine_.contains(block);
}

template <class Bus>
std::vector<std::uint32_t> connector<Bus>::quarantined_blocks() const {
  std::lock_guard g(mu());
  return quarantine_.blocks();
}

template <class Bus>
bool connector<Bus>::block_reused(std::uint32_t block) {
  kv_region& region = region_for("block_reused");
  std::lock_guard g(mu());
  return reuse_block_locked(region, block);
}

template <class Bus>
std::vector<std::uint32_t> connector<Bus>::blocks_reused(std::span<const std::uint32_t> blocks) {
  kv_region& region = region_for("blocks_reused");
  std::vector<std::uint32_t> refused;
  std::lock_guard g(mu());
  for (std::uint32_t b : blocks)
    if (!reuse_block_locked(region, b)) refused.push_back(b);
  return refused;
}

template <class Bus>
bool connector<Bus>::reuse_block_locked(kv_region& region, std::uint32_t block) {
  if (block >= region.layout().num_blocks)
    throw std::out_of_range("kvtier::engine::connector::block_reused: block id out of range");
  if (quarantine_.contains(block)) return false;
  region.begin_reuse(block);
  return true;
}

template <class Bus>
bool connector<Bus>::wait_released(std::span<const std::uint32_t> blocks, std::chrono::milliseconds timeout) {
  region_for("wait_released");
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] {
    return std::none_of(blocks.begin(), blocks.end(), [&](std::uint32_t b) { return quarantine_.contains(b); });
  });
}

template <class Bus>
void connector<Bus>::publish_quarantine_locked(std::size_t held, std::size_t released) {
  if (released != 0) notify_waiters_locked();
  bus_.publish(bus::connector_quarantine_changed{options_.rank, static_cast<std::uint32_t>(held),
                                                 static_cast<std::uint32_t>(released),
                                                 static_cast<std::uint32_t>(quarantine_.size())});
}

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
