#pragma once
// session (server/session/session.hpp): the lookups of one connection.
//   lookup_request          checks it (model id, world size, max_lookups_per_client,
//                           max_lookup_keys, the key budgets of client_budget.hpp), starts the
//                           cache's lookup (its L1 prefix held at once, the rest prefetched in
//                           the background) and answers at once when decided at once (an
//                           L1 hit), else, when the request asks (answer_when_decided), once
//                           the prefetch is decided (hold_lookup_answer: one round trip, no
//                           polling), else `pending`;
//   query_prefetch_request  answers the decided hit count; a lookup still deciding is not
//                           answered `pending`: the handler defers its answer to
//                           answer_when_decided(), which answers once the prefetch decided;
//   free_lookup_locks, end  release the lookup's holds.
// Lookups are the engine's (lookup_table, keyed by this session's engine scope: scope_):
// any connection of the engine finds, replaces, frees and ends them; the connection that
// issued one carries its budget (max_lookups_per_client, the key budgets) and takes it
// along when it goes (release_owned_lookups). release_rank_holds gives back one rank's
// holds when its retrieve ended (impl/copy_requests.hpp).

#include <kvtier/server/session/session.hpp>
#include <kvtier/telemetry/log_escaped.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline reply_or_deferred session::on(const protocol::lookup_request& r, call& c) {
  auto reg_r = registered("lookup_request");
  if (!reg_r) return reg_r.error();
  const registration& reg = **reg_r;
  if (r.model_id != reg.model_id)
    return request_error{errc::invalid_argument, "lookup_request.model_id " + std::to_string(r.model_id) +
                                                     " is not this connection's model id " +
                                                     std::to_string(reg.model_id) + " (from register_kv_response)"};
  if (r.world_size != reg.world_size)
    return request_error{errc::invalid_argument, "lookup_request.world_size " + std::to_string(r.world_size) +
                                                     " differs from the registration's " +
                                                     std::to_string(reg.world_size)};
  // Lookups are this connection's engine's (lookup_table): another engine's request of the
  // same id is another lookup. A lookup of the same request by this engine is replaced; its
  // budget was its issuer's.
  const lookup_table::entry* existing = ctx_.lookups.find(scope_, r.request_key);
  const bool replaces_own = existing != nullptr && existing->owner == id_;
  if (!replaces_own && ctx_.lookups.owned(id_) >= ctx_.config.max_lookups_per_client)
    return request_error{errc::out_of_memory,
                         "this connection holds " + std::to_string(ctx_.lookups.owned(id_)) +
                             " lookups (max_lookups_per_client): send end_request for finished requests"};
  const std::size_t ws = reg.world_size;
  if (r.chunk_hashes.size() * ws > max_lookup_keys)
    return request_error{errc::invalid_argument, "lookup_request: " + std::to_string(r.chunk_hashes.size()) +
                                                     " chunks x world size " + std::to_string(ws) + " is above " +
                                                     std::to_string(max_lookup_keys) +
                                                     " keys: look up fewer chunks at once"};
  if (ctx_.budget)
    if (auto refused =
            ctx_.budget->check_lookup(ctx_.lookups, id_, std::uint64_t{r.chunk_hashes.size()} * ws,
                                      replaces_own ? lookup_table::keys_of(*existing) : 0, ctx_.clients.size()))
      return *refused;
  const std::uint64_t mid = request_model_id(reg, r.cache_salt);
  std::vector<chunk_key> keys;
  keys.reserve(r.chunk_hashes.size() * ws);
  for (const hash128& h : r.chunk_hashes)
    for (std::size_t rank = 0; rank < ws; ++rank)
      keys.push_back(chunk_key{mid, reg.world_size, static_cast<std::uint16_t>(rank), h});
  cache::lookup_request lr;
  lr.keys = keys;
  lr.group = ws;
  lr.object_bytes = reg.object_bytes;
  lr.chunk_tokens = reg.chunk.chunk_tokens;
  lr.request_id = request_id_of(r.request_key);
  lr.prefill_tokens_per_second = reg.prefill_tokens_per_second;  // load or recompute
  const auto id = ctx_.cache.start_lookup(lr);
  lookup_table::entry e{id, id_, static_cast<std::uint32_t>(r.chunk_hashes.size()), reg.world_size, mid,
                        r.chunk_hashes, std::vector<bool>(reg.world_size, false)};
  // The new lookup holds its locks before the old one gives its back: nothing the two
  // share can be evicted in between.
  if (auto old = ctx_.lookups.put(scope_, r.request_key, std::move(e))) {
    answer_held_lookup(r.request_key, {});  // the replaced lookup's answer, if held: unknown
    ctx_.cache.release_all(old->cache_id);
  }
  if (auto st = ctx_.cache.poll(id)) return lookup_done(*st);  // decided at once (an L1 hit)
  if (!r.answer_when_decided) return protocol::lookup_response{protocol::prefetch_state::pending, 0, 0};
  hold_lookup_answer(c.id, r.request_key, id, c.started);
  return reply_or_deferred::deferred();
}

