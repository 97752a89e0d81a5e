#pragma once
// The operations of l2::redis_backend (lookup_and_pin, load, store, remove, list) as
// coroutines on the client's strand: one command per key in one redis_batch, then each key's
// outcome from its reply, every failure counted and logged once per operation (the tally).
// See l2/redis/redis_backend.hpp for the semantics.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/redis/detail/redis_batch.hpp>
#include <kvtier/l2/redis/detail/redis_client.hpp>
#include <kvtier/l2/redis/redis_stats.hpp>
#include <kvtier/l2/types.hpp>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/this_coro.hpp>

#include <hiredis.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

using redis_lookup_tuple = std::tuple<error_code, bitmap>;
using redis_batch_tuple = std::tuple<error_code, batch_result>;
using redis_list_tuple = std::tuple<error_code, std::vector<listed_object>>;

/// The failures of one operation, by kind, reported together when it ends.
struct redis_outcome_tally {
  std::size_t answered = 0, unavailable = 0, timeout = 0, server = 0, oom = 0, redirect_limit = 0, corrupt = 0;
  std::string last_error;
};

/// The outcome of a command that got no usable answer, counted in the tally.
[[nodiscard]] inline key_outcome redis_failure_outcome(const redis_batch::item& it, redis_outcome_tally& t) {
  if (!it.done || it.timed_out) {
    ++t.timeout;
    return key_outcome::timeout;
  }
  const auto& e = it.result;
  if (e.st == redis_reply_event::status::failed) {
    ++t.unavailable;
    t.last_error = e.text;
    return key_outcome::unavailable;
  }
  if (e.st == redis_reply_event::status::error) {
    t.last_error = e.text;
    const std::string_view s = e.text;
    if (s.starts_with("OOM")) {
      ++t.oom;
      return key_outcome::no_space;
    }
    if (s.starts_with("MOVED") || s.starts_with("ASK")) {
      ++t.redirect_limit;
      return key_outcome::io_error;
    }
    // Not this key's fault: the node cannot serve now (cluster down, loading, a replica, a
    // script running) or this client may not (no AUTH: Redis 7 refuses even to read a
    // large argument from an unauthenticated client, "unauthenticated bulk length").
    for (std::string_view down :
         {"CLUSTERDOWN", "LOADING", "MASTERDOWN", "TRYAGAIN", "NOAUTH", "WRONGPASS", "READONLY", "BUSY", "NOPERM"})
      if (s.starts_with(down)) {
        ++t.unavailable;
        return key_outcome::unavailable;
      }
    if (s.find("unauthenticated") != std::string_view::npos) {
      ++t.unavailable;
      return key_outcome::unavailable;
    }
  }
  ++t.server;
  return key_outcome::io_error;
}

inline void redis_report_tally(redis_client& c, const redis_outcome_tally& t, std::string_view op) {
  const std::string why = std::string(op) + (t.last_error.empty() ? "" : ": " + t.last_error);
  c.report(redis_error_kind::timeout, t.timeout, std::string(op) + ": deadline passed");
  c.report(redis_error_kind::unavailable, t.unavailable, why);
  c.report(redis_error_kind::server, t.server, why);
  c.report(redis_error_kind::oom, t.oom, why);
  c.report(redis_error_kind::redirect_limit, t.redirect_limit, why);
  c.report(redis_error_kind::corrupt, t.corrupt, std::string(op) + ": stored value failed its check; deleted");
}

/// The error of an operation whose batch gave up (ec: the deadline or the caller).
[[nodiscard]] inline error_code redis_batch_error(const error_code& ec) noexcept {
  return ec == boost::asio::error::operation_aborted ? ec : make_error_code(errc::timeout);
}

/// The answer of a load, store or remove of `sent` keys once its batch ran.
[[nodiscard]] inline redis_batch_tuple redis_batch_answer(const error_code& ec, const redis_outcome_tally& t,
                                                          std::size_t sent, batch_result r) {
  if (ec) return {redis_batch_error(ec), std::move(r)};
  if (sent > 0 && t.unavailable == sent) return {make_error_code(errc::backend_unavailable), std::move(r)};
  return {error_code{}, std::move(r)};
}

/// The answer of a load, store or remove refused before it starts (buffers that do not
/// match the keys, a client shut down), or nullopt.
[[nodiscard]] inline std::optional<redis_batch_tuple> redis_refuse(const redis_client& c, std::size_t keys,
                                                                   std::size_t buffers) {
  if (keys != buffers)
    return redis_batch_tuple{make_error_code(errc::invalid_argument), batch_result(keys, key_outcome::timeout)};
  if (c.is_shut_down())
    return redis_batch_tuple{make_error_code(errc::shutting_down), batch_result(keys, key_outcome::unavailable)};
  return std::nullopt;
}

