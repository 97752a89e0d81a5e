#pragma once
// disk_backend: the L2 tier on a local file system (NVMe), through io_uring (or the pread
// thread pool where the kernel refuses io_uring), O_DIRECT, checksummed, capacity-bounded.
// Models l2_backend and corruptible_backend (concepts.hpp). docs/l2-disk.md holds the rest:
// the on-disk format, trust, writing and reading an object, deadlines and the buffer
// contract, recovery, capacity, failures, threading, with the reasons for each choice.

#include <kvtier/config.hpp>
#include <kvtier/core/bitmap.hpp>
#include <kvtier/core/buffer.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/detail/async_slots.hpp>
#include <kvtier/error.hpp>
#include <kvtier/io/any_file_io.hpp>
#include <kvtier/io/probe.hpp>
#include <kvtier/l2/concepts.hpp>
#include <kvtier/l2/detail/coroutine_backend.hpp>
#include <kvtier/l2/disk/detail/disk_index.hpp>
#include <kvtier/l2/disk/detail/disk_layout.hpp>
#include <kvtier/l2/object_format.hpp>
#include <kvtier/l2/types.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/cancellation_signal.hpp>

#include <array>
#include <atomic>
#include <bitset>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

/// What a store makes durable before it answers ok.
enum class disk_sync : std::uint8_t {
  none,  ///< nothing: a crash may lose recent objects (loads still verify: never a wrong byte)
  data,  ///< each object's data and its name (disk_name_sync says how), before the store answers
};

/// How `sync = data` makes a stored object's name (its rename into objects/) durable
/// (docs/l2-disk.md, "Durability").
enum class disk_name_sync : std::uint8_t {
  /// fdatasync of each object after its rename, then one fsync per shard directory the batch
  /// touched: holds on every file system (the default: measured no slower, docs/l2-disk.md).
  directory,
  /// `file` where the start-up probe finds a file system known to commit a rename with the
  /// file's fsync (ext4 with a journal, xfs), else `directory`.
  automatic,
  /// fsync of each object after its rename, and no directory fsync: the file's fsync commits
  /// the journal transaction of its rename (ext4 with a journal, xfs). On a file system that
  /// does not (ext4 without a journal, ext2), a power failure may lose the object's name: the
  /// backend warns at start-up when the probe does not find one it trusts.
  file,
};

struct disk_backend_options {
  std::string name = "disk";
  /// The directory (created when missing). One process at a time (flock).
  std::filesystem::path path;
  /// Bytes the objects may allocate on the file system (st_blocks * 512). Required, > 0.
  std::uint64_t capacity_bytes = 0;
  disk_eviction eviction = disk_eviction::lru;
  /// Eviction starts when a store would pass high * capacity and frees down to low *
  /// capacity (0 < low <= high <= 1). 0.95/0.90: a store of 32 MiB evicts a batch of ~5% at
  /// once instead of one object per store, and a little room stays for st_blocks overshoot.
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  /// O_DIRECT for loads and stores whose buffers are 4 KiB aligned (L1 slots are). Falls
  /// back to buffered I/O, with a warning, on a file system that refuses it.
  bool o_direct = true;
  /// The file I/O: automatic (KVTIER_IO_BACKEND, else the probe), uring, pread.
  io::file_io_choice io = io::file_io_choice::automatic;
  /// Bytes per read/write (rounded up to 4 KiB). 1 MiB: >= 256 KiB keeps the submission cost
  /// under 1% and 1 MiB parts saturate the target disk (docs/io.md).
  std::size_t part_bytes = std::size_t{1} << 20;
  /// Reads or writes in flight per operation (1..256): 8-32 saturate an NVMe device.
  unsigned queue_depth = 16;
  /// Threads of the pread fallback: each runs one blocking read at a time, so this is the
  /// fallback's queue depth (16, as queue_depth). O_DIRECT reads sleep in the kernel, so
  /// threads beyond the cores cost little CPU (measured: docs/performance.md).
  unsigned pread_threads = 16;
  disk_sync sync = disk_sync::data;
  /// How `sync = data` makes names durable (name_sync_active() says which ran).
  disk_name_sync name_sync = disk_name_sync::directory;
  /// fallocate each object before writing it: ENOSPC shows before any byte is written, and
  /// O_DIRECT writes into allocated extents run in parallel on ext4 (an extending write
  /// takes the inode lock exclusively).
  bool preallocate = true;
  /// Read and checksum every payload at start-up (slow: reads the whole disk). Off: the
  /// header and the size are checked at start-up, the payload by every load.
  bool verify_on_start = false;
  /// At most one warning per interval for each recurring failure (ENOSPC, EIO, corruption).
  std::chrono::nanoseconds warn_interval = std::chrono::seconds(10);
  /// health() reports unhealthy after this many I/O errors in a row (a success resets).
  unsigned unhealthy_after_errors = 8;

