#pragma once
// session (server/session/session.hpp): the administration requests (docs/server.md,
// "Administration"; the `kvtier` program sends them):
//
//   list_objects_request  the objects of L1 and of every L2 backend, per model namespace (the
//                         model id of their chunk keys) and tier: objects and bytes, with the
//                         model name and salts the server learned for each id
//                         (model_namespaces.hpp; "known": false for ids it has not met since
//                         it started);
//   evict_request         removes the objects of a selection (all; or model name, request
//                         salt, model id, together) from the tiers named (default: every one).
//
// Who: the server's owner (its effective uid) and root only, by the connection's peer uid
// (SO_PEERCRED). Another user admitted by allowed_uids / allowed_gids may register and look
// up but is refused these with errc::permission_denied. No registration is needed: an
// operator does not bring a KV region.
//
// Removal never takes bytes from under a reader, and never lets a wrong byte be served:
//   - L1 (l1::tier::remove_if): an unlocked object goes at once; a locked one (a lookup's or
//     copy's read hold, a write or load in flight) is kept and counted in use, or with
//     `force` leaves the index at once while its memory waits for its last lock;
//   - L2: the objects the backend lists under the selection are removed with async_remove,
//     whose rule keeps what a prefetch pinned (`rejected`: counted in use) and what is being
//     stored (the disk backend's `writing` entries are not listed). A load that races a
//     removal finds the object gone (not_found: the engine recomputes); every load checks the
//     object's header and checksum, so it never serves another object's bytes.
// An object whose store to L2 was in flight may land in L2 after the eviction answered (its
// L1 copy was locked by the store, so it was counted in use): list again, or stop the
// engines first, when nothing may stay.
//
// Both requests await the L2 backends on the I/O thread's executor (the lane of this
// connection waits; every other connection is served meanwhile), each backend operation
// bounded by admin_deadline, and stop between batches when the connection closes.

#include <kvtier/protocol/unix_socket.hpp>
#include <kvtier/server/session/session.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

namespace detail {

/// A model id as the administration requests write it: 16 lowercase hex digits.
[[nodiscard]] inline std::string model_id_hex(std::uint64_t id) { return fmt::format("{:016x}", id); }

/// Objects and bytes of one tier.
struct tier_usage {
  std::uint64_t objects = 0;
  std::uint64_t bytes = 0;
};

}  // namespace detail

inline std::optional<request_error> session::admin_refusal(std::string_view what) {
  auto peer = protocol::peer_credentials(conn_.socket().native_handle());
  if (!peer)
    return request_error{errc::permission_denied, std::string(what) +
                                                      ": cannot read this connection's peer credentials (" +
                                                      peer.error().message() + ")"};
  const ::uid_t owner = ::geteuid();
  if (peer->uid == owner || peer->uid == 0) return std::nullopt;
  return request_error{errc::permission_denied,
                       fmt::format("{} is for the server's owner (uid {}) and root; this connection's user (uid {}) may "
                                   "register and look up, not list or remove objects: run kvtier as uid {} or root",
                                   what, owner, peer->uid, owner)};
}

