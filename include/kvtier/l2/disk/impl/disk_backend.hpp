#pragma once
// Definitions of l2::disk_backend (declarations and documentation: kvtier/l2/disk/disk_backend.hpp).

#include <kvtier/l2/disk/disk_backend.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bitset>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace kvtier::inline KVTIER_ABI_TAG::l2 {

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

/// Names of the entries of a directory (but . and ..); the fd stays open and usable.
[[nodiscard]] inline std::vector<std::string> list_directory(int dirfd) {
  std::vector<std::string> names;
  const int fd = ::dup(dirfd);
  if (fd < 0) return names;
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    ::close(fd);
    return names;
  }
  ::rewinddir(d);
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") names.emplace_back(n);
  }
  ::closedir(d);
  return names;
}

[[nodiscard]] inline std::string shard_dir_name(unsigned s) {
  return fmt::format("{:02x}", s);
}

/// Why a directory of the tier cannot be trusted (empty when it can): another user owns it,
/// or group or others may write in it (they could then replace its objects, checksums and
/// all). `st` describes `path`.
[[nodiscard]] inline std::string untrusted_directory(const std::string& path, const struct ::stat& st) {
  if (!S_ISDIR(st.st_mode)) return path + " is not a directory";
  if (st.st_uid != ::geteuid())
    return fmt::format(
        "{} is owned by uid {}, not by this user (uid {}): another user could replace the objects "
        "this server serves; give the tier a directory of its own user",
        path, st.st_uid, ::geteuid());
  if ((st.st_mode & 022) != 0)
    return fmt::format(
        "{} is writable by group or others (mode {:04o}): they could replace the objects this server "
        "serves; chmod 700 {}",
        path, st.st_mode & 07777, path);
  return {};
}

/// Creates `dir` and its missing parents with mode 0700 (whatever the umask: mkdir only
/// takes bits away from 0700). Returns the errno of the first failure, 0 on success.
[[nodiscard]] inline int make_private_directories(const std::filesystem::path& dir) {
  std::filesystem::path at;
  for (const auto& part : dir) {
    at /= part;
    if (::mkdir(at.c_str(), 0700) != 0 && errno != EEXIST) return errno;
  }
  return 0;
}

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
};

enum class part_kind : std::uint8_t { header, payload, tail };

/// One read or write of a transfer: a 4 KiB header block, a payload part, or the payload's
/// last partial block (through a bounce block).
struct disk_backend::part {
  std::uint32_t item = 0;
  part_kind kind = part_kind::payload;
  bool landed = false;       ///< load: its bytes are in the destination
  std::uint64_t offset = 0;  ///< in the payload (payload and tail parts)
  std::size_t len = 0;
};

/// The payload checksum is computed in part-sized steps as the bytes go by (XXH3 streaming),
/// never in one pass over a whole 32 MiB object: one pass costs ~2.5 ms of the I/O thread,
/// during which completed parts are not replaced and the device queue drains; 1 MiB steps
/// (~80 us) keep it full.
struct alignas(64) disk_backend::hash_state {
  XXH3_state_t state;
};

struct disk_backend::load_item {
  chunk_key key;
  std::span<std::byte> dst;
  std::uint64_t generation = 0;
  std::size_t index = 0;  ///< in the caller's batch
  detail::object_path path;
  int fd = -1;
  bool direct = false;
  std::size_t aligned_bytes = 0;  ///< payload bytes read straight into dst
  std::byte* header = nullptr;    ///< 4 KiB block of ours
  std::byte* tail = nullptr;      ///< 4 KiB bounce block for a partial last block
  unsigned parts_left = 0;
  std::size_t hash_next = 0;  ///< the next part (index into parts) to feed the checksum
  std::size_t parts_end = 0;  ///< one past this key's last part
  XXH3_state_t* hash = nullptr;
  const load_observer* landed = nullptr;  ///< told when the key verified (the caller's observer)
  bool failed = false;
  bool drop = false;  ///< the object is bad: remove it
  key_outcome outcome = key_outcome::timeout;
};

struct disk_backend::store_item {
  chunk_key key;
  std::span<const std::byte> src;
  std::uint64_t generation = 0;
  std::size_t index = 0;
  detail::object_path path;
  detail::temp_name temp;
  int fd = -1;
  bool direct = false;
  bool created = false;  ///< the temporary file exists
  bool committed = false;
  std::size_t aligned_bytes = 0;
  std::byte* header = nullptr;
  std::byte* tail = nullptr;
  unsigned parts_left = 0;
  XXH3_state_t* hash = nullptr;  ///< fed in order as the parts are issued
  bool failed = false;
  key_outcome outcome = key_outcome::timeout;
};

// --- construction, recovery -----------------------------------------------------------------

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