  /// Throws std::invalid_argument naming the option to fix.
  void validate() const;
};

/// What the start-up scan found.
struct disk_recovery_report {
  std::uint64_t objects = 0;          ///< objects recovered and servable
  std::uint64_t bytes = 0;            ///< their allocated bytes
  std::uint64_t dropped = 0;          ///< torn, corrupt or misplaced object files deleted
  std::uint64_t temp_files = 0;       ///< temporary files (interrupted stores) deleted
  std::uint64_t foreign_files = 0;    ///< files that are not ours, left alone
  std::uint64_t untrusted_files = 0;  ///< object files another user owns (or others may write): skipped
  std::uint64_t evicted = 0;          ///< objects evicted because they exceeded the capacity
};

/// Counters of one backend: relaxed atomics any thread may read at any time, shared
/// (shared_stats()) so that a reader may outlive the backend (docs/metrics.md lists the
/// kvtier_l2_disk_* series made of them).
struct disk_stats {
  enum op : std::uint8_t { load, store, remove, op_count };
  /// "load", "store", "remove" (the `op` label).
  [[nodiscard]] static constexpr std::string_view op_name(std::size_t o) noexcept {
    constexpr std::array<std::string_view, op_count> names = {"load", "store", "remove"};
    return o < names.size() ? names[o] : std::string_view{"unknown"};
  }
  std::atomic<std::uint64_t> enospc{0};                        ///< stores failed by ENOSPC/EDQUOT
  std::array<std::atomic<std::uint64_t>, op_count> io_errors{};  ///< keys failed by an I/O error
  std::atomic<std::uint64_t> corrupt_objects{0};  ///< loads that found a bad header, short file or checksum
  std::atomic<std::uint64_t> dropped_objects{0};  ///< objects dropped after a failed load
  std::atomic<std::uint64_t> evicted_objects{0};
  std::atomic<std::uint64_t> evicted_bytes{0};
  std::array<std::atomic<std::uint64_t>, op_count> timeouts{};  ///< keys that missed their deadline
  std::atomic<std::uint64_t> loaded_bytes{0};  ///< payload bytes of loads answered ok
  std::atomic<std::uint64_t> stored_bytes{0};  ///< payload bytes of stores answered ok
  std::atomic<std::uint64_t> recovered_objects{0};
  std::atomic<std::uint64_t> recovered_bytes{0};
  std::atomic<std::uint64_t> recovery_dropped{0};
  std::atomic<std::uint64_t> recovery_temp_files{0};
  std::atomic<std::uint64_t> recovery_untrusted{0};
  std::atomic<bool> o_direct{false};
  /// Whether stores fsync the shard directories they touched (sync = data, name_sync directory).
  std::atomic<bool> directory_fsync{false};
};

/// Operations may start from any thread; the I/O runs on a strand of the executor given.
/// unpin, usage, health, corrupt_stored and pins take a mutex and may be called from any
/// thread. An operation completes only once no read or write of the caller's buffers is in
/// flight (at its deadline or cancellation too). Destroy the backend when no operation runs,
/// before its io_context.
class disk_backend : public detail::coroutine_backend<disk_backend> {
 public:
  using executor_type = boost::asio::any_io_executor;

  /// Opens (creates) the directory, rebuilds the index (docs/l2-disk.md, "Recovery") and starts the
  /// file I/O on a strand of `executor`. `log` may be null (default: stderr at warn).
  /// Throws std::invalid_argument for bad options, std::runtime_error when the directory
  /// cannot be used (not writable, another process holds it, foreign FORMAT file).
  disk_backend(executor_type executor, disk_backend_options options, telemetry::logger* log = nullptr);
  ~disk_backend();

