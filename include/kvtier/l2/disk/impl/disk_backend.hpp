#pragma once
// Definitions of l2::disk_backend (declarations and documentation: kvtier/l2/disk/disk_backend.hpp)
// that every path shares: options, the per-operation state, construction, the small
// synchronous members, failure accounting, the fan-out of coroutines that bounds every
// operation by its deadline, eviction and removal. The paths have a file each beside this
// one: disk_directory.hpp (opening the directory, the start-up scan), disk_load.hpp,
// disk_store.hpp.

#include <kvtier/l2/disk/disk_backend.hpp>

#include <kvtier/io/parts.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

namespace detail {

namespace asio = boost::asio;

inline constexpr unsigned rename_noreplace = RENAME_NOREPLACE;

[[nodiscard]] inline bool is_aligned(const void* p) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) & (disk_block_bytes - 1)) == 0;
}

[[nodiscard]] inline bool is_errno(const error_code& ec, int e) noexcept {
  return ec.category() == boost::system::system_category() && ec.value() == e;
}

/// The file system ran out of room (ENOSPC) or quota (EDQUOT).
[[nodiscard]] inline bool is_no_space(const error_code& ec) noexcept {
  return is_errno(ec, ENOSPC) || is_errno(ec, EDQUOT);
}

/// Errors that mean the object's own bytes are unreadable (the device or the file system
/// says so), as opposed to a resource problem of ours (EMFILE, ENOMEM): the object is dropped.
[[nodiscard]] inline bool is_media_error(const error_code& ec) noexcept {
  return is_errno(ec, EIO) || is_errno(ec, EBADMSG) || is_errno(ec, EUCLEAN) || is_errno(ec, ENODATA);
}

[[nodiscard]] inline error_code last_errno() noexcept { return {errno, boost::system::system_category()}; }

}  // namespace detail

// --- options ----------------------------------------------------------------------------

inline void disk_backend_options::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("kvtier::l2::disk_backend_options: " + what); };
  if (path.empty()) fail("path is empty: set the directory of the disk tier");
  if (capacity_bytes == 0)
    fail("capacity_bytes is 0: set how many bytes the tier may allocate on disk (capacity_gb in JSON)");
  if (!(low_watermark > 0 && low_watermark <= high_watermark && high_watermark <= 1))
    fail(fmt::format("watermarks low={} high={}: need 0 < low <= high <= 1", low_watermark, high_watermark));
  if (part_bytes == 0 || part_bytes > (std::size_t{64} << 20))
    fail(fmt::format("part_bytes={}: use 4 KiB to 64 MiB (1 MiB is the default)", part_bytes));
  if (queue_depth == 0 || queue_depth > 256) fail(fmt::format("queue_depth={}: use 1 to 256", queue_depth));
  if (pread_threads == 0 || pread_threads > 64) fail(fmt::format("pread_threads={}: use 1 to 64", pread_threads));
  if (warn_interval.count() < 0) fail("warn_interval is negative");
  if (unhealthy_after_errors == 0) fail("unhealthy_after_errors is 0: use at least 1");
}

// --- per-operation state ------------------------------------------------------------------

/// The state of one fan_out: which work item comes next, the workers running, one
/// cancellation signal per worker, and why it stopped. One per operation: once stopped (by
/// the deadline or the caller), later fan_outs on the same state start nothing.
struct disk_backend::fan_state {
  bool stoppable = true;  ///< false: cleanup that always completes (no deadline, no cancellation)
  bool stop = false;
  bool timed_out = false;
  bool aborted = false;  ///< the caller cancelled the operation
  std::size_t next = 0;
  unsigned active = 0;
  std::unique_ptr<boost::asio::cancellation_signal[]> signals;
  std::exception_ptr error;

  [[nodiscard]] boost::asio::cancellation_slot slot(unsigned lane) const noexcept { return signals[lane].slot(); }
  /// The completion token of an operation of worker `lane`: cancelled with it, results as a tuple.
  [[nodiscard]] auto bind(unsigned lane) const noexcept {
    return boost::asio::bind_cancellation_slot(slot(lane), boost::asio::as_tuple(boost::asio::use_awaitable));
  }
};