inline void disk_backend::open_directory() {
  const auto& root = options_.path;
  const std::string where = "kvtier::l2::disk_backend '" + options_.name + "' at " + root.string();
  auto fail = [&](const std::string& what, int err) {
    throw std::runtime_error(where + ": " + what + (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
  };
  // Trust: the tier's files hold prompt-derived KV (private: 0600 files, 0700 directories),
  // and whatever is in them is served (so only directories no other user may write).
  auto untrusted = [&](const std::string& why) { throw std::invalid_argument(where + ": " + why); };
  if (const int err = detail::make_private_directories(root); err != 0) fail("cannot create the directory", err);
  {
    struct ::stat st {};
    if (::stat(root.c_str(), &st) != 0) fail("cannot inspect the directory", errno);
    if (auto why = detail::untrusted_directory(root.string(), st); !why.empty()) untrusted(why);
  }
  // A directory of ours (objects/, tmp/, a shard): trusted as above, and tightened to 0700
  // when an older version made it wider.
  auto check_own_dir = [&](int fd, const std::string& path) {
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) fail("cannot inspect " + path, errno);
    if (auto why = detail::untrusted_directory(path, st); !why.empty()) untrusted(why);
    if ((st.st_mode & 07777) != 0700) (void)::fchmod(fd, 0700);
  };

  // The format marker: refuse a directory written by another format (or something else).
  const auto marker = root / "FORMAT";
  if (std::FILE* f = std::fopen(marker.c_str(), "rb")) {
    char buf[64] = {};
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    if (std::string_view(buf, n) != detail::format_marker)
      fail("its FORMAT file says '" + std::string(buf, n) + "', not '" +
               std::string(detail::format_marker.substr(0, detail::format_marker.size() - 1)) +
               "': use an empty directory or one written by this version",
           0);
  } else {
    const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) fail("cannot write " + marker.string(), errno);
    const bool ok = ::write(fd, detail::format_marker.data(), detail::format_marker.size()) ==
                    static_cast<ssize_t>(detail::format_marker.size());
    ::fsync(fd);
    ::close(fd);
    if (!ok) fail("cannot write " + marker.string(), errno);
  }

  lock_fd_ = ::open((root / "LOCK").c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) fail("cannot open LOCK", errno);
  (void)::fchmod(lock_fd_, 0600);  // one an older version made 0644
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      fail("the directory is in use by another disk backend (flock on LOCK): give each one its own directory", 0);
    fail("cannot lock LOCK", errno);
  }

  for (const char* sub : {"objects", "tmp"})
    if (::mkdir((root / sub).c_str(), 0700) != 0 && errno != EEXIST) fail(std::string("cannot create ") + sub, errno);
  // O_NOFOLLOW: a symlink in place of a directory of ours is refused (ELOOP).
  objects_fd_ = ::open((root / "objects").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (objects_fd_ < 0) fail("cannot open objects/", errno);
  check_own_dir(objects_fd_, (root / "objects").string());
  tmp_fd_ = ::open((root / "tmp").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (tmp_fd_ < 0) fail("cannot open tmp/", errno);
  check_own_dir(tmp_fd_, (root / "tmp").string());
  for (unsigned s = 0; s < detail::disk_shard_count; ++s) {
    const std::string name = detail::shard_dir_name(s);
    if (::mkdirat(objects_fd_, name.c_str(), 0700) != 0 && errno != EEXIST)
      fail("cannot create objects/" + name, errno);
    shard_fds_[s] = ::openat(objects_fd_, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (shard_fds_[s] < 0) fail("cannot open objects/" + name, errno);
    check_own_dir(shard_fds_[s], (root / "objects" / name).string());
  }

  // Does this file system take O_DIRECT (tmpfs before 6.6, some FUSE file systems do not)?
  direct_ = false;
  if (options_.o_direct) {
    const char* probe = "o_direct_probe.tmp";
    const int fd = ::openat(tmp_fd_, probe, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
      aligned_buffer block(detail::disk_block_bytes);
      std::memset(block.data(), 0, block.size());
      if (::pwrite(fd, block.data(), block.size(), 0) != static_cast<ssize_t>(block.size())) err = errno;
      ::close(fd);
      ::unlinkat(tmp_fd_, probe, 0);
    }
    if (err == 0) direct_ = true;
    else
      log_->warn("disk backend '{}': the file system at {} refuses O_DIRECT ({}); using buffered I/O (the page "
                 "cache will hold a copy of what the tier reads and writes)",
                 options_.name, root.string(), std::strerror(err));
  }
  stats_->o_direct.store(direct_, std::memory_order_relaxed);
}

inline void disk_backend::recover() {
  // 1. Interrupted stores: every temporary file goes (none can be complete AND visible).
  for (const auto& n : detail::list_directory(tmp_fd_))
    if (::unlinkat(tmp_fd_, n.c_str(), 0) == 0) ++recovery_.temp_files;

  // 2. Objects: read and check each header block.
  struct found {
    chunk_key key;
    std::uint64_t payload = 0;
    std::uint64_t allocated = 0;
    ::timespec mtime{};
  };
  std::vector<found> all;
  aligned_buffer block(detail::disk_block_bytes);
  aligned_buffer scratch(options_.verify_on_start ? std::size_t{8} << 20 : 0);
  unsigned logged = 0;
  unsigned untrusted_logged = 0;
  const ::uid_t self = ::geteuid();
  auto drop = [&](int dirfd, const std::string& name, std::string_view why) {
    if (::unlinkat(dirfd, name.c_str(), 0) == 0 || errno == ENOENT) ++recovery_.dropped;
    if (logged++ < 8)
      log_->warn("disk backend '{}': dropped {} at start-up: {}", options_.name, name, why);
  };
  for (unsigned s = 0; s < detail::disk_shard_count; ++s) {
    const int dirfd = shard_fds_[s];
    for (const auto& name : detail::list_directory(dirfd)) {
      struct ::stat st {};
      if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      const auto key = detail::parse_object_name(name);
      if (!S_ISREG(st.st_mode) || !key) {
        ++recovery_.foreign_files;  // not ours: left alone
        continue;
      }
      // An object file another user owns, or one others may write, is not trusted: its
      // checksums prove nothing (whoever wrote it computed them). Left alone, never served.
      if (st.st_uid != self || (st.st_mode & 022) != 0) {
        ++recovery_.untrusted_files;
        if (untrusted_logged++ < 8)
          log_->warn(
              "disk backend '{}': skipped {} at start-up: not owned by this user (uid {}, mode {:04o}); it is "
              "left alone and never served",
              options_.name, name, st.st_uid, st.st_mode & 07777);
        continue;
      }
      if ((st.st_mode & 07777) != 0600) (void)::fchmodat(dirfd, name.c_str(), 0600, 0);  // an older version's 0644
      if (detail::shard_of(*key) != s) {
        drop(dirfd, name, "in the wrong shard directory");
        continue;
      }
      const int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        log_->warn("disk backend '{}': cannot open {} at start-up ({}): left alone, not served", options_.name, name,
                   std::strerror(errno));
        continue;
      }
      object_header h;
      const ssize_t got = ::pread(fd, block.data(), block.size(), 0);
      auto check = got == static_cast<ssize_t>(block.size())
                       ? detail::check_object(block.span(), *key, static_cast<std::uint64_t>(st.st_size), h)
                       : (got >= 0 ? detail::object_check::wrong_size : detail::object_check::bad_header);
      std::string why(detail::to_string(check));
      if (check == detail::object_check::ok && options_.verify_on_start) {
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        std::uint64_t at = 0;
        bool read_ok = true;
        while (at < h.payload_bytes) {
          const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(scratch.size(), h.payload_bytes - at));
          const ssize_t n = ::pread(fd, scratch.data(), want, static_cast<off_t>(detail::disk_block_bytes + at));
          if (n != static_cast<ssize_t>(want)) {
            read_ok = false;
            break;
          }
          XXH3_64bits_update(&state, scratch.data(), want);
          at += want;
        }
        if (!read_ok || XXH3_64bits_digest(&state) != h.payload_checksum) {
          check = detail::object_check::bad_header;
          why = read_ok ? "payload checksum mismatch" : "payload unreadable";
        }
      }
      ::close(fd);
      if (check != detail::object_check::ok) {
        drop(dirfd, name, why);
        continue;
      }
      all.push_back({*key, h.payload_bytes, static_cast<std::uint64_t>(st.st_blocks) * 512, st.st_mtim});
    }
  }
  if (logged > 8)
    log_->warn("disk backend '{}': {} more objects dropped at start-up", options_.name, logged - 8);
  if (untrusted_logged > 8)
    log_->warn("disk backend '{}': {} more object files not owned by this user skipped at start-up", options_.name,
               untrusted_logged - 8);

  // 3. The eviction order: oldest first (modification time; the key breaks ties so the order
  //    does not depend on readdir).
  std::sort(all.begin(), all.end(), [](const found& a, const found& b) {
    if (a.mtime.tv_sec != b.mtime.tv_sec) return a.mtime.tv_sec < b.mtime.tv_sec;
    if (a.mtime.tv_nsec != b.mtime.tv_nsec) return a.mtime.tv_nsec < b.mtime.tv_nsec;
    return a.key < b.key;
  });
  for (const auto& f : all) index_.add_ready(f.key, f.payload, f.allocated, next_generation_++);

  // 4. A capacity lowered since the last run: evict down to the low watermark now.
  if (static_cast<double>(index_.bytes_used()) >
      options_.high_watermark * static_cast<double>(options_.capacity_bytes)) {
    if (auto victims = index_.make_room(0, options_.capacity_bytes, options_.high_watermark, options_.low_watermark)) {
      for (const auto& v : *victims) {
        const auto p = detail::object_path_of(v.key);
        ::unlinkat(objects_fd_, p.c_str(), 0);
        index_.finish_remove(v.key, v.generation);
        ++recovery_.evicted;
        stats_->evicted_objects.fetch_add(1, std::memory_order_relaxed);
        stats_->evicted_bytes.fetch_add(v.allocated_bytes, std::memory_order_relaxed);
      }
    }
  }
  recovery_.objects = index_.objects();
  recovery_.bytes = index_.bytes_used();
  stats_->recovered_objects.store(recovery_.objects, std::memory_order_relaxed);
  stats_->recovered_bytes.store(recovery_.bytes, std::memory_order_relaxed);
  stats_->recovery_dropped.store(recovery_.dropped, std::memory_order_relaxed);
  stats_->recovery_temp_files.store(recovery_.temp_files, std::memory_order_relaxed);
  stats_->recovery_untrusted.store(recovery_.untrusted_files, std::memory_order_relaxed);
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

// --- lookup -----------------------------------------------------------------------------------

inline boost::asio::awaitable<disk_backend::lookup_tuple> disk_backend::lookup_impl(std::span<const chunk_key> keys,
                                                                                    deadline d) {
  bitmap found(keys.size());
  if (clock::now() >= d) co_return lookup_tuple{make_error_code(errc::timeout), found};
  std::lock_guard g(mutex_);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (auto* e = index_.find_ready(keys[i])) {
      ++e->pins;
      index_.touch(*e);
      found.set(i);
    }
  }
  co_return lookup_tuple{error_code{}, found};
}