  disk_backend(const disk_backend&) = delete;
  disk_backend& operator=(const disk_backend&) = delete;

  [[nodiscard]] std::string_view name() const noexcept { return options_.name; }
  [[nodiscard]] executor_type get_executor() const noexcept { return executor_; }
  [[nodiscard]] usage_info usage() const;
  [[nodiscard]] health_info health() const;

  // The operations (detail/coroutine_backend.hpp):
  //   async_lookup_and_pin  void(error_code, bitmap found): found keys are pinned (never
  //                         evicted) until unpin();
  //   async_load            void(error_code, batch_result); docs/l2-disk.md, "Reading
  //                         objects" and "Deadlines and the buffer contract".
  //                         Reads go segment-major (every key's header block, then segment
  //                         0 of every key, then segment 1, ...). With a load_observer, each
  //                         key is told its verified prefix each time it grows (segments
  //                         0..s landed and matched their checksums: verified_bytes = end of
  //                         segment s), and its whole size once every segment verified (only
  //                         then is it ok), so the caller can use its first layers while the
  //                         rest of the batch is read; an unsegmented object (written by an
  //                         earlier version) is told once, whole;
  //   async_store           void(error_code, batch_result): ok, exists, no_space, io_error,
  //                         timeout per key;
  //   async_remove          void(error_code, batch_result): ok, not_found, rejected (pinned,
  //                         or a store in flight);
  //   async_list            void(error_code, std::vector<listed_object>): the ready objects
  //                         the filter accepts, with their allocated bytes, from the index
  //                         (no I/O; one pass under the mutex, ~20 ns per object).
  static constexpr bool tells_landed_keys = true;
  static constexpr bool lists_objects = true;
  void unpin(std::span<const chunk_key> keys);

  /// Flips the first payload byte of the stored object ON DISK (a buffered write through a
  /// separate descriptor): the next load answers corrupt and drops it. False when absent.
  bool corrupt_stored(const chunk_key& key);

  /// Registers memory (the L1 arena: tier.arena()) as io_uring fixed buffers; reads into it
  /// then use READ_FIXED. Call before the first operation, or from the backend's executor.
  /// Returns the file I/O's answer (the pread fallback accepts and ignores it).
  error_code register_buffers(std::span<std::byte> region);
  /// Registers `region` next to what add_buffers() registered before (io::uring_context::
  /// add_buffers): a large arena a piece at a time, from the backend's executor, so no call
  /// pins more than its piece. errc::unsupported where the kernel cannot (before Linux 5.19:
  /// register_buffers the whole arena instead).
  error_code add_buffers(std::span<std::byte> region);

  /// Replaces the key listener (key_announcing_backend, types.hpp; empty: none). Told under
  /// the backend's mutex as the index changes: stored when a store's rename committed;
  /// removed when a ready object stops being served: evicted (capacity, chosen before its
  /// unlink), deleted (async_remove; a file a load found gone), corrupt (a load found it
  /// bad); stored again when such an unlink failed and the object is served again. The
  /// start-up scan's objects are not told (the constructor runs before any listener).
  void set_key_listener(key_listener l);

  /// Pins currently held on key (for tests).
  [[nodiscard]] std::uint32_t pins(const chunk_key& key) const;
  [[nodiscard]] const disk_stats& stats() const noexcept { return *stats_; }
  /// The same counters, shared: they stay readable after the backend is gone.
  [[nodiscard]] std::shared_ptr<const disk_stats> shared_stats() const noexcept { return stats_; }
  /// The file I/O's counters (io::io_stats), shared likewise.
  [[nodiscard]] std::shared_ptr<const io::io_stats> shared_io_stats() const noexcept {
    return file_io_->shared_stats();
  }
  [[nodiscard]] const disk_recovery_report& recovery() const noexcept { return recovery_; }
  [[nodiscard]] const disk_backend_options& options() const noexcept { return options_; }
  [[nodiscard]] io::file_io_kind file_io_kind() const noexcept { return file_io_->kind(); }
  /// Whether O_DIRECT is in use (asked for, and accepted by the file system).
  [[nodiscard]] bool o_direct_active() const noexcept { return direct_; }
  /// How names are made durable: directory or file (automatic resolved at start-up).
  [[nodiscard]] disk_name_sync name_sync_active() const noexcept { return name_sync_; }
  /// File I/O operations in flight (0 whenever no backend operation runs).
  [[nodiscard]] std::size_t io_in_flight() const noexcept { return file_io_->in_flight(); }
  /// Where the file of key lives (whether or not it exists), for tests and tools.
  [[nodiscard]] std::filesystem::path object_file(const chunk_key& key) const;

