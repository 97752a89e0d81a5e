#pragma once
// Fixtures of the l2_backend conformance suite: one per backend. Each owns an io_context and
// a backend of the requested capacity (bytes), and exposes both. Add a backend by writing its
// fixture here and appending it to KVTIER_L2_BACKEND_FIXTURES.

#include <kvtier/l2/memory_backend.hpp>

#include <boost/asio/io_context.hpp>

#include <cstdint>
#include <memory>

namespace kvtier::test {

struct memory_backend_fixture {
  boost::asio::io_context io;
  std::unique_ptr<l2::memory_backend> b;

  explicit memory_backend_fixture(std::uint64_t capacity_bytes) {
    l2::memory_backend_options o;
    o.name = "memory";
    o.capacity_bytes = capacity_bytes;
    b = std::make_unique<l2::memory_backend>(io.get_executor(), o);
  }
  l2::memory_backend& backend() { return *b; }
};

}  // namespace kvtier::test


#include <kvtier/l2/any_backend.hpp>
#include <kvtier/l2/fault_injecting_backend.hpp>

namespace kvtier::test {

/// The fault injector with no fault injected behaves exactly like the backend it wraps.
struct fault_injecting_memory_fixture {
  memory_backend_fixture inner;
  boost::asio::io_context& io = inner.io;
  l2::fault_injecting_backend<l2::memory_backend> b{inner.backend()};

  explicit fault_injecting_memory_fixture(std::uint64_t capacity_bytes) : inner(capacity_bytes) {}
  l2::fault_injecting_backend<l2::memory_backend>& backend() { return b; }
};

/// The type-erased wrapper the server uses, around a memory backend.
struct any_memory_fixture {
  boost::asio::io_context io;
  std::shared_ptr<l2::memory_backend> mem;
  std::unique_ptr<l2::any_backend> b;

  explicit any_memory_fixture(std::uint64_t capacity_bytes) {
    l2::memory_backend_options o;
    o.capacity_bytes = capacity_bytes;
    mem = std::make_shared<l2::memory_backend>(io.get_executor(), o);
    b = std::make_unique<l2::any_backend>(mem);
  }
  l2::any_backend& backend() { return *b; }
};

}  // namespace kvtier::test

#include <kvtier/io/probe.hpp>
#include <kvtier/l2/disk_backend.hpp>

#include "support/process.hpp"

namespace kvtier::test {

/// The disk backend in a fresh directory (on the file system of $TMPDIR, ext4 here), with
/// O_DIRECT, on the engine the probe picks (io_uring where the kernel allows it) or the
/// one forced.
template <io::engine_choice Engine>
struct basic_disk_fixture {
  temp_dir dir{"kvtier-disk"};
  boost::asio::io_context io;
  std::unique_ptr<l2::disk_backend> b;

  explicit basic_disk_fixture(std::uint64_t capacity_bytes) {
    l2::disk_backend_options o;
    o.name = "disk";
    o.path = dir.path() / "l2";
    o.capacity_bytes = capacity_bytes;
    o.io = Engine;
    b = std::make_unique<l2::disk_backend>(io.get_executor(), o);
  }
  l2::disk_backend& backend() { return *b; }
};
using disk_backend_fixture = basic_disk_fixture<io::engine_choice::automatic>;
using disk_pread_fixture = basic_disk_fixture<io::engine_choice::pread>;

}  // namespace kvtier::test

// Every backend the conformance suite runs against.
#define KVTIER_L2_BACKEND_FIXTURES                                                    \
  kvtier::test::memory_backend_fixture, kvtier::test::fault_injecting_memory_fixture, \
      kvtier::test::any_memory_fixture, kvtier::test::disk_backend_fixture, kvtier::test::disk_pread_fixture
