#pragma once
// make_l1_resident: the server's one-time L1 set-up at start ("l1_prefault", default on),
// before the first client:
//   1. fault every page of the arena in: madvise(MADV_POPULATE_WRITE) (Linux 5.14), else a
//      write to every page (the arena holds nothing yet). The arena is plain memory that
//      comes on first touch: without this, the first loads into a slot take a page fault per
//      4 KiB, inside the kernel's O_DIRECT page pinning;
//   2. hand the arena to every L2 backend that reads into registered memory faster
//      (any_backend::register_buffers: the disk backend's io_uring fixed buffers, READ_FIXED,
//      so a 1 MiB read pins no pages). The kernel may refuse (RLIMIT_MEMLOCK for a user
//      without CAP_IPC_LOCK): the backend then reads as before, and the refusal is reported
//      (and counted: kvtier_io_fixed_buffer_registration_failures_total).

#include <kvtier/config.hpp>
#include <kvtier/core/kv_region.hpp>
#include <kvtier/error.hpp>
#include <kvtier/l2/any_backend.hpp>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace kvtier::inline KVTIER_ABI_TAG::server {

/// What make_l1_resident did, for the start-up log.
struct l1_residency_report {
  std::size_t bytes = 0;
  double prefault_ms = 0;
  bool populated = false;               ///< the kernel populated it (false: the write loop did, or error)
  std::string error;                    ///< why the pages were left to first use (empty: they were not)
  std::vector<std::string> registered;  ///< backends that took the arena
  std::vector<std::string> refused;     ///< "name: reason" of backends that refused it
};

/// Call before the server serves (the fallback writes to the arena).
inline l1_residency_report make_l1_resident(std::span<std::byte> arena, std::span<l2::any_backend> backends) {
  l1_residency_report r;
  r.bytes = arena.size();
  const auto t0 = std::chrono::steady_clock::now();
  if (!arena.empty()) {
    const int err = kv_region::populate(arena.data(), arena.size());
    r.populated = err == 0;
    if (err == EINVAL) {  // a kernel before 5.14: a write per page (nothing is in L1 yet)
      const long page = ::sysconf(_SC_PAGESIZE);
      const std::size_t step = page > 0 ? static_cast<std::size_t>(page) : 4096;
      volatile std::byte* p = arena.data();
      for (std::size_t off = 0; off < arena.size(); off += step) p[off] = std::byte{0};
    } else if (err != 0) {
      // The kernel has it and could not (out of memory under a cgroup limit, say): writing
      // every page would only call the OOM killer. The pages come on first use.
      r.error = std::strerror(err);
    }
  }
  r.prefault_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (l2::any_backend& b : backends) {
    const error_code ec = b.register_buffers(arena);
    if (!ec)
      r.registered.emplace_back(b.name());
    else if (ec != make_error_code(errc::unsupported))
      r.refused.push_back(std::string(b.name()) + ": " + ec.message());
  }
  return r;
}

}  // namespace kvtier::inline KVTIER_ABI_TAG::server
