#pragma once
// Definitions of engine::connector (declarations and documentation: kvtier/engine/connector.hpp).
//
// Threads: the engine's threads call the public functions; the connector's own thread (its
// server_link's, engine/detail/server_link.hpp) runs the transport, the completions of the
// calls and the housekeeping. The connector's state is guarded by the link's mutex (mu()),
// so that an edge of the link and the connector's bookkeeping for it are one critical
// section. A call completes exactly once, with the mutex held (server_link).

#include <kvtier/engine/connector.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace engine {

// ---------------------------------------------------------------------------------------
// Construction, destruction, health
// ---------------------------------------------------------------------------------------

template <class Bus>
connector_options connector<Bus>::validated(connector_options o, const kv_region* region) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("kvtier::engine::connector: " + what); };
  if (auto e = o.validation_error(); !e.empty()) fail(e);
  if (region == nullptr) {
    if (!o.is_scheduler())
      fail(
          "a connector without a kv_region is a scheduler's: set options.scheduler (or rank 0), or give the "
          "worker its region");
    if (auto e = o.model.validation_error(); !e.empty())
      fail("options.model (the shape one rank's workers register): " + e);
    if (o.layout_kind == kv_layout_kind::mla && o.model.attention != attention_kind::mla)
      fail("options.layout_kind MLA needs an MLA options.model");
    return o;
  }
  if (!region->valid()) fail("the kv_region is not valid (create it with kv_region::create)");
  if (!(o.model == model_shape{}) || o.layout_kind != kv_layout_kind::nhd)
    fail("options.model and options.layout_kind are a scheduler's: a worker's come from its kv_region");
  const auto& layout = region->layout();
  if (o.chunk_tokens % layout.block_size != 0)
    fail("chunk_tokens (" + std::to_string(o.chunk_tokens) + ") must be a multiple of the region's block_size (" +
         std::to_string(layout.block_size) + ")");
  if (o.block_size != 0 && o.block_size != layout.block_size)
    fail("options.block_size (" + std::to_string(o.block_size) + ") differs from the region's (" +
         std::to_string(layout.block_size) + "): leave it 0");
  return o;
}

template <class Bus>
connector<Bus>::connector(connector_options options, kv_region& region, Bus& bus)
    : connector(std::move(options), &region, bus) {}

template <class Bus>
connector<Bus>::connector(connector_options options, Bus& bus) : connector(std::move(options), nullptr, bus) {}

template <class Bus>
connector<Bus>::connector(connector_options options, kv_region* region, Bus& bus)
    : options_(validated(std::move(options), region)),
      region_(region),
      bus_(bus),
      hasher_(options_.chunk_tokens, options_.hash),
      instance_id_(options_.instance_id != 0 ? options_.instance_id : static_cast<std::uint64_t>(::getpid())),
      tracker_(options_.finished_window),
      quarantine_(region ? region->layout().num_blocks : 0),
      is_load_error_(region ? region->layout().num_blocks : 0, false),
      link_(options_, registration(), region ? region->fd() : -1, *this) {
  if (options_.timeouts.quarantine_limit.count() > 0)
    boost::asio::co_spawn(link_.executor(), housekeeping(), detail::rethrow_if);
  link_.start();
}

template <class Bus>
connector<Bus>::~connector() {
  link_.stop();
}

template <class Bus>
protocol::register_kv_request connector<Bus>::registration() const {
  protocol::register_kv_request reg;
  reg.instance_id = instance_id_;
  reg.rank = options_.rank;
  reg.world_size = options_.world_size;
  reg.model_name = options_.model_name;
  reg.chunk_tokens = options_.chunk_tokens;
  reg.cache_salt = options_.cache_salt;
  reg.prefill_tokens_per_second = options_.prefill_tokens_per_second;
  reg.engine_id = options_.engine_id;
  if (region_ != nullptr) {
    const paged_kv_layout& layout = region_->layout();
    reg.model = layout.model;
    reg.block_size = layout.block_size;
    reg.num_blocks = layout.num_blocks;
    reg.region_bytes = region_->bytes();
    reg.layout_kind = layout.kind();
    reg.strides = layout.strides;
    reg.region = protocol::region_kind::cpu_memfd;
  } else {
    reg.model = options_.model;
    reg.layout_kind = options_.model.attention == attention_kind::mla ? kv_layout_kind::mla : options_.layout_kind;
    reg.region = protocol::region_kind::none;
  }
  return reg;
}