 private:
  friend class detail::coroutine_backend<disk_backend>;

  using lookup_tuple = std::tuple<error_code, bitmap>;
  using batch_tuple = std::tuple<error_code, batch_result>;

  struct fan_state;
  struct part;
  struct hash_state;
  struct object_item;
  struct load_item;
  struct load_plan;
  struct store_item;
  struct store_plan;
  struct store_leftovers;

  struct recovery_scan;

  // The directory (impl/disk_directory.hpp).
  void open_directory();
  /// Throws std::runtime_error naming the backend and its path, what failed and strerror(err) (err 0: none).
  [[noreturn]] void throw_directory_error(const std::string& what, int err) const;
  /// Throws std::invalid_argument naming the backend and its path, and why it is not trusted.
  [[noreturn]] void throw_untrusted(const std::string& why) const;
  /// A directory of ours (objects/, tmp/, a shard): trusted as the root, and tightened to 0700
  /// when an older version made it wider.
  void check_own_directory(int fd, const std::string& path) const;
  /// The format marker: refuses a directory written by another format (or something else),
  /// writes it into a new one.
  void check_format_marker() const;
  /// Takes the flock on LOCK: one process per directory.
  void lock_directory();
  /// Creates and opens objects/, tmp/ and the shard directories, checking each is ours.
  void open_subdirectories();
  /// Whether the file system takes O_DIRECT (a probe file in tmp/); warns when it does not.
  bool takes_o_direct();
  /// options_.name_sync, automatic resolved by the file system of objects/ (logged); warns
  /// when `file` was asked for on a file system the probe does not trust with it.
  disk_name_sync choose_name_sync();
  /// Whether a store batch ends with an fsync of each shard directory it touched.
  [[nodiscard]] bool syncs_directories() const noexcept {
    return options_.sync == disk_sync::data && name_sync_ == disk_name_sync::directory;
  }
  void recover();
  /// Checks one entry of a shard directory; recovers it into scan.all, drops it, or leaves it alone.
  void scan_object_file(recovery_scan& scan, unsigned shard, const std::string& name);
  /// verify_on_start: why the payload of the object open as fd (its header h, from
  /// header_block) fails its checksum, or each segment's, or empty.
  static std::string_view check_payload(int fd, const object_header& h, std::span<const std::byte> header_block,
                                        aligned_buffer& scratch);
  /// Deletes an object file found bad at start-up; counts it and warns about the first eight.
  void drop_at_start(recovery_scan& scan, int dirfd, const std::string& name, std::string_view why);
  void close_fds() noexcept;

  // The operations: lookup and load (impl/disk_load.hpp), store (impl/disk_store.hpp),
  // remove and list (impl/disk_backend.hpp).
  boost::asio::awaitable<lookup_tuple> lookup_impl(std::span<const chunk_key> keys, deadline d);
  boost::asio::awaitable<batch_tuple> load_impl(std::span<const chunk_key> keys,
                                                std::span<const std::span<std::byte>> destinations, deadline d,
                                                load_observer observer = {});
  boost::asio::awaitable<batch_tuple> store_impl(std::span<const chunk_key> keys,
                                                 std::span<const std::span<const std::byte>> sources, deadline d);
  boost::asio::awaitable<batch_tuple> remove_impl(std::span<const chunk_key> keys, deadline d);
  boost::asio::awaitable<std::tuple<error_code, std::vector<listed_object>>> list_impl(key_filter filter, deadline d);

