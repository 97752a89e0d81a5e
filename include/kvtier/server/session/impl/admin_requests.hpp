#pragma once
// session (server/session/session.hpp): the administration requests, which the `kvtier`
// program sends:
//   list_objects_request  the objects of L1 and of every L2 backend, per model namespace
//                         (model_namespaces.hpp) and tier;
//   evict_request         removes the objects of a selection from the tiers named;
//   list_keys_request     the chunk keys of one tier (what a router's index of the KV events
//                         is checked against: docs/kv-events.md).
// For the server's owner and root only (admin_refusal). docs/server.md, "Administration",
// has what each answers, how a removal never takes bytes from under a reader, and the
// bounds (admin_deadline per backend operation, batches, a closing connection).

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

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

namespace detail {

/// A model id as the administration requests write it: 16 lowercase hex digits.
[[nodiscard]] inline std::string model_id_hex(std::uint64_t id) { return fmt::format("{:016x}", id); }

/// Objects and bytes of one tier.
struct tier_usage {
  std::uint64_t objects = 0;
  std::uint64_t bytes = 0;

  void add(const tier_usage& o) noexcept {
    objects += o.objects;
    bytes += o.bytes;
  }
};

/// One model namespace of a listing: what the server learned of its id (`e`, null when it
/// has not met it since it started) and its objects per tier (`per_tier[i]`: tier_names[i]).
[[nodiscard]] inline nlohmann::json namespace_json(std::uint64_t id, const model_namespaces::entry* e,
                                                   const std::vector<tier_usage>& per_tier,
                                                   const std::vector<std::string>& tier_names) {
  using nlohmann::json;
  json n;
  n["model_id"] = model_id_hex(id);
  n["known"] = e != nullptr;
  n["model"] = e ? json(e->model_name) : json(nullptr);
  n["cache_salt"] = e ? json(e->cache_salt) : json(nullptr);
  n["deployment_salt"] = e ? json(e->deployment_salt) : json(nullptr);
  n["base_model_id"] = e ? json(model_id_hex(e->base_model_id)) : json(nullptr);
  n["dtype"] = e ? json(std::string(name(e->dtype))) : json(nullptr);
  n["layout"] = e ? json(std::string(name(e->layout))) : json(nullptr);
  json t = json::object();
  tier_usage all;
  for (std::size_t i = 0; i < per_tier.size(); ++i) {
    if (per_tier[i].objects == 0) continue;
    t[tier_names[i]] = {{"objects", per_tier[i].objects}, {"bytes", per_tier[i].bytes}};
    all.add(per_tier[i]);
  }
  n["tiers"] = std::move(t);
  n["objects"] = all.objects;
  n["bytes"] = all.bytes;
  return n;
}

/// The listing's text, within protocol::max_status_json_bytes: with thousands of namespaces
/// (unknown ids of a shared Redis), the largest that fit (`j["namespaces"]`: largest first).
[[nodiscard]] inline std::string fit_listing(nlohmann::json& j) {
  std::string text = j.dump();
  std::size_t dropped = 0;
  while (text.size() > protocol::max_status_json_bytes && !j["namespaces"].empty()) {
    const std::size_t cut = std::max<std::size_t>(1, j["namespaces"].size() / 8);
    for (std::size_t i = 0; i < cut; ++i) j["namespaces"].erase(j["namespaces"].size() - 1);
    dropped += cut;
    j["namespaces_truncated"] = dropped;
    text = j.dump();
  }
  return text;
}

/// The index of the L2 backend named `name`, or backends.size() when none is.
[[nodiscard]] inline std::size_t backend_named(std::string_view name, std::span<const l2::any_backend> backends) {
  std::size_t b = 0;
  while (b < backends.size() && backends[b].name() != name) ++b;
  return b;
}

/// "l1, disk, redis": the tier names of this server, for a refusal that names a wrong one.
[[nodiscard]] inline std::string tier_names_text(std::span<const l2::any_backend> backends) {
  std::string known = "l1";
  for (const auto& x : backends) known += ", " + std::string(x.name());
  return known;
}

/// The tiers an evict_request names: L1 or not, and the indices of the L2 backends.
struct evict_tiers {
  bool l1 = false;
  std::vector<std::size_t> backends;
};

/// evict_request.tiers ("l1" and the backends' names, comma-separated; empty: every tier),
/// or the refusal naming a tier this server does not have.
[[nodiscard]] inline request_result<evict_tiers> parse_evict_tiers(std::string_view list,
                                                                   std::span<const l2::any_backend> backends) {
  evict_tiers out;
  if (list.empty()) {
    out.l1 = true;
    for (std::size_t b = 0; b < backends.size(); ++b) out.backends.push_back(b);
    return out;
  }
  for (std::size_t at = 0;;) {
    const auto comma = list.find(',', at);
    std::string_view t = list.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
    while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
    if (t == "l1") {
      out.l1 = true;
    } else {
      const std::size_t b = backend_named(t, backends);
      if (b == backends.size()) {
        return request_error{errc::invalid_argument, fmt::format("evict_request.tiers: no tier named '{}' in '{}': "
                                                                 "this server has {}",
                                                                 t, list, tier_names_text(backends))};
      }
      if (std::find(out.backends.begin(), out.backends.end(), b) == out.backends.end()) out.backends.push_back(b);
    }
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  return out;
}

/// The selection of an evict_request as a key filter. Names and salts resolve to the ids
/// the server learned (model_namespaces.hpp) now, on the I/O thread: the filter runs on the
/// backends' executors and touches nothing of the session.
[[nodiscard]] inline l2::key_filter evict_filter(const protocol::evict_request& r, const model_namespaces& spaces) {
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
    spaces.for_each([&](std::uint64_t id, const model_namespaces::entry& e) {
      if (r.by_model && e.model_name != r.model_name) return;
      if (r.by_salt && e.cache_salt != r.cache_salt) return;
      sel->named.insert(id);
    });
  }
  return [sel = std::shared_ptr<const selection>(sel)](const chunk_key& k) {
    if (sel->by_id && k.model_id != sel->id) return false;
    if (sel->by_names && !sel->named.contains(k.model_id)) return false;
    return true;
  };
}

/// What an evict_request removed from one tier: a row of its JSON.
struct tier_removal {
  std::string tier;
  std::uint64_t removed = 0;
  std::uint64_t bytes = 0;
  std::uint64_t in_use = 0;
  std::uint64_t failed = 0;
  std::string error;
};

/// The evict_response of the tiers' removals: the sums, and one JSON row per tier.
[[nodiscard]] inline protocol::evict_response evict_answer(std::vector<tier_removal> removals) {
  protocol::evict_response out;
  nlohmann::json rows = nlohmann::json::array();
  for (auto& t : removals) {
    out.removed_objects += t.removed;
    out.removed_bytes += t.bytes;
    out.in_use_objects += t.in_use;
    out.failed_objects += t.failed;
    rows.push_back({{"tier", std::move(t.tier)},
                    {"removed_objects", t.removed},
                    {"removed_bytes", t.bytes},
                    {"in_use_objects", t.in_use},
                    {"failed_objects", t.failed},
                    {"error", std::move(t.error)}});
  }
  out.json = nlohmann::json{{"tiers", std::move(rows)}}.dump();
  return out;
}

/// "model 'x', salt 'y'" or "every object": what an evict_request selects, for the log.
[[nodiscard]] inline std::string evict_selection_text(const protocol::evict_request& r) {
  std::string what = r.all ? std::string("every object") : std::string();
  if (r.by_model) what += fmt::format("model '{}'", r.model_name);
  if (r.by_salt) what += fmt::format("{}salt '{}'", what.empty() ? "" : ", ", r.cache_salt);
  if (r.by_model_id) what += fmt::format("{}model id {}", what.empty() ? "" : ", ", model_id_hex(r.model_id));
  return what;
}

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
    for (std::size_t i = 0; i < tiers; ++i) totals[i].add(per_tier[i]);
    json n = detail::namespace_json(id, ctx_.namespaces.find(id), per_tier, tier_names);
    const std::uint64_t bytes = n["bytes"].get<std::uint64_t>();
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
  co_return protocol::list_objects_response{detail::fit_listing(j)};
}