inline reply_or_deferred session::on(const protocol::query_prefetch_request& r, call& c) {
  auto reg = registered("query_prefetch_request");
  if (!reg) return reg.error();
  const lookup_table::entry* e = ctx_.lookups.find(scope_, r.request_key);
  if (e == nullptr) return protocol::query_prefetch_response{protocol::prefetch_state::unknown, 0, 0};
  if (auto st = ctx_.cache.poll(e->cache_id)) return done_response(*st);
  if (ctx_.cache.known(e->cache_id)) {  // not decided yet: no polling on the wire, answered when it is
    boost::asio::co_spawn(conn_.get_executor(),
                          answer_when_decided(shared_from_this(), detail::waiting_request(waiting_), c.id,
                                              r.request_key, e->cache_id, c.started),
                          telemetry::log_escaped{&ctx_.log, "query_prefetch answer"});
    return reply_or_deferred::deferred();
  }
  ctx_.lookups.take(scope_, r.request_key);  // expired in the cache (lookup_ttl)
  return protocol::query_prefetch_response{protocol::prefetch_state::unknown, 0, 0};
}

inline protocol::query_prefetch_response session::done_response(const cache::lookup_status& st) {
  return protocol::query_prefetch_response{protocol::prefetch_state::done, static_cast<std::uint32_t>(st.chunks),
                                           static_cast<std::uint32_t>(st.l1_chunks)};
}

inline protocol::lookup_response session::lookup_done(const cache::lookup_status& st) {
  const auto q = done_response(st);
  return protocol::lookup_response{q.state, q.hit_chunks, q.l1_hit_chunks};
}

/// The answer to lookup `key` (call `call_id`), held until its prefetch (cache lookup
/// `cache_id`) is decided: no polling on the wire, one round trip. Answered earlier, with
/// `unknown`, when the lookup goes first (released, ended, replaced, unregistered:
/// answer_held_lookup); dropped when the connection closes.
inline void session::hold_lookup_answer(std::uint64_t call_id, std::string key, std::uint64_t cache_id,
                                        clock::time_point t0) {
  held_lookups_[key] = held_lookup{call_id, cache_id, t0};
  ctx_.cache.async_wait(cache_id,
                        boost::asio::bind_executor(conn_.get_executor(), [w = weak_from_this(), key, cache_id](
                                                                             error_code ec, cache::lookup_status st) {
                          if (auto self = w.lock())
                            self->answer_held_lookup(key, ec ? protocol::lookup_response{} : lookup_done(st), cache_id);
                        }));
}

/// Sends the held answer of lookup `key` (when it is lookup `cache_id`'s, if given).
inline void session::answer_held_lookup(const std::string& key, protocol::lookup_response reply,
                                        std::optional<std::uint64_t> cache_id) {
  auto it = held_lookups_.find(key);
  if (it == held_lookups_.end() || (cache_id && it->second.cache_id != *cache_id)) return;
  const held_lookup h = it->second;
  held_lookups_.erase(it);
  finish_request(bus::request_kind::lookup, true, h.t0);
  if (!closing_) conn_.async_send(h.call_id, protocol::message(reply), [](error_code) {});
}