inline boost::asio::awaitable<request_result<protocol::list_objects_response>> session::on(
    const protocol::list_objects_request&, call&) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  using nlohmann::json;
  if (auto refused = admin_refusal("list_objects_request")) co_return *refused;
  const std::span<l2::any_backend> backends = ctx_.cache.backends();
  const std::size_t tiers = 1 + backends.size();  // 0: L1, 1 + b: backend b
  std::vector<std::string> tier_names{"l1"};
  for (const auto& b : backends) tier_names.emplace_back(b.name());
  std::map<std::uint64_t, std::vector<detail::tier_usage>> by_id;
  auto count = [&](std::size_t tier, std::uint64_t id, std::uint64_t bytes) {
    auto& v = by_id[id];
    if (v.empty()) v.resize(tiers);
    ++v[tier].objects;
    v[tier].bytes += bytes;
  };
  ctx_.cache.visit_l1([&](const chunk_key& k, std::size_t bytes) { count(0, k.model_id, bytes); });
  json errors = json::object();
  const l2::key_filter every;  // (a named local: g++ 12 refuses a braced list in a co_await)
  for (std::size_t b = 0; b < backends.size(); ++b) {
    auto [ec, listed] =
        co_await backends[b].async_list(every, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
    if (closing_) co_return closing_error("list_objects_request");
    if (ec) {
      errors[tier_names[1 + b]] = "cannot list its objects: " + ec.message();
      continue;
    }
    for (const auto& o : listed) count(1 + b, o.key.model_id, o.bytes);
  }

  std::vector<detail::tier_usage> totals(tiers);
  std::vector<std::pair<std::uint64_t, json>> spaces;  // (bytes, namespace)
  for (const auto& [id, per_tier] : by_id) {
    json n;
    n["model_id"] = detail::model_id_hex(id);
    const model_namespaces::entry* e = ctx_.namespaces.find(id);
    n["known"] = e != nullptr;
    n["model"] = e ? json(e->model_name) : json(nullptr);
    n["cache_salt"] = e ? json(e->cache_salt) : json(nullptr);
    n["deployment_salt"] = e ? json(e->deployment_salt) : json(nullptr);
    n["base_model_id"] = e ? json(detail::model_id_hex(e->base_model_id)) : json(nullptr);
    n["dtype"] = e ? json(std::string(name(e->dtype))) : json(nullptr);
    n["layout"] = e ? json(std::string(name(e->layout))) : json(nullptr);
    json t = json::object();
    std::uint64_t objects = 0, bytes = 0;
    for (std::size_t i = 0; i < tiers; ++i) {
      if (per_tier[i].objects == 0) continue;
      t[tier_names[i]] = {{"objects", per_tier[i].objects}, {"bytes", per_tier[i].bytes}};
      objects += per_tier[i].objects;
      bytes += per_tier[i].bytes;
      totals[i].objects += per_tier[i].objects;
      totals[i].bytes += per_tier[i].bytes;
    }
    n["tiers"] = std::move(t);
    n["objects"] = objects;
    n["bytes"] = bytes;
    spaces.emplace_back(bytes, std::move(n));
  }
  // Largest first; ties by id (the map's order), so the order is stable.
  std::stable_sort(spaces.begin(), spaces.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  json j;
  j["tiers"] = tier_names;
  json t = json::object();
  for (std::size_t i = 0; i < tiers; ++i) t[tier_names[i]] = {{"objects", totals[i].objects}, {"bytes", totals[i].bytes}};
  j["totals"] = std::move(t);
  j["errors"] = std::move(errors);
  json list = json::array();
  for (auto& [bytes, n] : spaces) list.push_back(std::move(n));
  j["namespaces"] = std::move(list);
  std::string text = j.dump();
  // Thousands of namespaces (unknown ids of a shared Redis): keep the largest that fit.
  std::size_t dropped = 0;
  while (text.size() > protocol::max_status_json_bytes && !j["namespaces"].empty()) {
    const std::size_t cut = std::max<std::size_t>(1, j["namespaces"].size() / 8);
    for (std::size_t i = 0; i < cut; ++i) j["namespaces"].erase(j["namespaces"].size() - 1);
    dropped += cut;
    j["namespaces_truncated"] = dropped;
    text = j.dump();
  }
  co_return protocol::list_objects_response{std::move(text)};
}

inline boost::asio::awaitable<request_result<protocol::evict_response>> session::on(
    const protocol::evict_request& r, call&) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  using nlohmann::json;
  if (auto refused = admin_refusal("evict_request")) co_return *refused;
  const bool selects = r.by_model || r.by_salt || r.by_model_id;
  if (r.all && selects)
    co_return request_error{errc::invalid_argument,
                            "evict_request: `all` and a selection (model, salt, model id) exclude each other: send "
                            "one of them"};
  if (!r.all && !selects)
    co_return request_error{errc::invalid_argument,
                            "evict_request selects nothing: set `all`, or a model name, a salt or a model id"};

  // The tiers: "l1" and the backends' names, comma-separated; empty: every tier.
  const std::span<l2::any_backend> backends = ctx_.cache.backends();
  bool with_l1 = r.tiers.empty();
  std::vector<std::size_t> chosen;
  if (r.tiers.empty()) {
    for (std::size_t b = 0; b < backends.size(); ++b) chosen.push_back(b);
  } else {
    std::string known = "l1";
    for (const auto& b : backends) known += ", " + std::string(b.name());
    const std::string_view list = r.tiers;
    for (std::size_t at = 0;;) {
      const auto comma = list.find(',', at);
      std::string_view t = list.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
      while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
      while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
      if (t == "l1") {
        with_l1 = true;
      } else {
        std::size_t b = 0;
        while (b < backends.size() && backends[b].name() != t) ++b;
        if (b == backends.size())
          co_return request_error{errc::invalid_argument,
                                  fmt::format("evict_request.tiers: no tier named '{}' in '{}': this server has {}", t,
                                              list, known)};
        if (std::find(chosen.begin(), chosen.end(), b) == chosen.end()) chosen.push_back(b);
      }
      if (comma == std::string_view::npos) break;
      at = comma + 1;
    }
  }

  // The selection as a key filter. Names and salts resolve to the ids the server learned
  // (model_namespaces.hpp) now, on this thread: the filter runs on the backends' executors
  // and touches nothing of the session.
  struct selection {
    bool by_id = false;
    std::uint64_t id = 0;
    bool by_names = false;
    std::unordered_set<std::uint64_t> named;
  };
  auto sel = std::make_shared<selection>();
  sel->by_id = r.by_model_id;
  sel->id = r.model_id;
  if (r.by_model || r.by_salt) {
    sel->by_names = true;
    ctx_.namespaces.for_each([&](std::uint64_t id, const model_namespaces::entry& e) {
      if (r.by_model && e.model_name != r.model_name) return;
      if (r.by_salt && e.cache_salt != r.cache_salt) return;
      sel->named.insert(id);
    });
  }
  const l2::key_filter selected = [sel = std::shared_ptr<const selection>(sel)](const chunk_key& k) {
    if (sel->by_id && k.model_id != sel->id) return false;
    if (sel->by_names && !sel->named.contains(k.model_id)) return false;
    return true;
  };

  protocol::evict_response out;
  json tiers_json = json::array();
  auto report = [&](std::string tier, std::uint64_t removed, std::uint64_t bytes, std::uint64_t in_use,
                    std::uint64_t failed, std::string error) {
    out.removed_objects += removed;
    out.removed_bytes += bytes;
    out.in_use_objects += in_use;
    out.failed_objects += failed;
    tiers_json.push_back({{"tier", std::move(tier)},
                          {"removed_objects", removed},
                          {"removed_bytes", bytes},
                          {"in_use_objects", in_use},
                          {"failed_objects", failed},
                          {"error", std::move(error)}});
  };
  if (with_l1) {
    const l1::removal_summary s = ctx_.cache.remove_l1_if(selected, r.force);
    report("l1", s.removed, s.removed_bytes, s.locked, 0, {});
  }
  for (const std::size_t b : chosen) {
    l2::any_backend& backend = backends[b];
    std::string tier(backend.name());
    auto [ec, listed] =
        co_await backend.async_list(selected, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
    if (closing_) co_return closing_error("evict_request");
    if (ec) {
      report(std::move(tier), 0, 0, 0, 0, "cannot list its objects: " + ec.message());
      continue;
    }
    std::uint64_t removed = 0, bytes = 0, in_use = 0, failed = 0;
    std::string error;
    // Batches bound one backend operation (a Redis pipeline, a disk unlink fan-out).
    constexpr std::size_t per_batch = 1024;
    for (std::size_t first = 0; first < listed.size(); first += per_batch) {
      const std::size_t n = std::min(per_batch, listed.size() - first);
      std::vector<chunk_key> keys;
      keys.reserve(n);
      for (std::size_t i = 0; i < n; ++i) keys.push_back(listed[first + i].key);
      auto [rec, res] =
          co_await backend.async_remove(keys, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
      if (closing_) co_return closing_error("evict_request");
      for (std::size_t i = 0; i < n; ++i) {
        const l2::key_outcome o = i < res.size() ? res.outcomes[i] : l2::key_outcome::timeout;
        if (o == l2::key_outcome::ok) {
          ++removed;
          bytes += listed[first + i].bytes;
        } else if (o == l2::key_outcome::rejected) {
          ++in_use;  // pinned by a prefetch, or a store in flight
        } else if (o != l2::key_outcome::not_found) {  // not_found: gone meanwhile
          ++failed;
          if (error.empty()) error = std::string(l2::name(o)) + (rec ? " (" + rec.message() + ")" : std::string());
        }
      }
    }
    report(std::move(tier), removed, bytes, in_use, failed, std::move(error));
  }

  std::string what = r.all ? std::string("every object") : std::string();
  if (r.by_model) what += fmt::format("model '{}'", r.model_name);
  if (r.by_salt) what += fmt::format("{}salt '{}'", what.empty() ? "" : ", ", r.cache_salt);
  if (r.by_model_id) what += fmt::format("{}model id {}", what.empty() ? "" : ", ", detail::model_id_hex(r.model_id));
  ctx_.log.info("client {}: evicted {} ({}{}): {} objects, {} bytes removed, {} in use kept, {} failed", id_, what,
                r.tiers.empty() ? std::string("every tier") : "tiers " + r.tiers, r.force ? ", forced" : "",
                out.removed_objects, out.removed_bytes, out.in_use_objects, out.failed_objects);
  out.json = json{{"tiers", std::move(tiers_json)}}.dump();
  co_return out;
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