// --- load -------------------------------------------------------------------------------------

inline boost::asio::awaitable<disk_backend::batch_tuple> disk_backend::load_impl(
    std::span<const chunk_key> keys, std::span<const std::span<std::byte>> destinations, deadline d,
    load_observer observer) {
  namespace asio = boost::asio;
  co_await asio::this_coro::throw_if_cancelled(false);
  batch_result r(keys.size(), key_outcome::timeout);
  if (keys.size() != destinations.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
  if (clock::now() >= d) {
    stats_->timeouts[disk_stats::load].fetch_add(keys.size(), std::memory_order_relaxed);
    co_return batch_tuple{make_error_code(errc::timeout), r};
  }

  // 1. Plan: which keys are there, with the right size.
  std::vector<load_item> items;
  items.reserve(keys.size());
  {
    std::lock_guard g(mutex_);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      auto* e = index_.find_ready(keys[i]);
      if (e == nullptr) {
        r.outcomes[i] = key_outcome::not_found;
        continue;
      }
      if (e->payload_bytes != destinations[i].size()) {
        r.outcomes[i] = key_outcome::rejected;
        continue;
      }
      index_.touch(*e);
      load_item it;
      it.key = keys[i];
      it.dst = destinations[i];
      it.generation = e->generation;
      it.index = i;
      it.landed = observer ? &observer : nullptr;
      items.push_back(it);
    }
  }
  if (items.empty()) co_return batch_tuple{error_code{}, r};

  // 2. Parts, in key order: the header block, the payload in part_bytes parts, the tail.
  aligned_buffer blocks(items.size() * 2 * detail::disk_block_bytes);
  std::vector<hash_state> hashes(items.size());
  std::vector<part> parts;
  const std::size_t part_bytes = detail::round_up_block(options_.part_bytes);
  std::size_t counted = 0;
  for (std::size_t j = 0; j < items.size(); ++j) {
    load_item& it = items[j];
    it.hash = &hashes[j].state;
    XXH3_64bits_reset(it.hash);
    it.hash_next = parts.size();
    it.path = detail::object_path_of(it.key);
    it.direct = direct_ && detail::is_aligned(it.dst.data());
    it.aligned_bytes = it.dst.size() & ~(detail::disk_block_bytes - 1);
    it.header = blocks.data() + 2 * j * detail::disk_block_bytes;
    it.tail = it.header + detail::disk_block_bytes;
    const auto item = static_cast<std::uint32_t>(j);
    parts.push_back({item, part_kind::header, false, 0, detail::disk_block_bytes});
    for (std::size_t off = 0; off < it.aligned_bytes; off += part_bytes)
      parts.push_back({item, part_kind::payload, false, off, std::min(part_bytes, it.aligned_bytes - off)});
    if (it.dst.size() > it.aligned_bytes)
      parts.push_back({item, part_kind::tail, false, it.aligned_bytes, detail::disk_block_bytes});
    it.parts_left = static_cast<unsigned>(parts.size() - counted);
    it.parts_end = parts.size();
    counted = parts.size();
  }

  fan_state fs;
  // 3. Open every file (through file_io: a slow directory lookup never blocks the thread).
  auto open_body = [this, &items](std::size_t j, fan_state& f, unsigned lane) -> asio::awaitable<void> {
    load_item& it = items[j];
    const int flags = O_RDONLY | O_CLOEXEC | (it.direct ? O_DIRECT : 0);
    auto [ec, fd] = co_await file_io_->async_openat(objects_fd_, it.path.c_str(), flags, 0,
                                                   asio::bind_cancellation_slot(f.slot(lane), asio::as_tuple(asio::use_awaitable)));
    if (!ec) {
      it.fd = fd;
      co_return;
    }
    it.failed = true;
    if (detail::is_errno(ec, ENOENT)) {
      it.outcome = key_outcome::not_found;  // removed behind our back: forget it
      it.drop = true;
    } else if (ec == asio::error::operation_aborted) {
      it.outcome = key_outcome::timeout;
    } else if (ec == errc::shutting_down) {
      it.outcome = key_outcome::unavailable;
    } else {
      it.outcome = key_outcome::io_error;
      it.drop = detail::is_media_error(ec);
      count_io_error(disk_stats::load, ec, it.key);
    }
  };
  co_await fan_out(fs, items.size(), 64, d, open_body);

  // 4. Read every part, queue_depth at a time across keys; verify each key when it landed.
  auto read_body = [this, &items, &parts](std::size_t i, fan_state& f, unsigned lane) {
    return load_part(items, parts, i, f, lane);
  };
  co_await fan_out(fs, parts.size(), options_.queue_depth, d, read_body);

  // 5. Close, drop what was found bad, answer.
  std::vector<std::pair<chunk_key, std::uint64_t>> bad;
  std::size_t timeouts = 0;
  for (auto& it : items) {
    if (it.fd >= 0) ::close(it.fd);
    if (it.drop) bad.emplace_back(it.key, it.generation);
    if (it.outcome == key_outcome::timeout) ++timeouts;
    r.outcomes[it.index] = it.outcome;
  }
  if (!bad.empty()) co_await drop(std::move(bad));
  stats_->timeouts[disk_stats::load].fetch_add(timeouts, std::memory_order_relaxed);
  error_code ec;
  if (fs.aborted) ec = asio::error::operation_aborted;
  else if (timeouts > 0) ec = make_error_code(errc::timeout);
  co_return batch_tuple{ec, std::move(r)};
}

