#pragma once
// The store path of l2::disk_backend (declarations: kvtier/l2/disk/disk_backend.hpp; docs/l2-disk.md,
// "Writing an object"): per batch: plan and reserve room (evicting); then each key through
// its own pipeline, several keys at once (create the temporary file, write its parts through
// io::async_run_parts, commit: rename into place, then sync); clean up what did not commit,
// fsync the touched directories (name_sync directory), trim back under the watermark.

#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/disk/impl/disk_backend.hpp>

#include <kvtier/io/parts.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bitset>
#include <cerrno>
#include <cstring>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

struct disk_backend::store_item : object_item {
  std::span<const std::byte> src;
  detail::temp_name temp;
  bool created = false;  ///< the temporary file exists
  bool renamed = false;  ///< it is objects/<path> now (not yet committed until synced)
  bool committed = false;
};

/// The writes of one key of a store: its payload in part_bytes parts (across segment
/// boundaries), its partial last block through a bounce block, then its header block. Parts
/// begin in order, so the key's checksums are fed in order as its parts are issued: each
/// segment's digest goes into the segment table (in the header block) as its last byte goes
/// by, and the header (written last) carries the table's checksum (an empty payload:
/// unsegmented, the payload's digest).
struct disk_backend::store_plan {
  static constexpr bool writes = true;
  using signature = void(error_code);
  disk_backend* self;
  std::vector<store_item>* items;
  std::span<const part> parts;

  [[nodiscard]] std::size_t part_count() const noexcept { return parts.size(); }

  [[nodiscard]] std::optional<io::file_part> begin_part(std::size_t i) const noexcept {
    const part& p = parts[i];
    store_item& it = (*items)[p.item];
    if (it.failed || it.fd < 0) return std::nullopt;
    if (p.kind == part_kind::header) {
      object_header h;
      h.key = it.key;
      h.payload_bytes = it.src.size();
      if (it.segment_bytes != 0) {
        h.flags = object_flag_segmented;
        const auto count = static_cast<std::uint32_t>(segment_count(it.src.size(), it.segment_bytes));
        h.payload_checksum = segment_table_checksum(detail::table_area(it.header), count);
      } else {
        h.payload_checksum = XXH3_64bits_digest(it.hash);
      }
      // The block was zeroed and its table written by store_parts: only the header goes in.
      encode_header(h, std::span<std::byte, object_header_bytes>(it.header, object_header_bytes));
      return io::file_part{it.fd, it.header, p.len, 0};
    }
    hash_payload(it, p.offset, std::min<std::size_t>(p.offset + p.len, it.src.size()));
    // Written from, never into: the caller's bytes (payload) or our bounce block (tail).
    std::byte* buf = p.kind == part_kind::tail ? it.tail : const_cast<std::byte*>(it.src.data() + p.offset);
    return io::file_part{it.fd, buf, p.len, detail::disk_block_bytes + p.offset};
  }

  /// Feeds the payload bytes [from, to) (a part's, parts in order) to the key's checksum; a
  /// segmented object's running digest goes into its table at each segment's end.
  static void hash_payload(store_item& it, std::size_t from, std::size_t to) noexcept {
    while (from < to) {
      const std::uint64_t segment = it.segment_bytes == 0 ? 0 : from / it.segment_bytes;
      const auto segment_end = static_cast<std::size_t>(detail::segment_end(it.segment_bytes, it.src.size(), segment));
      const std::size_t upto = std::min(to, segment_end);
      kvtier::detail::xxh3_update(it.hash, it.src.data() + from, upto - from);
      from = upto;
      if (from == segment_end && it.segment_bytes != 0) {
        put_segment_checksum(detail::table_area(it.header), static_cast<std::size_t>(segment),
                             XXH3_64bits_digest(it.hash));
        XXH3_64bits_reset(it.hash);
      }
    }
  }