enum class part_kind : std::uint8_t { header, payload, tail };

/// One read or write of a load or store: a 4 KiB header block, a payload part, or the
/// payload's last partial block (through a bounce block). A payload part may span several
/// segments (a 3 MiB object's are 192 KiB): the device sees part_bytes operations, and the
/// checksums split at the segment boundaries as the part's bytes are hashed.
struct disk_backend::part {
  static constexpr std::size_t none = ~std::size_t{0};
  std::uint32_t item = 0;
  part_kind kind = part_kind::payload;
  bool landed = false;       ///< load: its bytes are in the destination
  std::uint64_t offset = 0;  ///< in the payload (payload and tail parts)
  std::size_t len = 0;
  std::size_t next = none;   ///< load: the index of its item's next payload part, in payload order
};

/// The payload checksums (one per segment) are computed in part-sized steps as the bytes go
/// by (XXH3 streaming), never in one pass over a whole 32 MiB object: one pass costs ~2.5 ms
/// of the I/O thread, during which completed parts are not replaced and the device queue
/// drains; 1 MiB steps (~80 us) keep it full.
struct alignas(64) disk_backend::hash_state {
  XXH3_state_t state;
};

/// What a load and a store track of one key while its parts move.
struct disk_backend::object_item {
  chunk_key key;
  std::uint64_t generation = 0;
  std::size_t index = 0;  ///< in the caller's batch
  detail::object_path path;
  int fd = -1;
  bool direct = false;
  std::size_t aligned_bytes = 0;  ///< payload bytes moved straight from or to the caller's memory
  std::byte* header = nullptr;    ///< 4 KiB block of ours
  std::byte* tail = nullptr;      ///< 4 KiB bounce block for a partial last block
  unsigned parts_left = 0;
  XXH3_state_t* hash = nullptr;  ///< the checksum of the current segment, fed in payload order
  /// The segment size (0: unsegmented, one checksum over the whole payload).
  std::uint64_t segment_bytes = 0;
  bool failed = false;
  key_outcome outcome = key_outcome::timeout;
};

// --- construction --------------------------------------------------------------------------------

inline disk_backend::disk_backend(executor_type executor, disk_backend_options options, telemetry::logger* log)
    : executor_(boost::asio::make_strand(std::move(executor))),
      options_(std::move(options)),
      log_(log),
      index_(options_.eviction),
      enospc_log_(options_.warn_interval),
      io_error_log_(options_.warn_interval),
      corrupt_log_(options_.warn_interval) {
  options_.validate();
  if (log_ == nullptr) {
    own_log_ = std::make_unique<telemetry::logger>(telemetry::log_level::warn, "kvtier.l2.disk");
    log_ = own_log_.get();
  }
  shard_fds_.fill(-1);
  try {
    open_directory();
    recover();
    io::any_file_io_options eo;
    eo.choice = options_.io;
    eo.pool.threads = options_.pread_threads;
    // Room for two operations at full depth plus their metadata ops; more wait in the ring.
    eo.uring.entries = std::max(256U, 4 * options_.queue_depth);
    // A store keeps queue_depth writes and queue_depth / 2 syncs in flight, a load queue_depth
    // reads, and ext4 runs the writes into fresh blocks, the syncs, opens and renames on
    // io-wq's bounded workers: room for all of them at once (the default is 4 per CPU).
    eo.uring.max_bounded_workers = 4 * options_.queue_depth;
    file_io_ = std::make_unique<io::any_file_io>(executor_, eo, log_);
  } catch (...) {
    close_fds();
    throw;
  }
  log_->info("disk backend '{}' at {}: {} objects ({:.2f} GiB) recovered, {} dropped, {} temporary files removed, "
             "{} evicted; file I/O {}, O_DIRECT {}, capacity {:.2f} GiB, eviction {}",
             options_.name, options_.path.string(), recovery_.objects,
             static_cast<double>(recovery_.bytes) / (1 << 30), recovery_.dropped, recovery_.temp_files,
             recovery_.evicted, io::to_string(file_io_->kind()), direct_ ? "on" : "off",
             static_cast<double>(options_.capacity_bytes) / (1 << 30),
             options_.eviction == disk_eviction::lru ? "lru" : options_.eviction == disk_eviction::fifo ? "fifo" : "none");
}

