#pragma once
// engine::connector, the scheduler side: lookups, their answers (lookup_result) and the
// notifications that release them (free_lookup_locks, end_request). Declarations and the
// contract: kvtier/engine/connector.hpp.

#include <kvtier/engine/connector.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

// ---------------------------------------------------------------------------------------
// Scheduler side
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::check_lookup(std::string_view request_id) const {
  if (!options_.is_scheduler())
    throw std::logic_error(
        "kvtier::engine::connector::lookup: only the scheduler's connector looks up "
        "(connector_options::scheduler)");
  check_request_id(request_id);
}

template <class Bus>
void connector<Bus>::lookup(std::string_view request_id, std::span<const token_id> tokens,
                            std::string_view cache_salt) {
  check_lookup(request_id);
  {
    std::lock_guard g(mu());
    if (lookups_.contains(std::string(request_id))) return;  // idempotent: do not even hash again
  }
  std::vector<hash128> hashes = hasher_.chunk_hashes(tokens);
  if (!options_.describe_chunks) return lookup_hashes(request_id, std::move(hashes), cache_salt);
  lookup_hashes(request_id, hashes, cache_salt);
  // After the lookup (its latency matters, the description's does not).
  describe_chunks(hashes, tokens, cache_salt);
}

template <class Bus>
void connector<Bus>::lookup_hashes(std::string_view request_id, std::vector<hash128> hashes,
                                   std::string_view cache_salt) {
  check_lookup(request_id);
  check_salt(cache_salt);
  if (hashes.size() > protocol::max_chunk_hashes)
    throw std::invalid_argument("kvtier::engine::connector: more than 65536 chunks in one lookup");
  std::string key(request_id);
  detail::issue_lock g(link_);
  auto [it, inserted] = lookups_.try_emplace(key);
  if (!inserted) return;
  lookup_entry& e = it->second;
  e.serial = next_lookup_serial_++;
  e.requested_chunks = static_cast<std::uint32_t>(hashes.size());
  e.started = clock::now();
  e.deadline = e.started + scaled(options_.timeouts.lookup_timeout);
  if (hashes.empty()) return answer_lookup_locked(key, e, 0, bus::connector_outcome::ok);
  if (link_.state_locked() != health_state::healthy)
    return answer_lookup_locked(key, e, 0, bus::connector_outcome::unhealthy);
  // One call: the server answers it when the prefetch is decided (at once for an L1 hit), so
  // a lookup costs one round trip and nothing wakes while the prefetch runs. Its deadline is
  // the lookup's.
  protocol::lookup_request req{
      key, link_.model_id_locked(), options_.world_size, std::move(hashes), std::string(cache_salt), true};
  const std::uint64_t cid = link_.next_call_id();
  link_.issue_locked(cid, call_kind::lookup, protocol::lookup_response::type, detail::server_link::encode(cid, req),
                     e.deadline - e.started, [this, key, serial = e.serial](pending_call&, call_result& r) {
                       on_lookup_reply_io(key, serial, r, true);
                     });
}

template <class Bus>
std::optional<std::size_t> connector<Bus>::lookup_result(std::string_view request_id) const {
  std::lock_guard g(mu());
  auto it = lookups_.find(std::string(request_id));
  if (it == lookups_.end()) return std::size_t{0};
  if (!it->second.answered) return std::nullopt;
  return it->second.tokens;
}

template <class Bus>
bool connector<Bus>::wait_lookups(std::span<const std::string> request_ids, std::chrono::microseconds timeout) {
  for (const std::string& id : request_ids) check_lookup(id);
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] {
    return std::none_of(request_ids.begin(), request_ids.end(), [&](const std::string& id) {
      auto it = lookups_.find(id);
      return it != lookups_.end() && !it->second.answered;
    });
  });
}

template <class Bus>
void connector<Bus>::free_lookup_locks(std::string_view request_id) {
  check_request_id(request_id);
  detail::issue_lock g(link_);
  send_notify_locked(protocol::free_lookup_locks_request{std::string(request_id)});
}

template <class Bus>
void connector<Bus>::end_request(std::string_view request_id) {
  check_request_id(request_id);
  detail::issue_lock g(link_);
  lookups_.erase(std::string(request_id));
  // Lazy: nothing waits for it, and waking the connector's thread for it would cost the
  // engine's thread more than the call (server_link::issue_locked).
  send_notify_locked(protocol::end_request_request{std::string(request_id)}, /*lazy=*/true);
}

template <class Bus>
template <class Msg>
void connector<Bus>::send_notify_locked(const Msg& m, bool lazy) {
  if (link_.state_locked() != health_state::healthy || link_.stopping_locked()) return;
  const std::uint64_t id = link_.next_call_id();
  link_.issue_locked(id, call_kind::notify, Msg::response_type::type, detail::server_link::encode(id, m),
                     scaled(options_.timeouts.request_timeout), {}, lazy);
}