  // What loads and stores share (impl/disk_backend.hpp).
  /// The answer to a batch refused before it starts (buffers that do not match the keys, a
  /// deadline already passed), or nullopt.
  std::optional<batch_tuple> refuse_batch(std::size_t keys, std::size_t buffers, deadline d, disk_stats::op op);
  /// The answer of a batch that ran: counts its timeouts.
  batch_tuple finish_batch(const fan_state& fs, disk_stats::op op, std::size_t timeouts, batch_result r);
  /// Sets up item j of a batch (checksum, path, O_DIRECT, its header and tail blocks) for a
  /// payload of `bytes` at `data`.
  void prepare_item(object_item& it, std::uint32_t j, const std::byte* data, std::size_t bytes, std::byte* blocks,
                    hash_state& hash);
  /// Appends the parts of the bytes [from, to) of item's payload: part_bytes parts (across
  /// segment boundaries), then its partial last block when `to` is past the last whole block.
  void add_payload_parts(std::vector<part>& parts, const object_item& it, std::uint32_t item, std::size_t from,
                         std::size_t to) const;
  /// The outcome of a key whose I/O failed with ec (not ENOSPC): timeout when cancelled,
  /// unavailable when shutting down, else io_error.
  static key_outcome outcome_of_failure(const error_code& ec) noexcept;

  template <class Body>
  boost::asio::awaitable<void> fan_out(fan_state& fs, std::size_t n, unsigned width, deadline d, Body& body);
  template <class Body>
  boost::asio::awaitable<void> fan_worker(fan_state& fs, unsigned lane, std::size_t n, Body& body);
  /// Runs a load_plan or store_plan through file_io, bounded by the deadline like fan_out.
  template <class Plan>
  boost::asio::awaitable<void> run_parts(fan_state& fs, deadline d, Plan plan);

  // The steps of a load (impl/disk_load.hpp).
  /// Step 1, under the mutex: answers the keys absent or of another size, touches the others.
  std::vector<load_item> plan_load(std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations,
                                   const load_observer& observer, batch_result& r);
  /// Step 2: the parts of every item, its blocks in `blocks`: every header block, then
  /// segment 0 of every item, segment 1 of every item, ... (payload parts, tail).
  std::vector<part> load_parts(std::vector<load_item>& items, std::byte* blocks, std::vector<hash_state>& hashes);
  /// Step 3: item's file could not be opened (ENOENT: removed behind our back, forgotten).
  void fail_open(load_item& it, const error_code& ec);
  void part_loaded(std::vector<load_item>& items, std::vector<part>& parts, std::size_t i, const error_code& ec,
                   std::size_t got);
  /// item's header block landed: whether it decodes, names the key, has known flags, the
  /// destination's length, and the segment table (valid, chained to the header by its
  /// checksum) the index recorded; fails the item corrupt when not.
  bool check_header(load_item& it);
  /// Feeds item's checksum with its landed payload prefix, in payload order, checks each
  /// segment that completed once the header landed, tells the observer of each verified
  /// prefix, and completes the item when its last segment verified.
  void verify_landed(load_item& it, std::vector<part>& parts);
  void fail_load(load_item& it, const error_code& ec);
  void fail_corrupt(load_item& it, std::string_view why);
  /// Every segment of item verified: ok, told whole.
  void verify_loaded(load_item& it);
  // The steps of a store (impl/disk_store.hpp).
  /// Step 1, under the mutex: answers the keys that exist or find no room, reserves room for the
  /// others (appending the victims to evict) and marks them `writing`.
  std::vector<store_item> plan_store(std::span<const chunk_key> keys,
                                     std::span<const std::span<const std::byte>> sources, batch_result& r,
                                     std::vector<detail::disk_victim>& victims);
  /// Step 2: the parts of every item (payload, tail, header last), its blocks in `blocks`;
  /// item j's parts are [first_parts[j], first_parts[j + 1]).
  std::vector<part> store_parts(std::vector<store_item>& items, std::byte* blocks, std::vector<hash_state>& hashes,
                                std::vector<std::size_t>& first_parts);
  /// How many keys of a batch of `keys` go through their pipelines at once.
  [[nodiscard]] unsigned store_lanes(std::size_t keys) const noexcept;
  /// The store lanes of the whole backend: keys whose writes and sync are in flight at once.
  [[nodiscard]] static unsigned store_lane_count(const disk_backend_options& o) noexcept {
    return std::max(1U, o.queue_depth / 2);
  }
  /// Step 3: creates item's temporary file (on an io-wq worker) and preallocates it; fails the
  /// item on an error, ENOSPC included.
  boost::asio::awaitable<void> create_temp_file(store_item& it, fan_state& fs, unsigned lane);
  boost::asio::awaitable<void> commit_stored(store_item& it, fan_state& fs, unsigned lane);
  void fail_store(store_item& it, const error_code& ec);
  /// Step 6: closes every file and answers each key; what is left to clean up.
  store_leftovers close_stored(std::vector<store_item>& items, batch_result& r);
  /// Step 6, under the mutex: releases the room of the keys that did not commit, keeps counting
  /// the files of theirs that could not be deleted.
  void release_uncommitted(const std::vector<store_item>& items, const std::vector<error_code>& unlink_errors,
                           const std::vector<std::uint64_t>& file_bytes);
  /// Step 7: fsyncs the shard directories in `dirty`, not stoppable.
  boost::asio::awaitable<void> sync_shards(std::bitset<detail::disk_shard_count> dirty);
  /// Step 8 (st_blocks above the estimates), and the start-up scan (a capacity lowered since
  /// the last run): under the mutex, the victims that bring usage back under the low watermark
  /// when it passed the high one, or nullopt.
  std::optional<std::vector<detail::disk_victim>> trim_victims();
  /// Unlinks names relative to dirfd, not stoppable (cleanup always completes); the error of
  /// each (ENOENT counts as success).
  template <class Name>
  boost::asio::awaitable<std::vector<error_code>> unlink_all(int dirfd, std::vector<Name> names);
  /// Removes victims chosen by the index: unlink, then forget; counts evictions.
  boost::asio::awaitable<void> evict(std::vector<detail::disk_victim> victims);
  /// An object a load found bad (why: corrupt, or deleted for a file gone behind our back).
  struct bad_object {
    chunk_key key;
    std::uint64_t generation = 0;
    bus::key_removal why = bus::key_removal::corrupt;
  };
  /// Drops objects a load found bad, when the index still holds the same generation.
  boost::asio::awaitable<void> drop(std::vector<bad_object> bad);
  /// Tells the key listener, if any, of keys (not empty) that changed (under the mutex).
  void tell(key_change c, bus::key_removal why, std::span<const chunk_key> keys) const;
  /// Tells it victims[from..] left (evicted), under the mutex.
  void tell_evicted(const std::vector<detail::disk_victim>& victims, std::size_t from) const;

