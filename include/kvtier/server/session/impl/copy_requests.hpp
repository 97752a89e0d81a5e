#pragma once
// session (server/session/session.hpp): retrieve and store, the requests that copy between the
// engine's KV region and L1. Each is one cache call, whose copies run on the server's copy
// pool while the I/O thread serves the other connections:
//   retrieve  tiered_cache::async_copy_out through the engine's lookup of the request (the
//             scheduler's: engine_table.hpp): each chunk scattered into the engine's blocks
//             as soon as L1 has it; answers the contiguous prefix copied; then this rank's
//             holds in that lookup go back (release_rank_holds). With
//             retrieve_request::progress, retrieve_progress frames tell the leading chunks
//             (and, layer-wise, layers) done, at most one queued, none after the response;
//   store     the generation fence before (chunks whose blocks the engine reused already are
//             not copied) and after (async_copy_in's fence: a block reused while we copied
//             is never stored under the old key), the copies gathered in between.
// docs/server.md, "Retrieve" and "Store", has the contract; copy_scope keeps the closing
// promise ("Inside a session").

#include <kvtier/server/session/session.hpp>

#include <kvtier/core/kv_transfer.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// Copies of this session in flight: counted from the start of a copy operation until its
/// completion ran; the last one to end closes the socket when close() came meanwhile.
class session::copy_scope {
 public:
  explicit copy_scope(session& s) : s_(s) { ++s_.copies_; }
  copy_scope(const copy_scope&) = delete;
  copy_scope& operator=(const copy_scope&) = delete;
  ~copy_scope() {
    if (--s_.copies_ == 0 && s_.closing_) s_.conn_.close();
  }

 private:
  session& s_;
};

/// The first error of the copies of one request (they run on several threads at once).
class session::first_error {
 public:
  void set(std::error_code ec) {
    std::lock_guard g(m_);
    if (!ec_) ec_ = ec;
  }
  [[nodiscard]] std::error_code get() {
    std::lock_guard g(m_);
    return ec_;
  }

 private:
  std::mutex m_;
  std::error_code ec_;
};

/// The progress of one retrieve that asked for it: what the copy threads report (leading
/// layers done for every chunk: on_progress; each part of each chunk the sink copied), what
/// the I/O thread sent. Coalescing: one send is posted at a time; it sends the latest counts.
class session::progress_sender : public std::enable_shared_from_this<progress_sender> {
 public:
  progress_sender(std::shared_ptr<session> s, std::uint64_t call_id, std::size_t chunks, std::size_t parts)
      : s_(std::move(s)), call_id_(call_id), parts_(parts), parts_copied_(chunks, 0) {}

  /// On a copy thread: `layers` leading layers are done for every chunk.
  void report(std::size_t layers) {
    {
      std::lock_guard g(m_);
      if (layers <= layers_) return;
      layers_ = layers;
    }
    post();
  }

  /// On a copy thread: part `part` of chunk `i` is in the engine's blocks (the sink copied
  /// it). A chunk whose every part is copied and whose predecessors all are counts in
  /// chunks_ready: the copy's answer counts at least those (its prefix ends only at a chunk
  /// that was not copied).
  void copied(std::size_t i, std::size_t part) {
    (void)part;
    {
      std::lock_guard g(m_);
      if (i >= parts_copied_.size() || ++parts_copied_[i] < parts_) return;
      const std::size_t before = chunks_;
      while (chunks_ < parts_copied_.size() && parts_copied_[chunks_] >= parts_) ++chunks_;
      if (chunks_ == before) return;
    }
    post();
  }

  /// On the I/O thread, when the copy completed: nothing is sent any more (the response
  /// follows, and the engine must never see progress after it).
  void finish() noexcept { over_ = true; }

 private:
  void post() {
    {
      std::lock_guard g(m_);
      if (std::exchange(posted_, true)) return;  // the send already posted takes the latest
    }
    boost::asio::post(s_->conn_.get_executor(), [self = shared_from_this()] { self->send(); });
  }

  // On the I/O thread.
  void send() {
    std::size_t layers = 0;
    std::size_t chunks = 0;
    {
      std::lock_guard g(m_);
      posted_ = false;
      layers = layers_;
      chunks = chunks_;
    }
    if (over_ || s_->closing_ || (layers <= sent_layers_ && chunks <= sent_chunks_)) return;
    sent_layers_ = layers;
    sent_chunks_ = chunks;
    const protocol::retrieve_progress p{static_cast<std::uint32_t>(layers), static_cast<std::uint32_t>(chunks)};
    s_->conn_.async_send(call_id_, p, [](error_code) {
      // A failed write fails the response's too: the lane handles it.
    });
  }