inline disk_backend::~disk_backend() {
  file_io_.reset();  // waits for any op still in the kernel before the fds go
  close_fds();
}

inline void disk_backend::close_fds() noexcept {
  for (int& fd : shard_fds_)
    if (fd >= 0) ::close(std::exchange(fd, -1));
  if (objects_fd_ >= 0) ::close(std::exchange(objects_fd_, -1));
  if (tmp_fd_ >= 0) ::close(std::exchange(tmp_fd_, -1));
  if (lock_fd_ >= 0) ::close(std::exchange(lock_fd_, -1));  // releases the flock
}

// --- small synchronous members --------------------------------------------------------------

inline usage_info disk_backend::usage() const {
  std::lock_guard g(mutex_);
  return {index_.bytes_used(), options_.capacity_bytes, index_.objects()};
}

inline health_info disk_backend::health() const {
  std::lock_guard g(mutex_);
  if (consecutive_errors_ >= options_.unhealthy_after_errors)
    return {false, fmt::format("{} I/O errors in a row, the last: {}", consecutive_errors_, last_error_)};
  return {};
}

inline void disk_backend::unpin(std::span<const chunk_key> keys) {
  std::lock_guard g(mutex_);
  for (const auto& k : keys)
    if (auto* e = index_.find(k); e != nullptr && e->pins > 0) --e->pins;
}

inline void disk_backend::set_key_listener(key_listener l) {
  std::lock_guard g(mutex_);
  listener_ = std::move(l);
}

inline void disk_backend::tell(key_change c, bus::key_removal why, std::span<const chunk_key> keys) const {
  if (listener_ && !keys.empty()) listener_(c, why, keys);
}

inline void disk_backend::tell_evicted(const std::vector<detail::disk_victim>& victims, std::size_t from) const {
  if (!listener_ || from >= victims.size()) return;
  std::vector<chunk_key> keys;
  keys.reserve(victims.size() - from);
  for (std::size_t i = from; i < victims.size(); ++i) keys.push_back(victims[i].key);
  tell(key_change::removed, bus::key_removal::evicted, keys);
}

inline std::uint32_t disk_backend::pins(const chunk_key& key) const {
  std::lock_guard g(mutex_);
  const auto* e = index_.find(key);
  return e == nullptr ? 0 : e->pins;
}

inline std::filesystem::path disk_backend::object_file(const chunk_key& key) const {
  return options_.path / "objects" / std::string(detail::object_path_of(key).view());
}

inline bool disk_backend::corrupt_stored(const chunk_key& key) {
  std::lock_guard g(mutex_);
  const auto* e = index_.find_ready(key);
  if (e == nullptr) return false;
  const auto p = detail::object_path_of(key);
  const int fd = ::openat(objects_fd_, p.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  // The first payload byte; for an empty payload a byte of the header's key (its checksum
  // then fails). A buffered write: an O_DIRECT read writes dirty pages back before reading.
  const off_t at = e->payload_bytes > 0 ? static_cast<off_t>(detail::disk_block_bytes) : 20;
  std::byte b{};
  bool ok = ::pread(fd, &b, 1, at) == 1;
  b ^= std::byte{0xff};
  ok = ok && ::pwrite(fd, &b, 1, at) == 1;
  ::close(fd);
  return ok;
}

inline error_code disk_backend::register_buffers(std::span<std::byte> region) {
  const io::buffer_region r[] = {region};
  return file_io_->register_buffers(r);
}

inline error_code disk_backend::add_buffers(std::span<std::byte> region) { return file_io_->add_buffers(region); }

// --- failure accounting -----------------------------------------------------------------------

inline void disk_backend::count_io_error(disk_stats::op op, const error_code& ec, const chunk_key& key) {
  const std::string_view what = disk_stats::op_name(op);
  stats_->io_errors[op].fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard g(mutex_);
    ++consecutive_errors_;
    last_error_ = fmt::format("{} of {}: {}", what, key.to_string(), ec.message());
  }
  if (auto hidden = io_error_log_.allow())
    log_->warn("disk backend '{}': {} of {} failed: {} ({} more I/O errors since the last message)", options_.name,
               what, key.to_string(), ec.message(), *hidden);
}

