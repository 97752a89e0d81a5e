#include <kvtier/engine/finished_tracker.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using kvtier::engine::finished_requests;
using kvtier::engine::finished_tracker;
using ids = std::vector<std::string>;

namespace {
finished_requests step(finished_tracker& t, const ids& engine = {}) { return t.take_finished(engine); }
}  // namespace

TEST_CASE("a request without transfers is finished sending as soon as the engine finishes it",
          "[engine][finished_tracker]") {
  finished_tracker t;
  auto r = step(t, {"a"});
  CHECK(r.sending == ids{"a"});
  CHECK(r.recving.empty());
  CHECK(t.tracked() == 0);
  CHECK(step(t, {"a"}).sending.empty());  // a re-report is swallowed
  CHECK(t.ignored_reports() == 1);
}

TEST_CASE("a completed retrieve is reported finished receiving exactly once", "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  CHECK(step(t).recving.empty());
  t.retrieve_done("a");
  CHECK(step(t).recving == ids{"a"});
  CHECK(step(t).recving.empty());
  t.retrieve_done("a");  // a duplicate completion changes nothing
  CHECK(step(t).recving.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("several retrieves of one request are reported once, when the last completes",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.retrieve_started("a");
  t.retrieve_done("a");
  CHECK(step(t).recving.empty());
  t.retrieve_done("a");
  CHECK(step(t).recving == ids{"a"});
}

TEST_CASE("an engine-finished request waits for its stores before it is finished sending",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.store_started("a");
  t.store_started("a");
  CHECK(step(t, {"a"}).sending.empty());
  CHECK(step(t, {"a"}).sending.empty());  // re-reported while waiting: still once
  t.store_done("a");
  CHECK(step(t).sending.empty());
  t.store_done("a");
  CHECK(step(t).sending == ids{"a"});
  CHECK(step(t, {"a"}).sending.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("a store completed before the engine finishes the request does not report it early",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.store_started("a");
  t.store_done("a");
  CHECK(step(t).sending.empty());
  CHECK(step(t, {"a"}).sending == ids{"a"});
}

TEST_CASE("a request with a pending retrieve is never reported finished sending", "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  auto r = step(t, {"a"});
  CHECK(r.sending.empty());
  CHECK(r.recving.empty());
  CHECK(step(t, {"a"}).sending.empty());
  t.retrieve_done("a");
  r = step(t);
  // Its receiving report is its last one: the engine frees a finished request on it.
  CHECK(r.recving == ids{"a"});
  CHECK(r.sending.empty());
  CHECK(step(t).sending.empty());
  CHECK(step(t, {"a"}).sending.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("an id never appears in both lists of one call", "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.retrieve_done("a");
  const auto r = step(t, {"a"});  // engine-finished in the same step its load completed
  CHECK(r.recving == ids{"a"});
  CHECK(r.sending.empty());
  CHECK(step(t, {"a"}).sending.empty());
}

TEST_CASE("the normal life of a request: load, compute, store, finish", "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.retrieve_done("a");
  CHECK(step(t).recving == ids{"a"});
  t.store_started("a");
  CHECK(step(t, {"a"}).sending.empty());
  t.store_done("a");
  const auto r = step(t);
  CHECK(r.sending == ids{"a"});
  CHECK(r.recving.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("drain completes every pending transfer, as the unhealthy connector does", "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("r");
  t.store_started("s");
  t.store_started("s");
  CHECK(t.drain() == 3);
  const auto r = step(t, {"s"});
  CHECK(r.recving == ids{"r"});
  CHECK(r.sending == ids{"s"});
  // Late completions of drained transfers, and re-reports, change nothing.
  t.retrieve_done("r");
  t.store_done("s");
  const auto again = step(t, {"s", "r"});
  CHECK(again.sending == ids{"r"});  // r was never finished by the engine before: now it is
  CHECK(again.recving.empty());
  CHECK(step(t, {"s", "r"}).sending.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("re-reports after the drain are not returned a second time (LMCache's duplicate report)",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.store_started("a");
  CHECK(step(t, {"a"}).sending.empty());
  t.drain();
  CHECK(step(t, {"a"}).sending == ids{"a"});
  for (int i = 0; i < 3; ++i) CHECK(step(t, {"a"}).sending.empty());
}

TEST_CASE("the window of retired ids is bounded and forgets the oldest", "[engine][finished_tracker]") {
  finished_tracker t(4);
  for (int i = 0; i < 6; ++i) CHECK(step(t, {std::to_string(i)}).sending == ids{std::to_string(i)});
  CHECK(t.remembered() == 4);
  CHECK(step(t, {"5"}).sending.empty());      // still remembered
  CHECK(step(t, {"0"}).sending == ids{"0"});  // beyond the window: documented limit
  CHECK_THROWS_AS(finished_tracker(0), std::invalid_argument);
}

TEST_CASE("memory stays bounded over a million requests", "[engine][finished_tracker]") {
  finished_tracker t(1024);
  std::size_t sending = 0;
  std::size_t recving = 0;
  std::size_t max_tracked = 0;
  ids finished;
  for (int i = 0; i < 1'000'000; ++i) {
    const std::string id = "req-" + std::to_string(i);
    if (i % 3 == 0) {
      t.retrieve_started(id);
      t.retrieve_done(id);
    }
    if (i % 2 == 0) t.store_started(id);
    finished.push_back(id);
    if (i % 2 == 0) t.store_done(id);
    if (finished.size() == 64) {
      const auto r = t.take_finished(finished);
      const auto again = t.take_finished(finished);  // async scheduling re-reports
      sending += r.sending.size() + again.sending.size();
      recving += r.recving.size() + again.recving.size();
      finished.clear();
    }
    max_tracked = std::max(max_tracked, t.tracked());
  }
  const auto r = t.take_finished(finished);
  sending += r.sending.size();
  recving += r.recving.size();
  // Ids with a load report it as their last one when the engine had finished them already:
  // every id is reported exactly once, in one list.
  CHECK(recving == 333'334);
  CHECK(sending == 666'666);
  CHECK(t.tracked() == 0);
  CHECK(max_tracked <= 64);
  CHECK(t.remembered() <= 1024);
}