inline boost::asio::awaitable<request_result<protocol::list_keys_response>> session::on(
    const protocol::list_keys_request& r, call&) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  if (auto refused = admin_refusal("list_keys_request")) co_return *refused;
  const std::span<l2::any_backend> backends = ctx_.cache.backends();
  std::vector<chunk_key> keys;
  if (r.tier == "l1") {
    ctx_.cache.visit_l1([&](const chunk_key& k, std::size_t) { keys.push_back(k); });
  } else {
    const std::size_t b = detail::backend_named(r.tier, backends);
    if (b == backends.size()) {
      co_return request_error{errc::invalid_argument,
                              fmt::format("list_keys_request.tier: no tier named '{}': this server has {}", r.tier,
                                          detail::tier_names_text(backends))};
    }
    const l2::key_filter every;
    auto [ec, listed] =
        co_await backends[b].async_list(every, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
    if (closing_) co_return closing_error("list_keys_request");
    if (ec)
      co_return request_error{errc::io_error, fmt::format("list_keys_request: cannot list {}: {}", r.tier, ec.message())};
    keys.reserve(listed.size());
    for (const auto& o : listed) keys.push_back(o.key);
  }
  std::sort(keys.begin(), keys.end());
  // ~60 bytes a key: stop where the document would pass its bound.
  const std::size_t fit = (protocol::max_status_json_bytes - 4096) / (chunk_key{}.to_string().size() + 3);
  const std::size_t n = std::min({keys.size(), fit, r.max_keys == 0 ? keys.size() : std::size_t{r.max_keys}});
  nlohmann::json list = nlohmann::json::array();
  for (std::size_t i = 0; i < n; ++i) list.push_back(keys[i].to_string());
  nlohmann::json j{{"tier", r.tier}, {"keys", std::move(list)}, {"total", keys.size()}, {"truncated", n < keys.size()}};
  co_return protocol::list_keys_response{j.dump()};
}