inline void disk_backend::count_enospc(const chunk_key& key) {
  stats_->enospc.fetch_add(1, std::memory_order_relaxed);
  if (auto hidden = enospc_log_.allow())
    log_->warn("disk backend '{}': the file system at {} is full (ENOSPC) storing {}: the store fails, L1 keeps "
               "its copy; lower capacity_bytes below the free space ({} more since the last message)",
               options_.name, options_.path.string(), key.to_string(), *hidden);
}

inline void disk_backend::count_corrupt(const chunk_key& key, std::string_view why) {
  stats_->corrupt_objects.fetch_add(1, std::memory_order_relaxed);
  if (auto hidden = corrupt_log_.allow())
    log_->warn("disk backend '{}': {} failed its check on load ({}): dropped, never served ({} more since the "
               "last message)",
               options_.name, key.to_string(), why, *hidden);
}

inline void disk_backend::count_success() noexcept {
  std::lock_guard g(mutex_);
  consecutive_errors_ = 0;
}

inline key_outcome disk_backend::outcome_of_failure(const error_code& ec) noexcept {
  if (ec == boost::asio::error::operation_aborted) return key_outcome::timeout;  // the deadline, or the caller
  if (ec == errc::shutting_down) return key_outcome::unavailable;
  return key_outcome::io_error;
}

// --- what loads and stores share ----------------------------------------------------------------

inline std::optional<disk_backend::batch_tuple> disk_backend::refuse_batch(std::size_t keys, std::size_t buffers,
                                                                            deadline d, disk_stats::op op) {
  batch_result r(keys, key_outcome::timeout);
  if (keys != buffers) return batch_tuple{make_error_code(errc::invalid_argument), std::move(r)};
  if (clock::now() >= d) {
    stats_->timeouts[op].fetch_add(keys, std::memory_order_relaxed);
    return batch_tuple{make_error_code(errc::timeout), std::move(r)};
  }
  return std::nullopt;
}

inline disk_backend::batch_tuple disk_backend::finish_batch(const fan_state& fs, disk_stats::op op,
                                                            std::size_t timeouts, batch_result r) {
  stats_->timeouts[op].fetch_add(timeouts, std::memory_order_relaxed);
  error_code ec;
  if (fs.aborted) ec = boost::asio::error::operation_aborted;
  else if (timeouts > 0) ec = make_error_code(errc::timeout);
  return batch_tuple{ec, std::move(r)};
}

inline void disk_backend::prepare_item(object_item& it, std::uint32_t j, const std::byte* data, std::size_t bytes,
                                       std::byte* blocks, hash_state& hash) {
  it.hash = &hash.state;
  XXH3_64bits_reset(it.hash);
  it.path = detail::object_path_of(it.key);
  it.direct = direct_ && detail::is_aligned(data);
  it.aligned_bytes = bytes & ~(detail::disk_block_bytes - 1);
  it.header = blocks + 2 * std::size_t{j} * detail::disk_block_bytes;
  it.tail = it.header + detail::disk_block_bytes;
}

inline void disk_backend::add_payload_parts(std::vector<part>& parts, const object_item& it, std::uint32_t item,
                                            std::size_t from, std::size_t to) const {
  const std::size_t part_bytes = detail::round_up_block(options_.part_bytes);
  const std::size_t aligned_to = std::min(to, it.aligned_bytes);
  for (std::size_t off = from; off < aligned_to; off += part_bytes)
    parts.push_back({item, part_kind::payload, false, off, std::min(part_bytes, aligned_to - off)});
  if (to > it.aligned_bytes)
    parts.push_back({item, part_kind::tail, false, it.aligned_bytes, detail::disk_block_bytes});
}

// --- the fan-out primitive ----------------------------------------------------------------------

