#pragma once
// Registers the "disk" L2 backend type (l2/disk/disk_backend.hpp) with a backend_factory:
//
//   {"type": "disk", "name": "nvme0", "path": "/mnt/nvme/kvtier", "capacity_gb": 512}
//
// The keys are those of server/config/disk_backend_json.hpp (path, capacity_gb | capacity_bytes,
// o_direct, io, eviction, watermarks, queue_depth, part_kib, pread_threads, sync, name_sync,
// preallocate, verify_on_start). Needs kvtier::uring (liburing). create() throws config_error
// for a directory the backend does not trust (another user owns it, or group or others may
// write it: l2/disk/disk_backend.hpp, "TRUST"). check() (check_disk_directory) refuses the
// same before anything is built, with the same messages. The backend's own series
// (kvtier_l2_disk_*, kvtier_io_*: telemetry/collectors.hpp) go to the server's registry.

#include <kvtier/config.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/server/config/backend_factory.hpp>
#include <kvtier/server/config/disk_backend_json.hpp>
#include <kvtier/telemetry/collectors.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

/// The disk backend's start-up checks, made without building or creating anything (the
/// backend's constructor makes them again, then does the work: creating the directories,
/// the lock, the recovery scan). Refuses, with the constructor's messages:
///   - a path, objects/ or tmp/ that exists and is not a directory of this user that nobody
///     else may write (config_error, "l2 backend '<name>' path (<path>): ...": exit 2);
///   - a missing path whose nearest existing parent this user may not create it in, a
///     FORMAT file of another format, a LOCK another process holds (std::runtime_error,
///     "kvtier::l2::disk_backend '<name>' at <path>: ...": exit 1).
inline void check_disk_directory(const l2::disk_backend_options& o, const std::string& name) {
  namespace fs = std::filesystem;
  const std::string where = "kvtier::l2::disk_backend '" + name + "' at " + o.path.string();
  auto fail = [&](const std::string& what, int err) {
    throw std::runtime_error(where + ": " + what + (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
  };
  auto untrusted = [&](const fs::path& dir, const struct ::stat& st) {
    if (auto why = l2::detail::untrusted_directory(dir.string(), st); !why.empty())
      throw config_error("l2 backend '" + name + "' path", o.path.string(), where + ": " + why);
  };
  struct ::stat st {};
  if (::stat(o.path.c_str(), &st) != 0) {
    if (errno != ENOENT) fail("cannot inspect the directory", errno);
    // Missing: created at start, with its missing parents, in the nearest one that exists.
    fs::path parent = o.path.lexically_normal();
    if (!parent.has_filename()) parent = parent.parent_path();  // a trailing '/'
    do parent = parent.parent_path();
    while (!parent.empty() && ::stat(parent.c_str(), &st) != 0 && errno == ENOENT);
    if (parent.empty()) parent = ".";
    if (::access(parent.c_str(), W_OK | X_OK) != 0) fail("cannot create the directory", errno);
    return;
  }
  untrusted(o.path, st);
  for (const char* sub : {"objects", "tmp"})
    if (::lstat((o.path / sub).c_str(), &st) == 0) untrusted(o.path / sub, st);
  const fs::path marker = o.path / "FORMAT";
  if (std::FILE* f = std::fopen(marker.c_str(), "rb")) {
    char buf[64] = {};
    const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    const std::string_view want = l2::detail::format_marker;
    if (std::string_view(buf, n) != want)
      fail("its FORMAT file says '" + std::string(buf, n) + "', not '" + std::string(want.substr(0, want.size() - 1)) +
               "': use an empty directory or one written by this version",
           0);
  }
  // Another process's backend holds the directory: its LOCK is flocked (the lock is per
  // open file, so this check's own lock conflicts with it and goes with the close).
  const int lock = ::open((o.path / "LOCK").c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (lock >= 0) {
    const bool held = ::flock(lock, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    ::close(lock);
    if (held)
      fail("the directory is in use by another disk backend (flock on LOCK): give each one its own directory", 0);
  }
}

inline void add_disk_backend_type(backend_factory& f) {
  f.add_type("disk",
             "local files (io_uring, O_DIRECT, checksummed, survives restarts); keys: name, path (required), "
             "capacity_gb|capacity_bytes (required), o_direct, io (auto|uring|pread), eviction (lru|fifo|none), "
             "high_watermark, low_watermark, queue_depth, part_kib, pread_threads, sync (data|none), "
             "name_sync (auto|directory|file), preallocate, verify_on_start",
             [](json_object_reader& r) {
               const std::string where = r.prefix();
               l2::disk_backend_options o;
               try {
                 o = disk_backend_options_from_json(r.rest());  // validates too
               } catch (const std::invalid_argument& e) {
                 throw config_error(where.substr(0, where.size() - 1), "disk", e.what());
               }
               backend_spec s;
               s.description = "disk, " + o.path.string() + ", " + std::to_string(o.capacity_bytes >> 20) + " MiB";
               s.check = [o](const std::string& name) { check_disk_directory(o, name); };
               s.create = [o](const backend_context& ctx, const std::string& name) {
                 l2::disk_backend_options named = o;
                 named.name = name;
                 try {
                   auto b = std::make_shared<l2::disk_backend>(ctx.executor, std::move(named), ctx.log);
                   if (ctx.metrics) {
                     telemetry::collect_io(*ctx.metrics, b->file_io_kind() == io::file_io_kind::uring,
                                           b->shared_io_stats());
                     telemetry::collect_disk_backend(*ctx.metrics, *b);
                   }
                   return l2::any_backend(std::move(b));
                 } catch (const std::invalid_argument& e) {
                   // A directory that cannot be trusted (another user's, or writable by
                   // others) is a configuration to change: the program exits 2.
                   throw config_error("l2 backend '" + name + "' path", o.path.string(), e.what());
                 }
               };
               return s;
             });
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier
