#pragma once
// finished_tracker: which request ids the connector reports to the engine as finished
// receiving (their KV loads are over) and finished sending (the engine finished them and
// their KV stores are over), following vLLM's KV-connector contract: each id once in each
// list, never in recving while a retrieve of it is pending, nor in sending while a retrieve
// or store is; bounded memory. Pure bookkeeping, no I/O, not thread-safe (the connector
// guards it with its mutex). docs/fault-tolerance.md, "Finished reporting", holds the rules.

#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/detail/xxhash.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

/// What get_finished returns: ids finished sending (stores over, blocks may be freed) and
/// finished receiving (loads over, the request may run).
struct finished_requests {
  std::vector<std::string> sending;
  std::vector<std::string> recving;
};

class finished_tracker {
 public:
  /// `window`: retired ids remembered to swallow re-reports (>= 1).
  explicit finished_tracker(std::size_t window = 65536) : window_capacity_(window) {
    if (window == 0) throw std::invalid_argument("kvtier::engine::finished_tracker: window must be >= 1");
  }

  /// A retrieve of `id` was issued; `synchronous`: the engine waits for it within its step,
  /// and `id` does not owe a receiving report for it (docs/fault-tolerance.md, "Finished reporting").
  void retrieve_started(std::string_view id, bool synchronous = false) {
    entry& e = tracked_entry(id);
    ++e.retrieves;
    if (!synchronous && !e.retired && !e.recv_reported) e.owes_recv = true;
  }

  /// A retrieve of `id` completed (data landed, or load error). When it was the last pending
  /// retrieve of `id`, `id` becomes due in `recving` (if it owes that report). Ignored when
  /// none is pending.
  void retrieve_done(std::string_view id) {
    auto it = find(id);
    if (it == entries_.end() || it->second.retrieves == 0) return;
    --it->second.retrieves;
    mark_recv_due(it);
    erase_if_idle(it);
  }

  /// A store of `id` was issued.
  void store_started(std::string_view id) { ++tracked_entry(id).stores; }

  /// A store of `id` completed (stored, refused, failed or timed out). Ignored when none is
  /// pending.
  void store_done(std::string_view id) {
    auto it = find(id);
    if (it == entries_.end() || it->second.stores == 0) return;
    --it->second.stores;
    erase_if_idle(it);
  }

  /// The engine's finished ids of this step in, the reports due out (docs/fault-tolerance.md, "Finished reporting").
  /// Re-reports of retired ids and of ids already waiting are ignored.
  finished_requests take_finished(std::span<const std::string> finished_by_engine) {
    finished_requests out;
    for (const std::string& id : finished_by_engine) {
      auto it = entries_.find(id);
      if (it == entries_.end() ? retired(id) : it->second.retired) {
        ++ignored_reports_;
        continue;
      }
      if (it == entries_.end()) it = entries_.try_emplace(id).first;
      entry& e = it->second;
      if (e.engine_finished) {
        ++ignored_reports_;
        continue;
      }
      e.engine_finished = true;
      send_wait_.insert(id);
    }

    // Requests still running: reported receiving once every retrieve of theirs ended.
    out.recving.reserve(recv_due_.size());
    for (std::string& id : recv_due_) {
      auto it = entries_.find(id);
      if (it == entries_.end() || !it->second.recv_due) continue;
      entry& e = it->second;
      e.recv_due = false;
      // Finished by the engine: its last report is decided below. A retrieve started since
      // it became due: due again when that one ends.
      if (e.engine_finished || e.retrieves != 0 || !e.owes_recv) continue;
      e.owes_recv = false;
      e.recv_reported = true;
      out.recving.push_back(std::move(id));
    }
    recv_due_.clear();

    // Requests the engine finished: their last report, once nothing of theirs is pending.
    for (auto w = send_wait_.begin(); w != send_wait_.end();) {
      auto it = entries_.find(*w);
      if (it == entries_.end()) {  // cannot happen: an engine-finished entry is never idle
        w = send_wait_.erase(w);
        continue;
      }
      entry& e = it->second;
      if (e.retrieves != 0 || e.stores != 0) {
        ++w;
        continue;
      }
      (e.owes_recv ? out.recving : out.sending).push_back(*w);
      retire(*w);
      entries_.erase(it);
      w = send_wait_.erase(w);
    }
    return out;
  }