  bool end_part(std::size_t i, const error_code& ec, std::size_t) {
    store_item& it = (*items)[parts[i].item];
    if (it.failed) return false;
    if (ec) self->fail_store(it, ec);  // (a write that stopped short ends with an error)
    else --it.parts_left;
    return false;  // a failed key does not stop the others
  }

  [[nodiscard]] std::tuple<error_code> result(const io::parts_outcome&) const noexcept { return {}; }
};

/// What step 6 of a store collects while it closes the files: the files of keys that did not
/// commit, to remove (temporary files, and renamed ones whose sync failed), with the room each
/// takes (temps first, then renamed), the shard directories a commit touched, the keys that
/// timed out.
struct disk_backend::store_leftovers {
  std::vector<detail::temp_name> temps;
  std::vector<detail::object_path> renamed;
  std::vector<std::uint64_t> bytes;
  std::bitset<detail::disk_shard_count> dirty;
  std::size_t timeouts = 0;
};

inline boost::asio::awaitable<disk_backend::batch_tuple> disk_backend::store_impl(
    std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> sources, deadline d) {
  namespace asio = boost::asio;
  co_await asio::this_coro::throw_if_cancelled(false);
  if (auto refused = refuse_batch(keys.size(), sources.size(), d, disk_stats::store)) co_return std::move(*refused);
  batch_result r(keys.size(), key_outcome::timeout);

  // 1. Plan: skip what exists, reserve room (choosing victims), mark the rest `writing`.
  std::vector<detail::disk_victim> victims;
  std::vector<store_item> items = plan_store(keys, sources, r, victims);
  if (!victims.empty()) co_await evict(std::move(victims));
  if (items.empty()) co_return batch_tuple{error_code{}, r};

  // 2. Parts: the payload in part_bytes parts (across segment boundaries: a 3 MiB object's
  //    16 segments go out in 3 writes), its partial last block through a bounce block, then
  //    the header block (written last: the segments' checksums are computed while the
  //    payload's writes are in flight). Key j's parts are parts[first[j], first[j + 1]).
  aligned_buffer blocks(items.size() * 2 * detail::disk_block_bytes);
  std::vector<hash_state> hashes(items.size());
  std::vector<std::size_t> first;
  const std::vector<part> parts = store_parts(items, blocks.data(), hashes, first);

  // 3-5. Each key through its own pipeline, `depth` writes each: create the temporary file
  //      (and allocate its blocks), take one of the backend's store lanes, write its parts,
  //      commit it (rename into objects/, then fsync or fdatasync), give the lane back. The lanes
  //      (queue_depth / 2, shared by every store in flight) bound the writes and syncs in
  //      flight, as fio's jobs do: a key's sync overlaps the other lanes' writes. The
  //      file is created before the lane is taken, so as many keys again (the backend's
  //      store_opens_) have their files ready when a lane frees; and the next batch's keys
  //      fill the lanes that this batch's last keys leave (the store pipeline keeps several
  //      batches in flight).
  const unsigned lanes = store_lanes(items.size());
  const unsigned depth = std::max(1U, options_.queue_depth / lanes);
  fan_state fs;
  auto key_body = [this, &items, &parts, &first, depth](std::size_t j, fan_state& f,
                                                        unsigned lane) -> asio::awaitable<void> {
    store_item& it = items[j];
    using slot_guard = kvtier::detail::async_slots::slot_guard;
    // Stopped while waiting for a slot (deadline, cancellation): a timeout; a temporary file
    // already created is removed in step 6.
    auto [open_ec] = co_await store_opens_.async_acquire(f.bind(lane));
    if (open_ec) co_return;
    std::optional<slot_guard> opening(std::in_place, store_opens_);
    co_await create_temp_file(it, f, lane);
    if (it.failed) co_return;
    auto [lane_ec] = co_await store_lanes_.async_acquire(f.bind(lane));
    if (lane_ec) co_return;
    const slot_guard held(store_lanes_);
    opening.reset();
    const std::span<const part> own = std::span(parts).subspan(first[j], first[j + 1] - first[j]);
    co_await io::async_run_parts(*file_io_, store_plan{this, &items, own}, depth, f.bind(lane));
    if (it.failed || it.parts_left != 0) co_return;
    co_await commit_stored(it, f, lane);
  };
  co_await fan_out(fs, items.size(), 2 * lanes, d, key_body);

  // 6. Close; remove the files of keys that did not commit (temporary, or renamed but not
  //    synced); release their room.
  store_leftovers left = close_stored(items, r);
  std::vector<error_code> unlink_errors;
  if (!left.temps.empty()) unlink_errors = co_await unlink_all(tmp_fd_, std::move(left.temps));
  if (!left.renamed.empty()) {
    const std::vector<error_code> e = co_await unlink_all(objects_fd_, std::move(left.renamed));
    unlink_errors.insert(unlink_errors.end(), e.begin(), e.end());
  }
  release_uncommitted(items, unlink_errors, left.bytes);

  // 7. Durability of the renames, where the objects' fsyncs did not commit them: one fsync
  //    per touched shard directory, for the batch.
  if (syncs_directories() && left.dirty.any()) co_await sync_shards(left.dirty);

  // 8. st_blocks may exceed the estimate (extent blocks): trim back under the watermark.
  if (auto trim = trim_victims(); trim && !trim->empty()) co_await evict(std::move(*trim));

  co_return finish_batch(fs, disk_stats::store, left.timeouts, std::move(r));
}

