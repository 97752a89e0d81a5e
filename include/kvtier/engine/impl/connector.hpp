#pragma once
// Definitions of engine::connector (declarations and documentation: kvtier/engine/connector.hpp).
//
// Threads: the engine's threads call the public functions; the connector's own thread runs
// the io_context: the connection lifecycle (connect, handshake, register, ping loop,
// backoff), one reader per connection, call deadlines, lookup queries and the pidfd watches.
// Shared state is guarded by mu_; Asio objects are touched on the connector's thread only
// (engine threads insert a call into calls_ and post its sending). A call completes exactly
// once, with mu_ held, by whichever comes first: its reply (reader), its deadline, the
// unhealthy edge, or the failure of its connection during the handshake.

#include <kvtier/engine/connector.hpp>

#include <pthread.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <variant>

namespace kvtier::inline KVTIER_ABI_TAG::engine {

namespace detail {
/// co_spawn completion: a coroutine of the connector that throws is a bug; fail loudly.
inline void rethrow_if(std::exception_ptr e) {
  if (e) std::rethrow_exception(e);
}
/// EOF, or its forms on the write side and after a crash: the server closed its end.
inline bool closed_by_peer(const boost::system::error_code& ec) noexcept {
  return ec == boost::asio::error::eof || ec == boost::asio::error::broken_pipe ||
         ec == boost::asio::error::connection_reset;
}
inline std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count());
}
}  // namespace detail

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
      io_(std::make_unique<boost::asio::io_context>(1)),
      breaker_(options_.breaker_threshold),
      tracker_(options_.finished_window),
      quarantine_(region ? region->layout().num_blocks : 0),
      is_load_error_(region ? region->layout().num_blocks : 0, false) {
  work_.emplace(io_->get_executor());
  ex_ = io_->get_executor();
  ping_timer_.emplace(ex_);
  retry_timer_.emplace(ex_);
  boost::asio::co_spawn(ex_, lifecycle(), detail::rethrow_if);
  if (options_.timeouts.quarantine_limit.count() > 0) boost::asio::co_spawn(ex_, housekeeping(), detail::rethrow_if);
  thread_ = std::thread([this] { io_->run(); });
  ::pthread_setname_np(thread_.native_handle(), "kvtier-connect");  // 15 chars max; for top/gdb
}

template <class Bus>
connector<Bus>::~connector() {
  {
    std::lock_guard g(mu_);
    stopping_ = true;
    healthy_.store(false, std::memory_order_release);
  }
  work_.reset();
  io_->stop();
  if (thread_.joinable()) thread_.join();
  // Asio objects go before their io_context; the context then destroys the coroutine frames
  // still suspended in it (their sockets and timers with them).
  calls_.clear();
  peers_.clear();
  ping_timer_.reset();
  retry_timer_.reset();
  io_.reset();
}

template <class Bus>
bool connector<Bus>::wait_ready(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return ready_cv_.wait_for(lock, timeout, [&] { return state_ == health_state::healthy; });
}

template <class Bus>
health_state connector<Bus>::state() const {
  std::lock_guard g(mu_);
  return state_;
}

template <class Bus>
std::string connector<Bus>::last_error() const {
  std::lock_guard g(mu_);
  return last_error_;
}

template <class Bus>
std::uint64_t connector<Bus>::boot_token() const {
  std::lock_guard g(mu_);
  return boot_token_.value_or(0);
}

