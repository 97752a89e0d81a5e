#pragma once
// The connector's calls in flight: one entry per request handed to the server link, keyed by
// its call id (the frame header's), until it completes. A call completes exactly once, by
// whichever comes first: its reply, its deadline, the unhealthy edge, or the loss of its
// connection (engine/detail/server_link.hpp decides; this is the table it keeps).

#include <kvtier/config.hpp>
#include <kvtier/protocol/messages.hpp>

#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {
namespace detail {

/// What a call is for: decides whether its timeout counts towards the breaker.
enum class call_kind : std::uint8_t { control, ping, lookup, query, retrieve, store, notify };

/// How a call ended.
enum class call_status : std::uint8_t {
  reply,        ///< the expected response
  error_reply,  ///< error_response
  timeout,      ///< the deadline passed
  unhealthy,    ///< released on the unhealthy edge
  closed,       ///< the connection broke before an answer (handshake) or was gone at send
};

struct call_result {
  call_status status = call_status::closed;
  protocol::message reply{};
  std::string error;  ///< error_response message, or why
};

struct pending_call;
/// Runs once when the call completes, with the link's mutex held.
using call_done = std::function<void(pending_call&, call_result&)>;

struct pending_call {
  std::uint64_t id = 0;
  call_kind kind = call_kind::control;
  std::uint64_t epoch = 0;  ///< the connection it was issued on (server_link)
  protocol::message_type expect{};
  std::chrono::steady_clock::duration timeout{};
  std::vector<std::byte> bytes;  ///< the encoded frame until sent
  int fd = -1;                   ///< passed beside the frame (register)
  bool sent = false;             ///< handed to the socket: the server may act on it
  std::chrono::steady_clock::time_point sent_at{};  ///< when it was handed to the socket
  std::optional<boost::asio::steady_timer> deadline;
  call_done done;
};

/// The table. Not synchronized: its owner holds its mutex around every use.
class call_table {
 public:
  using call_ptr = std::shared_ptr<pending_call>;

  void insert(call_ptr c) {
    const std::uint64_t id = c->id;
    calls_.emplace(id, std::move(c));
  }

  /// The call `id`, null when it already completed.
  [[nodiscard]] call_ptr find(std::uint64_t id) const {
    auto it = calls_.find(id);
    return it == calls_.end() ? nullptr : it->second;
  }

  /// Removes and returns the call `id` when it was issued on connection `epoch` (any
  /// connection when nullopt); null otherwise.
  call_ptr take(std::uint64_t id, std::optional<std::uint64_t> epoch = std::nullopt) {
    auto it = calls_.find(id);
    if (it == calls_.end() || (epoch && it->second->epoch != *epoch)) return nullptr;
    call_ptr c = std::move(it->second);
    calls_.erase(it);
    return c;
  }

  /// Removes and returns the calls of connection `epoch` (all when nullopt), oldest first.
  std::vector<call_ptr> take_all(std::optional<std::uint64_t> epoch) {
    std::vector<call_ptr> out;
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (!epoch || it->second->epoch == *epoch) {
        out.push_back(std::move(it->second));
        it = calls_.erase(it);
      } else {
        ++it;
      }
    }
    std::sort(out.begin(), out.end(), [](const call_ptr& a, const call_ptr& b) { return a->id < b->id; });
    return out;
  }

  /// Calls of these kinds in flight.
  [[nodiscard]] std::size_t count(std::initializer_list<call_kind> kinds) const {
    return static_cast<std::size_t>(std::count_if(calls_.begin(), calls_.end(), [&](const auto& kv) {
      return std::find(kinds.begin(), kinds.end(), kv.second->kind) != kinds.end();
    }));
  }

  [[nodiscard]] std::size_t size() const noexcept { return calls_.size(); }
  void clear() noexcept { calls_.clear(); }

 private:
  std::unordered_map<std::uint64_t, call_ptr> calls_;
};

}  // namespace detail
}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