/// EXISTS per key; pins the keys found.
inline boost::asio::awaitable<redis_lookup_tuple> redis_lookup(std::shared_ptr<redis_client> self,
                                                               std::span<const chunk_key> keys, deadline d) {
  co_await boost::asio::this_coro::throw_if_cancelled(false);  // a cancelled batch answers operation_aborted
  auto& c = *self;
  const std::size_t n = keys.size();
  if (c.is_shut_down()) co_return redis_lookup_tuple{make_error_code(errc::shutting_down), bitmap(n)};
  redis_batch b(c, d);
  for (const auto& k : keys) b.add(redis_batch::command::exists, c.key_of(k));
  const error_code ec = co_await b.run();
  bitmap found(n);
  redis_outcome_tally tally;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& it = b.items()[i];
    if (it.done && it.result.st == redis_reply_event::status::reply && it.result.reply->type == REDIS_REPLY_INTEGER) {
      if (it.result.reply->integer > 0) found.set(i);
      ++tally.answered;
      continue;
    }
    (void)redis_failure_outcome(it, tally);
  }
  redis_report_tally(c, tally, "lookup");
  if (ec) co_return redis_lookup_tuple{redis_batch_error(ec), bitmap(n)};
  if (n > 0 && tally.answered == 0)
    co_return redis_lookup_tuple{make_error_code(tally.unavailable == n ? errc::backend_unavailable : errc::io_error),
                                 bitmap(n)};
  c.pin(keys, found);
  co_return redis_lookup_tuple{error_code{}, std::move(found)};
}

/// GET per key, straight into the destinations; a corrupt value is deleted before answering.
inline boost::asio::awaitable<redis_batch_tuple> redis_load(std::shared_ptr<redis_client> self,
                                                            std::span<const chunk_key> keys,
                                                            std::span<const std::span<std::byte>> dst, deadline d) {
  co_await boost::asio::this_coro::throw_if_cancelled(false);  // a cancelled batch answers operation_aborted
  auto& c = *self;
  const std::size_t n = keys.size();
  if (auto refused = redis_refuse(c, n, dst.size())) co_return std::move(*refused);
  batch_result r(n, key_outcome::timeout);
  redis_batch b(c, d);
  for (std::size_t i = 0; i < n; ++i) {
    auto& it = b.add(redis_batch::command::get, c.key_of(keys[i]));
    it.dst = dst[i];
    it.expect = keys[i];
  }
  const error_code ec = co_await b.run();
  redis_outcome_tally tally;
  std::vector<std::string> corrupt;
  std::vector<chunk_key> corrupt_keys;
  for (std::size_t i = 0; i < n; ++i) {
    auto& it = b.items()[i];
    using st = redis_reply_event::status;
    if (it.done && it.result.st == st::object_ok)
      r.outcomes[i] = key_outcome::ok;
    else if (it.done && it.result.st == st::object_nil)
      r.outcomes[i] = key_outcome::not_found;
    else if (it.done && it.result.st == st::object_size)
      r.outcomes[i] = key_outcome::rejected;
    else if (it.done && it.result.st == st::object_corrupt) {
      r.outcomes[i] = key_outcome::corrupt;
      corrupt.push_back(it.key);
      corrupt_keys.push_back(keys[i]);
      ++tally.corrupt;
    } else {
      r.outcomes[i] = redis_failure_outcome(it, tally);
      continue;
    }
    ++tally.answered;
  }
  redis_report_tally(c, tally, "load");
  if (!corrupt.empty() && !ec) {
    // A corrupt value is never served and is dropped, so that the next lookup misses it
    // (the caller may look it up again as soon as we answer: delete before answering).
    redis_batch del(c, d);
    for (std::size_t j = 0; j < corrupt.size(); ++j) {
      auto& it = del.add(redis_batch::command::del, std::move(corrupt[j]));
      it.expect = corrupt_keys[j];
      it.tell = true;
      it.removal = bus::key_removal::corrupt;
    }
    co_await del.run();
  }
  co_return redis_batch_answer(ec, tally, n, std::move(r));
}