inline std::vector<disk_backend::store_item> disk_backend::plan_store(
    std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> sources, batch_result& r,
    std::vector<detail::disk_victim>& victims) {
  std::vector<store_item> items;
  items.reserve(keys.size());
  std::lock_guard g(mutex_);
  const std::size_t first_victim = victims.size();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (const auto* e = index_.find(keys[i])) {
      // Being removed, or a bad file that could not be deleted: refuse rather than race the
      // unlink or claim an object we would never serve.
      r.outcomes[i] = e->state == detail::entry_state::removing || e->state == detail::entry_state::stuck
                          ? key_outcome::rejected
                          : key_outcome::exists;
      continue;
    }
    const std::uint64_t need = detail::object_file_bytes(sources[i].size());
    auto room = index_.make_room(need, options_.capacity_bytes, options_.high_watermark, options_.low_watermark);
    if (!room) {
      r.outcomes[i] = key_outcome::no_space;
      continue;
    }
    victims.insert(victims.end(), room->begin(), room->end());
    store_item it;
    it.key = keys[i];
    it.src = sources[i];
    it.generation = next_generation_++;
    it.index = i;
    it.temp = detail::temp_name_of(it.key, next_temp_++);
    it.segment_bytes = detail::disk_segment_bytes(it.src.size());
    index_.begin_write(it.key, it.src.size(), need, it.generation, it.segment_bytes);
    items.push_back(it);
  }
  tell_evicted(victims, first_victim);  // no longer served from now on (their unlinks follow)
  return items;
}

inline std::vector<disk_backend::part> disk_backend::store_parts(std::vector<store_item>& items, std::byte* blocks,
                                                                 std::vector<hash_state>& hashes,
                                                                 std::vector<std::size_t>& first_parts) {
  std::vector<part> parts;
  first_parts.assign(1, 0);
  for (std::size_t j = 0; j < items.size(); ++j) {
    store_item& it = items[j];
    const auto item = static_cast<std::uint32_t>(j);
    const std::size_t first = parts.size();
    prepare_item(it, item, it.src.data(), it.src.size(), blocks, hashes[j]);
    if (const std::size_t rest = it.src.size() - it.aligned_bytes; rest > 0) {
      std::memcpy(it.tail, it.src.data() + it.aligned_bytes, rest);
      std::memset(it.tail + rest, 0, detail::disk_block_bytes - rest);
    }
    std::memset(it.header, 0, detail::disk_block_bytes);
    if (it.segment_bytes != 0) {
      const auto count = static_cast<std::uint32_t>(segment_count(it.src.size(), it.segment_bytes));
      encode_segment_table(it.segment_bytes, count, detail::table_area(it.header));
    }
    add_payload_parts(parts, it, item, 0, it.src.size());
    parts.push_back({item, part_kind::header, false, 0, detail::disk_block_bytes});
    it.parts_left = static_cast<unsigned>(parts.size() - first);
    first_parts.push_back(parts.size());
  }
  return parts;
}

