#pragma once
// The directory of l2::disk_backend (declarations: kvtier/l2/disk/disk_backend.hpp; docs/l2-disk.md):
// opening it (trust: ownership and modes; the FORMAT marker; the LOCK; whether the file system
// takes O_DIRECT; how its file system makes a rename durable) and the start-up scan that
// rebuilds the index from it (recovery).

#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/l2/disk/impl/disk_backend.hpp>

#include <fmt/format.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {

namespace detail {


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

/// statfs(2) f_type of the file systems the name-durability probe knows.
inline constexpr std::uint64_t ext4_magic = 0xEF53;  // ext2, ext3 and ext4 share it
inline constexpr std::uint64_t xfs_magic = 0x58465342;

/// What a file system does with a renamed file's fsync.
struct rename_durability {
  /// fsync(2) of the file after its rename commits the rename (and the file's creation).
  bool file_fsync_commits = false;
  std::string file_system;  ///< for the log: "ext4 with a journal (loop0)", "xfs", ...
};

/// Whether fsync of a file commits its rename on the file system `fs_magic` (statfs f_type)
/// on device `dev` (st_dev), read from `sys` (/sys) and `proc` (/proc).
/// - ext4 with a journal: the rename marks the file's inode dirty in the rename's
///   transaction, so the file's fsync waits for that transaction's commit (i_sync_tid; with
///   fast_commit, the fast commit carries the file's directory entries); jbd2 commits in
///   order, so its creation is in too. fdatasync waits only for the data's transaction.
/// - xfs: the rename logs the file's inode; fsync forces the log up to the inode's last
///   commit, and the log is forced in order.
/// - ext4 without a journal writes the file's own inode only, so ext2/ext3/ext4 are
///   told apart by /sys/fs/ext4/<dev>/journal_task ("<none>" without a journal; the pid of
///   jbd2's thread with one), else by /proc/fs/jbd2/<dev>-8 (an internal journal). Any
///   doubt (a device not found, another file system) answers false.
[[nodiscard]] inline rename_durability probe_rename_durability(std::uint64_t fs_magic, ::dev_t dev,
                                                               const std::filesystem::path& sys = "/sys",
                                                               const std::filesystem::path& proc = "/proc") {
  namespace fs = std::filesystem;
  if (fs_magic == xfs_magic) return {true, "xfs"};
  if (fs_magic != ext4_magic) return {false, fmt::format("file system 0x{:x}", fs_magic)};
  std::error_code ec;
  const fs::path link = fs::read_symlink(sys / "dev" / "block" / fmt::format("{}:{}", major(dev), minor(dev)), ec);
  const std::string device = ec ? std::string() : link.filename().string();
  if (device.empty()) return {false, fmt::format("ext4 on device {}:{}, its journal unknown", major(dev), minor(dev))};
  if (std::ifstream task(sys / "fs" / "ext4" / device / "journal_task"); task) {
    std::string word;
    task >> word;
    if (!word.empty() && word != "<none>") return {true, "ext4 with a journal (" + device + ")"};
    if (word == "<none>") return {false, "ext4 without a journal (" + device + ")"};
  }
  if (fs::exists(proc / "fs" / "jbd2" / (device + "-8"), ec)) return {true, "ext4 with a journal (" + device + ")"};
  return {false, "ext4 without a journal found (" + device + ")"};
}

}  // namespace detail

// --- opening the directory ---------------------------------------------------------------

inline void disk_backend::open_directory() {
  const auto& root = options_.path;
  // Trust: the tier's files hold prompt-derived KV (private: 0600 files, 0700 directories),
  // and whatever is in them is served (so only directories no other user may write).
  if (const int err = detail::make_private_directories(root); err != 0)
    throw_directory_error("cannot create the directory", err);
  {
    struct ::stat st {};
    if (::stat(root.c_str(), &st) != 0) throw_directory_error("cannot inspect the directory", errno);
    if (auto why = detail::untrusted_directory(root.string(), st); !why.empty()) throw_untrusted(why);
  }
  check_format_marker();
  lock_directory();
  open_subdirectories();
  direct_ = options_.o_direct && takes_o_direct();
  stats_->o_direct.store(direct_, std::memory_order_relaxed);
  name_sync_ = choose_name_sync();
  stats_->directory_fsync.store(syncs_directories(), std::memory_order_relaxed);
}