/// SET NX per key: header (with the payload checksum), then the caller's bytes.
inline boost::asio::awaitable<redis_batch_tuple> redis_store(std::shared_ptr<redis_client> self,
                                                             std::span<const chunk_key> keys,
                                                             std::span<const std::span<const std::byte>> src,
                                                             deadline d) {
  co_await boost::asio::this_coro::throw_if_cancelled(false);  // a cancelled batch answers operation_aborted
  auto& c = *self;
  const std::size_t n = keys.size();
  if (auto refused = redis_refuse(c, n, src.size())) co_return std::move(*refused);
  batch_result r(n, key_outcome::timeout);
  if (clock::now() >= d) co_return redis_batch_tuple{make_error_code(errc::timeout), r};
  redis_batch b(c, d);
  for (std::size_t i = 0; i < n; ++i) {
    auto& it = b.add(redis_batch::command::set, c.key_of(keys[i]));
    it.expect = keys[i];
    it.tell = true;
    object_header h;
    h.key = keys[i];
    h.payload_bytes = src[i].size();
    h.payload_checksum = payload_checksum(src[i]);
    encode_header(h, it.header);
    it.payload = src[i];
  }
  const error_code ec = co_await b.run();
  redis_outcome_tally tally;
  std::uint64_t stored = 0, stored_bytes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& it = b.items()[i];
    if (it.done && it.result.st == redis_reply_event::status::reply) {
      const int t = it.result.reply->type;
      if (t == REDIS_REPLY_STATUS) {
        r.outcomes[i] = key_outcome::ok;
        ++stored;
        stored_bytes += object_header_bytes + src[i].size();
      } else if (t == REDIS_REPLY_NIL) {
        r.outcomes[i] = key_outcome::exists;  // SET NX found the key
      } else {
        r.outcomes[i] = key_outcome::io_error;
        ++tally.server;
        continue;
      }
      ++tally.answered;
      continue;
    }
    r.outcomes[i] = redis_failure_outcome(it, tally);
  }
  redis_report_tally(c, tally, "store");
  if (stored > 0) c.note_mutation(static_cast<std::int64_t>(stored), static_cast<std::int64_t>(stored_bytes));
  co_return redis_batch_answer(ec, tally, n, std::move(r));
}

/// DEL per key not pinned here (`rejected` for the pinned ones).
inline boost::asio::awaitable<redis_batch_tuple> redis_remove(std::shared_ptr<redis_client> self,
                                                              std::span<const chunk_key> keys, deadline d) {
  co_await boost::asio::this_coro::throw_if_cancelled(false);  // a cancelled batch answers operation_aborted
  auto& c = *self;
  const std::size_t n = keys.size();
  if (auto refused = redis_refuse(c, n, n)) co_return std::move(*refused);
  batch_result r(n, key_outcome::timeout);
  // Pinned here (a prefetch of this process is about to load it): not removed.
  std::vector<std::size_t> sent;
  const std::vector<bool> pinned = c.pinned(keys);
  for (std::size_t i = 0; i < n; ++i) {
    if (pinned[i]) r.outcomes[i] = key_outcome::rejected;
    else sent.push_back(i);
  }
  redis_batch b(c, d);
  for (auto i : sent) {
    auto& it = b.add(redis_batch::command::del, c.key_of(keys[i]));
    it.expect = keys[i];
    it.tell = true;  // deleted
  }
  const error_code ec = co_await b.run();
  redis_outcome_tally tally;
  std::uint64_t removed = 0;
  for (std::size_t j = 0; j < sent.size(); ++j) {
    const auto& it = b.items()[j];
    const std::size_t i = sent[j];
    if (it.done && it.result.st == redis_reply_event::status::reply && it.result.reply->type == REDIS_REPLY_INTEGER) {
      r.outcomes[i] = it.result.reply->integer > 0 ? key_outcome::ok : key_outcome::not_found;
      removed += it.result.reply->integer > 0 ? 1 : 0;
      ++tally.answered;
      continue;
    }
    r.outcomes[i] = redis_failure_outcome(it, tally);
  }
  redis_report_tally(c, tally, "remove");
  if (removed > 0) c.note_mutation(-static_cast<std::int64_t>(removed), 0);
  co_return redis_batch_answer(ec, tally, sent.size(), std::move(r));
}