template <class Bus>
bool connector<Bus>::wait_ready(std::chrono::milliseconds timeout) {
  return link_.wait_ready(timeout);
}

template <class Bus>
std::uint64_t connector<Bus>::progress() const {
  std::lock_guard g(mu());
  return progress_;
}

template <class Bus>
bool connector<Bus>::wait_progress(std::uint64_t seen, std::chrono::microseconds timeout) {
  std::unique_lock lock(mu());
  return wait_for_locked(lock, timeout, [&] { return progress_ != seen; });
}

template <class Bus>
health_state connector<Bus>::state() const {
  std::lock_guard g(mu());
  return link_.state_locked();
}

template <class Bus>
std::string connector<Bus>::last_error() const {
  std::lock_guard g(mu());
  return link_.last_error_locked();
}

template <class Bus>
std::uint64_t connector<Bus>::boot_token() const {
  std::lock_guard g(mu());
  return link_.boot_token_locked();
}

template <class Bus>
connector_stats connector<Bus>::stats() const {
  std::lock_guard g(mu());
  const detail::link_stats l = link_.stats_locked();
  connector_stats s;
  s.registrations = l.registrations;
  s.late_replies = l.late_replies;
  s.progress_messages = l.progress_messages;
  s.ignored_progress = l.ignored_progress;
  s.calls_issued = l.calls_issued;
  s.calls_sent_by_caller = l.calls_sent_by_caller;
  s.pending_calls = l.pending_calls;
  s.tracked_requests = tracker_.tracked();
  s.lookups = lookups_.size();
  s.open_connections = l.open_connections;
  s.descriptions_sent = descriptions_sent_;
  s.chunks_described = chunks_described_;
  s.quarantined_blocks = quarantine_.size();
  s.unhealthy_ns = l.unhealthy_ns;
  return s;
}

// ---------------------------------------------------------------------------------------
// The link's edges
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::on_healthy_locked(bool reconnect, bool restarted, std::uint64_t unhealthy_ns) {
  // A new connection (perhaps another server, which may publish KV events): it is asked
  // afresh, and nothing counts as described on it.
  ++describe_generation_;
  describe_state_ = describe_state::unknown;
  described_.clear();
  described_order_.clear();
  if (reconnect) bus_.publish(bus::connector_reconnected{options_.rank, restarted});
  bus_.publish(bus::connector_healthy{options_.rank, unhealthy_ns});
}

template <class Bus>
void connector<Bus>::on_unhealthy_locked(std::string_view reason, std::size_t released_transfers) {
  std::size_t released = released_transfers;
  for (const auto& [id, e] : lookups_)
    if (!e.answered) ++released;
  bus_.publish(bus::connector_unhealthy{options_.rank, reason, static_cast<std::uint32_t>(released)});
}

template <class Bus>
void connector<Bus>::after_unhealthy_locked() {
  // Lookups still pending answer 0: the engine must not wait for the server.
  std::vector<std::pair<std::string, std::uint64_t>> pending;
  for (const auto& [id, e] : lookups_)
    if (!e.answered) pending.emplace_back(id, e.serial);
  for (const auto& [id, serial] : pending)
    if (lookup_entry* e = find_lookup_locked(id, serial); e != nullptr && !e->answered)
      answer_lookup_locked(id, *e, 0, bus::connector_outcome::unhealthy);
}

template <class Bus>
void connector<Bus>::on_peer_refused_locked(std::uint32_t uid, std::uint32_t pid, std::uint32_t expected) {
  bus_.publish(bus::connector_peer_refused{options_.rank, uid, pid, expected});
}

template <class Bus>
void connector<Bus>::on_copies_over_locked(std::uint64_t epoch) {
  if (const std::size_t n = quarantine_.release_epoch(epoch); n != 0) publish_quarantine_locked(0, n);
}

template <class Bus>
void connector<Bus>::on_late_reply_locked(std::uint64_t id) {
  // The late answer of a call whose blocks are quarantined: the server's copy is over.
  if (quarantine_.holds_call(id))
    if (const std::size_t released = quarantine_.release_call(id); released != 0)
      publish_quarantine_locked(0, released);
}