template <class Bus>
connector_stats connector<Bus>::stats() const {
  std::lock_guard g(mu_);
  connector_stats s = stats_;
  s.pending_calls = calls_.size();
  s.tracked_requests = tracker_.tracked();
  s.lookups = lookups_.size();
  s.open_connections = 0;
  for (const auto& [epoch, p] : peers_)
    if (!p->broken) ++s.open_connections;
  return s;
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
template <class Msg>
std::vector<std::byte> connector<Bus>::encode(std::uint64_t call_id, const Msg& m) {
  auto r = protocol::encode_frame(call_id, m);
  if (!r)
    throw std::invalid_argument("kvtier::engine::connector: cannot encode " + std::string(protocol::name(Msg::type)) +
                                ": " + r.error().message());
  return std::move(*r);
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

// ---------------------------------------------------------------------------------------
// Scheduler side
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::lookup(std::string_view request_id, std::span<const token_id> tokens,
                            std::string_view cache_salt) {
  if (!options_.is_scheduler())
    throw std::logic_error(
        "kvtier::engine::connector::lookup: only the scheduler's connector looks up "
        "(connector_options::scheduler)");
  check_request_id(request_id);
  {
    std::lock_guard g(mu_);
    if (lookups_.contains(std::string(request_id))) return;  // idempotent: do not even hash again
  }
  lookup_hashes(request_id, hasher_.chunk_hashes(tokens), cache_salt);
}

template <class Bus>
void connector<Bus>::lookup_hashes(std::string_view request_id, std::vector<hash128> hashes,
                                   std::string_view cache_salt) {
  if (!options_.is_scheduler())
    throw std::logic_error(
        "kvtier::engine::connector::lookup: only the scheduler's connector looks up "
        "(connector_options::scheduler)");
  check_request_id(request_id);
  check_salt(cache_salt);
  if (hashes.size() > protocol::max_chunk_hashes)
    throw std::invalid_argument("kvtier::engine::connector: more than 65536 chunks in one lookup");
  std::string key(request_id);
  std::lock_guard g(mu_);
  auto [it, inserted] = lookups_.try_emplace(key);
  if (!inserted) return;
  lookup_entry& e = it->second;
  e.serial = next_lookup_serial_++;
  e.requested_chunks = static_cast<std::uint32_t>(hashes.size());
  e.started = clock::now();
  e.deadline = e.started + scaled(options_.timeouts.lookup_timeout);
  if (hashes.empty()) return answer_lookup_locked(key, e, 0, bus::connector_outcome::ok);
  if (state_ != health_state::healthy) return answer_lookup_locked(key, e, 0, bus::connector_outcome::unhealthy);
  e.hashes = std::move(hashes);
  e.cache_salt = std::string(cache_salt);
  boost::asio::post(ex_, [this, key, serial = e.serial] { start_lookup_io(key, serial); });
}

template <class Bus>
std::optional<std::size_t> connector<Bus>::lookup_result(std::string_view request_id) const {
  std::lock_guard g(mu_);
  auto it = lookups_.find(std::string(request_id));
  if (it == lookups_.end()) return std::size_t{0};
  if (!it->second.answered) return std::nullopt;
  return it->second.tokens;
}

template <class Bus>
void connector<Bus>::free_lookup_locks(std::string_view request_id) {
  check_request_id(request_id);
  std::lock_guard g(mu_);
  send_notify_locked(protocol::free_lookup_locks_request{std::string(request_id)});
}

template <class Bus>
void connector<Bus>::end_request(std::string_view request_id) {
  check_request_id(request_id);
  std::lock_guard g(mu_);
  lookups_.erase(std::string(request_id));
  send_notify_locked(protocol::end_request_request{std::string(request_id)});
}

template <class Bus>
template <class Msg>
void connector<Bus>::send_notify_locked(const Msg& m) {
  if (state_ != health_state::healthy || stopping_) return;
  const std::uint64_t id = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  issue_locked(id, call_kind::notify, current_epoch_, Msg::response_type::type, encode(id, m), -1,
               scaled(options_.timeouts.request_timeout), {});
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
  e.hashes = {};
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
void connector<Bus>::start_lookup_io(const std::string& id, std::uint64_t serial) {
  std::lock_guard g(mu_);
  if (stopping_) return;
  lookup_entry* e = find_lookup_locked(id, serial);
  if (e == nullptr || e->answered) return;
  if (state_ != health_state::healthy) return answer_lookup_locked(id, *e, 0, bus::connector_outcome::unhealthy);
  const std::uint64_t cid = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  protocol::lookup_request req{id, model_id_, options_.world_size, std::move(e->hashes), std::move(e->cache_salt)};
  e->hashes = {};
  e->cache_salt = {};
  issue_locked(cid, call_kind::lookup, current_epoch_, protocol::lookup_response::type, encode(cid, req), -1,
               scaled(options_.timeouts.request_timeout),
               [this, id, serial](pending_call&, call_result& r) { on_lookup_reply_io(id, serial, r, true); });
}

template <class Bus>
void connector<Bus>::issue_query_locked(const std::string& id, std::uint64_t serial) {
  const lookup_entry* e = find_lookup_locked(id, serial);
  if (e == nullptr) return;
  // The server answers when the prefetch is decided (within its own wait budget); we wait
  // until the lookup's deadline at most.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(e->deadline - clock::now());
  const std::uint64_t cid = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  issue_locked(cid, call_kind::query, current_epoch_, protocol::query_prefetch_response::type,
               encode(cid, protocol::query_prefetch_request{id}), -1, std::max(left, std::chrono::milliseconds(1)),
               [this, id, serial](pending_call&, call_result& r) { on_lookup_reply_io(id, serial, r, false); });
}

template <class Bus>
void connector<Bus>::on_lookup_reply_io(const std::string& id, std::uint64_t serial, call_result& r, bool ack) {
  lookup_entry* e = find_lookup_locked(id, serial);
  if (e == nullptr) {
    // end_request came first (its frame may even have overtaken the lookup's): make sure
    // the server forgets the lookup it just accepted.
    if (ack && r.status == call_status::reply) send_notify_locked(protocol::end_request_request{id});
    return;
  }
  if (e->answered) return;
  if (r.status != call_status::reply) {
    answer_lookup_locked(id, *e, 0, outcome_of(r.status));
    // The server may hold locks for a lookup whose answer we gave up on.
    if (r.status == call_status::timeout) send_notify_locked(protocol::free_lookup_locks_request{id});
    return;
  }
  // After the ack, the query: the server answers it once the prefetch is decided, so
  // nothing wakes while it waits.
  if (ack) return issue_query_locked(id, serial);
  const auto& q = std::get<protocol::query_prefetch_response>(r.reply);
  switch (q.state) {
    case protocol::prefetch_state::done: {
      const std::size_t chunks = std::min<std::size_t>(q.hit_chunks, e->requested_chunks);
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
  // `pending`: the server's wait ended before the decision (a server that answers at once,
  // or the lookup replaced meanwhile): ask again, the server waits again. No timer.
  if (state_ == health_state::healthy) issue_query_locked(id, serial);
}

// ---------------------------------------------------------------------------------------
// Worker side
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::retrieve(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                              std::span<const std::uint32_t> block_ids, std::uint32_t skip_tokens,
                              std::string_view cache_salt) {
  region_for("retrieve");
  if (block_ids.size() % blocks_per_chunk() != 0)
    throw std::invalid_argument("kvtier::engine::connector::retrieve: block ids are not whole chunks");
  const std::size_t chunks = block_ids.size() / blocks_per_chunk();
  const std::vector<hash128> hashes = hashes_of(tokens, first_chunk, chunks);
  retrieve_hashes(request_id, hashes, first_chunk, block_ids, skip_tokens, cache_salt);
}

template <class Bus>
void connector<Bus>::retrieve_hashes(std::string_view request_id, std::span<const hash128> hashes,
                                     std::uint32_t first_chunk, std::span<const std::uint32_t> block_ids,
                                     std::uint32_t skip_tokens, std::string_view cache_salt) {
  region_for("retrieve");
  check_request_id(request_id);
  check_salt(cache_salt);
  check_blocks(block_ids, hashes.size());
  if (std::uint64_t{skip_tokens} > std::uint64_t{hashes.size()} * options_.chunk_tokens)
    throw std::invalid_argument("kvtier::engine::connector::retrieve: skip_tokens exceeds the range");
  auto info = std::make_shared<retrieve_info>();
  info->request_id = std::string(request_id);
  info->block_ids.assign(block_ids.begin(), block_ids.end());
  info->chunks = static_cast<std::uint32_t>(hashes.size());
  info->skip_tokens = skip_tokens;
  info->started = clock::now();
  const std::uint64_t cid = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::byte> bytes;
  if (info->chunks != 0)
    bytes = encode(cid, protocol::retrieve_request{info->request_id, options_.rank, first_chunk,
                                                   std::vector<hash128>(hashes.begin(), hashes.end()), info->block_ids,
                                                   skip_tokens, std::string(cache_salt)});
  std::lock_guard g(mu_);
  tracker_.retrieve_started(info->request_id);
  if (info->chunks == 0) return finish_retrieve_locked(*info, 0, bus::connector_outcome::ok, nullptr);
  if (state_ != health_state::healthy)
    return finish_retrieve_locked(*info, 0, bus::connector_outcome::unhealthy, nullptr);
  issue_locked(cid, call_kind::retrieve, current_epoch_, protocol::retrieve_response::type, std::move(bytes), -1,
               scaled(options_.timeouts.retrieve_timeout), [this, info](pending_call& c, call_result& r) {
                 std::uint32_t got = 0;
                 auto outcome = outcome_of(r.status);
                 if (r.status == call_status::reply) {
                   got = std::min(std::get<protocol::retrieve_response>(r.reply).retrieved_chunks, info->chunks);
                   outcome = got == info->chunks ? bus::connector_outcome::ok : bus::connector_outcome::partial;
                 }
                 finish_retrieve_locked(*info, got, outcome, &c);
               });
}

template <class Bus>
void connector<Bus>::finish_retrieve_locked(const retrieve_info& info, std::uint32_t retrieved,
                                            bus::connector_outcome outcome, const pending_call* call) {
  const std::uint32_t bpc = blocks_per_chunk();
  const std::uint64_t ct = options_.chunk_tokens;
  const std::uint64_t bs = region_->layout().block_size;
  // The blocks of the chunks that did not land, but those entirely inside the skipped prefix
  // (never to be written: the engine's own KV).
  std::vector<std::uint32_t> affected;
  for (std::uint32_t i = retrieved; i < info.chunks; ++i)
    for (std::uint32_t j = 0; j < bpc; ++j)
      if (i * ct + (j + 1) * bs > info.skip_tokens) affected.push_back(info.block_ids[std::size_t{i} * bpc + j]);
  std::size_t held = 0;
  // A call the server may still act on: its blocks wait for a proof that no copy can follow
  // (its answer, the connection's close by the server, the process's death). Released
  // because the server closed the connection: that is the proof already.
  const auto pit = call != nullptr ? peers_.find(call->epoch) : peers_.end();
  const bool closed_by_server = pit != peers_.end() && pit->second->closed_by_server;
  if (call != nullptr && call->sent && !closed_by_server &&
      (outcome == bus::connector_outcome::timeout || outcome == bus::connector_outcome::unhealthy))
    held = quarantine_.hold(call->id, call->epoch, affected);
  for (std::uint32_t b : affected)
    if (!is_load_error_[b]) {
      is_load_error_[b] = true;
      load_errors_.push_back(b);
    }
  tracker_.retrieve_done(info.request_id);
  // The completion comes last: whoever waits for it sees the retrieve's other events.
  if (!affected.empty())
    bus_.publish(bus::connector_load_error{options_.rank, outcome, static_cast<std::uint32_t>(affected.size())});
  if (held != 0) publish_quarantine_locked(held, 0);
  bus_.publish(bus::connector_retrieve_completed{options_.rank, outcome, info.chunks, retrieved,
                                                 static_cast<std::uint32_t>(affected.size()),
                                                 detail::elapsed_ns(info.started)});
}

template <class Bus>
void connector<Bus>::store(std::string_view request_id, std::span<const token_id> tokens, std::uint32_t first_chunk,
                           std::uint32_t chunk_count, std::span<const std::uint32_t> block_ids,
                           std::string_view cache_salt) {
  region_for("store");
  if (block_ids.size() != std::size_t{chunk_count} * blocks_per_chunk())
    throw std::invalid_argument("kvtier::engine::connector::store: " + std::to_string(block_ids.size()) +
                                " block ids for " + std::to_string(chunk_count) + " chunks");
  const std::vector<hash128> hashes = hashes_of(tokens, first_chunk, chunk_count);
  store_hashes(request_id, hashes, first_chunk, block_ids, cache_salt);
}

template <class Bus>
void connector<Bus>::store_hashes(std::string_view request_id, std::span<const hash128> hashes,
                                  std::uint32_t first_chunk, std::span<const std::uint32_t> block_ids,
                                  std::string_view cache_salt) {
  kv_region& region = region_for("store");
  check_request_id(request_id);
  check_salt(cache_salt);
  check_blocks(block_ids, hashes.size());
  // The fencing values: read now, at issue time, after the forward pass wrote the blocks.
  std::vector<std::uint64_t> generations(block_ids.size());
  for (std::size_t i = 0; i < block_ids.size(); ++i) generations[i] = region.generation(block_ids[i]);
  auto info = std::make_shared<store_info>();
  info->request_id = std::string(request_id);
  info->chunks = static_cast<std::uint32_t>(hashes.size());
  info->started = clock::now();
  const std::uint64_t cid = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::byte> bytes;
  if (info->chunks != 0)
    bytes = encode(cid, protocol::store_request{info->request_id, options_.rank, first_chunk,
                                                std::vector<hash128>(hashes.begin(), hashes.end()),
                                                std::vector<std::uint32_t>(block_ids.begin(), block_ids.end()),
                                                std::move(generations), std::string(cache_salt)});
  std::lock_guard g(mu_);
  tracker_.store_started(info->request_id);
  if (info->chunks == 0) return finish_store_locked(*info, nullptr, bus::connector_outcome::ok);
  if (state_ != health_state::healthy) return finish_store_locked(*info, nullptr, bus::connector_outcome::unhealthy);
  issue_locked(cid, call_kind::store, current_epoch_, protocol::store_response::type, std::move(bytes), -1,
               scaled(options_.timeouts.store_timeout),
               [this, info](pending_call&, call_result& r) { finish_store_locked(*info, &r, outcome_of(r.status)); });
}

template <class Bus>
void connector<Bus>::finish_store_locked(const store_info& info, const call_result* r, bus::connector_outcome outcome) {
  bus::connector_store_completed e{options_.rank, outcome, info.chunks};
  if (r != nullptr && r->status == call_status::reply) {
    const auto& s = std::get<protocol::store_response>(r->reply);
    e.stored_chunks = s.stored;
    e.already_present_chunks = s.already_present;
    e.failed_chunks = s.failed;
  }
  e.duration_ns = detail::elapsed_ns(info.started);
  tracker_.store_done(info.request_id);
  bus_.publish(e);
}

template <class Bus>
finished_requests connector<Bus>::get_finished(std::span<const std::string> finished_by_engine) {
  std::lock_guard g(mu_);
  // While unhealthy nothing is in flight (the edge released every call and new ones are
  // skipped), so this drains nothing; it is the rule's safety net.
  if (state_ == health_state::unhealthy) tracker_.drain();
  return tracker_.take_finished(finished_by_engine);
}

template <class Bus>
std::vector<std::uint32_t> connector<Bus>::take_load_error_blocks() {
  std::lock_guard g(mu_);
  std::vector<std::uint32_t> out = std::move(load_errors_);
  load_errors_.clear();
  for (std::uint32_t b : out) is_load_error_[b] = false;
  return out;
}

// ---------------------------------------------------------------------------------------
// Fencing
// ---------------------------------------------------------------------------------------

template <class Bus>
bool connector<Bus>::block_is_quarantined(std::uint32_t block) const {
  std::lock_guard g(mu_);
  return quarantine_.contains(block);
}

template <class Bus>
std::vector<std::uint32_t> connector<Bus>::quarantined_blocks() const {
  std::lock_guard g(mu_);
  return quarantine_.blocks();
}

template <class Bus>
bool connector<Bus>::block_reused(std::uint32_t block) {
  kv_region& region = region_for("block_reused");
  if (block >= region.layout().num_blocks)
    throw std::out_of_range("kvtier::engine::connector::block_reused: block id out of range");
  std::lock_guard g(mu_);
  if (quarantine_.contains(block)) return false;
  region.begin_reuse(block);
  return true;
}

template <class Bus>
void connector<Bus>::publish_quarantine_locked(std::size_t held, std::size_t released) {
  bus_.publish(bus::connector_quarantine_changed{options_.rank, static_cast<std::uint32_t>(held),
                                                 static_cast<std::uint32_t>(released),
                                                 static_cast<std::uint32_t>(quarantine_.size())});
}

// ---------------------------------------------------------------------------------------
// Calls
// ---------------------------------------------------------------------------------------

template <class Bus>
void connector<Bus>::issue_locked(std::uint64_t id, call_kind kind, std::uint64_t epoch, protocol::message_type expect,
                                  std::vector<std::byte> bytes, int fd, clock::duration timeout, call_done done) {
  auto c = std::make_shared<pending_call>();
  c->id = id;
  c->kind = kind;
  c->epoch = epoch;
  c->expect = expect;
  c->timeout = timeout;
  c->bytes = std::move(bytes);
  c->fd = fd;
  c->done = std::move(done);
  calls_.emplace(id, std::move(c));
  ++stats_.calls_issued;
  // Never completes inside this call: the sending (and everything after) runs on the thread.
  boost::asio::post(ex_, [this, id] { send_io(id); });
}

template <class Bus>
void connector<Bus>::complete_locked(pending_call& c, call_result r) {
  if (c.deadline) c.deadline->cancel();
  if (c.done) c.done(c, r);
}

template <class Bus>
void connector<Bus>::send_io(std::uint64_t id) {
  std::lock_guard g(mu_);
  if (stopping_) return;
  auto it = calls_.find(id);
  if (it == calls_.end()) return;  // released before it could be sent
  std::shared_ptr<pending_call> c = it->second;
  auto pit = peers_.find(c->epoch);
  if (pit == peers_.end() || pit->second->broken) {
    calls_.erase(it);
    return complete_locked(*c, call_result{call_status::closed, {}, "connection gone"});
  }
  c->deadline.emplace(ex_);
  c->deadline->expires_after(c->timeout);
  c->deadline->async_wait([this, id](error_code ec) {
    if (!ec) on_deadline_io(id);
  });
  c->sent = true;
  const std::uint64_t epoch = c->epoch;
  pit->second->conn->async_write_frame(std::move(c->bytes), c->fd, [this, epoch](error_code ec) {
    if (!ec || ec == boost::asio::error::operation_aborted) return;
    std::lock_guard lg(mu_);
    if (stopping_) return;
    if (auto p = peers_.find(epoch); p != peers_.end()) {
      const bool closed = detail::closed_by_peer(ec);
      last_error_ = closed ? "the server closed the connection" : "socket error: " + ec.message();
      on_peer_broken_io(*p->second, closed ? "eof" : "socket_error", closed);
    }
  });
}

template <class Bus>
void connector<Bus>::on_deadline_io(std::uint64_t id) {
  std::lock_guard g(mu_);
  if (stopping_) return;
  auto it = calls_.find(id);
  if (it == calls_.end()) return;
  std::shared_ptr<pending_call> c = it->second;
  calls_.erase(it);
  complete_locked(*c, call_result{call_status::timeout, {}, "deadline passed"});
  // Work (not pings, not the handshake) timing out again and again: the server answers
  // pings but does nothing else.
  // A query waits server-side for the prefetch's decision: its deadline is the lookup's,
  // and a prefetch slower than that is no sign of a hung server.
  const bool work = c->kind != call_kind::control && c->kind != call_kind::ping && c->kind != call_kind::query;
  if (work && c->epoch == current_epoch_ && state_ == health_state::healthy && breaker_.on_timeout()) {
    last_error_ = std::to_string(breaker_.threshold()) + " calls in a row timed out";
    mark_unhealthy_io("timeouts");
  }
}

template <class Bus>
template <class Msg>
boost::asio::awaitable<typename connector<Bus>::call_result> connector<Bus>::async_call(call_kind kind,
                                                                                        std::uint64_t epoch,
                                                                                        const Msg& m, int fd,
                                                                                        clock::duration timeout) {
  auto w = std::make_shared<call_waiter>(ex_);
  const std::uint64_t id = next_call_id_.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::byte> bytes = encode(id, m);
  {
    std::lock_guard g(mu_);
    if (stopping_) co_return call_result{call_status::closed, {}, "stopping"};
    issue_locked(id, kind, epoch, Msg::response_type::type, std::move(bytes), fd, timeout,
                 [w](pending_call&, call_result& r) {
                   w->result = std::move(r);
                   w->timer.expires_at(clock::time_point::min());  // wakes the waiter, now or later
                 });
  }
  if (!w->result) co_await w->timer.async_wait(boost::asio::as_tuple(boost::asio::use_awaitable));
  if (!w->result) co_return call_result{call_status::closed, {}, "stopping"};
  co_return std::move(*w->result);
}

// ---------------------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------------------

template <class Bus>
boost::asio::awaitable<void> connector<Bus>::reader(std::shared_ptr<peer> p) {
  for (;;) {
    auto [ec, f] = co_await p->conn->async_read_frame(boost::asio::as_tuple(boost::asio::use_awaitable));
    std::lock_guard g(mu_);
    if (stopping_) co_return;
    if (ec) {
      if (ec != boost::asio::error::operation_aborted) {
        if (detail::closed_by_peer(ec)) {
          last_error_ = p->refusal.empty() ? "the server closed the connection"
                                           : "the server refused the connection: " + p->refusal;
          on_peer_broken_io(*p, "eof", true);
        } else if (ec.category() == kvtier_category()) {
          if (const auto* why = p->conn->last_read_error()) last_error_ = "bad stream from the server: " + why->reason;
          on_peer_broken_io(*p, "protocol_error", false);
        } else {
          last_error_ = "socket error: " + ec.message();
          on_peer_broken_io(*p, "socket_error", false);
        }
      }
      co_return;
    }
    if (!on_frame_io(*p, std::move(f))) co_return;
  }
}

template <class Bus>
bool connector<Bus>::on_frame_io(peer& p, protocol::frame f) {
  auto decoded = protocol::decode_message(f);
  if (!decoded) {
    last_error_ = "bad reply from the server: " + decoded.error().reason;
    on_peer_broken_io(p, "protocol_error", false);
    return false;
  }
  const std::uint64_t id = f.header.call_id;
  // Call ids start at 1: an error with id 0 answers no call but the connection itself (the
  // server refuses it and closes it: say why in last_error()).
  if (id == 0 && protocol::type_of(*decoded) == protocol::message_type::error_response) {
    p.refusal = std::get<protocol::error_response>(*decoded).message;
    last_error_ = "the server refused the connection: " + p.refusal;
    return true;
  }
  if (auto it = calls_.find(id); it != calls_.end() && it->second->epoch == p.epoch) {
    std::shared_ptr<pending_call> c = it->second;
    calls_.erase(it);
    const protocol::message_type t = protocol::type_of(*decoded);
    call_result r;
    if (t == protocol::message_type::error_response) {
      r.status = call_status::error_reply;
      r.error = std::get<protocol::error_response>(*decoded).message;
    } else if (t == c->expect) {
      r.status = call_status::reply;
      r.reply = std::move(*decoded);
    } else {
      last_error_ =
          "the server answered " + std::string(protocol::name(c->expect)) + " with " + std::string(protocol::name(t));
      complete_locked(*c, call_result{call_status::error_reply, {}, last_error_});
      on_peer_broken_io(p, "protocol_error", false);
      return false;
    }
    if (p.epoch == current_epoch_) breaker_.on_reply();
    const bool forgotten = r.status == call_status::error_reply &&
                           std::get<protocol::error_response>(*decoded).error() == errc::not_registered;
    complete_locked(*c, std::move(r));
    // The server lost this connection's registration without closing it: register again.
    if (forgotten && p.epoch == current_epoch_ && state_ == health_state::healthy) {
      last_error_ = "the server no longer knows this connection's registration";
      mark_unhealthy_io("not_registered");
    }
    return true;
  }
  ++stats_.late_replies;
  // The late answer of a call whose blocks are quarantined: the server's copy is over.
  if (quarantine_.holds_call(id)) {
    if (const std::size_t released = quarantine_.release_call(id); released != 0)
      publish_quarantine_locked(0, released);
    maybe_retire_peer_io(p.epoch);
  }
  return true;
}

template <class Bus>
void connector<Bus>::on_peer_broken_io(peer& p, std::string_view reason, bool server_closed) {
  if (p.broken) return;
  p.broken = true;
  p.closed_by_server = server_closed;
  p.conn->close();
  // The server's close proves its copies for this connection over (docs/protocol.md): the
  // blocks of calls given up on it earlier leave quarantine, and the calls failed below
  // enter none (finish_retrieve_locked).
  if (server_closed)
    if (const std::size_t n = quarantine_.release_epoch(p.epoch); n != 0) publish_quarantine_locked(0, n);
  if (p.epoch == current_epoch_) {
    if (state_ == health_state::healthy)
      mark_unhealthy_io(reason);
    else
      fail_calls_io(p.epoch, call_status::closed);  // the handshake: establish() takes it from here
  } else {
    maybe_retire_peer_io(p.epoch);
  }
}

template <class Bus>
void connector<Bus>::fail_calls_io(std::optional<std::uint64_t> epoch, call_status status) {
  std::vector<std::shared_ptr<pending_call>> victims;
  for (auto it = calls_.begin(); it != calls_.end();) {
    if (!epoch || it->second->epoch == *epoch) {
      victims.push_back(std::move(it->second));
      it = calls_.erase(it);
    } else {
      ++it;
    }
  }
  std::sort(victims.begin(), victims.end(), [](const auto& a, const auto& b) { return a->id < b->id; });
  for (auto& c : victims) complete_locked(*c, call_result{status, {}, "released"});
}

template <class Bus>
void connector<Bus>::mark_unhealthy_io(std::string_view reason) {
  if (state_ == health_state::unhealthy) return;
  state_ = health_state::unhealthy;
  healthy_.store(false, std::memory_order_release);
  unhealthy_since_ = clock::now();
  // Everything waiting on the server is released: the engine must not wait for it.
  std::uint32_t released = 0;
  for (const auto& [id, c] : calls_)
    if (c->kind == call_kind::retrieve || c->kind == call_kind::store) ++released;
  std::vector<std::pair<std::string, std::uint64_t>> pending_lookups;
  for (const auto& [id, e] : lookups_)
    if (!e.answered) pending_lookups.emplace_back(id, e.serial);
  released += static_cast<std::uint32_t>(pending_lookups.size());
  bus_.publish(bus::connector_unhealthy{options_.rank, reason, released});
  fail_calls_io(std::nullopt, call_status::unhealthy);
  for (const auto& [id, serial] : pending_lookups)
    if (lookup_entry* e = find_lookup_locked(id, serial); e != nullptr && !e->answered)
      answer_lookup_locked(id, *e, 0, bus::connector_outcome::unhealthy);
  const std::uint64_t old = std::exchange(current_epoch_, 0);
  if (old != 0) maybe_retire_peer_io(old);
  if (ping_timer_) ping_timer_->cancel();
  ready_cv_.notify_all();
}

template <class Bus>
void connector<Bus>::maybe_retire_peer_io(std::uint64_t epoch) {
  if (epoch == current_epoch_) return;
  auto it = peers_.find(epoch);
  if (it == peers_.end()) return;
  peer& p = *it->second;
  // Kept while the server may still write blocks it was handed on this connection: its late
  // replies arrive here, and its pidfd tells when it is gone.
  if (quarantine_.holds_epoch(epoch) && !p.process_gone) return;
  p.conn->close();
  if (p.pidfd) {
    error_code ignored;
    p.pidfd->close(ignored);
  }
  peers_.erase(it);
}

template <class Bus>
void connector<Bus>::watch_process_io(const std::shared_ptr<peer>& p) {
  p->pidfd->async_wait(boost::asio::posix::descriptor_base::wait_read, [this, p](error_code ec) {
    if (ec) return;
    std::lock_guard g(mu_);
    if (stopping_) return;
    p->process_gone = true;
    if (const std::size_t n = quarantine_.release_epoch(p->epoch); n != 0) publish_quarantine_locked(0, n);
    maybe_retire_peer_io(p->epoch);
  });
}

template <class Bus>
std::string connector<Bus>::fail_handshake_locked(std::uint64_t epoch, std::string_view reason, std::string message) {
  last_error_ = std::move(message);
  fail_calls_io(epoch, call_status::closed);
  if (current_epoch_ == epoch) current_epoch_ = 0;
  if (auto it = peers_.find(epoch); it != peers_.end()) {
    it->second->broken = true;
    it->second->conn->close();
  }
  maybe_retire_peer_io(epoch);
  mark_unhealthy_io(reason);  // only an edge when it was starting (a failed retry changes nothing)
  return std::string(reason);
}

template <class Bus>
boost::asio::awaitable<std::string> connector<Bus>::establish() {
  namespace asio = boost::asio;
  auto [ec, socket] =
      co_await protocol::async_connect_unix(ex_, options_.socket_path, asio::as_tuple(asio::use_awaitable));
  if (ec) {
    std::lock_guard g(mu_);
    if (stopping_) co_return "stopping";
    last_error_ = "cannot connect to " + options_.socket_path + ": " + ec.message();
    mark_unhealthy_io("connect_failed");
    co_return "connect_failed";
  }
  // Who listens there: the server's user (or root), else nothing is sent (the memfd least of
  // all). A local user who listened on the path first gets refused here.
  if (const auto who = protocol::peer_credentials(socket.native_handle());
      !who || (who->uid != options_.server_uid.value_or(::geteuid()) && who->uid != 0)) {
    error_code ignored;
    socket.close(ignored);
    std::lock_guard g(mu_);
    if (stopping_) co_return "stopping";
    const ::uid_t expected = options_.server_uid.value_or(::geteuid());
    last_error_ = !who ? "cannot read the credentials of the server at " + options_.socket_path + " (" +
                             who.error().message() + "): not connecting"
                       : "refusing the server at " + options_.socket_path + ": its process runs as " + who->describe() +
                             ", not as uid " + std::to_string(expected) +
                             " (another user may be listening on this path); if the server runs under a service "
                             "account, set connector_options::server_uid to its uid";
    if (who)
      bus_.publish(
          bus::connector_peer_refused{options_.rank, who->uid, static_cast<std::uint32_t>(who->pid), expected});
    mark_unhealthy_io("peer_refused");
    co_return "peer_refused";
  }
  auto p = std::make_shared<peer>();
  p->pid = detail::peer_pid(socket.native_handle());
  const int pidfd = detail::open_pidfd(p->pid);
  p->conn = std::make_shared<protocol::connection>(std::move(socket));
  if (pidfd >= 0) p->pidfd.emplace(ex_, pidfd);
  std::uint64_t epoch = 0;
  {
    std::lock_guard g(mu_);
    if (stopping_) co_return "stopping";
    epoch = ++next_epoch_;
    p->epoch = epoch;
    peers_[epoch] = p;
    current_epoch_ = epoch;
    breaker_.reset();
    if (p->pidfd) watch_process_io(p);
  }
  asio::co_spawn(ex_, reader(p), detail::rethrow_if);

  const auto request_timeout = scaled(options_.timeouts.request_timeout);
  const auto why = [](const call_result& r) {
    return r.status == call_status::timeout       ? "handshake_timeout"
           : r.status == call_status::error_reply ? "handshake_error"
                                                  : "eof";
  };
  const protocol::get_chunk_size_request chunk_size_query;
  call_result r = co_await async_call(call_kind::control, epoch, chunk_size_query, -1, request_timeout);
  if (r.status != call_status::reply) {
    std::lock_guard g(mu_);
    co_return fail_handshake_locked(epoch, why(r),
                                    "get_chunk_size failed: " + (r.error.empty() ? std::string(why(r)) : r.error));
  }
  const std::uint32_t server_chunk = std::get<protocol::get_chunk_size_response>(r.reply).chunk_tokens;
  if (server_chunk != options_.chunk_tokens) {
    std::lock_guard g(mu_);
    co_return fail_handshake_locked(epoch, "chunk_size_mismatch",
                                    "the server uses chunk_tokens=" + std::to_string(server_chunk) +
                                        ", this connector " + std::to_string(options_.chunk_tokens) +
                                        ": configure both with the same chunk size");
  }
  protocol::register_kv_request reg;
  reg.instance_id = instance_id_;
  reg.rank = options_.rank;
  reg.world_size = options_.world_size;
  reg.model_name = options_.model_name;
  reg.chunk_tokens = options_.chunk_tokens;
  reg.cache_salt = options_.cache_salt;
  reg.prefill_tokens_per_second = options_.prefill_tokens_per_second;
  if (region_ != nullptr) {
    const paged_kv_layout& layout = region_->layout();
    reg.model = layout.model;
    reg.block_size = layout.block_size;
    reg.num_blocks = layout.num_blocks;
    reg.region_bytes = region_->bytes();
    reg.layout_kind = layout.kind();
    reg.region = protocol::region_kind::cpu_memfd;
  } else {
    reg.model = options_.model;
    reg.layout_kind = options_.model.attention == attention_kind::mla ? kv_layout_kind::mla : options_.layout_kind;
    reg.region = protocol::region_kind::none;
  }
  r = co_await async_call(call_kind::control, epoch, reg, region_ != nullptr ? region_->fd() : -1, request_timeout);
  std::lock_guard g(mu_);
  if (stopping_) co_return "stopping";
  if (r.status == call_status::error_reply)
    co_return fail_handshake_locked(epoch, "register_failed", "the server refused the registration: " + r.error);
  if (r.status != call_status::reply)
    co_return fail_handshake_locked(epoch, why(r), "register failed: " + std::string(why(r)));
  if (p->broken || current_epoch_ != epoch)
    co_return fail_handshake_locked(epoch, "eof", "connection lost while registering");
  const auto& resp = std::get<protocol::register_kv_response>(r.reply);
  const bool reconnect = boot_token_.has_value();
  const bool restarted = reconnect && *boot_token_ != resp.boot_token;
  boot_token_ = resp.boot_token;
  model_id_ = resp.model_id;
  const bool was_unhealthy = state_ == health_state::unhealthy;
  state_ = health_state::healthy;
  healthy_.store(true, std::memory_order_release);
  ++stats_.registrations;
  if (reconnect) bus_.publish(bus::connector_reconnected{options_.rank, restarted});
  bus_.publish(bus::connector_healthy{options_.rank, was_unhealthy ? detail::elapsed_ns(unhealthy_since_) : 0});
  ready_cv_.notify_all();
  co_return std::string{};
}

template <class Bus>
boost::asio::awaitable<void> connector<Bus>::ping_loop(std::uint64_t epoch) {
  namespace asio = boost::asio;
  for (;;) {
    {
      std::lock_guard g(mu_);
      if (stopping_ || epoch != current_epoch_ || state_ != health_state::healthy) co_return;
    }
    const protocol::ping_request ping{instance_id_};
    call_result r = co_await async_call(call_kind::ping, epoch, ping, -1, scaled(options_.timeouts.ping_timeout));
    {
      std::lock_guard g(mu_);
      if (stopping_ || epoch != current_epoch_ || state_ != health_state::healthy) co_return;
      if (r.status == call_status::timeout) {
        last_error_ =
            "the server left a ping unanswered for " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::milliseconds>(scaled(options_.timeouts.ping_timeout)).count()) +
            " ms";
        mark_unhealthy_io("ping_timeout");
        co_return;
      }
      if (r.status == call_status::error_reply) {
        last_error_ = "the server answered a ping with an error: " + r.error;
        mark_unhealthy_io("ping_error");
        co_return;
      }
      if (r.status != call_status::reply) co_return;
      const auto& pr = std::get<protocol::ping_response>(r.reply);
      if (boot_token_ && pr.boot_token != *boot_token_) {
        last_error_ = "the server's boot token changed under a live connection";
        mark_unhealthy_io("server_restarted");
        co_return;
      }
    }
    ping_timer_->expires_after(scaled(options_.timeouts.ping_interval));
    co_await ping_timer_->async_wait(asio::as_tuple(asio::use_awaitable));
  }
}

template <class Bus>
boost::asio::awaitable<void> connector<Bus>::lifecycle() {
  namespace asio = boost::asio;
  backoff retry(scaled(options_.timeouts.reconnect_initial), scaled(options_.timeouts.reconnect_max));
  for (;;) {
    {
      std::lock_guard g(mu_);
      if (stopping_) co_return;
    }
    const std::string failure = co_await establish();
    std::uint64_t epoch = 0;
    {
      std::lock_guard g(mu_);
      if (stopping_) co_return;
      epoch = current_epoch_;
    }
    if (failure.empty()) {
      retry.reset();
      co_await ping_loop(epoch);
      std::lock_guard g(mu_);
      if (stopping_) co_return;
    }
    retry_timer_->expires_after(retry.next());
    co_await retry_timer_->async_wait(asio::as_tuple(asio::use_awaitable));
  }
}

template <class Bus>
boost::asio::awaitable<void> connector<Bus>::housekeeping() {
  namespace asio = boost::asio;
  asio::steady_timer t(ex_);
  for (;;) {
    t.expires_after(scaled(options_.timeouts.ping_interval));
    co_await t.async_wait(asio::as_tuple(asio::use_awaitable));
    std::lock_guard g(mu_);
    if (stopping_) co_return;
    const auto cutoff = clock::now() - scaled(options_.timeouts.quarantine_limit);
    if (const std::size_t n = quarantine_.release_held_before(cutoff); n != 0) {
      publish_quarantine_locked(0, n);
      std::vector<std::uint64_t> epochs;
      for (const auto& [e, p] : peers_) epochs.push_back(e);
      for (std::uint64_t e : epochs) maybe_retire_peer_io(e);
    }
  }
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::engine