/// The connection closed with lookup answers held: each request ends unanswered (its
/// server_request_finished, not ok), so that requests in flight go back to 0.
inline void session::drop_held_lookup_answers() {
  for (const auto& [key, h] : held_lookups_) finish_request(bus::request_kind::lookup, false, h.t0);
  held_lookups_.clear();
}

/// A query of a lookup still deciding: answered once it is decided (tiered_cache::
/// async_wait; the prefetch decides within its wait budget, prefetch_timeout_cap_ms at
/// most), while this connection's next frames are read and answered (answers carry their
/// call id). A lookup replaced meanwhile is waited for in its turn; one released or
/// reaped meanwhile answers unknown.
inline boost::asio::awaitable<void> session::answer_when_decided(std::shared_ptr<session> self,
                                                                 detail::waiting_request waiting, std::uint64_t call_id,
                                                                 std::string request_key, std::uint64_t cache_id,
                                                                 clock::time_point t0) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  (void)self;     // keeps the session alive until the answer went out
  (void)waiting;  // counts the query in requests_in_flight() until then (the frame owns it)
  protocol::query_prefetch_response reply{protocol::prefetch_state::unknown, 0, 0};
  for (;;) {
    auto [ec, st] = co_await ctx_.cache.async_wait(cache_id, as_tuple(use_awaitable));
    const lookup_table::entry* e = closing_ ? nullptr : ctx_.lookups.find(scope_, request_key);
    if (e == nullptr) break;        // released, ended, reaped
    if (e->cache_id != cache_id) {  // replaced by a newer lookup
      cache_id = e->cache_id;
      continue;
    }
    if (!ec) reply = done_response(st);
    break;
  }
  finish_request(bus::request_kind::query_prefetch, true, t0);
  if (!closing_) co_await conn_.async_send(call_id, protocol::message(reply), as_tuple(use_awaitable));
}

inline request_result<protocol::free_lookup_locks_response> session::on(const protocol::free_lookup_locks_request& r,
                                                                        call&) {
  auto reg = registered("free_lookup_locks_request");
  if (!reg) return reg.error();
  forget_lookup(r.request_key);
  return protocol::free_lookup_locks_response{};
}

inline request_result<protocol::end_request_response> session::on(const protocol::end_request_request& r, call&) {
  auto reg = registered("end_request_request");
  if (!reg) return reg.error();
  forget_lookup(r.request_key);
  return protocol::end_request_response{};
}

/// Releases this engine's lookup of `request_key` (none: nothing to do).
inline void session::forget_lookup(const std::string& request_key) {
  answer_held_lookup(request_key, {});
  if (auto e = ctx_.lookups.take(scope_, request_key)) ctx_.cache.release_all(e->cache_id);
}

/// Releases the lookups this connection issued (it unregisters, or changes engines).
inline void session::release_owned_lookups() {
  while (!held_lookups_.empty()) answer_held_lookup(held_lookups_.begin()->first, {});
  for (const auto& e : ctx_.lookups.take_owned_by(id_)) ctx_.cache.release_all(e.cache_id);
}

/// A retrieve of rank `rank` through this engine's lookup `request_key` (cache lookup
/// `cache_id`) ended: every hold of that rank in the lookup goes back, copied or not (the
/// copy gave back those of the chunks it was asked for; the rank's other chunks, which it
/// will never ask for, go now). The lookup stays (the scheduler may still query or end it);
/// once every rank retrieved it holds nothing. A lookup replaced or released meanwhile is
/// left alone.
inline void session::release_rank_holds(const std::string& request_key, std::uint64_t cache_id, std::uint16_t rank) {
  lookup_table::entry* e = ctx_.lookups.find(scope_, request_key);
  if (e == nullptr || e->cache_id != cache_id || rank >= e->world_size || e->ranks_retrieved[rank]) return;
  e->ranks_retrieved[rank] = true;
  std::vector<chunk_key> keys;
  keys.reserve(e->hashes.size());
  for (const hash128& h : e->hashes) keys.push_back(chunk_key{e->model_id, e->world_size, rank, h});
  ctx_.cache.release(cache_id, keys);
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