inline boost::asio::awaitable<void> disk_backend::load_part(std::vector<load_item>& items, std::vector<part>& parts,
                                                            std::size_t i, fan_state& fs, unsigned lane) {
  namespace asio = boost::asio;
  part& p = parts[i];
  load_item& it = items[p.item];
  if (it.failed || it.fd < 0) co_return;
  std::byte* buf = p.kind == part_kind::header ? it.header
                   : p.kind == part_kind::tail ? it.tail
                                               : it.dst.data() + p.offset;
  const std::uint64_t at = p.kind == part_kind::header ? 0 : detail::disk_block_bytes + p.offset;
  auto [ec, got] = co_await file_io_->async_read(it.fd, std::span<std::byte>(buf, p.len), at,
                                                asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
  if (it.failed) co_return;  // another part of this key failed meanwhile
  if (ec) {
    it.failed = true;
    if (ec == asio::error::operation_aborted) {
      it.outcome = key_outcome::timeout;
    } else if (ec == errc::shutting_down) {
      it.outcome = key_outcome::unavailable;
    } else {
      it.outcome = key_outcome::io_error;
      it.drop = detail::is_media_error(ec);
      count_io_error(disk_stats::load, ec, it.key);
    }
    co_return;
  }
  if (got < p.len) {  // end of file before the header's length: a truncated object
    it.failed = true;
    it.outcome = key_outcome::corrupt;
    it.drop = true;
    count_corrupt(it.key, "the file is shorter than its header says");
    co_return;
  }
  if (p.kind == part_kind::tail)
    std::memcpy(it.dst.data() + it.aligned_bytes, it.tail, it.dst.size() - it.aligned_bytes);
  p.landed = true;
  // Feed the checksum with the landed prefix of this key's payload, in order.
  while (it.hash_next < it.parts_end && parts[it.hash_next].landed) {
    const part& q = parts[it.hash_next++];
    if (q.kind == part_kind::header) continue;
    const std::size_t len = std::min<std::size_t>(q.len, it.dst.size() - q.offset);
    XXH3_64bits_update(it.hash, it.dst.data() + q.offset, len);
  }
  if (--it.parts_left == 0) verify_loaded(it);
}

inline void disk_backend::verify_loaded(load_item& it) {
  const auto h = decode_header(std::span<const std::byte>(it.header, detail::disk_block_bytes));
  std::string_view why;
  if (!h) why = "bad header";
  else if (h->key != it.key) why = "the header names another key";
  else if (h->flags != 0 || h->payload_bytes != it.dst.size()) why = "the header's length differs";
  else if (XXH3_64bits_digest(it.hash) != h->payload_checksum) why = "payload checksum mismatch";
  if (!why.empty()) {
    it.failed = true;
    it.outcome = key_outcome::corrupt;
    it.drop = true;
    count_corrupt(it.key, why);
    return;
  }
  it.outcome = key_outcome::ok;
  stats_->loaded_bytes.fetch_add(it.dst.size(), std::memory_order_relaxed);
  count_success();
  if (it.landed != nullptr) (*it.landed)(it.index);  // every part landed: nothing writes dst any more
}

inline boost::asio::awaitable<void> disk_backend::drop(std::vector<std::pair<chunk_key, std::uint64_t>> bad) {
  std::vector<detail::object_path> paths;
  std::vector<std::pair<chunk_key, std::uint64_t>> gone;
  {
    std::lock_guard g(mutex_);
    for (const auto& [k, gen] : bad)
      if (index_.start_remove(k, gen)) {
        gone.emplace_back(k, gen);
        paths.push_back(detail::object_path_of(k));
      }
  }
  const auto errors = co_await unlink_all(objects_fd_, std::move(paths));
  std::size_t dropped = 0;
  {
    std::lock_guard g(mutex_);
    for (std::size_t i = 0; i < gone.size(); ++i) {
      if (errors[i]) {
        // The bad file is still there: never served, still counted, remove() retries.
        index_.mark_stuck(gone[i].first, gone[i].second);
        continue;
      }
      index_.finish_remove(gone[i].first, gone[i].second);
      ++dropped;
    }
  }
  for (std::size_t i = 0; i < gone.size(); ++i)
    if (errors[i]) count_io_error(disk_stats::remove, errors[i], gone[i].first);
  stats_->dropped_objects.fetch_add(dropped, std::memory_order_relaxed);
}

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
    for (std::size_t i = 0; i < victims.size(); ++i) {
      const auto& v = victims[i];
      if (errors[i]) {
        // Its file is still there and intact: it stays served and counted (not evicted).
        index_.abort_remove(v.key, v.generation);
        continue;
      }
      index_.finish_remove(v.key, v.generation);
      bytes += v.allocated_bytes;
      ++evicted;
    }
  }
  for (std::size_t i = 0; i < errors.size(); ++i)
    if (errors[i]) count_io_error(disk_stats::remove, errors[i], victims[i].key);
  stats_->evicted_objects.fetch_add(evicted, std::memory_order_relaxed);
  stats_->evicted_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