inline void disk_backend::throw_directory_error(const std::string& what, int err) const {
  throw std::runtime_error("kvtier::l2::disk_backend '" + options_.name + "' at " + options_.path.string() + ": " +
                           what + (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
}

inline void disk_backend::throw_untrusted(const std::string& why) const {
  throw std::invalid_argument("kvtier::l2::disk_backend '" + options_.name + "' at " + options_.path.string() + ": " +
                              why);
}

inline void disk_backend::check_own_directory(int fd, const std::string& path) const {
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) throw_directory_error("cannot inspect " + path, errno);
  if (auto why = detail::untrusted_directory(path, st); !why.empty()) throw_untrusted(why);
  if ((st.st_mode & 07777) != 0700) (void)::fchmod(fd, 0700);
}

inline void disk_backend::check_format_marker() const {
  const auto marker = options_.path / "FORMAT";
  if (std::FILE* f = std::fopen(marker.c_str(), "rb")) {
    char buf[64] = {};
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    if (std::string_view(buf, n) != detail::format_marker)
      throw_directory_error("its FORMAT file says '" + std::string(buf, n) + "', not '" +
                                std::string(detail::format_marker.substr(0, detail::format_marker.size() - 1)) +
                                "': use an empty directory or one written by this version",
                            0);
    return;
  }
  const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw_directory_error("cannot write " + marker.string(), errno);
  const bool ok = ::write(fd, detail::format_marker.data(), detail::format_marker.size()) ==
                  static_cast<ssize_t>(detail::format_marker.size());
  ::fsync(fd);
  ::close(fd);
  if (!ok) throw_directory_error("cannot write " + marker.string(), errno);
}

inline void disk_backend::lock_directory() {
  lock_fd_ = ::open((options_.path / "LOCK").c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) throw_directory_error("cannot open LOCK", errno);
  (void)::fchmod(lock_fd_, 0600);  // one an older version made 0644
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      throw_directory_error(
          "the directory is in use by another disk backend (flock on LOCK): give each one its own directory", 0);
    throw_directory_error("cannot lock LOCK", errno);
  }
}

