#pragma once
// client_budget: how much of the server one client, and all of them together, may hold, so
// that the server's memory stays bounded whatever a client sends (docs/server.md,
// "Budgets"). All on the server's one I/O thread; the refusal counters are atomics because
// /metrics may be read from anywhere.
//
//   connections   at most max_connections open, at most max_connections_per_uid of one
//                 peer uid: a connection past either is answered with error_response
//                 {over_budget, "... max_connections ..."} and closed at once;
//   lookup keys   the chunk keys (chunks x world size) held by open lookups, ~40 bytes of
//                 server memory each: one connection may hold lookup_keys_per_client, all
//                 together lookup_keys_total. Past the total a client is still admitted
//                 while it holds less than its fair share (total / registered clients), so
//                 one abuser cannot lock a well-behaved engine out; the keys held therefore
//                 never exceed twice lookup_keys_total. A refused lookup is
//                 error_response{over_budget, "..."} naming the key to raise.
//
// The peer check (allowed uids and gids) is made by the listener (server/listener.hpp) before
// admit(); its refusals are counted here with the others
// (kvtier_server_connections_refused_total).

#include <kvtier/config.hpp>
#include <kvtier/error.hpp>
#include <kvtier/server/session/lookup_table.hpp>
#include <kvtier/server/session/request_error.hpp>

#include <sys/types.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

class client_budget {
 public:
  struct limits {
    std::uint32_t max_connections = 1024;
    std::uint32_t max_connections_per_uid = 512;
    std::uint64_t lookup_keys_total = std::uint64_t{1} << 22;
    std::uint64_t lookup_keys_per_client = std::uint64_t{1} << 20;
  };

  /// Why a connection was refused (the label of kvtier_server_connections_refused_total).
  enum class refusal : std::uint8_t { peer_uid, max_connections, max_connections_per_uid };
  static constexpr std::size_t refusal_count = 3;
  static constexpr std::array<std::string_view, refusal_count> refusal_names = {"peer_uid", "max_connections",
                                                                                "max_connections_per_uid"};

  explicit client_budget(limits l) noexcept : limits_(l) {}

  [[nodiscard]] const limits& get_limits() const noexcept { return limits_; }

  /// Admits connection `client_id` of `uid` (and records it), or says which cap refuses it.
  [[nodiscard]] std::optional<refusal> admit(std::uint64_t client_id, ::uid_t uid) {
    if (uid_of_.size() >= limits_.max_connections) return refusal::max_connections;
    auto& n = per_uid_[uid];
    if (n >= limits_.max_connections_per_uid) return refusal::max_connections_per_uid;
    ++n;
    uid_of_[client_id] = uid;
    return std::nullopt;
  }

  /// Connection `client_id` is gone.
  void closed(std::uint64_t client_id) {
    auto it = uid_of_.find(client_id);
    if (it == uid_of_.end()) return;
    if (auto u = per_uid_.find(it->second); u != per_uid_.end() && --u->second == 0) per_uid_.erase(u);
    uid_of_.erase(it);
  }

  /// The error_response text of a refused connection.
  [[nodiscard]] std::string refusal_message(refusal r, ::uid_t uid) const {
    switch (r) {
      case refusal::peer_uid:
        return "uid " + std::to_string(uid) +
               " may not use this server: it serves its own user; name others in allowed_uids / allowed_gids";
      case refusal::max_connections:
        return "the server has " + std::to_string(limits_.max_connections) +
               " connections open (max_connections): close some or raise max_connections";
      case refusal::max_connections_per_uid:
        return "uid " + std::to_string(uid) + " has " + std::to_string(limits_.max_connections_per_uid) +
               " connections open (max_connections_per_uid): close some or raise max_connections_per_uid";
    }
    return {};
  }

  void count(refusal r) noexcept { refused_[static_cast<std::size_t>(r)].fetch_add(1, std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t refused(refusal r) const noexcept {
    return refused_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
  }

  /// Whether connection `client_id` may start a lookup of `keys` keys that replaces one of
  /// its own holding `replaced` keys (0 when none). `clients`: registered connections now.
  [[nodiscard]] std::optional<request_error> check_lookup(const lookup_table& lookups, std::uint64_t client_id,
                                                          std::uint64_t keys, std::uint64_t replaced,
                                                          std::size_t clients) {
    const std::uint64_t held = lookups.owned_keys(client_id) - replaced;
    const std::uint64_t total = lookups.keys() - replaced;
    if (held + keys > limits_.lookup_keys_per_client) {
      lookups_refused_.fetch_add(1, std::memory_order_relaxed);
      return request_error{errc::over_budget,
                           "lookup_request: " + std::to_string(keys) + " keys more would make this connection hold " +
                               std::to_string(held + keys) + " lookup keys, above max_lookup_keys_per_client (" +
                               std::to_string(limits_.lookup_keys_per_client) +
                               "): send end_request / free_lookup_locks for finished requests, or raise it"};
    }
    const std::uint64_t fair_share = limits_.lookup_keys_total / std::max<std::size_t>(clients, 1);
    if (total + keys > limits_.lookup_keys_total && held + keys > fair_share) {
      lookups_refused_.fetch_add(1, std::memory_order_relaxed);
      return request_error{errc::over_budget, "lookup_request: the server's lookups hold " + std::to_string(total) +
                                                  " keys (max_lookup_keys " +
                                                  std::to_string(limits_.lookup_keys_total) +
                                                  ") and this connection already holds " + std::to_string(held) +
                                                  " (its share): end finished requests, or raise max_lookup_keys"};
    }
    return std::nullopt;
  }

  [[nodiscard]] std::uint64_t lookups_refused() const noexcept {
    return lookups_refused_.load(std::memory_order_relaxed);
  }

 private:
  limits limits_;
  std::unordered_map<std::uint64_t, ::uid_t> uid_of_;   ///< open connections
  std::unordered_map<::uid_t, std::uint32_t> per_uid_;  ///< open connections per uid
  std::array<std::atomic<std::uint64_t>, refusal_count> refused_{};
  std::atomic<std::uint64_t> lookups_refused_{0};
};

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
