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
  /// Damages the wrapped backend's copy (the wrapper passes the load through to it).
  bool corrupt_stored(const chunk_key& k) { return inner.backend().corrupt_stored(k); }
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
  /// Damages the stored copy behind the wrapper's back (the wrapper has no such operation).
  bool corrupt_stored(const chunk_key& k) { return mem->corrupt_stored(k); }
};

}  // namespace kvtier::test

namespace kvtier::test {
/// Whether a pin keeps the backend from evicting the object. A fixture declares
/// `static constexpr bool pins_prevent_eviction = false;` when its backend's pins are
/// advisory (Redis evicts by its own maxmemory policy); the eviction test then checks what
/// such a backend must still guarantee (see backend_conformance_test.cpp).
template <class Fixture>
inline constexpr bool pins_prevent_eviction = [] {
  if constexpr (requires { Fixture::pins_prevent_eviction; }) return Fixture::pins_prevent_eviction;
  else return true;
}();
}  // namespace kvtier::test

#ifndef KVTIER_L2_TEST_REDIS
#include <kvtier/io/probe.hpp>
#include <kvtier/l2/disk/disk_backend.hpp>

#include "support/process.hpp"

namespace kvtier::test {

/// The disk backend in a fresh directory (on the file system of $TMPDIR, ext4 here), with
/// O_DIRECT, on the file I/O the probe picks (io_uring where the kernel allows it) or the
/// one forced.
template <io::file_io_choice Choice>
struct basic_disk_fixture {
  temp_dir dir{"kvtier-disk"};
  boost::asio::io_context io;
  std::unique_ptr<l2::disk_backend> b;

  explicit basic_disk_fixture(std::uint64_t capacity_bytes) {
    l2::disk_backend_options o;
    o.name = "disk";
    o.path = dir.path() / "l2";
    o.capacity_bytes = capacity_bytes;
    o.io = Choice;
    b = std::make_unique<l2::disk_backend>(io.get_executor(), o);
  }
  l2::disk_backend& backend() { return *b; }
};
using disk_backend_fixture = basic_disk_fixture<io::file_io_choice::automatic>;
using disk_pread_fixture = basic_disk_fixture<io::file_io_choice::pread>;

}  // namespace kvtier::test

// Every backend the conformance suite runs against.
#define KVTIER_L2_BACKEND_FIXTURES                                                    \
  kvtier::test::memory_backend_fixture, kvtier::test::fault_injecting_memory_fixture, \
      kvtier::test::any_memory_fixture, kvtier::test::disk_backend_fixture, kvtier::test::disk_pread_fixture
#else
// kvtier_test_redis compiles the suite a second time (l2/redis_conformance_test.cpp) with
// these: a real standalone Redis and a real three-master cluster (tests/l2/redis_support.hpp),
// shared by the tests of the process and emptied (FLUSHALL) for each fixture.
#include <kvtier/l2/redis/redis_backend.hpp>

#include "l2/redis_support.hpp"

namespace kvtier::test {

/// The backend on one of the shared servers. Redis's memory is not limited here (eviction
/// is Redis's policy: redis_backend_test.cpp tests it with maxmemory set): `capacity` is
/// ignored, and pins do not prevent eviction.
template <bool Cluster>
struct redis_fixture {
  static constexpr bool pins_prevent_eviction = false;
  boost::asio::io_context io;
  std::unique_ptr<l2::redis_backend> b;

  explicit redis_fixture(std::uint64_t /*capacity_bytes*/) {
    l2::redis_backend_options o;
    o.name = Cluster ? "redis-cluster" : "redis";
    o.cluster = Cluster;
    o.connections_per_node = 2;
    if constexpr (Cluster) {
      auto& c = shared_cluster();
      c.flush();
      o.nodes = {c.node(0).endpoint()};
    } else {
      auto& s = shared_standalone();
      s.command({"FLUSHALL"});
      o.nodes = {s.endpoint()};
    }
    b = std::make_unique<l2::redis_backend>(io.get_executor(), o);
    if (!run_until(io, [&] { return b->health().healthy; }))
      throw std::runtime_error("redis backend not healthy: " + b->health().reason);
  }
  l2::redis_backend& backend() { return *b; }

  /// Damages the stored payload behind the backend's back (redis-cli SETRANGE); false when
  /// the key is absent.
  bool corrupt_stored(const chunk_key& k) {
    const std::uint16_t port = Cluster ? shared_cluster().node(0).port() : shared_standalone().port();
    const std::string cli = "redis-cli -c -p " + std::to_string(port) + " ";
    const std::string key = "'" + b->key_of(k) + "'";
    if (run_command(cli + "EXISTS " + key).output.find('1') != 0) return false;
    const auto r = run_command(cli + "SETRANGE " + key + " " + std::to_string(l2::object_header_bytes) + " CORRUPT!");
    return r.exit_code == 0 && !r.output.empty() && r.output[0] >= '1' && r.output[0] <= '9';
  }
};
using redis_standalone_fixture = redis_fixture<false>;
using redis_cluster_fixture = redis_fixture<true>;

}  // namespace kvtier::test

#define KVTIER_L2_BACKEND_FIXTURES kvtier::test::redis_standalone_fixture, kvtier::test::redis_cluster_fixture
#endif