// Runs body(i, fs, lane) for i in [0, n) on at most `width` worker coroutines, each taking the
// next item when its previous one is done (items start in order). At the deadline, or when
// the caller cancels the operation, no new item starts and every worker's signal is
// emitted (cancelling its I/O in flight); this returns only once every worker has finished,
// i.e. once no I/O of these items is in flight.
template <class Body>
boost::asio::awaitable<void> disk_backend::fan_out(fan_state& fs, std::size_t n, unsigned width, deadline d,
                                                   Body& body) {
  namespace asio = boost::asio;
  if (fs.stop || n == 0) co_return;
  if (fs.stoppable && clock::now() >= d) {
    fs.stop = fs.timed_out = true;
    co_return;
  }
  const auto lanes = static_cast<unsigned>(std::min<std::size_t>(width, n));
  fs.next = 0;
  fs.signals = std::make_unique<asio::cancellation_signal[]>(lanes);
  fs.active = lanes;
  asio::steady_timer wake(executor_, fs.stoppable ? d : asio::steady_timer::time_point::max());
  for (unsigned w = 0; w < lanes; ++w)
    asio::co_spawn(executor_, fan_worker(fs, w, n, body), [&fs, &wake](std::exception_ptr e) {
      if (e && !fs.error) fs.error = e;
      if (--fs.active == 0) wake.cancel();
    });
  while (fs.active > 0) {
    auto [ec] = co_await wake.async_wait(asio::as_tuple(asio::use_awaitable));
    if (fs.active == 0) break;
    if (ec) co_await asio::this_coro::reset_cancellation_state();  // the caller's cancellation
    if (!fs.stoppable) continue;
    if (!fs.stop) {
      fs.stop = true;
      (ec ? fs.aborted : fs.timed_out) = true;
      for (unsigned w = 0; w < lanes; ++w) fs.signals[w].emit(asio::cancellation_type::terminal);
    }
    wake.expires_at(asio::steady_timer::time_point::max());
  }
  fs.signals.reset();
  if (fs.error) std::rethrow_exception(std::exchange(fs.error, nullptr));
}

template <class Body>
boost::asio::awaitable<void> disk_backend::fan_worker(fan_state& fs, unsigned lane, std::size_t n, Body& body) {
  while (!fs.stop && fs.next < n) {
    const std::size_t i = fs.next++;
    co_await body(i, fs, lane);
  }
}

// Runs a load's or store's parts (io::async_run_parts) until done, or until the deadline or
// the caller's cancellation, which stop it as fan_out's workers are stopped (it is fan_out's
// only worker): it then cancels the parts in flight and returns once none is.
template <class Plan>
boost::asio::awaitable<void> disk_backend::run_parts(fan_state& fs, deadline d, Plan plan) {
  auto body = [this, &plan](std::size_t, fan_state& f, unsigned lane) -> boost::asio::awaitable<void> {
    co_await io::async_run_parts(*file_io_, std::move(plan), options_.queue_depth, f.bind(lane));
  };
  co_await fan_out(fs, 1, 1, d, body);
}

// --- eviction and removal -----------------------------------------------------------------------

template <class Name>
boost::asio::awaitable<std::vector<error_code>> disk_backend::unlink_all(int dirfd, std::vector<Name> names) {
  namespace asio = boost::asio;
  std::vector<error_code> errors(names.size());
  fan_state fs;
  fs.stoppable = false;
  auto body = [this, dirfd, &names, &errors](std::size_t i, fan_state&, unsigned) -> asio::awaitable<void> {
    auto [ec] = co_await file_io_->async_unlinkat(dirfd, names[i].c_str(), 0, asio::as_tuple(asio::use_awaitable));
    if (ec && !detail::is_errno(ec, ENOENT)) errors[i] = ec;
  };
  co_await fan_out(fs, names.size(), 32, deadline::max(), body);
  co_return errors;
}