  std::shared_ptr<session> s_;
  std::uint64_t call_id_;
  std::size_t parts_;
  std::mutex m_;
  std::vector<std::size_t> parts_copied_;  ///< under m_: per chunk, its parts the sink copied
  std::size_t layers_ = 0;                 ///< under m_
  std::size_t chunks_ = 0;                 ///< under m_: leading chunks every part of which is copied
  bool posted_ = false;                    ///< under m_: a send() is queued on the I/O thread
  std::size_t sent_layers_ = 0;            ///< I/O thread
  std::size_t sent_chunks_ = 0;            ///< I/O thread
  bool over_ = false;                      ///< I/O thread
};

inline request_error session::closing_error(std::string_view what) {
  return request_error{errc::shutting_down, std::string(what) + ": the connection is closing"};
}

inline boost::asio::awaitable<request_result<protocol::retrieve_response>> session::on(
    const protocol::retrieve_request& r, call& c) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  auto reg_r = copy_target("retrieve_request", r.rank, r.chunk_hashes.size(), r.block_ids);
  if (!reg_r) co_return reg_r.error();
  registration& reg = **reg_r;
  const std::size_t n = r.chunk_hashes.size();
  if (n == 0) co_return protocol::retrieve_response{0};
  if (closing_) co_return closing_error("retrieve_request");  // no copy starts after the close

  const std::uint64_t mid = request_model_id(reg, r.cache_salt);
  std::vector<chunk_key> keys(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = reg.key(mid, r.chunk_hashes[i]);
  cache::copy_out_request cr;
  // The engine's lookup of the request (its scheduler's, on another connection; or this
  // connection's own): the copy takes each chunk as its load lands. Another engine's
  // request of the same id is not this one's.
  if (const lookup_table::entry* e = ctx_.lookups.find(scope_, r.request_key)) cr.lookup = e->cache_id;
  const std::uint64_t lookup = cr.lookup;
  cr.keys = keys;
  cr.object_bytes = reg.object_bytes;
  const std::uint32_t layers = reg.chunk.model.num_layers;
  const bool by_layer = r.progress && layers > 1;  // layer-wise: one part per layer
  std::shared_ptr<progress_sender> progress;
  if (r.progress) progress = std::make_shared<progress_sender>(shared_from_this(), c.id, n, by_layer ? layers : 1);
  if (by_layer) {
    cr.parts = layers;
    cr.on_progress = [progress](std::size_t done) { progress->report(done); };
  }
  first_error refused;
  cache::copy_out_sink sink = retrieve_sink(reg, r, by_layer, progress, refused);
  std::size_t copied = 0;
  {
    copy_scope scope(*this);
    auto [ec, count] = co_await ctx_.cache.async_copy_out(std::move(cr), std::move(sink), as_tuple(use_awaitable));
    copied = ec ? 0 : count;
  }
  if (progress) progress->finish();  // on the I/O thread, before the response is queued
  // This rank is done with the lookup: its holds on the chunks it did not ask for go too.
  if (lookup != 0) release_rank_holds(r.request_key, lookup, r.rank);
  if (const std::error_code e = refused.get()) ctx_.log.error("client {}: retrieve copy refused: {}", id_, e.message());
  co_return protocol::retrieve_response{static_cast<std::uint32_t>(copied)};
}