  void count_io_error(disk_stats::op op, const error_code& ec, const chunk_key& key);
  void count_enospc(const chunk_key& key);
  void count_corrupt(const chunk_key& key, std::string_view why);
  void count_success() noexcept;

  executor_type executor_;
  disk_backend_options options_;
  std::unique_ptr<telemetry::logger> own_log_;
  telemetry::logger* log_;
  std::shared_ptr<disk_stats> stats_ = std::make_shared<disk_stats>();
  disk_recovery_report recovery_;
  bool direct_ = false;
  disk_name_sync name_sync_ = disk_name_sync::directory;

  int lock_fd_ = -1;
  int objects_fd_ = -1;
  int tmp_fd_ = -1;
  std::array<int, detail::disk_shard_count> shard_fds_{};

  mutable std::mutex mutex_;
  detail::disk_index index_;
  key_listener listener_;  ///< guarded by mutex_, called under it
  std::uint64_t next_generation_ = 1;
  std::uint64_t next_temp_ = 1;
  unsigned consecutive_errors_ = 0;
  std::string last_error_;
  /// Taken by a key of a store for its writes and sync (impl/disk_store.hpp), shared by
  /// every store in flight; on executor_.
  kvtier::detail::async_slots store_lanes_{executor_, store_lane_count(options_)};
  /// Taken by a key of a store from its file's creation until it has a lane: as many files
  /// are made ready ahead as there are lanes, whatever the number of batches in flight.
  kvtier::detail::async_slots store_opens_{executor_, store_lane_count(options_)};

  telemetry::log_throttle enospc_log_;
  telemetry::log_throttle io_error_log_;
  telemetry::log_throttle corrupt_log_;

  std::unique_ptr<io::any_file_io> file_io_;  // last: destroyed first (it waits for in-flight ops)
};

static_assert(corruptible_backend<disk_backend> && listing_backend<disk_backend> &&
              key_announcing_backend<disk_backend>);

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/l2/disk/impl/disk_backend.hpp>