inline boost::asio::awaitable<void> disk_backend::evict(std::vector<detail::disk_victim> victims) {
  std::vector<detail::object_path> paths;
  paths.reserve(victims.size());
  for (const auto& v : victims) paths.push_back(detail::object_path_of(v.key));
  const auto errors = co_await unlink_all(objects_fd_, std::move(paths));
  std::uint64_t bytes = 0;
  std::size_t evicted = 0;
  {
    std::lock_guard g(mutex_);
    std::vector<chunk_key> back;
    for (std::size_t i = 0; i < victims.size(); ++i) {
      const auto& v = victims[i];
      if (errors[i]) {
        // Its file is still there and intact: it stays served and counted (not evicted), and
        // is listed again.
        if (index_.abort_remove(v.key, v.generation)) back.push_back(v.key);
        continue;
      }
      index_.finish_remove(v.key, v.generation);
      bytes += v.allocated_bytes;
      ++evicted;
    }
    tell(key_change::stored, {}, back);
  }
  for (std::size_t i = 0; i < errors.size(); ++i)
    if (errors[i]) count_io_error(disk_stats::remove, errors[i], victims[i].key);
  stats_->evicted_objects.fetch_add(evicted, std::memory_order_relaxed);
  stats_->evicted_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

inline boost::asio::awaitable<disk_backend::batch_tuple> disk_backend::remove_impl(std::span<const chunk_key> keys,
                                                                                   deadline d) {
  batch_result r(keys.size(), key_outcome::not_found);
  if (clock::now() >= d) {
    std::fill(r.outcomes.begin(), r.outcomes.end(), key_outcome::timeout);
    co_return batch_tuple{make_error_code(errc::timeout), r};
  }
  std::vector<detail::object_path> paths;
  struct removal {
    std::size_t index = 0;
    std::uint64_t generation = 0;
    bool was_stuck = false;
  };
  std::vector<removal> gone;
  {
    std::lock_guard g(mutex_);
    std::vector<chunk_key> unlisted;  // ready objects no longer served (a stuck one was not)
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto* e = index_.find(keys[i]);
      if (e == nullptr || e->state == detail::entry_state::removing) continue;
      if (e->state == detail::entry_state::writing || e->pins > 0) {
        r.outcomes[i] = key_outcome::rejected;  // a store in flight, or pinned by a prefetch
        continue;
      }
      const bool was_stuck = e->state == detail::entry_state::stuck;  // a bad file: retry its unlink
      if (auto gen = was_stuck ? index_.start_remove_stuck(keys[i]) : index_.start_remove(keys[i])) {
        gone.push_back({i, *gen, was_stuck});
        paths.push_back(detail::object_path_of(keys[i]));
        r.outcomes[i] = key_outcome::ok;
        if (!was_stuck && listener_) unlisted.push_back(keys[i]);
      }
    }
    tell(key_change::removed, bus::key_removal::deleted, unlisted);
  }
  if (gone.empty()) co_return batch_tuple{error_code{}, r};
  const auto errors = co_await unlink_all(objects_fd_, std::move(paths));
  {
    std::lock_guard g(mutex_);
    std::vector<chunk_key> back;
    for (std::size_t j = 0; j < gone.size(); ++j) {
      const auto& x = gone[j];
      if (!errors[j])
        index_.finish_remove(keys[x.index], x.generation);
      else if (x.was_stuck)
        index_.mark_stuck(keys[x.index], x.generation);
      else if (index_.abort_remove(keys[x.index], x.generation))  // still there: still served
        back.push_back(keys[x.index]);
    }
    tell(key_change::stored, {}, back);
  }
  for (std::size_t j = 0; j < gone.size(); ++j)
    if (errors[j]) {
      r.outcomes[gone[j].index] = key_outcome::io_error;
      count_io_error(disk_stats::remove, errors[j], keys[gone[j].index]);
    }
  co_return batch_tuple{error_code{}, r};
}

inline boost::asio::awaitable<std::tuple<error_code, std::vector<listed_object>>> disk_backend::list_impl(
    key_filter filter, deadline d) {
  std::vector<listed_object> out;
  if (clock::now() >= d) co_return std::tuple{make_error_code(errc::timeout), std::move(out)};
  std::lock_guard g(mutex_);
  index_.for_each_ready([&](const chunk_key& k, const detail::disk_entry& e) {
    if (!filter || filter(k)) out.push_back({k, e.allocated_bytes});
  });
  co_return std::tuple{error_code{}, std::move(out)};
}

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

// The paths, each in its own file; after the shared definitions above, which they use.
#include <kvtier/l2/disk/impl/disk_directory.hpp>
#include <kvtier/l2/disk/impl/disk_load.hpp>
#include <kvtier/l2/disk/impl/disk_store.hpp>