/// The sink of a retrieve: chunk i (layer `part` of it when `by_layer`) scattered into the
/// engine's blocks, its first r.skip_tokens tokens skipped. It runs on the worker pool;
/// everything it reads stays alive until the copy's completion (the retrieve's coroutine
/// frame, the registration: the connection cannot unregister meanwhile).
inline cache::copy_out_sink session::retrieve_sink(const registration& reg, const protocol::retrieve_request& r,
                                                   bool by_layer, std::shared_ptr<progress_sender> progress,
                                                   first_error& refused) {
  const paged_kv_view view = reg.region.view();
  const chunk_layout& chunk = reg.chunk;
  const std::uint32_t ct = reg.chunk.chunk_tokens;
  const std::size_t bpc = reg.blocks_per_chunk;
  // The layer copies write around the cache as the whole chunk's would (chosen by the
  // object's size, not the layer's).
  const transfer_options layer_write{reg.object_bytes >= transfer_streaming_threshold_bytes ? transfer_write::streaming
                                                                                             : transfer_write::cached};
  return [this, &r, &chunk, &refused, view, ct, bpc, by_layer, layer_write, progress = std::move(progress)](
             std::size_t i, std::size_t part, std::span<const std::byte> object) {
    if (part == 0 && ctx_.hooks.during_copy) ctx_.hooks.during_copy(id_);
    const std::uint64_t done = std::uint64_t{ct} * i;
    const std::uint64_t skip = r.skip_tokens > done ? std::min<std::uint64_t>(r.skip_tokens - done, ct) : 0;
    const auto ids = std::span(r.block_ids).subspan(i * bpc, bpc);
    std::error_code ec;
    if (by_layer) {
      ec = scatter_chunk_layer(view, ids, chunk, object.data(), static_cast<std::uint32_t>(part),
                               static_cast<std::uint32_t>(skip), layer_write);
    } else {
      const scatter_item item{ids, object.data(), static_cast<std::uint32_t>(skip)};
      ec = scatter_chunks(view, chunk, std::span(&item, 1));
    }
    if (ec) {
      refused.set(ec);
      return false;
    }
    if (progress) progress->copied(i, part);
    return true;
  };
}

inline boost::asio::awaitable<request_result<protocol::store_response>> session::on(const protocol::store_request& r,
                                                                                    call&) {
  using boost::asio::as_tuple;
  using boost::asio::use_awaitable;
  auto reg_r = copy_target("store_request", r.rank, r.chunk_hashes.size(), r.block_ids);
  if (!reg_r) co_return reg_r.error();
  registration& reg = **reg_r;
  const std::size_t n = r.chunk_hashes.size();
  const std::uint64_t mid = request_model_id(reg, r.cache_salt);
  const std::size_t bpc = reg.blocks_per_chunk;
  auto blocks_of = [&](std::size_t i) { return std::span(r.block_ids).subspan(i * bpc, bpc); };
  auto fenced = [&](std::size_t i) {
    for (std::size_t b = i * bpc; b < (i + 1) * bpc; ++b)
      if (reg.region.generation(r.block_ids[b]) != r.block_generations[b]) return true;
    return false;
  };

  protocol::store_response out;
  // Chunks whose blocks were reused before we even start are not copied at all.
  std::vector<std::size_t> todo;
  std::vector<chunk_key> keys;
  for (std::size_t i = 0; i < n; ++i) {
    if (fenced(i)) {
      ++out.failed;
      continue;
    }
    todo.push_back(i);
    keys.push_back(reg.key(mid, r.chunk_hashes[i]));
  }
  if (keys.empty()) co_return out;
  if (closing_) co_return closing_error("store_request");  // no copy starts after the close

  cache::copy_in_request cr;
  cr.keys = keys;
  cr.object_bytes = reg.object_bytes;
  cr.context = pipeline::write_context{request_id_of(r.request_key), 0, r.first_chunk};
  const paged_kv_view view = reg.region.view();
  const chunk_layout& chunk = reg.chunk;
  first_error refused;
  cache::copy_in_source source = [&](std::size_t j, std::span<std::byte> object) {
    if (ctx_.hooks.during_copy) ctx_.hooks.during_copy(id_);
    const gather_item item{blocks_of(todo[j]), object.data(), 0};
    if (const std::error_code ec = gather_chunks(view, chunk, std::span(&item, 1))) {
      refused.set(ec);
      return false;
    }
    return true;
  };
  // The fence: a block the engine reused while we copied is never stored under the old
  // key. Runs on this thread after every copy ended.
  bool hooked = false;
  cache::copy_in_fence fence = [&](std::size_t j) {
    if (!std::exchange(hooked, true) && ctx_.hooks.after_store_copy) ctx_.hooks.after_store_copy(id_, r.block_ids);
    return !fenced(todo[j]);
  };
  cache::copy_in_result res;
  {
    copy_scope scope(*this);
    auto [ec, x] =
        co_await ctx_.cache.async_copy_in(std::move(cr), std::move(source), std::move(fence), as_tuple(use_awaitable));
    res = ec ? cache::copy_in_result{0, 0, keys.size()} : x;
  }
  if (const std::error_code e = refused.get()) ctx_.log.error("client {}: store copy refused: {}", id_, e.message());
  out.stored += static_cast<std::uint32_t>(res.stored);
  out.already_present += static_cast<std::uint32_t>(res.already_present);
  out.failed += static_cast<std::uint32_t>(res.failed);
  co_return out;
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