inline boost::asio::awaitable<request_result<protocol::evict_response>> session::on(const protocol::evict_request& r,
                                                                                    call&) {
  if (auto refused = admin_refusal("evict_request")) co_return *refused;
  const bool selects = r.by_model || r.by_salt || r.by_model_id;
  if (r.all && selects)
    co_return request_error{errc::invalid_argument,
                            "evict_request: `all` and a selection (model, salt, model id) exclude each other: send "
                            "one of them"};
  if (!r.all && !selects)
    co_return request_error{errc::invalid_argument,
                            "evict_request selects nothing: set `all`, or a model name, a salt or a model id"};
  const std::span<l2::any_backend> backends = ctx_.cache.backends();
  auto tiers = detail::parse_evict_tiers(r.tiers, backends);
  if (!tiers) co_return tiers.error();
  const l2::key_filter selected = detail::evict_filter(r, ctx_.namespaces);

  std::vector<detail::tier_removal> removals;
  if (tiers->l1) {
    const l1::removal_summary s = ctx_.cache.remove_l1_if(selected, r.force);
    removals.push_back({"l1", s.removed, s.removed_bytes, s.locked, 0, {}});
  }
  for (const std::size_t b : tiers->backends) {
    auto removal = co_await evict_from_backend(backends[b], selected);
    if (!removal) co_return removal.error();
    removals.push_back(std::move(*removal));
  }
  protocol::evict_response out = detail::evict_answer(std::move(removals));
  ctx_.log.info("client {}: evicted {} ({}{}): {} objects, {} bytes removed, {} in use kept, {} failed", id_,
                detail::evict_selection_text(r), r.tiers.empty() ? std::string("every tier") : "tiers " + r.tiers,
                r.force ? ", forced" : "", out.removed_objects, out.removed_bytes, out.in_use_objects,
                out.failed_objects);
  co_return out;
}

/// Removes what `backend` lists under `selected`, in batches that bound one backend
/// operation (a Redis pipeline, a disk unlink fan-out); closing_error when the connection
/// closes meanwhile.
inline boost::asio::awaitable<request_result<detail::tier_removal>> session::evict_from_backend(
    l2::any_backend& backend, const l2::key_filter& selected) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  detail::tier_removal out{std::string(backend.name())};
  auto [ec, listed] = co_await backend.async_list(selected, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
  if (closing_) co_return closing_error("evict_request");
  if (ec) {
    out.error = "cannot list its objects: " + ec.message();
    co_return out;
  }
  constexpr std::size_t per_batch = 1024;
  for (std::size_t first = 0; first < listed.size(); first += per_batch) {
    const std::size_t n = std::min(per_batch, listed.size() - first);
    std::vector<chunk_key> keys;
    keys.reserve(n);
    for (std::size_t i = 0; i < n; ++i) keys.push_back(listed[first + i].key);
    auto [rec, res] = co_await backend.async_remove(keys, l2::clock::now() + admin_deadline, as_tuple(use_awaitable));
    if (closing_) co_return closing_error("evict_request");
    for (std::size_t i = 0; i < n; ++i) {
      const l2::key_outcome o = i < res.size() ? res.outcomes[i] : l2::key_outcome::timeout;
      if (o == l2::key_outcome::ok) {
        ++out.removed;
        out.bytes += listed[first + i].bytes;
      } else if (o == l2::key_outcome::rejected) {
        ++out.in_use;  // pinned by a prefetch, or a store in flight
      } else if (o != l2::key_outcome::not_found) {  // not_found: gone meanwhile
        ++out.failed;
        if (out.error.empty())
          out.error = std::string(l2::name(o)) + (rec ? " (" + rec.message() + ")" : std::string());
      }
    }
  }
  co_return out;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