// --- store ------------------------------------------------------------------------------------

inline boost::asio::awaitable<disk_backend::batch_tuple> disk_backend::store_impl(
    std::span<const chunk_key> keys, std::span<const std::span<const std::byte>> sources, deadline d) {
  namespace asio = boost::asio;
  co_await asio::this_coro::throw_if_cancelled(false);
  batch_result r(keys.size(), key_outcome::timeout);
  if (keys.size() != sources.size()) co_return batch_tuple{make_error_code(errc::invalid_argument), r};
  if (clock::now() >= d) {
    stats_->timeouts[disk_stats::store].fetch_add(keys.size(), std::memory_order_relaxed);
    co_return batch_tuple{make_error_code(errc::timeout), r};
  }

  // 1. Plan: skip what exists, reserve room (choosing victims), mark the rest `writing`.
  std::vector<store_item> items;
  std::vector<detail::disk_victim> victims;
  items.reserve(keys.size());
  {
    std::lock_guard g(mutex_);
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
      index_.begin_write(it.key, it.src.size(), need, it.generation);
      items.push_back(it);
    }
  }
  if (!victims.empty()) co_await evict(std::move(victims));
  if (items.empty()) co_return batch_tuple{error_code{}, r};

  // 2. Parts: the payload in part_bytes parts, its partial last block through a bounce block,
  //    then the header block (written last: its checksum is computed while the payload's
  //    writes are in flight).
  aligned_buffer blocks(items.size() * 2 * detail::disk_block_bytes);
  std::vector<hash_state> hashes(items.size());
  std::vector<part> parts;
  const std::size_t part_bytes = detail::round_up_block(options_.part_bytes);
  std::size_t counted = 0;
  for (std::size_t j = 0; j < items.size(); ++j) {
    store_item& it = items[j];
    it.hash = &hashes[j].state;
    XXH3_64bits_reset(it.hash);
    it.path = detail::object_path_of(it.key);
    it.direct = direct_ && detail::is_aligned(it.src.data());
    it.aligned_bytes = it.src.size() & ~(detail::disk_block_bytes - 1);
    it.header = blocks.data() + 2 * j * detail::disk_block_bytes;
    it.tail = it.header + detail::disk_block_bytes;
    const auto item = static_cast<std::uint32_t>(j);
    for (std::size_t off = 0; off < it.aligned_bytes; off += part_bytes)
      parts.push_back({item, part_kind::payload, false, off, std::min(part_bytes, it.aligned_bytes - off)});
    if (it.src.size() > it.aligned_bytes) {
      const std::size_t rest = it.src.size() - it.aligned_bytes;
      std::memcpy(it.tail, it.src.data() + it.aligned_bytes, rest);
      std::memset(it.tail + rest, 0, detail::disk_block_bytes - rest);
      parts.push_back({item, part_kind::tail, false, it.aligned_bytes, detail::disk_block_bytes});
    }
    parts.push_back({item, part_kind::header, false, 0, detail::disk_block_bytes});
    it.parts_left = static_cast<unsigned>(parts.size() - counted);
    counted = parts.size();
  }

  fan_state fs;
  // 3. Create the temporary files (and allocate their blocks).
  auto open_body = [this, &items](std::size_t j, fan_state& f, unsigned lane) -> asio::awaitable<void> {
    store_item& it = items[j];
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (it.direct ? O_DIRECT : 0);
    auto [ec, fd] =
        co_await file_io_->async_openat(tmp_fd_, it.temp.c_str(), flags, 0600,
                                       asio::bind_cancellation_slot(f.slot(lane), asio::as_tuple(asio::use_awaitable)));
    if (ec) {
      fail_store(it, ec);
      co_return;
    }
    it.fd = fd;
    it.created = true;
    // No io_uring opcode here for fallocate in file_io; the syscall only reserves extents
    // (tens of microseconds on ext4), and shows ENOSPC before any byte is written.
    if (options_.preallocate &&
        ::fallocate(fd, 0, 0, static_cast<off_t>(detail::object_file_bytes(it.src.size()))) != 0 &&
        errno != EOPNOTSUPP && errno != ENOSYS)
      fail_store(it, detail::last_errno());
  };
  co_await fan_out(fs, items.size(), 64, d, open_body);

  // 4. Write every part, queue_depth at a time across keys.
  auto write_body = [this, &items, &parts](std::size_t i, fan_state& f, unsigned lane) {
    return store_part(items, parts[i], f, lane);
  };
  co_await fan_out(fs, parts.size(), options_.queue_depth, d, write_body);

  // 5. Commit every written key at once: fdatasync, rename into objects/. In parallel, the
  //    file system folds the syncs into a few journal commits.
  auto commit_body = [this, &items](std::size_t j, fan_state& f, unsigned lane) -> asio::awaitable<void> {
    store_item& it = items[j];
    if (it.failed || it.fd < 0 || it.parts_left != 0) co_return;
    co_await commit_stored(it, f, lane);
  };
  co_await fan_out(fs, items.size(), 64, d, commit_body);

  // 6. Close; remove the temporary files of keys that did not commit; release their room.
  std::vector<detail::temp_name> temps;
  std::vector<std::uint64_t> temp_bytes;
  std::bitset<detail::disk_shard_count> dirty;
  std::size_t timeouts = 0;
  for (auto& it : items) {
    if (it.fd >= 0) ::close(it.fd);
    if (it.committed) dirty.set(detail::shard_of(it.key));
    else if (it.created) {
      temps.push_back(it.temp);
      temp_bytes.push_back(detail::object_file_bytes(it.src.size()));
    }
    if (it.outcome == key_outcome::timeout) ++timeouts;
    r.outcomes[it.index] = it.outcome;
  }
  std::vector<error_code> temp_errors;
  if (!temps.empty()) temp_errors = co_await unlink_all(tmp_fd_, std::move(temps));
  {
    std::lock_guard g(mutex_);
    for (const auto& it : items)
      if (!it.committed) index_.abort_write(it.key, it.generation);
    // A temporary file that could not be deleted still takes room: counted until the next
    // start-up's scan deletes it.
    for (std::size_t i = 0; i < temp_errors.size(); ++i)
      if (temp_errors[i]) index_.keep_stray(temp_bytes[i]);
  }

  // 7. Durability of the renames: one fsync per touched shard directory, for the batch.
  if (options_.sync == disk_sync::data && dirty.any()) {
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

  // 8. st_blocks may exceed the estimate (extent blocks): trim back under the watermark.
  std::optional<std::vector<detail::disk_victim>> trim;
  {
    std::lock_guard g(mutex_);
    if (static_cast<double>(index_.bytes_used()) >
        options_.high_watermark * static_cast<double>(options_.capacity_bytes))
      trim = index_.make_room(0, options_.capacity_bytes, options_.high_watermark, options_.low_watermark);
  }
  if (trim && !trim->empty()) co_await evict(std::move(*trim));

  stats_->timeouts[disk_stats::store].fetch_add(timeouts, std::memory_order_relaxed);
  error_code ec;
  if (fs.aborted) ec = asio::error::operation_aborted;
  else if (timeouts > 0) ec = make_error_code(errc::timeout);
  co_return batch_tuple{ec, std::move(r)};
}

