// store_controller on its own (pipeline/store_controller.hpp), on the pipeline fixture
// (pipeline_fixtures.hpp: an L1 tier, two memory backends, one behind the fault injector, a
// bus that records the events, one io_context the test drives). What it offers lands in
// every target with the bytes L1 holds; skip_l1 drops from L1 only what every target
// stored; a failed key stays in L1 and is counted; batches split at max_batch_keys and at half
// the in-flight bound; stop drops what is queued.
#include <kvtier/pipeline/policies.hpp>
#include <kvtier/pipeline/store_controller.hpp>

#include "pipeline/pipeline_fixtures.hpp"

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_store_controller_test {

using namespace kvtier;
using namespace kvtier::test;

namespace {

template <class StorePolicy>
struct fixture : pipeline_fixture {
  std::unique_ptr<pipeline::store_controller<test_tier, StorePolicy, test_bus>> store;

  explicit fixture(pipeline::store_options o = {}) {
    store = std::make_unique<pipeline::store_controller<test_tier, StorePolicy, test_bus>>(
        io.get_executor(), *l1, backends, bus, tracker, StorePolicy{}, o);
  }
  ~fixture() {
    store->stop();
    run_until(io, [&] { return tracker.idle(); });
  }
  bool idle() { return store->inflight_tasks() == 0 && store->pending_keys() == 0 && tracker.idle(); }
};

std::uint64_t succeeded(const pipeline_events& e, std::uint8_t backend) {
  std::uint64_t n = 0;
  for (const auto& c : e.completed)
    if (c.backend_index == backend) n += c.succeeded_count;
  return n;
}
std::uint64_t failed(const pipeline_events& e, std::uint8_t backend) {
  std::uint64_t n = 0;
  for (const auto& c : e.completed)
    if (c.backend_index == backend) n += c.failed_count;
  return n;
}

}  // namespace

TEST_CASE("write_through stores every offered key in every backend with L1's bytes and keeps L1", "[pipeline]") {
  fixture<pipeline::write_through> f;
  const auto keys = keys_of(0, 10);
  f.write_l1(keys);
  f.store->offer(keys);
  REQUIRE(run_until(f.io, [&] { return f.events().completed.size() == 2 && f.idle(); }));
  CHECK(succeeded(f.events(), 0) == 10);
  CHECK(succeeded(f.events(), 1) == 10);
  CHECK(failed(f.events(), 0) + failed(f.events(), 1) == 0);
  CHECK(f.held_by(0, keys) == 10);
  CHECK(f.held_by(1, keys) == 10);
  CHECK(f.l1_has(keys) == 10);
  // The pinned read locks of the store are gone: every key is evictable again.
  std::vector<l1::status> st(keys.size());
  CHECK(f.l1->remove(keys, false, st) == keys.size());
}

TEST_CASE("a task holds at most max_batch_keys keys and at most half the in-flight bound", "[pipeline]") {
  // Objects of 32 MiB in tasks of 64 keys filled the 2 GiB bound with one task: the device
  // idled through each task's tail and its directory fsyncs (docs/performance.md, "L2 disk
  // vs fio"). A bound of 8 objects: tasks of at most 4 keys, whatever max_batch_keys says.
  pipeline::store_options o;
  o.max_inflight_bytes = 8 * object_bytes;
  CHECK(pipeline::task_keys(o, object_bytes) == 4);
  CHECK(pipeline::task_keys(o, 3 * object_bytes) == 1);   // 2 objects fit the bound, 1 its half
  CHECK(pipeline::task_keys(o, 100 * object_bytes) == 1);  // larger than the bound: one key
  CHECK(pipeline::task_keys(o, 0) == o.max_batch_keys);
  o.max_batch_keys = 3;
  CHECK(pipeline::task_keys(o, object_bytes) == 3);  // max_batch_keys still caps it
}

/// Offers 10 keys under `o`, which must make tasks of at most 4 keys: 4 + 4 + 2 per backend,
/// each within its bounds, every key stored.
void check_tasks_of_four(const pipeline::store_options& o) {
  fixture<pipeline::write_through> f(o);
  const auto keys = keys_of(100, 10);
  f.write_l1(keys);
  f.store->offer(keys);
  REQUIRE(run_until(f.io, [&] { return f.events().completed.size() == 6 && f.idle(); }));
  REQUIRE(f.events().submitted.size() == 6);  // 4 + 4 + 2 keys, for each of 2 backends
  for (const auto& s : f.events().submitted) {
    CHECK(s.key_count <= 4);
    CHECK(s.bytes == s.key_count * object_bytes);
    CHECK(s.bytes <= o.max_inflight_bytes / 2);
  }
  CHECK(succeeded(f.events(), 0) == 10);
  CHECK(succeeded(f.events(), 1) == 10);
}

TEST_CASE("batches split at max_batch_keys, one task per backend and batch", "[pipeline]") {
  pipeline::store_options o;
  o.max_batch_keys = 4;
  check_tasks_of_four(o);
}

TEST_CASE("batches split at half the in-flight bound, so a second task is in flight beside each", "[pipeline]") {
  pipeline::store_options o;
  o.max_inflight_bytes = 8 * object_bytes;  // max_batch_keys stays 64
  check_tasks_of_four(o);
}

TEST_CASE("skip_l1 drops from L1 only the keys every backend stored; a failed key stays and is counted",
          "[pipeline]") {
  fixture<pipeline::skip_l1> f;
  const auto keys = keys_of(200, 6);
  // Backend b fails keys 201 and 204.
  l2::fault bad;
  bad.op = l2::fault_op::store;
  bad.kind = l2::fault_kind::fail;
  bad.match = [](const chunk_key& k) { return k.hash.lo == 201 || k.hash.lo == 204; };
  f.faulty_b->inject(bad);
  f.write_l1(keys);
  f.store->offer(keys);
  REQUIRE(run_until(f.io, [&] { return f.events().completed.size() == 2 && f.idle(); }));
  CHECK(succeeded(f.events(), 0) == 6);
  CHECK(succeeded(f.events(), 1) == 4);
  CHECK(failed(f.events(), 1) == 2);
  for (const auto& k : keys) {
    const bool failed_somewhere = k.hash.lo == 201 || k.hash.lo == 204;
    INFO("key " << k.hash.lo);
    CHECK(f.l1->contains(k) == failed_somewhere);  // no blind retry: L1 keeps what a target lacks
  }
  CHECK(f.held_by(0, keys) == 6);
  CHECK(f.held_by(1, keys) == 4);
}

TEST_CASE("stop drops what is queued and ends the loop; offers after it are ignored", "[pipeline]") {
  fixture<pipeline::write_through> f;
  const auto keys = keys_of(300, 8);
  f.write_l1(keys);
  f.store->offer(keys);  // queued: the loop runs only when the io_context does
  CHECK(f.store->pending_keys() == 8);
  f.store->stop();
  CHECK(f.store->pending_keys() == 0);
  f.store->offer(keys);
  CHECK(f.store->pending_keys() == 0);
  REQUIRE(run_until(f.io, [&] { return f.tracker.idle(); }));
  CHECK(f.events().submitted.empty());
  CHECK(f.held_by(0, keys) == 0);
  for (const auto& k : keys) CHECK(f.l1->contains(k));
}

}  // namespace file_store_controller_test