  /// The server is gone: every pending retrieve and store counts as completed (retrieves
  /// become due in `recving`). Returns how many operations were released.
  std::size_t drain() {
    std::size_t released = 0;
    for (auto it = entries_.begin(); it != entries_.end();) {
      entry& e = it->second;
      released += e.retrieves + e.stores;
      e.stores = 0;
      e.retrieves = 0;
      mark_recv_due(it);
      if (e.idle()) it = entries_.erase(it);
      else ++it;
    }
    return released;
  }

  /// Ids with state (something pending, due or waiting, or reported receiving and not yet
  /// finished by the engine); 0 when every id got its last report.
  [[nodiscard]] std::size_t tracked() const noexcept { return entries_.size(); }
  /// Retired ids remembered (<= window()).
  [[nodiscard]] std::size_t remembered() const noexcept { return window_.size(); }
  [[nodiscard]] std::size_t window() const noexcept { return window_capacity_; }
  /// Engine reports ignored so far (re-reports).
  [[nodiscard]] std::uint64_t ignored_reports() const noexcept { return ignored_reports_; }
  [[nodiscard]] std::uint32_t pending_retrieves(std::string_view id) const {
    auto it = entries_.find(std::string(id));
    return it == entries_.end() ? 0 : it->second.retrieves;
  }
  [[nodiscard]] std::uint32_t pending_stores(std::string_view id) const {
    auto it = entries_.find(std::string(id));
    return it == entries_.end() ? 0 : it->second.stores;
  }

 private:
  struct entry {
    std::uint32_t retrieves = 0;   ///< retrieves issued and not completed
    std::uint32_t stores = 0;      ///< stores issued and not completed
    bool owes_recv = false;        ///< a retrieve was issued; no receiving report yet
    bool recv_reported = false;    ///< reported receiving: never again
    bool recv_due = false;         ///< in recv_due_: its retrieves ended, to be checked
    bool engine_finished = false;  ///< in send_wait_: the engine finished it, no last report yet
    bool retired = false;          ///< its last report was given: transfers tracked, nothing reported
    /// Nothing pending and nothing left to report or remember: the entry can go.
    [[nodiscard]] bool idle() const noexcept {
      if (retrieves != 0 || stores != 0) return false;
      return retired || (!owes_recv && !recv_reported && !recv_due && !engine_finished);
    }
  };
  struct hash_of_hash {
    std::size_t operator()(const hash128& h) const noexcept { return static_cast<std::size_t>(h.lo ^ (h.hi * 31)); }
  };

  using map_type = std::unordered_map<std::string, entry>;

  map_type::iterator find(std::string_view id) { return entries_.find(std::string(id)); }

  /// The entry of `id`, made when missing (a retired id's entry tracks without reporting).
  entry& tracked_entry(std::string_view id) {
    auto [it, inserted] = entries_.try_emplace(std::string(id));
    if (inserted && retired(id)) it->second.retired = true;
    return it->second;
  }

  /// Queues `it` for a receiving report when its retrieves all ended and it owes one (a
  /// request the engine finished gets its last report from send_wait_ instead).
  void mark_recv_due(map_type::iterator it) {
    entry& e = it->second;
    if (e.retrieves != 0 || !e.owes_recv || e.engine_finished || e.recv_due) return;
    e.recv_due = true;
    recv_due_.push_back(it->first);
  }

  void erase_if_idle(map_type::iterator it) {
    if (it->second.idle()) entries_.erase(it);
  }

  static hash128 id_hash(std::string_view id) noexcept {
    const XXH128_hash_t h = XXH3_128bits(id.data(), id.size());
    return {h.low64, h.high64};
  }

  [[nodiscard]] bool retired(std::string_view id) const { return window_set_.contains(id_hash(id)); }

  void retire(std::string_view id) {
    const hash128 h = id_hash(id);
    if (!window_set_.insert(h).second) return;
    window_.push_back(h);
    if (window_.size() > window_capacity_) {
      window_set_.erase(window_.front());
      window_.pop_front();
    }
  }

  std::size_t window_capacity_;
  map_type entries_;
  std::vector<std::string> recv_due_;             ///< ids whose retrieves ended, in order
  std::unordered_set<std::string> send_wait_;     ///< engine-finished ids without their last report
  std::deque<hash128> window_;                    ///< retired ids, oldest first
  std::unordered_set<hash128, hash_of_hash> window_set_;
  std::uint64_t ignored_reports_ = 0;
};

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