inline unsigned disk_backend::store_lanes(std::size_t keys) const noexcept {
  // Two writes in flight per key (fio's store baseline: 8 jobs of depth 2 at depth 16), so
  // that queue_depth / 2 keys sync at once; one key alone gets the whole depth.
  return static_cast<unsigned>(std::min<std::size_t>(keys, store_lane_count(options_)));
}

inline boost::asio::awaitable<void> disk_backend::create_temp_file(store_item& it, fan_state& fs, unsigned lane) {
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (it.direct ? O_DIRECT : 0);
  auto [ec, fd] = co_await file_io_->async_openat(tmp_fd_, it.temp.c_str(), flags, 0600, fs.bind(lane));
  if (ec) {
    fail_store(it, ec);
    co_return;
  }
  it.fd = fd;
  it.created = true;
  // ENOSPC shows here, before any byte is written. A plain syscall on this thread (0.02 ms
  // for 3 MiB on ext4, 0.9 ms for 32 MiB): through the ring (IORING_OP_FALLOCATE, tried in
  // issue 30) the stores ran 0.96x as fast, every key paying an io-wq round trip.
  if (options_.preallocate &&
      ::fallocate(fd, 0, 0, static_cast<off_t>(detail::object_file_bytes(it.src.size()))) != 0 && errno != EOPNOTSUPP &&
      errno != ENOSYS)
    fail_store(it, detail::last_errno());
}

inline disk_backend::store_leftovers disk_backend::close_stored(std::vector<store_item>& items, batch_result& r) {
  store_leftovers left;
  std::vector<std::uint64_t> renamed_bytes;
  for (auto& it : items) {
    if (it.fd >= 0) ::close(it.fd);
    if (it.committed) {
      left.dirty.set(detail::shard_of(it.key));
    } else if (it.renamed) {
      left.renamed.push_back(it.path);
      renamed_bytes.push_back(detail::object_file_bytes(it.src.size()));
    } else if (it.created) {
      left.temps.push_back(it.temp);
      left.bytes.push_back(detail::object_file_bytes(it.src.size()));
    }
    if (it.outcome == key_outcome::timeout) ++left.timeouts;
    r.outcomes[it.index] = it.outcome;
  }
  left.bytes.insert(left.bytes.end(), renamed_bytes.begin(), renamed_bytes.end());  // temps first, then renamed
  return left;
}

inline void disk_backend::release_uncommitted(const std::vector<store_item>& items,
                                              const std::vector<error_code>& unlink_errors,
                                              const std::vector<std::uint64_t>& file_bytes) {
  std::lock_guard g(mutex_);
  for (const auto& it : items)
    if (!it.committed) index_.abort_write(it.key, it.generation);
  // A file that could not be deleted still takes room: counted until the next start-up's scan
  // deletes it (a temporary file) or adopts it (a renamed one: complete, its checksum checked
  // when loaded).
  for (std::size_t i = 0; i < unlink_errors.size(); ++i)
    if (unlink_errors[i]) index_.keep_stray(file_bytes[i]);
}

inline boost::asio::awaitable<void> disk_backend::sync_shards(std::bitset<detail::disk_shard_count> dirty) {
  namespace asio = boost::asio;
  std::vector<int> dirs;
  for (unsigned s = 0; s < detail::disk_shard_count; ++s)
    if (dirty.test(s)) dirs.push_back(shard_fds_[s]);
  fan_state sync_fs;
  sync_fs.stoppable = false;
  auto sync_body = [this, &dirs](std::size_t i, fan_state&, unsigned) -> asio::awaitable<void> {
    auto [ec] = co_await file_io_->async_fsync(dirs[i], asio::as_tuple(asio::use_awaitable));
    (void)ec;  // the objects are committed and verified on load; only durability is at stake
  };
  co_await fan_out(sync_fs, dirs.size(), 16, deadline::max(), sync_body);
}