template <class Bus>
void connector<Bus>::on_retrieve_progress_locked(std::uint64_t id, std::uint32_t layers_ready,
                                                 std::uint32_t chunks_ready) {
  auto it = loads_.find(id);
  if (it == loads_.end()) return;
  load_in_flight& load = it->second;
  // Chunks beyond the request (a server bug) count as the request's; the answer still
  // decides which chunks landed when it comes.
  load.chunks_ready = std::max(load.chunks_ready, std::min(chunks_ready, load.chunks));
  // A server saying more than the model has means every layer.
  const std::uint32_t layers = std::min(layers_ready, region_->layout().model.num_layers);
  if (layers <= load.layers_ready) return;
  load.layers_ready = layers;
  notify_waiters_locked();
}

template <class Bus>
bool connector<Bus>::awaits_late_replies_locked(std::uint64_t epoch) const {
  return quarantine_.holds_epoch(epoch);
}

// ---------------------------------------------------------------------------------------
// Engine-thread helpers
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::check_request_id(std::string_view id) const {
  if (id.empty() || id.size() > protocol::max_request_key_bytes)
    throw std::invalid_argument("kvtier::engine::connector: a request id has 1..256 bytes");
}

template <class Bus>
void connector<Bus>::check_salt(std::string_view salt) {
  if (salt.size() > protocol::max_cache_salt_bytes)
    throw std::invalid_argument("kvtier::engine::connector: a cache salt has at most 256 bytes");
}

template <class Bus>
kv_region& connector<Bus>::region_for(const char* what) const {
  if (region_ == nullptr)
    throw std::logic_error(std::string("kvtier::engine::connector::") + what +
                           ": this connector has no kv_region (a scheduler's); only workers retrieve and store");
  return *region_;
}

template <class Bus>
void connector<Bus>::check_blocks(std::span<const std::uint32_t> block_ids, std::size_t chunks) const {
  if (chunks > protocol::max_chunk_hashes)
    throw std::invalid_argument("kvtier::engine::connector: more than 65536 chunks in one call");
  if (block_ids.size() != chunks * blocks_per_chunk())
    throw std::invalid_argument("kvtier::engine::connector: " + std::to_string(block_ids.size()) + " block ids for " +
                                std::to_string(chunks) + " chunks of " + std::to_string(blocks_per_chunk()) +
                                " blocks");
  for (std::uint32_t b : block_ids)
    if (b >= region_->layout().num_blocks)
      throw std::invalid_argument("kvtier::engine::connector: block id " + std::to_string(b) +
                                  " is not below num_blocks " + std::to_string(region_->layout().num_blocks));
}

template <class Bus>
std::vector<hash128> connector<Bus>::hashes_of(std::span<const token_id> tokens, std::uint32_t first_chunk,
                                               std::size_t chunks) const {
  const std::size_t need = (std::size_t{first_chunk} + chunks) * options_.chunk_tokens;
  if (tokens.size() < need)
    throw std::invalid_argument("kvtier::engine::connector: chunks up to " + std::to_string(first_chunk + chunks) +
                                " need " + std::to_string(need) + " tokens, got " + std::to_string(tokens.size()));
  std::vector<hash128> all = hasher_.chunk_hashes(tokens.first(need));
  return {all.begin() + first_chunk, all.end()};
}

template <class Bus>
bus::connector_outcome connector<Bus>::outcome_of(call_status s) noexcept {
  switch (s) {
    case call_status::reply:
      return bus::connector_outcome::ok;
    case call_status::error_reply:
      return bus::connector_outcome::failed;
    case call_status::timeout:
      return bus::connector_outcome::timeout;
    case call_status::unhealthy:
    case call_status::closed:
      return bus::connector_outcome::unhealthy;
  }
  return bus::connector_outcome::failed;
}

template <class Bus>
boost::asio::awaitable<void> connector<Bus>::housekeeping() {
  namespace asio = boost::asio;
  asio::steady_timer t(link_.executor());
  for (;;) {
    t.expires_after(scaled(options_.timeouts.ping_interval));
    co_await t.async_wait(asio::as_tuple(asio::use_awaitable));
    std::lock_guard g(mu());
    if (link_.stopping_locked()) co_return;
    const auto cutoff = clock::now() - scaled(options_.timeouts.quarantine_limit);
    if (const std::size_t n = quarantine_.release_held_before(cutoff); n != 0) {
      publish_quarantine_locked(0, n);
      link_.retire_connections_locked();
    }
  }
}

}  // namespace engine
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
