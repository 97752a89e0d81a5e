#pragma once
// server (server/server.hpp): KV events for routers (docs/kv-events.md, "What the server
// announces"), on when the configuration has "kv_events":
//   setup_kv_events()       (constructor) the medium of each tier, the transport
//                           (server_options::kv_event_transport: ZMQ in kvtier-server), the
//                           tier_announcer attached to the bus's key relay, AllBlocksCleared
//                           first;
//   announce_l2_contents()  (start, before the first connection is accepted) what each announced
//                           L2 backend holds already (a disk tier after a restart), as its
//                           tier_keys_stored: announced once the engines describe those chunks;
//   add_kv_events_metrics() the kvtier_kv_events_* series;
//   kv_events_status()      the status document's "kv_events".

#include <kvtier/server/server.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

namespace detail {
/// The medium a backend type announces by default: the names an AMD fork of vLLM uses for
/// tiers below CPU (DISK, REMOTE); kv_events.medium_names overrides (e.g. STORAGE).
[[nodiscard]] inline std::string default_medium(std::string_view backend_type) {
  if (backend_type == "disk") return "DISK";
  if (backend_type == "redis") return "REMOTE";
  std::string m(backend_type);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return m;
}
}  // namespace detail

inline void server::setup_kv_events() {
  const kv_events_config& k = config_.kv_events;
  if (!k.enabled) return;
  if (!options_.kv_event_transport)
    throw config_error("kv_events", k.endpoint,
                       "this kvtier-server was built without libzmq, so it cannot publish KV events: install "
                       "libzmq3-dev and cppzmq-dev and rebuild, or remove \"kv_events\"");
  // Tier names: "l1", then the backends' names (the list and evict requests' names).
  const auto backends = cache_->backends();
  std::vector<std::string> names{"l1"};
  for (const auto& b : backends) names.emplace_back(b.name());
  auto known = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const auto& t : k.tiers)
    if (!known(t))
      throw config_error("kv_events.tiers", t, fmt::format("names no tier of this server: it has {}", fmt::join(names, ", ")));
  for (const auto& [t, medium] : k.medium_names)
    if (!known(t))
      throw config_error("kv_events.medium_names", t,
                         fmt::format("names no tier of this server: it has {}", fmt::join(names, ", ")));
  kv_events::tier_announcer_options o;
  o.description_bytes = k.description_bytes;
  o.mediums.resize(names.size());
  for (std::size_t t = 0; t < names.size(); ++t) {
    const std::string type = t == 0 ? std::string("l1") : backend_types_[t - 1];
    const bool chosen = k.tiers.empty() ? type != "redis" : std::find(k.tiers.begin(), k.tiers.end(), names[t]) != k.tiers.end();
    if (!chosen) continue;
    const auto named = k.medium_names.find(names[t]);
    o.mediums[t] = named != k.medium_names.end() ? named->second : t == 0 ? std::string("CPU") : detail::default_medium(type);
    if (type == "redis")
      log_.warn("kv_events: tier {} (Redis) announced: its removals are the server's own only; keys Redis evicts or "
                "expires by itself stay in a router's index",
                names[t]);
  }
  kv_transport_ = options_.kv_event_transport(k);
  kv_announcer_ = std::make_unique<kv_events::tier_announcer>(std::move(o), *kv_transport_);
  kv_announcer_->clear_all();  // a router forgets what it heard of this publisher before
  bus_.subscriber<kv_events::tier_key_relay>().attach(kv_announcer_.get());
  std::vector<std::string> announced;
  for (std::size_t t = 0; t < names.size(); ++t)
    if (kv_announcer_->announces(static_cast<std::uint8_t>(t))) announced.push_back(names[t] + " as " + kv_announcer_->medium(static_cast<std::uint8_t>(t)));
  log_.info("kv_events: publishing {} ({} form) for {}", kv_transport_->describe(), k.form, fmt::join(announced, ", "));
}

inline boost::asio::awaitable<void> server::announce_l2_contents() {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  const auto backends = cache_->backends();
  for (std::size_t b = 0; b < backends.size(); ++b) {
    const auto tier = bus::l2_tier(b);
    if (!kv_announcer_->announces(tier)) continue;
    const l2::key_filter every;
    auto [ec, listed] = co_await backends[b].async_list(every, l2::clock::now() + std::chrono::seconds(60),
                                                        as_tuple(use_awaitable));
    if (ec) {
      log_.warn("kv_events: cannot list {} ({}): what it holds is announced as it is stored again", backends[b].name(),
                ec.message());
      continue;
    }
    bus::tier_keys_stored e{tier, {}};
    e.keys.reserve(listed.size());
    for (const auto& o : listed) e.keys.push_back(o.key);
    log_.info("kv_events: {} holds {} objects at start: announced as engines describe them", backends[b].name(),
              e.keys.size());
    bus_.publish(e);
  }
}

