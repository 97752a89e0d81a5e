// The load-or-recompute arithmetic (pipeline/load_or_recompute.hpp) with explicit samples, so
// every number is exact: what the meter estimates from load tasks (a task that landed nothing
// lowers it by the time it cost; fast tasks bring a slow estimate back), and the prefix
// best_prefix offers from those estimates (a chunk counts only if every one before it lands).
#include <kvtier/pipeline/load_or_recompute.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_load_or_recompute_test {

using namespace kvtier;
using namespace kvtier::pipeline;
using std::chrono::milliseconds;

namespace {
constexpr std::uint64_t mib = 1 << 20;
}  // namespace

TEST_CASE("the meter knows nothing before a backend's first load task, then bytes landed per second of loading",
          "[pipeline][gate]") {
  bandwidth_meter m(2);
  CHECK_FALSE(m.estimate(0).known);
  CHECK(m.bytes_per_second(0) == 0);
  m.record(0, 0, 0, milliseconds(5));    // asked nothing: no sample
  m.record(0, mib, mib, milliseconds(0));  // took no time: no sample
  CHECK_FALSE(m.estimate(0).known);
  m.record(0, 8 * mib, 8 * mib, milliseconds(8));  // 1 MiB per ms
  CHECK(m.bytes_per_second(0) == Approx(1000.0 * mib));
  const auto e = m.estimate(0);
  CHECK(e.known);
  CHECK(e.landed_share == Approx(1.0));
  CHECK(e.seconds_per_byte == Approx(1e-3 / mib));
  CHECK_FALSE(m.estimate(1).known);  // per backend
  CHECK_FALSE(m.estimate(7).known);  // out of range: unknown, never a crash
  CHECK(m.bytes_per_second(7) == 0);
}

TEST_CASE("a load task that landed nothing lowers the estimate by the time it cost", "[pipeline][gate]") {
  bandwidth_meter m(1);
  for (int i = 0; i < 10; ++i) m.record(0, 8 * mib, 8 * mib, milliseconds(4));  // 2 GiB/s
  const double fast = m.bytes_per_second(0);
  CHECK(fast == Approx(2000.0 * mib));
  // A stalled disk: 8 MiB asked, nothing landed, the task gave up after 5 s.
  m.record(0, 8 * mib, 0, std::chrono::seconds(5));
  CHECK(m.bytes_per_second(0) < fast / 100);
  CHECK(m.estimate(0).landed_share < 0.8);
  // At 50,000 tokens/s a 256-token chunk of 8 MiB computes in 5.12 ms: it loaded in 4 ms
  // before (a gain), and loses now.
  const double compute = 256.0 / 50'000;
  CHECK(load_gain(load_estimate{true, 4e-3 / (8 * mib), 1}, compute, 8 * mib) > 0);
  CHECK(load_gain(m.estimate(0), compute, 8 * mib) < 0);
  // A backend that fails at once costs little time but delivers nothing: it loses too.
  bandwidth_meter f(1);
  f.record(0, 8 * mib, 8 * mib, milliseconds(4));
  for (int i = 0; i < 4; ++i) f.record(0, 8 * mib, 0, milliseconds(1));
  CHECK(f.estimate(0).landed_share < 0.3);
  CHECK(load_gain(f.estimate(0), compute, 8 * mib) < 0);
}

TEST_CASE("fast tasks after a slow sample bring the estimate back within a few samples", "[pipeline][gate]") {
  bandwidth_meter m(1);
  m.record(0, 8 * mib, 8 * mib, milliseconds(500));  // one slow first sample: 16 MiB/s
  const double compute = 256.0 / 50'000;              // 5.12 ms per 8 MiB chunk
  CHECK(load_gain(m.estimate(0), compute, 8 * mib) < 0);
  int samples = 0;
  while (load_gain(m.estimate(0), compute, 8 * mib) < 0 && samples < 100) {
    m.record(0, 8 * mib, 8 * mib, milliseconds(4));  // the backend is fast again: 2 GiB/s
    ++samples;
  }
  // (1 - alpha)^n * 500 ms has to fall to about 3.3 * 1.1 ms: n = 14 with alpha = 0.3.
  CHECK(samples == 14);
}

TEST_CASE("best_prefix weighs each chunk by the chance that the prefix up to it lands, minus its load time",
          "[pipeline][gate]") {
  const recompute_rate rate{50'000, 256, 1, 8 * mib};  // 5.12 ms per chunk
  const load_estimate fast{true, 1e-3 / (8 * mib), 1};     // 1 ms a chunk
  const load_estimate slow{true, 20e-3 / (8 * mib), 1};    // 20 ms a chunk
  const load_estimate failing{true, 1e-3 / (8 * mib), 0.1};  // fast, but 10% lands
  const load_estimate unknown{};
  const std::vector<int> l2_only = {0, 0, 0, 0};
  auto offered = [&](const std::vector<int>& src, load_estimate e) {
    const std::vector<load_estimate> est = {e};
    return best_prefix(src, rate, est);
  };
  CHECK(offered(l2_only, fast).keys == 4);
  CHECK(offered(l2_only, slow).keys == 0);
  CHECK(offered(l2_only, slow).available == 4);
  CHECK(offered(l2_only, failing).keys == 0);
  // Half of its loads land: a chunk saves its compute time only if every chunk before it
  // landed too (0.5, 0.25, 0.125, ... of 5.12 ms), and each costs 1 ms: two chunks pay.
  CHECK(offered(l2_only, load_estimate{true, 1e-3 / (8 * mib), 0.5}).keys == 2);
  CHECK(offered(l2_only, unknown).keys == 4);
  // L1 chunks after a slow one pay for it: 3 x 5.12 ms saved > 20 - 5.12 ms lost.
  CHECK(offered({0, source_l1, source_l1, source_l1}, slow).keys == 4);
  // The prefix ends where no tier has the key.
  CHECK(offered({0, 0, source_none, 0}, fast).available == 2);
  // No rate declared: everything is offered.
  const std::vector<load_estimate> est = {slow};
  CHECK(best_prefix(l2_only, recompute_rate{0, 256, 1, 8 * mib}, est).keys == 4);
}

}  // namespace file_load_or_recompute_test