template <class Bus>
typename connector<Bus>::lookup_entry* connector<Bus>::find_lookup_locked(const std::string& id, std::uint64_t serial) {
  auto it = lookups_.find(id);
  return it != lookups_.end() && it->second.serial == serial ? &it->second : nullptr;
}

template <class Bus>
void connector<Bus>::answer_lookup_locked(const std::string& id, lookup_entry& e, std::size_t tokens,
                                          bus::connector_outcome outcome) {
  e.answered = true;
  e.tokens = tokens;
  notify_waiters_locked();
  bus_.publish(bus::connector_lookup_completed{options_.rank, outcome, e.requested_chunks,
                                               static_cast<std::uint32_t>(tokens / options_.chunk_tokens),
                                               options_.chunk_tokens, detail::elapsed_ns(e.started)});
  answered_order_.emplace_back(id, e.serial);
  // Bound the answers kept: the oldest answered go first (e may be erased from here on).
  while (lookups_.size() > options_.max_lookups && !answered_order_.empty()) {
    auto [oid, os] = std::move(answered_order_.front());
    answered_order_.pop_front();
    auto it = lookups_.find(oid);
    if (it != lookups_.end() && it->second.serial == os && it->second.answered) lookups_.erase(it);
  }
  // Entries of answers already dropped (end_request) are compacted away, so the order list
  // stays within 2 x max_lookups however the engine behaves.
  if (answered_order_.size() > 2 * options_.max_lookups + 16) {
    std::deque<std::pair<std::string, std::uint64_t>> live;
    for (auto& [oid, os] : answered_order_) {
      auto it = lookups_.find(oid);
      if (it != lookups_.end() && it->second.serial == os) live.emplace_back(std::move(oid), os);
    }
    answered_order_ = std::move(live);
  }
}

template <class Bus>
void connector<Bus>::issue_query_locked(const std::string& id, std::uint64_t serial) {
  const lookup_entry* e = find_lookup_locked(id, serial);
  if (e == nullptr) return;
  // The server answers when the prefetch is decided (within its own wait budget); we wait
  // until the lookup's deadline at most.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(e->deadline - clock::now());
  const std::uint64_t cid = link_.next_call_id();
  link_.issue_locked(cid, call_kind::query, protocol::query_prefetch_response::type,
                     detail::server_link::encode(cid, protocol::query_prefetch_request{id}),
                     std::max(left, std::chrono::milliseconds(1)),
                     [this, id, serial](pending_call&, call_result& r) { on_lookup_reply_io(id, serial, r, false); });
}

template <class Bus>
void connector<Bus>::on_lookup_reply_io(const std::string& id, std::uint64_t serial, call_result& r, bool from_lookup) {
  lookup_entry* e = find_lookup_locked(id, serial);
  if (e == nullptr) {
    // end_request came first: make sure the server forgets the lookup it accepted.
    if (from_lookup && r.status == call_status::reply) send_notify_locked(protocol::end_request_request{id});
    return;
  }
  if (e->answered) return;
  if (r.status != call_status::reply) {
    answer_lookup_locked(id, *e, 0, outcome_of(r.status));
    // The server may hold locks for a lookup whose answer we gave up on.
    if (r.status == call_status::timeout) send_notify_locked(protocol::free_lookup_locks_request{id});
    return;
  }
  // The lookup's answer and a query's carry the same fields.
  auto prefetch = [](const auto& a) { return std::pair{a.state, a.hit_chunks}; };
  const auto [state, hit_chunks] = from_lookup ? prefetch(std::get<protocol::lookup_response>(r.reply))
                                               : prefetch(std::get<protocol::query_prefetch_response>(r.reply));
  switch (state) {
    case protocol::prefetch_state::done: {
      const std::size_t chunks = std::min<std::size_t>(hit_chunks, e->requested_chunks);
      return answer_lookup_locked(id, *e, chunks * options_.chunk_tokens, bus::connector_outcome::ok);
    }
    case protocol::prefetch_state::unknown:
      return answer_lookup_locked(id, *e, 0, bus::connector_outcome::failed);
    case protocol::prefetch_state::pending:
      break;
  }
  if (clock::now() >= e->deadline) {
    answer_lookup_locked(id, *e, 0, bus::connector_outcome::timeout);
    send_notify_locked(protocol::free_lookup_locks_request{id});
    return;
  }
  // `pending`: the server answered before the decision (one that answers at once, or whose
  // wait ended first): ask with query_prefetch, which it answers when decided. No timer.
  if (link_.state_locked() == health_state::healthy) issue_query_locked(id, serial);
}

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
