#include <kvtier/engine/finished_tracker.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

// This file's names (its test binary is compiled in unity batches with the module's other files).
namespace file_finished_tracker_test {

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
  // Remembered until the engine finishes it, so that it is never reported receiving twice.
  CHECK(t.tracked() == 1);
  CHECK(step(t, {"a"}).sending == ids{"a"});
  CHECK(t.tracked() == 0);
}

TEST_CASE("a synchronous retrieve is never reported receiving but holds back its request's sending report",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a", true);
  CHECK(t.pending_retrieves("a") == 1);
  CHECK(step(t).recving.empty());
  t.retrieve_done("a");
  CHECK(step(t).recving.empty());
  CHECK(t.tracked() == 0);  // nothing owed: no entry kept
  // Finished by the engine while a synchronous retrieve is pending: sending once it ended,
  // never receiving.
  t.retrieve_started("b", true);
  auto r = step(t, {"b"});
  CHECK(r.sending.empty());
  CHECK(r.recving.empty());
  t.retrieve_done("b");
  r = step(t);
  CHECK(r.sending == ids{"b"});
  CHECK(r.recving.empty());
  CHECK(t.tracked() == 0);
  // An asynchronous retrieve of the same id still owes its report.
  t.retrieve_started("c", true);
  t.retrieve_started("c");
  t.retrieve_done("c");
  t.retrieve_done("c");
  CHECK(step(t).recving == ids{"c"});
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

// --- several retrieves per request (vLLM chunked prefill), issue 13 item 1 ---------------

TEST_CASE("a request is never reported finished receiving while one of its retrieves is pending",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.retrieve_done("a");
  t.retrieve_started("a");  // the next step of a long prompt loads more of it
  CHECK(step(t).recving.empty());
  CHECK(t.pending_retrieves("a") == 1);
  t.retrieve_done("a");
  CHECK(step(t).recving == ids{"a"});  // now every retrieve of it ended: once
  CHECK(step(t).recving.empty());
  CHECK(step(t, {"a"}).sending == ids{"a"});
  CHECK(step(t).recving.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("a retrieve started after the receiving report is never reported again and holds back sending",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.retrieve_done("a");
  CHECK(step(t).recving == ids{"a"});
  t.retrieve_started("a");
  CHECK(step(t, {"a"}).sending.empty());  // finished by the engine with a retrieve pending
  t.retrieve_done("a");
  const auto r = step(t);
  CHECK(r.recving.empty());  // never twice
  CHECK(r.sending == ids{"a"});
  CHECK(step(t, {"a"}).sending.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("an engine-finished request's last report waits for every pending store and retrieve",
          "[engine][finished_tracker]") {
  finished_tracker t;
  t.retrieve_started("a");
  t.store_started("a");
  CHECK(step(t, {"a"}).recving.empty());
  t.retrieve_done("a");
  auto r = step(t);
  CHECK(r.recving.empty());  // its receiving report is its last: it waits for the store too
  CHECK(r.sending.empty());
  t.store_done("a");
  r = step(t);
  CHECK(r.recving == ids{"a"});
  CHECK(r.sending.empty());
  CHECK(t.tracked() == 0);
}

TEST_CASE("transfers of a retired id are tracked but never reported", "[engine][finished_tracker]") {
  finished_tracker t;
  CHECK(step(t, {"a"}).sending == ids{"a"});
  t.retrieve_started("a");
  t.store_started("a");
  CHECK(t.pending_retrieves("a") == 1);
  t.retrieve_done("a");
  t.store_done("a");
  const auto r = step(t, {"a"});
  CHECK(r.recving.empty());
  CHECK(r.sending.empty());
  CHECK(t.tracked() == 0);
}

namespace {

// The contract of finished_tracker, written as plainly as possible: what each id may and
// must be reported, checked against random schedules of a vLLM-like engine.
struct reference_model {
  struct id_state {
    int retrieves = 0;             // pending
    int stores = 0;                // pending
    bool owes_recv = false;        // a retrieve started, no receiving report yet
    bool recv_reported = false;    // reported finished receiving (never again)
    bool engine_finished = false;  // the engine reported it finished (first report counts)
    bool final_reported = false;   // its last report was given (sending, or recving after the finish)
  };
  std::map<std::string, id_state> s;

  finished_requests take(const ids& engine) {
    for (const auto& id : engine) {
      auto& x = s[id];
      if (!x.final_reported) x.engine_finished = true;
    }
    finished_requests out;
    for (auto& [id, x] : s) {
      if (x.final_reported) continue;
      const bool nothing_pending = x.retrieves == 0 && x.stores == 0;
      // recving: every retrieve of it ended, reported once; for a finished request it is
      // the last report, so it also waits for the stores.
      if (x.owes_recv && x.retrieves == 0 && (!x.engine_finished || nothing_pending)) {
        out.recving.push_back(id);
        x.owes_recv = false;
        x.recv_reported = true;
        if (x.engine_finished) x.final_reported = true;
        continue;
      }
      // sending: finished by the engine, nothing pending, nothing else owed.
      if (x.engine_finished && nothing_pending && !x.owes_recv) {
        out.sending.push_back(id);
        x.final_reported = true;
      }
    }
    return out;
  }
};

std::vector<std::string> sorted_ids(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("random interleavings of retrieves, stores and finishes match the reference model",
          "[engine][finished_tracker]") {
  constexpr int schedules = 4000;
  constexpr int ids_per_schedule = 6;
  std::size_t recv_reports = 0;
  std::size_t send_reports = 0;
  for (int seed = 1; seed <= schedules; ++seed) {
    INFO("seed " << seed);
    std::mt19937 rng(static_cast<std::uint32_t>(seed));
    auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
    finished_tracker t(1024);
    reference_model m;
    struct engine_view {
      int retrieves = 0;  // issued and not completed, as the engine's connector knows them
      int stores = 0;
      bool finished = false;
      int recv_reports = 0;
      int send_reports = 0;
      bool had_retrieve = false;
    };
    std::map<std::string, engine_view> v;
    std::vector<std::string> names;
    for (int i = 0; i < ids_per_schedule; ++i) {
      names.push_back(std::to_string(i));  // offline-mode ids
      v[names.back()];
    }

    std::string trace;  // the schedule so far, shown when a check fails
    auto check_report = [&](const finished_requests& got, const finished_requests& want) {
      INFO("schedule:" << trace);
      REQUIRE(sorted_ids(got.recving) == sorted_ids(want.recving));
      REQUIRE(sorted_ids(got.sending) == sorted_ids(want.sending));
      for (const auto& id : got.recving) {
        auto& x = v[id];
        REQUIRE(x.retrieves == 0);     // never while a retrieve of it is pending
        REQUIRE(x.recv_reports == 0);  // never twice
        REQUIRE(x.send_reports == 0);  // never after its last report
        ++x.recv_reports;
        if (x.finished) REQUIRE(x.stores == 0);  // its last report: nothing pending
      }
      for (const auto& id : got.sending) {
        auto& x = v[id];
        REQUIRE(x.finished);  // only after the engine finished it
        REQUIRE(x.retrieves == 0);
        REQUIRE(x.stores == 0);
        REQUIRE(x.send_reports == 0);
        REQUIRE(std::find(got.recving.begin(), got.recving.end(), id) == got.recving.end());
        ++x.send_reports;
      }
      recv_reports += got.recving.size();
      send_reports += got.sending.size();
    };

    ids finished_this_step;
    const int events = 20 + static_cast<int>(rng() % 80);
    for (int e = 0; e < events; ++e) {
      const std::string& id = names[rng() % names.size()];
      auto& x = v[id];
      auto& mx = m.s[id];
      const int what = static_cast<int>(rng() % 100);
      if (what < 20 && !x.finished) {  // a step loads (more of) the request
        t.retrieve_started(id);
        trace += " R+" + id;
        ++x.retrieves;
        x.had_retrieve = true;
        ++mx.retrieves;
        if (!mx.recv_reported && !mx.final_reported) mx.owes_recv = true;
      } else if (what < 40 && x.retrieves > 0) {
        t.retrieve_done(id);
        trace += " R-" + id;
        --x.retrieves;
        --mx.retrieves;
      } else if (what < 52 && !x.finished) {  // a step saves what it computed
        t.store_started(id);
        trace += " S+" + id;
        ++x.stores;
        ++mx.stores;
      } else if (what < 66 && x.stores > 0) {
        t.store_done(id);
        trace += " S-" + id;
        --x.stores;
        --mx.stores;
      } else if (what < 78) {  // finished by the engine (again: async scheduling re-reports)
        if (!x.finished || chance(50)) {
          finished_this_step.push_back(id);
          trace += " F" + id;
        }
        x.finished = true;
      } else if (what < 98) {  // get_finished
        trace += " get_finished";
        const auto want = m.take(finished_this_step);
        const auto got = t.take_finished(finished_this_step);
        finished_this_step.clear();
        check_report(got, want);
      } else {
        trace += " drain";  // the server died: every pending transfer counts as done
        const std::size_t pending = [&] {
          std::size_t n = 0;
          for (auto& [k, y] : v) n += static_cast<std::size_t>(y.retrieves + y.stores);
          return n;
        }();
        REQUIRE(t.drain() == pending);
        for (auto& [k, y] : v) y.retrieves = y.stores = 0;
        for (auto& [k, y] : m.s) y.retrieves = y.stores = 0;
      }
    }
    // The end of the run: every transfer completes, the engine finishes every request.
    for (auto& [id, x] : v) {
      for (; x.retrieves > 0; --x.retrieves, --m.s[id].retrieves) t.retrieve_done(id);
      for (; x.stores > 0; --x.stores, --m.s[id].stores) t.store_done(id);
      if (!x.finished) finished_this_step.push_back(id);
      x.finished = true;
    }
    for (int round = 0; round < 2; ++round) {
      const auto want = m.take(finished_this_step);
      const auto got = t.take_finished(finished_this_step);
      finished_this_step = ids(names.begin(), names.end());  // and re-reported once more
      check_report(got, want);
    }
    // Every request got exactly one last report; every loaded one was reported receiving.
    for (auto& [id, x] : v) {
      INFO("id " << id);
      CHECK(x.send_reports + (x.recv_reports != 0 && x.send_reports == 0 ? 1 : 0) == 1);
      CHECK(x.recv_reports == (x.had_retrieve ? 1 : 0));
    }
    REQUIRE(t.tracked() == 0);
  }
  CHECK(recv_reports > 0);
  CHECK(send_reports > 0);
}

}  // namespace file_finished_tracker_test