inline void disk_backend::fail_store(store_item& it, const error_code& ec) {
  it.failed = true;
  if (ec == boost::asio::error::operation_aborted) {
    it.outcome = key_outcome::timeout;
  } else if (ec == errc::shutting_down) {
    it.outcome = key_outcome::unavailable;
  } else if (detail::is_no_space(ec)) {
    it.outcome = key_outcome::no_space;
    count_enospc(it.key);
  } else {
    it.outcome = key_outcome::io_error;
    count_io_error(disk_stats::store, ec, it.key);
  }
}

inline boost::asio::awaitable<void> disk_backend::store_part(std::vector<store_item>& items, const part& p,
                                                             fan_state& fs, unsigned lane) {
  namespace asio = boost::asio;
  store_item& it = items[p.item];
  if (it.failed || it.fd < 0) co_return;
  const std::byte* buf = nullptr;
  std::uint64_t at = detail::disk_block_bytes + p.offset;
  // Parts start in order (the fan-out hands them out in order and this runs before the first
  // suspension), so the checksum is fed in order, one part at a time, before its write.
  if (p.kind != part_kind::header)
    XXH3_64bits_update(it.hash, it.src.data() + p.offset, std::min<std::size_t>(p.len, it.src.size() - p.offset));
  if (p.kind == part_kind::header) {
    object_header h;
    h.key = it.key;
    h.payload_bytes = it.src.size();
    h.payload_checksum = XXH3_64bits_digest(it.hash);
    detail::encode_header_block(h, std::span<std::byte, detail::disk_block_bytes>(it.header, detail::disk_block_bytes));
    buf = it.header;
    at = 0;
  } else {
    buf = p.kind == part_kind::tail ? it.tail : it.src.data() + p.offset;
  }
  std::size_t done = 0;
  while (done < p.len) {
    auto [ec, put] = co_await file_io_->async_write(it.fd, std::span<const std::byte>(buf + done, p.len - done),
                                                   at + done,
                                                   asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
    if (it.failed) co_return;
    if (ec) {
      fail_store(it, ec);
      co_return;
    }
    if (put == 0) {
      fail_store(it, make_error_code(errc::io_error));
      co_return;
    }
    done += put;
    if (done < p.len && fs.stop) {
      fail_store(it, asio::error::operation_aborted);
      co_return;
    }
  }
  --it.parts_left;
}

inline boost::asio::awaitable<void> disk_backend::commit_stored(store_item& it, fan_state& fs, unsigned lane) {
  namespace asio = boost::asio;
  if (options_.sync == disk_sync::data) {
    auto [ec] = co_await file_io_->async_fdatasync(
        it.fd, asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
    if (ec) {
      fail_store(it, ec);
      co_return;
    }
  }
  struct ::stat st {};
  const std::uint64_t allocated = ::fstat(it.fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_blocks) * 512
                                                           : detail::object_file_bytes(it.src.size());
  auto [ec] = co_await file_io_->async_renameat(tmp_fd_, it.temp.c_str(), objects_fd_, it.path.c_str(),
                                               detail::rename_noreplace,
                                               asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
  if (detail::is_errno(ec, EEXIST)) {
    // A file at this path that the index does not know (put there behind our back, or left by
    // a crash): nothing serves it, so ours (complete, just verified on write) replaces it once.
    // Answering `exists` would claim an object that loads answer not_found for.
    auto [uec] = co_await file_io_->async_unlinkat(
        objects_fd_, it.path.c_str(), 0,
        asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
    if (uec && !detail::is_errno(uec, ENOENT)) {
      fail_store(it, uec);
      co_return;
    }
    std::tie(ec) = co_await file_io_->async_renameat(
        tmp_fd_, it.temp.c_str(), objects_fd_, it.path.c_str(), detail::rename_noreplace,
        asio::bind_cancellation_slot(fs.slot(lane), asio::as_tuple(asio::use_awaitable)));
  }
  if (ec) {
    fail_store(it, ec);
    co_return;
  }
  {
    std::lock_guard g(mutex_);
    index_.commit(it.key, it.generation, allocated);
  }
  it.committed = true;
  it.outcome = key_outcome::ok;
  stats_->stored_bytes.fetch_add(it.src.size(), std::memory_order_relaxed);
  count_success();
}

// --- remove -----------------------------------------------------------------------------------

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
      }
    }
  }
  if (gone.empty()) co_return batch_tuple{error_code{}, r};
  const auto errors = co_await unlink_all(objects_fd_, std::move(paths));
  {
    std::lock_guard g(mutex_);
    for (std::size_t j = 0; j < gone.size(); ++j) {
      const auto& x = gone[j];
      if (!errors[j])
        index_.finish_remove(keys[x.index], x.generation);
      else if (x.was_stuck)
        index_.mark_stuck(keys[x.index], x.generation);
      else
        index_.abort_remove(keys[x.index], x.generation);  // still there: still served
    }
  }
  for (std::size_t j = 0; j < gone.size(); ++j)
    if (errors[j]) {
      r.outcomes[gone[j].index] = key_outcome::io_error;
      count_io_error(disk_stats::remove, errors[j], keys[gone[j].index]);
    }
  co_return batch_tuple{error_code{}, r};
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::l2