inline void disk_backend::open_subdirectories() {
  const auto& root = options_.path;
  for (const char* sub : {"objects", "tmp"})
    if (::mkdir((root / sub).c_str(), 0700) != 0 && errno != EEXIST)
      throw_directory_error(std::string("cannot create ") + sub, errno);
  // O_NOFOLLOW: a symlink in place of a directory of ours is refused (ELOOP).
  objects_fd_ = ::open((root / "objects").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (objects_fd_ < 0) throw_directory_error("cannot open objects/", errno);
  check_own_directory(objects_fd_, (root / "objects").string());
  tmp_fd_ = ::open((root / "tmp").c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (tmp_fd_ < 0) throw_directory_error("cannot open tmp/", errno);
  check_own_directory(tmp_fd_, (root / "tmp").string());
  for (unsigned s = 0; s < detail::disk_shard_count; ++s) {
    const std::string name = detail::shard_dir_name(s);
    if (::mkdirat(objects_fd_, name.c_str(), 0700) != 0 && errno != EEXIST)
      throw_directory_error("cannot create objects/" + name, errno);
    shard_fds_[s] = ::openat(objects_fd_, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (shard_fds_[s] < 0) throw_directory_error("cannot open objects/" + name, errno);
    check_own_directory(shard_fds_[s], (root / "objects" / name).string());
  }
}

inline disk_name_sync disk_backend::choose_name_sync() {
  if (options_.name_sync == disk_name_sync::directory) return disk_name_sync::directory;
  struct ::statfs sfs {};
  struct ::stat st {};
  detail::rename_durability probe{false, "a file system that could not be inspected"};
  if (::fstatfs(objects_fd_, &sfs) == 0 && ::fstat(objects_fd_, &st) == 0)
    probe = detail::probe_rename_durability(static_cast<std::uint64_t>(sfs.f_type), st.st_dev);
  if (options_.name_sync == disk_name_sync::file) {
    if (!probe.file_fsync_commits && options_.sync == disk_sync::data)
      log_->warn(
          "disk backend '{}' at {}: name_sync file on {}, whose fsync of a file is not known to commit its "
          "rename: a power failure may lose the names of stored objects (use name_sync directory or auto)",
          options_.name, options_.path.string(), probe.file_system);
    return disk_name_sync::file;
  }
  if (options_.sync == disk_sync::data)
    log_->info("disk backend '{}' at {}: {}: {}", options_.name, options_.path.string(), probe.file_system,
               probe.file_fsync_commits
                   ? "an object's fsync commits its rename (no directory fsyncs)"
                   : "fdatasync of each object, then an fsync of each shard directory a batch touched");
  return probe.file_fsync_commits ? disk_name_sync::file : disk_name_sync::directory;
}

inline bool disk_backend::takes_o_direct() {
  // tmpfs before 6.6 and some FUSE file systems do not.
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
  if (err == 0) return true;
  log_->warn(
      "disk backend '{}': the file system at {} refuses O_DIRECT ({}); using buffered I/O (the page "
      "cache will hold a copy of what the tier reads and writes)",
      options_.name, options_.path.string(), std::strerror(err));
  return false;
}

// --- the start-up scan ---------------------------------------------------------------------

/// What the start-up scan carries from one object file to the next.
struct disk_backend::recovery_scan {
  struct found {
    chunk_key key;
    std::uint64_t payload = 0;
    std::uint64_t allocated = 0;
    ::timespec mtime{};
    std::uint64_t segment_bytes = 0;  ///< 0: unsegmented
  };
  std::vector<found> all;  ///< the objects recovered
  aligned_buffer block{detail::disk_block_bytes};
  aligned_buffer scratch;         ///< payload reads of verify_on_start
  unsigned logged = 0;            ///< drops so far (eight are warned about one by one)
  unsigned untrusted_logged = 0;  ///< untrusted files so far (likewise)
  ::uid_t self = ::geteuid();
};

inline void disk_backend::recover() {
  // 1. Interrupted stores: every temporary file goes (none can be complete AND visible).
  for (const auto& n : detail::list_directory(tmp_fd_))
    if (::unlinkat(tmp_fd_, n.c_str(), 0) == 0) ++recovery_.temp_files;

  // 2. Objects: read and check each header block.
  recovery_scan scan;
  scan.scratch = aligned_buffer(options_.verify_on_start ? std::size_t{8} << 20 : 0);
  for (unsigned s = 0; s < detail::disk_shard_count; ++s)
    for (const auto& name : detail::list_directory(shard_fds_[s])) scan_object_file(scan, s, name);
  if (scan.logged > 8)
    log_->warn("disk backend '{}': {} more objects dropped at start-up", options_.name, scan.logged - 8);
  if (scan.untrusted_logged > 8)
    log_->warn("disk backend '{}': {} more object files not owned by this user skipped at start-up", options_.name,
               scan.untrusted_logged - 8);

  // 3. The eviction order: oldest first (modification time; the key breaks ties so the order
  //    does not depend on readdir).
  using found = recovery_scan::found;
  std::sort(scan.all.begin(), scan.all.end(), [](const found& a, const found& b) {
    if (a.mtime.tv_sec != b.mtime.tv_sec) return a.mtime.tv_sec < b.mtime.tv_sec;
    if (a.mtime.tv_nsec != b.mtime.tv_nsec) return a.mtime.tv_nsec < b.mtime.tv_nsec;
    return a.key < b.key;
  });
  for (const auto& f : scan.all) index_.add_ready(f.key, f.payload, f.allocated, next_generation_++, f.segment_bytes);

  // 4. A capacity lowered since the last run: evict down to the low watermark now.
  if (auto victims = trim_victims()) {
    for (const auto& v : *victims) {
      const auto p = detail::object_path_of(v.key);
      ::unlinkat(objects_fd_, p.c_str(), 0);
      index_.finish_remove(v.key, v.generation);
      ++recovery_.evicted;
      stats_->evicted_objects.fetch_add(1, std::memory_order_relaxed);
      stats_->evicted_bytes.fetch_add(v.allocated_bytes, std::memory_order_relaxed);
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

inline void disk_backend::scan_object_file(recovery_scan& scan, unsigned shard, const std::string& name) {
  const int dirfd = shard_fds_[shard];
  struct ::stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return;
  const auto key = detail::parse_object_name(name);
  if (!S_ISREG(st.st_mode) || !key) {
    ++recovery_.foreign_files;  // not ours: left alone
    return;
  }
  // An object file another user owns, or one others may write, is not trusted: its
  // checksums prove nothing (whoever wrote it computed them). Left alone, never served.
  if (st.st_uid != scan.self || (st.st_mode & 022) != 0) {
    ++recovery_.untrusted_files;
    if (scan.untrusted_logged++ < 8)
      log_->warn(
          "disk backend '{}': skipped {} at start-up: not owned by this user (uid {}, mode {:04o}); it is "
          "left alone and never served",
          options_.name, name, st.st_uid, st.st_mode & 07777);
    return;
  }
  if ((st.st_mode & 07777) != 0600) (void)::fchmodat(dirfd, name.c_str(), 0600, 0);  // an older version's 0644
  if (detail::shard_of(*key) != shard) {
    drop_at_start(scan, dirfd, name, "in the wrong shard directory");
    return;
  }
  const int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    log_->warn("disk backend '{}': cannot open {} at start-up ({}): left alone, not served", options_.name, name,
               std::strerror(errno));
    return;
  }
  object_header h;
  std::uint64_t segment_bytes = 0;
  const ssize_t got = ::pread(fd, scan.block.data(), scan.block.size(), 0);
  auto check =
      got == static_cast<ssize_t>(scan.block.size())
          ? detail::check_object(scan.block.span(), *key, static_cast<std::uint64_t>(st.st_size), h, &segment_bytes)
          : (got >= 0 ? detail::object_check::wrong_size : detail::object_check::bad_header);
  std::string why(detail::to_string(check));
  if (check == detail::object_check::ok && options_.verify_on_start) {
    if (const std::string_view bad = check_payload(fd, h, scan.block.span(), scan.scratch); !bad.empty()) {
      check = detail::object_check::bad_header;
      why = bad;
    }
  }
  ::close(fd);
  if (check != detail::object_check::ok) {
    drop_at_start(scan, dirfd, name, why);
    return;
  }
  scan.all.push_back(
      {*key, h.payload_bytes, static_cast<std::uint64_t>(st.st_blocks) * 512, st.st_mtim, segment_bytes});
}

inline std::string_view disk_backend::check_payload(int fd, const object_header& h,
                                                    std::span<const std::byte> header_block, aligned_buffer& scratch) {
  // The XXH3-64 of payload bytes [from, to), or nullopt when they cannot be read.
  auto digest_of = [&](std::uint64_t from, std::uint64_t to) -> std::optional<std::uint64_t> {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (std::uint64_t at = from; at < to;) {
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(scratch.size(), to - at));
      const ssize_t n = ::pread(fd, scratch.data(), want, static_cast<off_t>(detail::disk_block_bytes + at));
      if (n != static_cast<ssize_t>(want)) return std::nullopt;
      kvtier::detail::xxh3_update(&state, scratch.data(), want);
      at += want;
    }
    return XXH3_64bits_digest(&state);
  };
  if ((h.flags & object_flag_segmented) == 0) {
    const auto d = digest_of(0, h.payload_bytes);
    if (!d) return "payload unreadable";
    if (*d != h.payload_checksum) return "payload checksum mismatch";
    return {};
  }
  const auto t = decode_segment_table(h, detail::table_area(header_block));
  if (!t) return "bad segment table";  // (check_object passed it: not reached)
  for (std::uint32_t s = 0; s < t->count; ++s) {
    const auto d = digest_of(t->begin(s), t->end(s));
    if (!d) return "payload unreadable";
    if (*d != t->checksum(s)) return "segment checksum mismatch";
  }
  return {};
}

inline void disk_backend::drop_at_start(recovery_scan& scan, int dirfd, const std::string& name, std::string_view why) {
  if (::unlinkat(dirfd, name.c_str(), 0) == 0 || errno == ENOENT) ++recovery_.dropped;
  if (scan.logged++ < 8) log_->warn("disk backend '{}': dropped {} at start-up: {}", options_.name, name, why);
}

}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
