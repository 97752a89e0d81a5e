#pragma once
// Registers the "disk" L2 backend type (l2/disk/disk_backend.hpp) with a backend_factory:
//
//   {"type": "disk", "name": "nvme0", "path": "/mnt/nvme/kvtier", "capacity_gb": 512}
//
// The keys are those of server/disk_backend_json.hpp (path, capacity_gb | capacity_bytes,
// o_direct, io, eviction, watermarks, queue_depth, part_kib, pread_threads, sync,
// preallocate, verify_on_start). Needs kvtier::uring (liburing). create() throws config_error
// for a directory the backend does not trust (another user owns it, or group or others may
// write it: l2/disk/disk_backend.hpp, "TRUST"). The backend's own series
// (kvtier_l2_disk_*, kvtier_io_*: telemetry/collectors.hpp) go to the server's registry.

#include <kvtier/config.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>
#include <kvtier/server/backend_factory.hpp>
#include <kvtier/server/disk_backend_json.hpp>
#include <kvtier/telemetry/collectors.hpp>

#include <memory>
#include <stdexcept>
#include <string>

namespace kvtier::inline KVTIER_ABI_TAG::server {

inline void add_disk_backend_type(backend_factory& f) {
  f.add_type("disk",
             "local files (io_uring, O_DIRECT, checksummed, survives restarts); keys: name, path (required), "
             "capacity_gb|capacity_bytes (required), o_direct, io (auto|uring|pread), eviction (lru|fifo|none), "
             "high_watermark, low_watermark, queue_depth, part_kib, pread_threads, sync (data|none), preallocate, "
             "verify_on_start",
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

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