inline void server::add_kv_events_metrics() {
  if (!kv_announcer_) return;
  using telemetry::metric_type;
  const kv_events::tier_announcer_stats& s = kv_announcer_->stats();
  auto add = [&](const char* name, const char* help, metric_type type, const std::atomic<std::uint64_t>& v) {
    registry_.add_callback(name, help, type, {}, [&v] { return static_cast<double>(v.load(std::memory_order_relaxed)); });
  };
  add("kvtier_kv_events_chunks_stored_total", "BlockStored events offered (one per chunk and tier)", metric_type::counter,
      s.chunks_stored);
  add("kvtier_kv_events_chunks_removed_total", "BlockRemoved events offered (one per chunk and tier)", metric_type::counter,
      s.chunks_removed);
  add("kvtier_kv_events_undescribed_total",
      "Chunks a tier took before any engine described them (announced only once described)", metric_type::counter,
      s.undescribed);
  add("kvtier_kv_events_chunks_held", "Chunks the announced tiers hold (rank 0's objects)", metric_type::gauge,
      s.chunks_held);
  add("kvtier_kv_events_chunks_announced", "Of those, announced (described)", metric_type::gauge, s.chunks_announced);
  add("kvtier_kv_events_descriptions", "Chunk descriptions kept", metric_type::gauge, s.descriptions_held);
  add("kvtier_kv_events_description_bytes", "Their bytes (bounded by kv_events.description_bytes)", metric_type::gauge,
      s.description_bytes);
  add("kvtier_kv_events_descriptions_evicted_total", "Descriptions dropped for room (oldest first)",
      metric_type::counter, s.descriptions_evicted);
  auto transport = [this](auto field) {
    return [this, field] { return static_cast<double>(kv_transport_->stats().*field); };
  };
  using ts = kv_events::kv_event_transport_stats;
  registry_.add_callback("kvtier_kv_events_published_total", "Events sent to subscribers", metric_type::counter, {},
                         transport(&ts::events_published));
  registry_.add_callback(
      "kvtier_kv_events_dropped_total",
      "Events dropped: the publisher's queue was full (a subscriber or the socket fell behind) or the socket refused",
      metric_type::counter, {}, transport(&ts::events_dropped));
  registry_.add_callback("kvtier_kv_events_replay_buffer_batches", "Batches kept for replay", metric_type::gauge, {},
                         transport(&ts::replay_buffer_batches));
  registry_.add_callback("kvtier_kv_events_replay_buffer_bytes", "Their bytes", metric_type::gauge, {},
                         transport(&ts::replay_buffer_bytes));
  registry_.add_callback("kvtier_kv_events_replay_requests_total", "Replays answered", metric_type::counter, {},
                         transport(&ts::replay_requests));
  registry_.add_callback("kvtier_kv_events_replay_gaps_total",
                         "Replays that asked for batches no longer held (reported as a ReplayGap)",
                         metric_type::counter, {}, transport(&ts::replay_gaps));
}

inline nlohmann::json server::kv_events_status() const {
  if (!kv_announcer_) return nullptr;
  const auto& s = kv_announcer_->stats();
  const auto t = kv_transport_->stats();
  auto v = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  return {{"publishing", kv_transport_->describe()},
          {"form", config_.kv_events.form},
          {"chunks_held", v(s.chunks_held)},
          {"chunks_announced", v(s.chunks_announced)},
          {"chunks_stored", v(s.chunks_stored)},
          {"chunks_removed", v(s.chunks_removed)},
          {"undescribed", v(s.undescribed)},
          {"descriptions", v(s.descriptions_held)},
          {"description_bytes", v(s.description_bytes)},
          {"descriptions_evicted", v(s.descriptions_evicted)},
          {"descriptions_refused", v(s.descriptions_refused)},
          {"events_published", t.events_published},
          {"events_dropped", t.events_dropped},
          {"replay_buffer_batches", t.replay_buffer_batches},
          {"replay_buffer_bytes", t.replay_buffer_bytes},
          {"bus_dropped", bus_.dropped()}};
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