/// The SCAN MATCH pattern of the keys under `prefix`: the prefix taken literally (glob
/// characters escaped), then ":*".
[[nodiscard]] inline std::string redis_scan_pattern(std::string_view prefix) {
  std::string p;
  p.reserve(prefix.size() + 2);
  for (const char ch : prefix) {
    if (ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\') p += '\\';
    p += ch;
  }
  p += ":*";
  return p;
}

/// The error of a listing that failed at item `it` (`what`: the command), reported as the
/// other operations report theirs.
inline error_code redis_list_failure(redis_client& c, const redis_batch::item& it, std::string_view what) {
  redis_outcome_tally tally;
  if (it.done && it.result.st == redis_reply_event::status::reply) {
    ++tally.server;
    tally.last_error = std::string(what) + ": unexpected reply";
  } else {
    (void)redis_failure_outcome(it, tally);
  }
  redis_report_tally(c, tally, "list");
  return make_error_code(tally.unavailable > 0 ? errc::backend_unavailable : errc::io_error);
}

/// The reply to a SCAN, or null when it is not [cursor, [names...]].
inline const redisReply* redis_scan_reply(const redis_batch::item& it) {
  const redisReply* r = it.done && it.result.st == redis_reply_event::status::reply ? it.result.reply.get() : nullptr;
  if (r == nullptr || r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
      r->element[1]->type != REDIS_REPLY_ARRAY)
    return nullptr;
  return r;
}

/// Appends the objects of a SCAN page that the filter accepts and that were not seen before.
inline void redis_collect_page(redis_client& c, const redisReply& page, const key_filter& filter,
                               std::unordered_set<chunk_key, chunk_key_hash>& seen, std::vector<chunk_key>& keys,
                               std::vector<std::string>& names) {
  for (std::size_t i = 0; i < page.elements; ++i) {
    if (page.element[i]->type != REDIS_REPLY_STRING) continue;
    const std::string_view name = redis_reply_text(*page.element[i]);
    const auto k = c.parse_key(name);
    if (!k || (filter && !filter(*k)) || !seen.insert(*k).second) continue;
    keys.push_back(*k);
    names.emplace_back(name);
  }
}

/// SCAN ... MATCH <prefix>:* COUNT 1000 on every node of the keyspace until its cursor comes
/// back to 0, keeping the keys of objects (parse_key) the filter accepts; then STRLEN per key
/// (the value's bytes, header included), pipelined 1024 at a time. A key gone before its
/// STRLEN (0) is left out. Any failure (a node down, the deadline) completes with its error
/// and nothing: a partial listing would read as "these are all".
inline boost::asio::awaitable<redis_list_tuple> redis_list(std::shared_ptr<redis_client> self, key_filter filter,
                                                           deadline d) {
  co_await boost::asio::this_coro::throw_if_cancelled(false);  // a cancelled batch answers operation_aborted
  auto& c = *self;
  std::vector<listed_object> out;
  if (c.is_shut_down()) co_return redis_list_tuple{make_error_code(errc::shutting_down), std::move(out)};
  const std::vector<redis_node*> nodes = c.keyspace_nodes();
  if (nodes.empty()) co_return redis_list_tuple{make_error_code(errc::backend_unavailable), std::move(out)};
  const std::string pattern = redis_scan_pattern(c.options().key_prefix);
  std::vector<chunk_key> keys;
  std::vector<std::string> names;
  std::unordered_set<chunk_key, chunk_key_hash> seen;  // SCAN may return a key twice
  for (redis_node* n : nodes) {
    std::string cursor = "0";
    do {
      redis_batch b(c, d);
      auto& scan = b.add(redis_batch::command::raw);
      scan.fixed = n;
      scan.args = {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"};
      if (const error_code ec = co_await b.run()) co_return redis_list_tuple{redis_batch_error(ec), {}};
      const auto& it = b.items().front();
      const redisReply* r = redis_scan_reply(it);
      if (r == nullptr) co_return redis_list_tuple{redis_list_failure(c, it, "SCAN on " + n->name), {}};
      cursor = std::string(redis_reply_text(*r->element[0]));
      redis_collect_page(c, *r->element[1], filter, seen, keys, names);
    } while (cursor != "0");
  }
  constexpr std::size_t per_batch = 1024;
  out.reserve(keys.size());
  for (std::size_t first = 0; first < keys.size(); first += per_batch) {
    const std::size_t n = std::min(per_batch, keys.size() - first);
    redis_batch b(c, d);
    for (std::size_t j = 0; j < n; ++j) {
      auto& it = b.add(redis_batch::command::raw, names[first + j]);
      it.args = {"STRLEN", names[first + j]};
    }
    if (const error_code ec = co_await b.run()) co_return redis_list_tuple{redis_batch_error(ec), {}};
    for (std::size_t j = 0; j < n; ++j) {
      const auto& it = b.items()[j];
      if (!it.done || it.result.st != redis_reply_event::status::reply ||
          it.result.reply->type != REDIS_REPLY_INTEGER)
        co_return redis_list_tuple{redis_list_failure(c, it, "STRLEN"), {}};
      if (it.result.reply->integer > 0)
        out.push_back({keys[first + j], static_cast<std::uint64_t>(it.result.reply->integer)});
    }
  }
  co_return redis_list_tuple{error_code{}, std::move(out)};
}

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