inline std::optional<std::vector<detail::disk_victim>> disk_backend::trim_victims() {
  std::lock_guard g(mutex_);
  if (static_cast<double>(index_.bytes_used()) <=
      options_.high_watermark * static_cast<double>(options_.capacity_bytes))
    return std::nullopt;
  auto victims = index_.make_room(0, options_.capacity_bytes, options_.high_watermark, options_.low_watermark);
  if (victims) tell_evicted(*victims, 0);
  return victims;
}

inline void disk_backend::fail_store(store_item& it, const error_code& ec) {
  it.failed = true;
  if (detail::is_no_space(ec)) {
    it.outcome = key_outcome::no_space;
    count_enospc(it.key);
    return;
  }
  it.outcome = outcome_of_failure(ec);
  if (it.outcome == key_outcome::io_error) count_io_error(disk_stats::store, ec, it.key);
}

inline boost::asio::awaitable<void> disk_backend::commit_stored(store_item& it, fan_state& fs, unsigned lane) {
  // Rename first, then sync, so that one journal commit takes both. name_sync file: the
  // file's fsync waits for the rename's transaction (ext4 with a journal, xfs), and the name
  // is durable with the data. name_sync directory: fdatasync, and the shard directories'
  // fsyncs at the batch's end (step 7) make the names durable; synced before its rename,
  // each key waited for a second commit. The key counts as stored only once synced.
  // A process that dies in between leaves a complete file (its writes had all completed),
  // which a restart serves; a power failure may leave a torn one, which the load's checksum
  // catches (never a wrong byte).
  auto [ec] = co_await file_io_->async_renameat(tmp_fd_, it.temp.c_str(), objects_fd_, it.path.c_str(),
                                                detail::rename_noreplace, fs.bind(lane));
  if (detail::is_errno(ec, EEXIST)) {
    // A file at this path that the index does not know (put there behind our back, or left by
    // a crash): nothing serves it, so ours (complete, just verified on write) replaces it once.
    // Answering `exists` would claim an object that loads answer not_found for.
    auto [uec] = co_await file_io_->async_unlinkat(objects_fd_, it.path.c_str(), 0, fs.bind(lane));
    if (uec && !detail::is_errno(uec, ENOENT)) {
      fail_store(it, uec);
      co_return;
    }
    std::tie(ec) = co_await file_io_->async_renameat(tmp_fd_, it.temp.c_str(), objects_fd_, it.path.c_str(),
                                                     detail::rename_noreplace, fs.bind(lane));
  }
  if (ec) {
    fail_store(it, ec);
    co_return;
  }
  it.renamed = true;  // from here on, a failure removes objects/<path> (close_stored)
  if (options_.sync == disk_sync::data) {
    // Two statements, not co_await in both arms of ?: (g++ 12 ran both).
    if (name_sync_ == disk_name_sync::file)
      std::tie(ec) = co_await file_io_->async_fsync(it.fd, fs.bind(lane));
    else
      std::tie(ec) = co_await file_io_->async_fdatasync(it.fd, fs.bind(lane));
    if (ec) {
      fail_store(it, ec);
      co_return;
    }
  }
  struct ::stat st {};
  const std::uint64_t allocated = ::fstat(it.fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_blocks) * 512
                                                           : detail::object_file_bytes(it.src.size());
  {
    std::lock_guard g(mutex_);
    if (index_.commit(it.key, it.generation, allocated)) tell(key_change::stored, {}, {&it.key, 1});
  }
  it.committed = true;
  it.outcome = key_outcome::ok;
  stats_->stored_bytes.fetch_add(it.src.size(), std::memory_order_relaxed);
  count_success();
}

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
